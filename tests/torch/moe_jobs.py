"""Pool jobs for tests/torch/test_moe.py: `commlib_torch.moe` on this rank against the float64 reference
`commlib.reference.moe.simulate_moe` (over every rank's data, rebuilt from the seed on each rank), for every
case of `cases` at the pool's world size, and the errors each rank raises."""

from __future__ import annotations

import numpy as np
import torch

from commlib import CommError, split_sizes
from commlib import moe as spec
from commlib.reference.moe import simulate_moe
from commlib_torch import checked, moe


def cases(world: int) -> list[dict]:
    """The case table: placement, K, capacity, layout, features, dtype, T per rank, routes."""
    varied = [5, 3, 4, 0][:world] if world > 1 else [5]  # T = 0 on one rank (exact only)
    uneven = split_sizes(8, world) if world != 1 else None
    return [
        dict(E=2 * world, epr=None, K=2, cap={}, layout="exact", F=(4,), T=varied, noncontig=True),
        dict(E=8, epr=uneven, K=2, cap=dict(capacity=1), layout="exact", F=(2, 3), T=varied),
        dict(E=8, epr=uneven, K=1, cap=dict(capacity_factor=1.0), layout="padded", F=(3,), T=[4] * world),
        dict(E=8, epr=uneven, K=2, cap={}, layout="padded", F=(2, 3), T=[3] * world, nothing=True),
        dict(E=2 * world, epr=None, K=2, cap=dict(capacity=1), layout="padded", F=(4,), T=[5] * world),
        dict(E=2 * world, epr=None, K=1, cap={}, layout="exact", F=(4,), T=varied, nothing=True, unweighted=True),
        dict(E=8, epr=uneven, K=2, cap=dict(capacity=1), layout="padded", F=(4,), T=[4] * world, unweighted=True),
        dict(E=8, epr=uneven, K=2, cap={}, layout="exact", F=(4,), T=[6] * world, dtype="bfloat16"),
    ]


def _data(case: dict, world: int, seed: int):
    rng = np.random.default_rng(seed)
    xs, indices, weights, out_bars = [], [], [], []
    for rank in range(world):
        tokens = case["T"][rank]
        xs.append(rng.standard_normal((tokens, *case["F"])))
        rows = [rng.permutation(case["E"])[: case["K"]] for _ in range(tokens)]
        routed = np.array(rows, dtype=np.int64).reshape(tokens, case["K"])
        routed[rng.random(routed.shape) < 0.2] = -1
        if case.get("nothing") and rank == world - 1:
            routed[:] = -1  # one rank routes nothing
        indices.append(routed)
        weights.append(rng.random((tokens, case["K"])))
        out_bars.append(rng.standard_normal((tokens, *case["F"])))
    if case.get("dtype") == "bfloat16":  # the reference sees the rounded inputs
        xs, weights = [_bf16(a) for a in xs], [_bf16(a) for a in weights]
    return xs, indices, weights, out_bars


def _bf16(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).double().numpy()


def _scales(tokens_per_expert, first_expert: int, rows: int, length: int) -> np.ndarray:
    """Each dispatched row's expert e as (e + 1); past `rows` 0 (padded)."""
    experts = np.repeat(np.arange(len(tokens_per_expert)) + first_expert, tokens_per_expert)
    scale = np.zeros(length)
    scale[:rows] = experts + 1.0
    return scale


def _experts(d, scale):
    """Expert e: tanh((e + 1) * row), a different function per expert so that a wrong order cannot pass."""
    shape = (-1,) + (1,) * (d.ndim - 1)
    if isinstance(d, torch.Tensor):
        return torch.tanh(torch.from_numpy(scale).to(d.dtype).reshape(shape) * d)
    return np.tanh(scale.reshape(shape) * d)


def _error(got: torch.Tensor, expected: np.ndarray) -> float:
    assert tuple(got.shape) == expected.shape, (tuple(got.shape), expected.shape)
    return float(np.abs(got.detach().double().numpy() - expected).max(initial=0.0))


