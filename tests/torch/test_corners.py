"""The corners on real gloo groups: NaN under max/min, half-precision averages whose sum overflows,
dtypes gloo cannot carry, a rank outside the group, arguments that are not tensors, complex avg. Every value
is the one the issue states, or the numpy reference's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import commlib_torch
from commlib import plans, reference
from commlib_torch import DeviceCommunicator, _c10d, _walk
from tests.spec.test_corners import TORCH_DTYPES_GLOO_LACKS

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# A job that expects an error returns its "Type: message" text, so the test sees every rank's outcome.


NAN = float("nan")


def _text(call) -> object:
    try:
        return call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.complex128 if tensor.is_complex() else torch.float64).numpy()


def nan_extremum(ctx, op: str, convention: str):
    """The NaN example (W=2: rank 0 [nan, 5], rank 1 [5, nan]) plus a third element with a plain extremum on
    rank 1; cotangent ones. (output, input gradient)."""
    values = [[NAN, 5.0, 1.0], [5.0, NAN, 2.0 if op == "max" else 0.0]][ctx.rank]
    x = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    out = commlib_torch.all_reduce(x, op, convention=convention)
    out.backward(torch.ones(3, dtype=torch.float64))
    return _numpy(out), _numpy(x.grad)


def half_avg(ctx, dtype: str, op_name: str, value: float):
    """`value` on every rank in `dtype`, avg forward and backward with cotangent `value` on every rank."""
    W = ctx.world_size
    shape = (2 * W,) if op_name == "reduce_scatter" else (2,)
    x = torch.full(shape, value, dtype=getattr(torch, dtype), requires_grad=True)
    out = commlib_torch.all_reduce(x, "avg") if op_name == "all_reduce" else commlib_torch.reduce_scatter(x, 0, "avg")
    out.backward(torch.full_like(out, value))
    return _numpy(out), _numpy(x.grad)


def _bytes(rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Seeded random bytes viewed as `dtype` (`shape` with the last dim in elements)."""
    generator = torch.Generator().manual_seed(rank)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def moved(ctx, dtype: str):
    """Every data-movement op (and send/recv, DeviceCommunicator.gather) on random bytes viewed as `dtype`:
    {op: output bytes} (or the error text)."""
    W, rank, kind = ctx.world_size, ctx.rank, getattr(torch, dtype)
    x = _bytes(rank, (2 * W, 2 * W), kind)
    comm = DeviceCommunicator(dist.group.WORLD)
    calls = {
        "all_gather": lambda: commlib_torch.all_gather(x, 0),
        "all_gather_last": lambda: commlib_torch.all_gather(x, -1),
        "broadcast": lambda: commlib_torch.broadcast(x, W - 1),
        "gather": lambda: commlib_torch.gather(x, W - 1, 0),
        "scatter": lambda: commlib_torch.scatter(x, W - 1, -1),
        "all_to_all": lambda: commlib_torch.all_to_all(x, 0, 1),
        "all_to_all_4d": lambda: commlib_torch.all_to_all_4d(x.reshape(1, 2 * W, W, 2), 2, 1),
        "permute": lambda: commlib_torch.permute(x, [(r, (r + 1) % W) for r in range(W)]),
        "all_to_all_single": lambda: commlib_torch.all_to_all(x, 0, 0),
        "shard": lambda: commlib_torch.shard(x, -1),
        "transposed": lambda: commlib_torch.all_gather(x.t(), 0),
        "seed_gather": lambda: comm.gather(x, 0, 0),
    }
    out = {}
    for name, call in calls.items():
        result = _text(call)
        moved_bytes = isinstance(result, torch.Tensor)
        out[name] = result.contiguous().view(torch.uint8).numpy() if moved_bytes else result
    received = [None, None]
    sends = [lambda: comm.send(x, (rank + 1) % W), lambda: received.__setitem__(0, comm.recv(x.shape, kind))]
    for step in sends if rank == 0 else reversed(sends):
        step()
    out["send_recv"] = received[0].view(torch.uint8).numpy()
    return out


def reduced(ctx, dtype: str, op: str, values):
    """all_reduce(x, op) and reduce_scatter (sum) of rank r's `values[r]` in `dtype`: (all_reduce, reduce_scatter)
    outputs as numpy arrays of `dtype`, or the error text."""
    x = (
        torch.from_numpy(np.array(values[ctx.rank], dtype=dtype))
        if "int" in dtype
        else torch.tensor(values[ctx.rank]).to(getattr(torch, dtype))
    )
    numpy = (lambda t: t.numpy()) if "int" in dtype else (lambda t: t.float().numpy())
    results = []
    for call in (
        lambda: commlib_torch.all_reduce(x, op),
        lambda: commlib_torch.reduce_scatter(x.repeat(ctx.world_size), 0, "sum"),
    ):
        result = _text(call)
        results.append(result if isinstance(result, str) else numpy(result))
    return results


def outside_the_group(ctx):
    """Rank 1 of a W=3 world calls every op (and every DeviceCommunicator method) on the group {0, 2}: the error
    texts. Ranks 0 and 2 run nothing (a communicating call on rank 1 would hang)."""
    group = dist.new_group([0, 2])
    if ctx.rank != 1:
        return None
    x = torch.ones(2, 2)
    comm = DeviceCommunicator(group)
    calls = {
        **_every_op(lambda op: lambda: getattr(commlib_torch, op[0])(x, *op[1], group=group)),
        **{
            f"comm.{name}": (lambda name=name, args=args: getattr(comm, name)(x, *args))
            for name, args in _METHODS.items()
        },
        "comm.send": lambda: comm.send(x, 0),
        "comm.recv": lambda: comm.recv((2,), torch.float32, 0),
    }
    return {name: _text(call) for name, call in calls.items()}


_OPS = {
    "all_reduce": (),
    "all_gather": (0,),
    "reduce_scatter": (0,),
    "all_to_all": (0, 1),
    "all_to_all_4d": (),
    "broadcast": (0,),
    "gather": (0,),
    "scatter": (0,),
    "permute": ([(0, 1)],),
    "sum_grad": (),
    "shard": (0,),
    "reduce": (0,),
}
_METHODS = {
    "all_reduce": (),
    "all_gather": (0,),
    "reduce_scatter": (0,),
    "all_to_all": (0, 1),
    "all_to_all_4D": (),
    "broadcast": (0,),
    "gather": (0,),
    "scatter": (0,),
    "permute": ([(0, 1)],),
    "sum_grad": (),
    "slice": (0,),
    "reduce": (0,),
}


def _every_op(make):
    return {op: make((op, args)) for op, args in _OPS.items()}


def not_a_tensor(ctx, kind: str):
    """Every op and DeviceCommunicator method given a numpy array or a list: the error texts."""
    value = np.ones((2, 2)) if kind == "numpy" else [[1.0, 1.0], [1.0, 1.0]]
    comm = DeviceCommunicator(dist.group.WORLD)
    calls = {
        **{op: (lambda op=op, args=args: getattr(commlib_torch, op)(value, *args)) for op, args in _OPS.items()},
        **{
            f"comm.{name}": (lambda name=name, args=args: getattr(comm, name)(value, *args))
            for name, args in _METHODS.items()
        },
        "comm.send": lambda: comm.send(value, 0),
        "comm.recv": lambda: comm.recv((2,), np.dtype("float32"), 0),
    }
    return {name: _text(call) for name, call in calls.items()}


def complex_avg(ctx, dtype: str, xs, cotangents):
    """all_reduce(x, "avg") and reduce_scatter(x, 0, "avg") of complex `xs[rank]`, backward with
    `cotangents[rank]`: [(output, input gradient)] per op."""
    results = []
    for op in (lambda t: commlib_torch.all_reduce(t, "avg"), lambda t: commlib_torch.reduce_scatter(t, 0, "avg")):
        x = torch.tensor(xs[ctx.rank], dtype=getattr(torch, dtype), requires_grad=True)
        out = op(x)
        cotangent = torch.tensor(cotangents[ctx.rank], dtype=out.dtype)[: out.shape[0]]
        out.backward(cotangent)
        results.append((_numpy(out), _numpy(x.grad)))
    return results