def every_case(ctx, seed: int = 0) -> list[dict]:
    """Per case: this rank's errors against the reference of the dispatched rows, combined output, x / y /
    weights gradients, that the padded rows are exactly 0 (and NaN written there reaches nothing)."""
    results = []
    for number, case in enumerate(cases(ctx.world_size)):
        xs, indices, weights, out_bars = _data(case, ctx.world_size, seed + number)
        keys = dict(experts_per_rank=case["epr"], layout=case["layout"], **case["cap"])
        sim = simulate_moe(xs, indices, case["E"], **keys)
        plan, table = sim.plans[ctx.rank], sim.tables[ctx.rank]
        first = plan.expert_offsets
        ys, d_scales = [], []
        for rank in range(ctx.world_size):
            length = sim.dispatched[rank].shape[0]
            scale = _scales(sim.tables[rank].tokens_per_expert, first[rank], sim.tables[rank].rows, length)
            ys.append(_experts(sim.dispatched[rank], scale))
            d_scales.append(scale)
        unweighted = case.get("unweighted", False)
        given = None if unweighted else weights
        full = simulate_moe(xs, indices, case["E"], weights=given, ys=ys, out_bars=out_bars, **keys)
        d_bars = [
            bar * s.reshape((-1,) + (1,) * (bar.ndim - 1)) * (1 - y**2)
            for bar, s, y in zip(full.y_bar, d_scales, ys, strict=True)
        ]
        x_bar = simulate_moe(xs, indices, case["E"], ys=d_bars, **keys).combined[ctx.rank]

        dtype = torch.bfloat16 if case.get("dtype") == "bfloat16" else torch.float64
        tokens = case["T"][ctx.rank]
        if case.get("noncontig"):
            leaf = torch.zeros((tokens, 2 * case["F"][0]), dtype=dtype)
            leaf[:, ::2] = torch.from_numpy(xs[ctx.rank])
            leaf.requires_grad_(True)
            x = leaf[:, ::2]
            assert tokens < 2 or not x.is_contiguous()
        else:
            leaf = torch.from_numpy(xs[ctx.rank]).to(dtype).requires_grad_(True)
            x = leaf
        w = torch.from_numpy(weights[ctx.rank]).to(dtype).requires_grad_(True)
        routing = moe.route(torch.from_numpy(indices[ctx.rank]), case["E"], **keys)
        d = moe.dispatch(x, routing)
        valid = (torch.arange(d.shape[0]) < routing.rows).reshape((-1,) + (1,) * (d.ndim - 1))
        if case["layout"] == "padded":  # the cotangent of the padded rows: NaN, never read
            d.register_hook(lambda grad, valid=valid: torch.where(valid, grad, torch.nan))
        y = _experts(d, d_scales[ctx.rank])
        y = torch.where(valid, y, torch.nan)  # NaN in the padded rows of y: never read
        with torch.no_grad():  # builds no autograd state
            no_grad = moe.combine(moe.dispatch(x, routing), routing, None if unweighted else w).grad_fn is None
        out = moe.combine(y, routing, None if unweighted else w)
        (out.double() * torch.from_numpy(out_bars[ctx.rank])).sum().backward()
        x_grad = leaf.grad[:, ::2] if case.get("noncontig") else leaf.grad
        results.append(
            dict(
                dtype=str(out.dtype),
                routing=[
                    routing.rows == table.rows,
                    routing.dropped == table.dropped,
                    routing.tokens_per_expert.tolist() == table.tokens_per_expert.tolist(),
                ],
                dispatched=_error(d, sim.dispatched[ctx.rank]),
                padded_zero=bool((d[routing.rows :] == 0).all()),
                combined=_error(out, full.combined[ctx.rank]),
                x_grad=_error(x_grad, x_bar),
                x_scale=float(np.abs(x_bar).max(initial=0.0)),
                w_grad=0.0 if unweighted else _error(w.grad, full.weights_bar[ctx.rank]),
                no_grad=no_grad and (unweighted or w.grad is not None),
                finite=bool(
                    torch.isfinite(out).all()
                    and torch.isfinite(leaf.grad).all()
                    and (unweighted or torch.isfinite(w.grad).all())
                ),
                bf16=case.get("dtype") == "bfloat16",
            )
        )
    return results