#: One call per op (W=2 shapes) for the lazy-view job below.
LAZY_VIEW_CALLS = {
    "all_reduce": lambda x: commlib_torch.all_reduce(x),
    "all_gather": lambda x: commlib_torch.all_gather(x, 0),
    "reduce_scatter": lambda x: commlib_torch.reduce_scatter(x, 0),
    "all_to_all": lambda x: commlib_torch.all_to_all(x, 0, 1),
    "all_to_all same dim": lambda x: commlib_torch.all_to_all(x, 0, 0),
    "broadcast": lambda x: commlib_torch.broadcast(x, 1),
    "gather": lambda x: commlib_torch.gather(x, 1, 0),
    "scatter": lambda x: commlib_torch.scatter(x, 1, 0),
    "permute": lambda x: commlib_torch.permute(x, [(0, 1), (1, 0)]),
    "permute one way": lambda x: commlib_torch.permute(x, [(1, 0)]),
    "reduce": lambda x: commlib_torch.reduce(x, 1),
    "shard": lambda x: commlib_torch.shard(x, 0),
    "sum_grad": lambda x: commlib_torch.sum_grad(x),
}


def lazy_views(ctx, kind: str) -> dict[str, object]:
    """{op: whether its output on a conj (or negative) view equals its output on the same values materialised,
    or the error text}: torch keeps ``x.conj()`` and ``x.conj().imag`` as lazy bits c10d cannot send."""
    base = (torch.arange(8.0).reshape(4, 2) + ctx.rank) * (1 + 2j)
    lazy = base.conj() if kind == "conj" else base.conj().imag
    assert lazy.is_conj() or lazy.is_neg()
    plain = lazy.resolve_conj().resolve_neg()
    found: dict[str, object] = {}
    for name, call in LAZY_VIEW_CALLS.items():
        try:
            found[name] = torch.equal(call(lazy), call(plain))
        except RuntimeError as error:
            found[name] = f"RuntimeError: {str(error).splitlines()[0]}"
    return found


def complex_gather_scatter(ctx, dtype: str):
    """gather to rank 1 and scatter from rank 1 of complex rows (rank r holds r * 10 + [0..3] * (1 + 2j)),
    forward and backward (cotangent ones): (gather output, its input gradient, scatter output, its gradient)."""
    x = ((torch.arange(4.0).reshape(2, 2) + 10 * ctx.rank) * (1 + 2j)).to(getattr(torch, dtype)).requires_grad_()
    gathered = commlib_torch.gather(x, 1, 0)
    gathered.backward(torch.ones_like(gathered))
    grad_gather, x.grad = x.grad, None
    scattered = commlib_torch.scatter(x, 1, 0)
    scattered.backward(torch.ones_like(scattered))
    return _numpy(gathered), _numpy(grad_gather), _numpy(scattered), _numpy(x.grad)


def _forward_backward(call, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input gradient for a cotangent of ones)."""
    x = x.detach().requires_grad_()
    out = call(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    return out.detach(), grad


def direct_against_wrappers(ctx, dtype: str) -> dict[str, object]:
    """{op: whether output and input gradient are the same through the process group's methods (the walks'
    eager calls, `commlib_torch._c10d`) and through torch.distributed's functions (forced), or the error}."""
    x = ((torch.arange(8.0).reshape(4, 2) + 10 * ctx.rank) * (1 + 2j if "complex" in dtype else 1)).to(
        getattr(torch, dtype)
    )
    found: dict[str, object] = {}
    direct = _c10d._direct
    for name, call in LAZY_VIEW_CALLS.items():
        try:
            mine = _forward_backward(call, x)
            _c10d._direct = lambda group, tensor: None
            try:
                theirs = _forward_backward(call, x)
            finally:
                _c10d._direct = direct
            found[name] = all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        except RuntimeError as error:
            found[name] = f"RuntimeError: {str(error).splitlines()[0]}"
    return found


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def under_function_mode(ctx) -> tuple[bool, list[str]]:
    """all_reduce of rank + [0, 1, 2] inside a torch function mode: (the sum is right, the torch.distributed
    functions called): a mode (non-strict export's, for one) sees the call through the wrapper."""
    called, wrapped = [], dist.all_reduce

    def recording(*args, **kwargs):
        called.append("all_reduce")
        return wrapped(*args, **kwargs)

    dist.all_reduce = recording
    try:
        with _PassThrough():
            out = commlib_torch.all_reduce(torch.arange(3.0) + ctx.rank)
    finally:
        dist.all_reduce = wrapped
    expected = sum(torch.arange(3.0) + rank for rank in range(ctx.world_size))
    return torch.equal(out, expected), called


def dead_transform_wrapper(ctx) -> list[tuple[bool, bool, bool]]:
    """A tensor kept from inside a finished ``torch.func.grad`` (a dead functorch wrapper) as all_reduce's input,
    through commlib and through `Function.apply` itself: (the sum is right, the output requires grad, the output
    is still a functorch wrapper) for each. `Function.apply` unwraps it first, and so must commlib."""
    from commlib_torch._op import PlanFunction

    def kept(x: torch.Tensor) -> torch.Tensor:
        inside.append(x)
        return (x * x).sum()

    inside: list[torch.Tensor] = []
    torch.func.grad(kept)(torch.arange(3.0) + ctx.rank)
    (dead,) = inside
    plan = plans.all_reduce(dead.shape, ctx.world_size, "sum")
    expected = sum(torch.arange(3.0) + rank for rank in range(ctx.world_size))
    outs = commlib_torch.all_reduce(dead), PlanFunction.apply(dead, (plan, None, None))
    return [
        (torch.equal(out, expected), out.requires_grad, torch._C._functorch.is_functorch_wrapped_tensor(out))
        for out in outs
    ]


def strides_that_undo_the_pack(ctx) -> tuple[bool, bool, bool, bool]:
    """all_to_all(x, 1, 0) of an x [A, W] whose strides are the pack's order ([W, A] in memory, so the pack's
    permutation of it is contiguous: sent as it is, no copy), against the same x made contiguous: (the pack sent
    x's own memory, the outputs equal, the gradients equal, the output doubled in place is twice the output)."""
    W, A = ctx.world_size, 3
    torch.manual_seed(ctx.rank)
    x = torch.randn(W, A).t().requires_grad_()  # [A, W], strides (1, A)
    dense = x.detach().contiguous().requires_grad_()
    plan = plans.all_to_all(x.shape, W, 1, 0)
    packed = _walk.rearrange(x.detach(), plan.layout.pack, plan.layout.send_shape, x.dtype, output=False)
    cotangent = torch.randn(A * W, 1)
    out, expected = commlib_torch.all_to_all(x, 1, 0), commlib_torch.all_to_all(dense, 1, 0)
    (out * cotangent).sum().backward()
    (expected * cotangent).sum().backward()
    doubled = commlib_torch.all_to_all(x.detach(), 1, 0).mul_(2)
    return (
        packed.data_ptr() == x.data_ptr(),
        torch.equal(out, expected),
        torch.equal(x.grad, dense.grad),
        torch.equal(doubled, 2 * expected.detach()),
    )