def _message(call) -> str:
    try:
        call()
    except (CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def errors(ctx) -> list[str]:
    """Bad indices on the last rank (>= E, < -1, twice), then a good route (no rank hangs), then the kind and
    shape errors: the messages every rank raised."""
    world, last = ctx.world_size, ctx.world_size - 1
    num_experts = 2 * world
    good = torch.tensor([[0, 1], [1, -1], [-1, -1]])
    messages = []
    for bad_row in ([num_experts, 0], [-2, 0], [1, 1]):
        indices = good.clone()
        if ctx.rank == last:
            indices[1] = torch.tensor(bad_row)
        messages.append(_message(lambda indices=indices: moe.route(indices, num_experts)))
    routing = moe.route(good, num_experts)  # after the errors, the ranks still agree
    x = torch.ones(3, 2)
    messages.append(str(moe.combine(moe.dispatch(x, routing), routing).tolist()))
    messages += [
        _message(lambda: moe.route(good.double(), num_experts)),
        _message(lambda: moe.route([[0]], num_experts)),
        _message(lambda: moe.route(good[:, 0], num_experts)),
        _message(lambda: moe.dispatch(torch.ones(4, 2), routing)),
        _message(lambda: moe.dispatch(x, "routing")),
        _message(lambda: moe.combine(torch.ones(routing.rows + 1, 2), routing)),
        _message(lambda: moe.combine(moe.dispatch(x, routing), routing, torch.ones(3, 1))),
        _message(lambda: moe.combine(moe.dispatch(x, routing), routing, [[1.0]])),
    ]
    return messages


def expected_errors(world: int) -> list[str]:
    """What `errors` must give on every rank, from the spec's helpers."""
    num_experts, last = 2 * world, world - 1
    plan = spec.route_plan((3, 2), "int64", num_experts, world)

    def text(call) -> str:
        return _message(call)

    return [
        f"CommError: {spec.bad_route_error(last, 1, num_experts, 'range', num_experts)}",
        f"CommError: {spec.bad_route_error(last, 1, -2, 'range', num_experts)}",
        f"CommError: {spec.bad_route_error(last, 1, 1, 'twice', num_experts)}",
        None,  # the good route: checked by the test
        text(lambda: spec.route_plan((3, 2), "float64", num_experts, world)),
        None,
        text(lambda: spec.route_plan((3,), "int64", num_experts, world)),
        text(lambda: spec.check_rows(spec.DISPATCH_OP, "x", (4, 2), 3, "tokens T")),
        None,
        None,
        text(lambda: spec.check_weights((3, 1), plan)),
        None,
    ]


def checked_mismatch(ctx) -> list[str]:
    """Checked mode: rank 0 routes with another capacity, then dispatches another dtype, then padded with
    another T: the messages every rank raised (none hangs)."""
    indices = torch.tensor([[0], [1]])
    with checked():
        capacity = 1 if ctx.rank == 0 else 2
        messages = [_message(lambda: moe.route(indices, 2 * ctx.world_size, capacity=capacity))]
        routing = moe.route(indices, 2 * ctx.world_size)
        x = torch.ones(2, 3, dtype=torch.float32 if ctx.rank == 0 else torch.float64)
        messages.append(_message(lambda: moe.dispatch(x, routing)))
        tokens = indices if ctx.rank == 0 else torch.tensor([[0]])  # padded: T compared in checked mode
        messages.append(_message(lambda: moe.route(tokens, 2 * ctx.world_size, layout="padded")))
    return messages


def row_exchanges(ctx) -> dict[str, list[int]]:
    """The row all_to_alls (``[rows, H]``, H = 5) of dispatch, combine and their backward, on both layouts:
    one per direction, forward and backward (combine's weights gradient reads the rows its forward brought
    back); and the same step once more without the weights' gradient (weights a constant)."""
    import torch.distributed as dist

    calls: list[str] = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        if input.dim() == 2 and input.shape[1] == 5:
            calls.append(phase)
        return original(output, input, *args, **kwargs)

    found: dict[str, list[int]] = {}
    dist.all_to_all_single = counting
    try:
        for layout, weights_grad in (("exact", True), ("padded", True), ("exact", False)):
            calls.clear()
            generator = torch.Generator().manual_seed(ctx.rank)
            x = torch.randn(6, 5, generator=generator, requires_grad=True)
            logits = torch.randn(6, 2 * ctx.world_size, generator=generator, requires_grad=weights_grad)
            weights, indices = logits.softmax(-1).topk(2, dim=-1)
            routing = moe.route(indices, 2 * ctx.world_size, layout=layout)
            phase = "forward"
            out = moe.combine(moe.dispatch(x, routing) * 2.0, routing, weights)
            phase = "backward"
            out.square().sum().backward()
            assert x.grad is not None and (logits.grad is not None) == weights_grad
            found[f"{layout} weights_grad={weights_grad}"] = [calls.count("forward"), calls.count("backward")]
    finally:
        dist.all_to_all_single = original
    return found


_EP_DP: dict = {}


def ep_dp_gradients(ctx) -> dict[str, float]:
    """Expert parallelism x data parallelism on 4 ranks, a 2 (dp) x 2 (ep) mesh (global rank ``2 * d + e``):
    experts sharded over "ep" (E = 4, 2 per rank) and replicated over "dp"; a shared layer and the router
    replicated everywhere. One float64 step of ``out = x @ shared + combine(tanh(dispatch(x) @ expert_e))``
    with a top-2 softmax router, each rank its own tokens, loss = the sum of every rank's ``<out, target>``.
    Gradients synced as docs/moe.md says: the experts' over "dp" only, the rest over the world; compared with
    the same model unsharded in this process over every rank's tokens. Also the two natural mistakes
    (experts synced over the world, the router over "dp" only): their largest relative errors."""
    from torch.distributed.device_mesh import init_device_mesh

    from commlib_torch.sequence import sync_gradients

    if "mesh" not in _EP_DP:
        _EP_DP["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    mesh = _EP_DP["mesh"]
    ep, dp = mesh["ep"], mesh["dp"]
    E, K, T, H, local = 4, 2, 6, 4, 2
    generator = torch.Generator().manual_seed(7)
    shared0 = torch.randn(H, H, generator=generator, dtype=torch.float64) / 2
    router0 = torch.randn(H, E, generator=generator, dtype=torch.float64)
    experts0 = torch.randn(E, H, H, generator=generator, dtype=torch.float64) / 2
    xs = torch.randn(ctx.world_size, T, H, generator=generator, dtype=torch.float64)
    targets = torch.randn(ctx.world_size, T, H, generator=generator, dtype=torch.float64)
    first = ep.get_local_rank() * local

    def leaves(expert_slice):
        return [t.clone().requires_grad_() for t in (shared0, router0, experts0[expert_slice])]

    # unsharded, in this process: every rank's tokens, every expert
    shared, router, experts = leaves(slice(None))
    total = 0.0
    for x, target in zip(xs, targets, strict=True):
        weights, indices = (x @ router).softmax(-1).topk(K, dim=-1)
        moe_out = sum(
            weights[:, k : k + 1] * torch.tanh(torch.einsum("th,thg->tg", x, experts[indices[:, k]])) for k in range(K)
        )
        total = total + ((x @ shared + moe_out) * target).sum()
    total.backward()
    want = {"shared": shared.grad, "router": router.grad, "experts": experts.grad[first : first + local]}

    # sharded: this rank's tokens, its EP rank's experts
    shared, router, experts = leaves(slice(first, first + local))
    x, target = xs[ctx.rank], targets[ctx.rank]
    weights, indices = (x @ router).softmax(-1).topk(K, dim=-1)
    routing = moe.route(indices, E, ep)
    rows = moe.dispatch(x, routing)
    parts = torch.split(rows, routing.tokens_per_expert.tolist())
    y = torch.cat([torch.tanh(part @ experts[e]) for e, part in enumerate(parts)])
    ((x @ shared + moe.combine(y, routing, weights)) * target).sum().backward()
    local_grads = {"shared": shared.grad.clone(), "router": router.grad.clone(), "experts": experts.grad.clone()}

    def error(got, expected):
        return float((got - expected).abs().max() / expected.abs().max())

    sync_gradients([experts], group=dp)  # experts: replicated over dp only
    sync_gradients([shared, router])  # replicated over every rank (WORLD)
    found = {"shared": error(shared.grad, want["shared"]), "router": error(router.grad, want["router"])}
    found["experts"] = error(experts.grad, want["experts"])

    for name, tensor in (("experts", experts), ("router", router)):  # the mistakes, from the local gradients
        tensor.grad = local_grads[name].clone()
    sync_gradients([experts])  # experts over the world: other ranks' experts added in
    sync_gradients([router], group=dp)  # router over dp only: the other EP rank's tokens missing
    found["mistake: experts over the world"] = error(experts.grad, want["experts"])
    found["mistake: router over dp only"] = error(router.grad, want["router"])
    return found


def padded_compiled(ctx) -> dict[str, object]:
    """The padded layout's route + dispatch + expert + combine under ``torch.compile(fullgraph=True)``
    (aot_eager), route included (its tables are built on the device, no host read): the graph breaks
    ``torch._dynamo.explain`` counts, and whether the output and the x / weights gradients are eager's bit for
    bit."""
    import torch._dynamo as dynamo

    generator = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(6, 4, generator=generator, requires_grad=True)
    weights = torch.rand(6, 2, generator=generator, requires_grad=True)
    indices = torch.stack([torch.randperm(2 * ctx.world_size, generator=generator)[:2] for _ in range(6)])
    indices[1, 1] = -1

    def step(x, weights, indices):
        routing = moe.route(indices, 2 * ctx.world_size, capacity=2, layout="padded")
        return moe.combine(torch.tanh(moe.dispatch(x, routing)), routing, weights)

    dynamo.reset()
    breaks = dynamo.explain(step)(x, weights, indices).graph_break_count
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        x.grad = weights.grad = None
        out = fn(x, weights, indices)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, weights.grad))
    dynamo.reset()
    same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    return {"graph_breaks": breaks, "same": same}