def local_gradient_doubled_in_place(ctx) -> tuple[bool, bool]:
    """The input gradient of an uneven all_gather(convention="replicated") (a local step of the exact layout:
    this rank's block of the cotangent) taken with create_graph=True, then doubled in place: (allowed and
    twice the block, and the second derivative through it is right)."""
    rows = 1 + 2 * ctx.rank
    x = torch.randn(2, rows, 3, requires_grad=True)
    out = commlib_torch.all_gather(x, 1, sizes=(1, 3), convention="replicated")
    cotangent = torch.randn(out.shape)
    (grad,) = torch.autograd.grad(out, x, cotangent * out, create_graph=True)  # d/dx <c * out, out> / 2
    block = cotangent[:, ctx.rank : ctx.rank + rows] if ctx.rank == 0 else cotangent[:, 1:]
    grad.mul_(2)
    (second,) = torch.autograd.grad(grad.sum(), x)
    return torch.allclose(grad, 2 * block * x), torch.allclose(second, 2 * block)


# --- the tests ----------------------------------------------------------------------------------------------


pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize(("convention", "factor"), [("sum", 2.0), ("replicated", 1.0)])
def test_nan_under_max_and_min(pool, op, convention, factor):
    """[nan, 5] and [5, nan] -> [nan, nan] on every rank (numpy's maximum); the gradient goes to the NaN holder."""
    replies = pool(2).run(nan_extremum, op, convention)
    for rank, (out, grad) in enumerate(replies):
        np.testing.assert_array_equal(out[:2], [NAN, NAN])
        assert out[2] == (2.0 if op == "max" else 0.0)
        np.testing.assert_array_equal(grad, factor * np.array([[1, 0, 0], [0, 1, 1]][rank]))