def padded_bad_indices(ctx) -> list[object]:
    """Bad entries (>= E, < -1, an expert again in its row) on the last rank only, padded layout: eager, every
    rank raises the first bad rank's error (the flag travels with the counts), checked mode too; under
    ``torch.compile(fullgraph=True)`` nothing is read on the host: they are counted in `routing.invalid` and
    dropped (the routing equals the one of the cleaned indices). Then a good eager route: no rank hangs."""
    world, last = ctx.world_size, ctx.world_size - 1
    good = torch.tensor([[0, 1], [1, -1], [-1, -1]])
    x = torch.arange(6.0).reshape(3, 2)

    def step(indices):
        routing = moe.route(indices, 2 * world, layout="padded")
        return moe.dispatch(x, routing), routing.rows, routing.invalid

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    found: list[object] = []
    for bad_row, clean_row in (([2 * world, 0], [-1, 0]), ([-2, 0], [-1, 0]), ([1, 1], [1, -1])):
        indices, clean = good.clone(), good.clone()
        if ctx.rank == last:
            indices[1], clean[1] = torch.tensor(bad_row), torch.tensor(clean_row)
        found.append(_message(lambda indices=indices: moe.route(indices, 2 * world, layout="padded")))
        with checked():
            found.append(_message(lambda indices=indices: moe.route(indices, 2 * world, layout="padded")))
        rows, count, invalid = compiled(indices)
        cleaned_rows, cleaned_count, _ = step(clean)
        found.append([int(invalid), torch.equal(rows, cleaned_rows) and int(count) == int(cleaned_count)])
    found.append(str(step(good)[0].sum().item()))  # the ranks still agree after the errors
    return found


def padded_tokens_mismatch(ctx) -> list[str]:
    """The padded layout with another T on rank 0 (dropless, and with a capacity): eager, every rank raises
    `padded_tokens_error` before any row moves (T travels with the counts); then a good route, no hang."""
    tokens = 3 if ctx.rank == 0 else 2
    indices = torch.zeros(tokens, 1, dtype=torch.int64)
    messages = [
        _message(lambda: moe.route(indices, 2 * ctx.world_size, layout="padded")),
        _message(lambda: moe.route(indices, 2 * ctx.world_size, capacity=1, layout="padded")),
    ]
    routing = moe.route(torch.zeros(2, 1, dtype=torch.int64), 2 * ctx.world_size, layout="padded")
    messages.append(str(moe.dispatch(torch.ones(2, 1), routing).sum().item()))
    return messages