@pytest.mark.parametrize(("dtype", "value"), [("float16", 40000.0), ("bfloat16", 3.0e38)])
@pytest.mark.parametrize("op_name", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_half_precision_avg_whose_sum_overflows(pool, dtype, value, op_name, world_size):
    """`value` on every rank: the sum overflows the dtype, the average is `value`; all_reduce's backward sums
    the cotangents (`value` each) too and gives `value`, reduce_scatter's gathers them and gives `value` / W."""
    expected = float(torch.tensor(value, dtype=getattr(torch, dtype)))
    expected_grad = expected if op_name == "all_reduce" else expected / world_size
    for out, grad in pool(world_size).run(half_avg, dtype, op_name, value):
        np.testing.assert_allclose(out, expected, rtol=4e-3)
        np.testing.assert_allclose(grad, expected_grad, rtol=4e-3)


@pytest.mark.parametrize("dtype", TORCH_DTYPES_GLOO_LACKS)
def test_every_dtype_gloo_lacks_moves_exactly(pool, dtype):
    """Every data-movement op, send/recv and the seed's gather on random bytes viewed as `dtype`: the output's
    bytes are the reference's op on the input bytes (a carrier moves bits, whatever they mean)."""
    W, kind = 2, getattr(torch, dtype)
    inputs = [_bytes(rank, (2 * W, 2 * W), kind).view(torch.uint8).numpy() for rank in range(W)]
    expected = {
        "all_gather": reference.all_gather(inputs, 0),
        "all_gather_last": reference.all_gather(inputs, -1),
        "broadcast": reference.broadcast(inputs, W - 1),
        "gather": reference.gather(inputs, W - 1, 0),
        "scatter": reference.scatter(inputs, W - 1, -1),
        "all_to_all": reference.all_to_all(inputs, 0, 1),
        "all_to_all_4d": reference.all_to_all_4d([x.reshape(1, 2 * W, W, -1) for x in inputs], 2, 1),
        "permute": reference.permute(inputs, [(r, (r + 1) % W) for r in range(W)]),
        "all_to_all_single": reference.all_to_all(inputs, 0, 0),
        "shard": reference.shard(inputs, -1),  # block r of the elements is block r of their bytes
        "transposed": reference.all_gather(
            [x.reshape(2 * W, 2 * W, -1).transpose(1, 0, 2).reshape(2 * W, -1) for x in inputs], 0
        ),
        "seed_gather": [reference.gather(inputs, 0, 0)[0], None],
        "send_recv": [inputs[1], inputs[0]],
    }
    replies = pool(W).run(moved, dtype)
    for rank, reply in enumerate(replies):
        assert set(reply) == set(expected)
        for name, want in expected.items():
            got = reply[name]
            assert not isinstance(got, str), (name, got)
            if want[rank] is None:
                assert got is None, name
            else:
                np.testing.assert_array_equal(got.reshape(want[rank].shape), want[rank], err_msg=name)


INTEGER_VALUES = {  # rank r's values: wrap-around sums, values past the signed range, ties
    "int16": [[30000, -5, 7], [30000, 9, 7]],
    "uint16": [[60000, 5, 1], [60000, 65535, 2]],
    "uint32": [[4_000_000_000, 5, 3], [4_000_000_001, 2, 3]],
    "uint64": [[2**63 + 1, 5, 3], [2**63, 2, 3]],
}


@pytest.mark.parametrize("dtype", INTEGER_VALUES)
@pytest.mark.parametrize("op", ["sum", "product", "max", "min"])
def test_integer_reductions_gloo_lacks_are_exact(pool, dtype, op):
    """The dtype's own arithmetic (numpy's: wrapping modulo 2**bits) where a carrier is exact; uint64 max/min
    (no exact carrier) refused with the spec's message on every rank."""
    values = INTEGER_VALUES[dtype]
    stacked = np.array(values, dtype=dtype)
    want = {
        "sum": stacked.sum(0, dtype=dtype),
        "product": stacked.prod(0, dtype=dtype),
        "max": stacked.max(0),
        "min": stacked.min(0),
    }[op]
    for out, scattered in pool(2).run(reduced, dtype, op, values):
        if dtype == "uint64" and op in ("max", "min"):
            assert out == (
                f"CommError: all_reduce: op ('{op}') on uint64 has no exact carrier: the backend lacks "
                f"uint64 and any wider integer that holds every uint64 value; cast x to a dtype it "
                f"carries first. Received: shape=(3,), op='{op}', dtype='uint64'"
            )
        else:
            assert out.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(out, want)
        assert scattered.dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_max_min_exact_and_sum_refused(pool, dtype):
    values = [[1.5, NAN, -2.0], [2.5, 1.0, -3.0]]
    for op, want in (("max", [2.5, NAN, -2.0]), ("min", [1.5, NAN, -3.0])):
        for out, _ in pool(2).run(reduced, dtype, op, values):
            np.testing.assert_array_equal(out, want)
    for out, scattered in pool(2).run(reduced, dtype, "sum", values):
        assert out.startswith(f"CommError: all_reduce: op ('sum') on {dtype} is not supported: its rounding differs")
        assert scattered.startswith(f"CommError: reduce_scatter: op ('sum') on {dtype} is not supported")


def test_a_rank_outside_the_group(pool):
    errors = pool(3).run(outside_the_group)[1]
    assert len(errors) == 26
    for name, text in errors.items():
        op = name.removeprefix("comm.").replace("all_to_all_4D", "all_to_all_4d").replace("slice", "shard")
        assert text == (
            f"CommError: {op}: this rank (global rank 1) is not a member of the group (global ranks "
            f"[0, 2]): only its members may call its collectives. Received: rank=1, group_ranks=[0, 2]"
        )


@pytest.mark.parametrize(("kind", "type_name"), [("numpy", "numpy.ndarray"), ("list", "list")])
def test_not_a_tensor(pool, kind, type_name):
    for errors in pool(2).run(not_a_tensor, kind):
        assert len(errors) == 26
        for name, text in errors.items():
            op = name.removeprefix("comm.").replace("all_to_all_4D", "all_to_all_4d").replace("slice", "shard")
            if name == "comm.recv":
                assert text == (
                    "TypeError: recv: dtype must be a torch.dtype, not numpy.Float32DType. "
                    "Received: type='numpy.Float32DType'"
                )
                continue
            argument = "tensor" if name == "comm.send" else "x"
            assert text == (
                f"TypeError: {op}: {argument} must be a torch.Tensor, not {type_name}. Received: type='{type_name}'"
            )


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_avg_forward_and_gradient(pool, dtype):
    rng = np.random.default_rng(3)
    draw = lambda: rng.standard_normal(4) + 1j * rng.standard_normal(4)  # noqa: E731
    xs, cotangents = [draw() for _ in range(2)], [draw() for _ in range(2)]
    replies = pool(2).run(complex_avg, dtype, xs, cotangents)
    for index, op in enumerate(("all_reduce", "reduce_scatter")):
        plan = getattr(plans, op)((4,), 2, op="avg", dtype=dtype)
        outputs = reference.forward(plan, xs)
        grads = reference.vjp(plan, xs, [c[: plan.out_shape[0]] for c in cotangents])
        for rank, reply in enumerate(replies):
            out, grad = reply[index]
            np.testing.assert_allclose(out, outputs[rank], rtol=1e-5)
            np.testing.assert_allclose(grad, grads[rank], rtol=1e-5)


@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_lazy_conj_and_neg_views_travel_as_their_values(pool, kind):
    """``x.conj()`` (complex) and ``x.conj().imag`` (a negative view) are lazy in torch: every op sends their
    values, as for the same tensor materialised."""
    for found in pool(2).run(lazy_views, kind):
        assert found == dict.fromkeys(LAZY_VIEW_CALLS, True)


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_gather_and_scatter(pool, dtype):
    """gloo refuses complex tensors in c10d's gather and scatter: they travel as their real views."""
    xs = [(np.arange(4.0).reshape(2, 2) + 10 * rank) * (1 + 2j) for rank in range(2)]
    replies = pool(2).run(complex_gather_scatter, dtype)
    for rank, (gathered, grad_gather, scattered, grad_scatter) in enumerate(replies):
        np.testing.assert_array_equal(gathered, np.concatenate(xs) if rank == 1 else np.zeros((4, 2)))
        np.testing.assert_array_equal(grad_gather, np.ones((2, 2)))  # scatter of the root's ones
        np.testing.assert_array_equal(scattered, xs[1][rank : rank + 1])
        np.testing.assert_array_equal(grad_scatter, np.ones((2, 2)) if rank == 1 else np.zeros((2, 2)))


@pytest.mark.parametrize("dtype", ["float32", "complex64"])
def test_process_group_methods_match_torch_distributed(pool, dtype):
    """The eager walks call the process group's own methods (`commlib_torch._c10d`): every op's output and
    gradient are those of the same walk through torch.distributed's functions, real and complex."""
    for found in pool(2).run(direct_against_wrappers, dtype):
        assert found == dict.fromkeys(LAZY_VIEW_CALLS, True)


def test_torch_function_modes_see_the_collective(pool):
    """Inside a torch function mode the c10d call goes through torch.distributed's function (which dispatches
    to the mode) and the result is unchanged."""
    for right, called in pool(2).run(under_function_mode):
        assert right
        assert called == ["all_reduce"]


def test_dead_transform_wrappers_are_unwrapped_as_function_apply_does(pool):
    """commlib calls the autograd Function's C apply itself (eager, no transform active): a tensor kept from
    inside a finished torch.func transform comes out as through `Function.apply`, unwrapped (values right, no
    gradient, no wrapper)."""
    for commlib_out, function_apply in pool(2).run(dead_transform_wrapper):
        assert commlib_out == function_apply == (True, False, False)


def test_an_input_whose_strides_undo_the_pack(pool):
    """The pack pass of an input already in the pack's order is no copy; values and gradients are those of the
    contiguous input, and the output is still a tensor of its own."""
    for found in pool(2).run(strides_that_undo_the_pack):
        assert found == (True, True, True, True)


def test_a_local_gradient_can_be_doubled_in_place(pool):
    """A gradient the exact layout's local step makes (uneven, replicated all_gather's backward) is a tensor of
    its own too: doubled in place under create_graph, with the right values and second derivative."""
    for found in pool(2).run(local_gradient_doubled_in_place):
        assert found == (True, True)
