"""`commlib_jax.moe` against the spec's float64 reference (`commlib.reference.moe.simulate_moe`, padded layout):
every rank's dispatched rows, combined output, routing counts and the x / y / weights gradients, through
per-expert nonlinear experts (expert e: ``tanh((e + 1) * row)``, so a wrong ordering cannot pass) with NaN
written into the padded rows. Compiles dominate, so one jitted program runs every case of a mesh. The jnp
routing tables (`traced_routing` / `traced_tables`) are checked against the spec's numpy ones."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError, moe, split_sizes
from commlib.reference.moe import SimulatedMoeRanks, simulate_moe
from commlib_jax import moe as jmoe
from tests.jax.test_sequence_parallel import _runtime_error


@dataclasses.dataclass(frozen=True)
class Case:
    tokens: int
    top_k: int
    features: tuple[int, ...]
    experts: int
    placement: tuple[int, ...] | None = None
    capacity: int | None = None
    capacity_factor: float | None = None
    empty_rank: bool = False  # rank 1 routes nothing
    bad: bool = False  # indices outside [-1, E) and an expert twice in a row: counted and dropped
    dtype: str = "float64"

    def options(self) -> dict:
        return dict(capacity=self.capacity, capacity_factor=self.capacity_factor, experts_per_rank=self.placement)


def _data(case: Case, world: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    shape = (world, case.tokens)
    indices = np.array([rng.permutation(case.experts)[: case.top_k] for _ in range(world * case.tokens)])
    indices = indices.reshape(*shape, case.top_k)
    indices[rng.random(indices.shape) < 0.15] = -1
    if case.empty_rank and world > 1:
        indices[1] = -1
    clean = indices.copy()
    if case.bad:
        indices[0, 0, 0] = case.experts + 3  # outside: dropped
        indices[-1, 1, 0] = -5
        if case.top_k > 1:
            indices[0, 2, 1] = indices[0, 2, 0] = 1  # twice: the later copy dropped
            clean[0, 2, 0], clean[0, 2, 1] = 1, -1
        clean[0, 0, 0] = clean[-1, 1, 0] = -1
    dtype = jnp.bfloat16 if case.dtype == "bfloat16" else np.float64

    def rounded(values: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(values, dtype), np.float64)

    return dict(
        x=rounded(rng.standard_normal((*shape, *case.features))),
        indices=indices,
        clean=clean,
        weights=rounded(rng.random((*shape, case.top_k))),
        out_bar=rounded(rng.standard_normal((*shape, *case.features))),
    )


def _scales(routing_counts: np.ndarray, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert e's scale e + 1 for each dispatched row, and which rows are valid."""
    ends = np.cumsum(routing_counts)
    row = np.arange(length)
    local = np.minimum(np.searchsorted(ends, row, side="right"), len(ends) - 1)
    return offset + local + 1.0, row < ends[-1]


def _column(values, ndim: int):
    return values.reshape(*values.shape, *[1] * (ndim - values.ndim))


def _rank_body(cases: tuple[Case, ...], axis):
    """One rank's program: every case's route, dispatch, experts, combine and their VJPs."""

    def body(*args):
        outputs = []
        for case, (x, indices, weights, out_bar) in zip(cases, args, strict=True):
            dtype = jnp.bfloat16 if case.dtype == "bfloat16" else jnp.float64
            x, weights, out_bar = (a.astype(dtype) for a in (x, weights, out_bar))
            routing = jmoe.route(indices, case.experts, axis, **case.options())
            placement = routing.plan.experts_per_rank
            offset = jnp.asarray(routing.plan.expert_offsets[:-1])[jax.lax.axis_index(axis)]
            ends = jnp.cumsum(routing.tokens_per_expert)
            row = jnp.arange(routing.plan.padded_rows)
            local = jnp.minimum(jnp.searchsorted(ends, row, side="right"), max(placement) - 1)
            scale = _column((offset + local + 1).astype(dtype), 1 + len(case.features))
            valid = _column(row < routing.rows, 1 + len(case.features))

            def experts(d, scale=scale, valid=valid):  # NaN in the padded rows must reach nothing
                return jnp.where(valid, jnp.tanh(scale * d), jnp.nan)

            def layer(x, weights, routing=routing, experts=experts):
                return jmoe.combine(experts(jmoe.dispatch(x, routing)), routing, weights)

            dispatched, dispatch_vjp = jax.vjp(lambda x, routing=routing: jmoe.dispatch(x, routing), x)
            y = experts(dispatched)
            combined, combine_vjp = jax.vjp(lambda y, w, routing=routing: jmoe.combine(y, routing, w), y, weights)
            y_bar, w_bar = combine_vjp(out_bar)
            (x_bar,) = dispatch_vjp(jnp.where(valid, y_bar, jnp.nan))  # padded cotangent rows: ignored
            _, layer_vjp = jax.vjp(layer, x, weights)
            x_grad, w_grad = layer_vjp(out_bar)
            counts = jnp.stack([routing.rows, routing.dropped, routing.invalid])
            outputs.append(
                (dispatched, combined, y_bar, w_bar, x_bar, x_grad, w_grad, routing.tokens_per_expert, counts)
            )
        return outputs

    return body


def _program(cases: tuple[Case, ...], mode: str, world: int):
    if mode == "pmap":
        return jax.pmap(_rank_body(cases, "i"), axis_name="i", devices=jax.devices()[:world])
    if mode == "mesh2x2":
        mesh, axis = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b")), ("a", "b")
    else:
        mesh, axis = Mesh(np.array(jax.devices()[:world]), ("i",)), "i"
    body = _rank_body(cases, axis)

    def stacked(*args):
        return jax.tree.map(lambda t: t[None], body(*jax.tree.map(lambda a: a[0], args)))

    spec = P(axis)
    return jax.jit(jax.shard_map(stacked, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=mode == "vma"))


def _expected(case: Case, data: dict, world: int) -> tuple:
    xs, clean, ws, bars = (list(data[name]) for name in ("x", "clean", "weights", "out_bar"))
    options = dict(layout="padded", **case.options())
    first = simulate_moe(xs, clean, case.experts, **options)
    offsets = first.plans[0].expert_offsets
    length = first.plans[0].padded_rows
    scales = [_scales(t.tokens_per_expert, offsets[r], length) for r, t in enumerate(first.tables)]
    ndim = 1 + len(case.features)
    ys = [
        np.where(_column(v, ndim), np.tanh(_column(s, ndim) * d), np.nan)
        for (s, v), d in zip(scales, first.dispatched, strict=True)
    ]
    sim = simulate_moe(xs, clean, case.experts, weights=ws, ys=ys, out_bars=bars, **options)
    chain = [
        np.where(_column(v, ndim), yb * _column(s, ndim) * (1 - np.where(_column(v, ndim), y, 0.0) ** 2), 0.0)
        for (s, v), yb, y in zip(scales, sim.y_bar, ys, strict=True)
    ]
    tables = moe.RankTables(
        **{f.name: [getattr(t, f.name) for t in sim.tables] for f in dataclasses.fields(moe.RankTables)}
    )
    x_grad = moe.dispatch_vjp(SimulatedMoeRanks(case.top_k), chain, tables)
    most = max(first.plans[0].experts_per_rank)
    per_expert = np.stack([np.pad(t.tokens_per_expert, (0, most - len(t.tokens_per_expert))) for t in sim.tables])
    invalid = (data["indices"] != data["clean"]).sum(axis=(1, 2))
    counts = np.stack([[t.rows, t.dropped, bad] for t, bad in zip(sim.tables, invalid, strict=True)])
    return (
        first.dispatched,
        sim.combined,
        sim.y_bar,
        sim.weights_bar,
        sim.x_bar,
        x_grad,
        sim.weights_bar,
        per_expert,
        counts,
    )


NAMES = ("dispatched", "combined", "y_bar", "weights_bar", "x_bar", "x_grad", "weights_grad", "tokens_per_expert")


def _check(cases: tuple[Case, ...], mode: str, world: int, seed: int = 0) -> None:
    datas = [_data(case, world, seed + n) for n, case in enumerate(cases)]
    args = [tuple(d[name] for name in ("x", "indices", "weights", "out_bar")) for d in datas]
    got = jax.device_get(_program(cases, mode, world)(*args))
    for case, data, outputs in zip(cases, datas, got, strict=True):
        expected = _expected(case, data, world)
        tolerance = dict(rtol=3e-2, atol=3e-2) if case.dtype == "bfloat16" else dict(rtol=1e-12, atol=1e-12)
        for name, value, want in zip(NAMES, outputs, expected, strict=False):
            for rank in range(world):
                np.testing.assert_allclose(
                    np.asarray(value[rank], np.float64), want[rank], **tolerance, err_msg=f"{case} {name} rank {rank}"
                )
        np.testing.assert_array_equal(outputs[-1], expected[-1], err_msg=f"{case} rows, dropped, invalid")
        for rank in range(world):  # the padded rows: exactly 0, and so are their cotangents
            rows = int(outputs[-1][rank][0])
            for name, value in (("dispatched", outputs[0]), ("y_bar", outputs[2])):
                assert not np.asarray(value[rank][rows:]).any(), f"{case} {name} rank {rank}: padded rows not 0"
            for value in outputs[1:]:
                assert np.isfinite(np.asarray(value[rank], np.float64)).all(), f"{case}: a NaN leaked"


CASES = (
    Case(6, 1, (3,), 4),
    Case(6, 2, (2, 3), 4, capacity=1),
    Case(8, 2, (3,), 8, capacity_factor=1.0, empty_rank=True),
    Case(5, 2, (3,), 4, bad=True),
    Case(6, 2, (4,), 4, capacity=2, dtype="bfloat16"),
)


@pytest.mark.parametrize(
    ("mode", "world", "cases"),
    [
        ("vma", 1, CASES[:2]),
        ("vma", 2, (*CASES, Case(4, 2, (3,), 4, capacity=0))),
        ("vma", 4, CASES),
        ("novma", 4, CASES[1:4]),
        ("pmap", 4, CASES[1:4]),
        ("mesh2x2", 4, CASES[1:3]),
        ("vma", 3, (Case(6, 2, (3,), 8, split_sizes(8, 3)), Case(4, 2, (2, 3), 8, split_sizes(8, 3), capacity=1))),
    ],
)
def test_against_reference(mode: str, world: int, cases: tuple[Case, ...]) -> None:
    _check(cases, mode, world)


# ---------------------------------------------------------------------------------------------------------
# The jnp tables against the spec's numpy ones (equal on the valid entries)
# ---------------------------------------------------------------------------------------------------------


def _to_padded(compact: np.ndarray, sizes: np.ndarray, chunk: int) -> np.ndarray:
    """The padded-layout position of each compact send / receive position (-1 stays -1)."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    owner = np.searchsorted(np.cumsum(sizes), compact, side="right")
    return np.where(compact >= 0, owner * chunk + compact - starts[np.minimum(owner, len(sizes) - 1)], -1)


@pytest.mark.parametrize(
    ("world", "experts", "top_k", "placement", "capacity"),
    [(1, 4, 2, None, None), (2, 4, 1, None, 1), (3, 8, 2, split_sizes(8, 3), None), (4, 8, 3, None, 2)],
)
def test_traced_tables_equal_the_spec(world, experts, top_k, placement, capacity) -> None:
    rng = np.random.default_rng(world)
    tokens = 7
    indices = [np.array([rng.permutation(experts)[:top_k] for _ in range(tokens)]) for _ in range(world)]
    for index in indices:
        index[rng.random(index.shape) < 0.2] = -1
    plan = moe.route_plan(
        (tokens, top_k), "int64", experts, world, capacity=capacity, experts_per_rank=placement, layout="padded"
    )
    chunk, offsets = max(plan.experts_per_rank) * plan.slot, plan.expert_offsets
    local = [moe.local_routing(index, plan) for index in indices]
    traced = [jmoe.traced_routing(jnp.asarray(index), plan) for index in indices]
    counts = np.stack([send for _, send, _ in local])
    for rank in range(world):
        order, send, dropped = local[rank]
        got = jax.device_get(traced[rank])
        np.testing.assert_array_equal(got["order"][got["keep"]], order)
        np.testing.assert_array_equal(got["counts"], send)
        assert int(got["dropped"]) == dropped and int(got["invalid"]) == 0
        want = moe.rank_tables(plan, rank, order, send, dropped, counts[:, offsets[rank] : offsets[rank + 1]])
        received = np.stack([jax.device_get(t["send"])[rank] for t in traced])  # what the exchange delivers
        tables = jax.device_get(jmoe.traced_tables(plan, traced[rank], received))
        send_at = _to_padded(np.arange(want.send_copy.size), want.send_sizes, chunk)
        expected = np.full(world * chunk, -1)
        expected[send_at] = want.send_copy
        np.testing.assert_array_equal(tables["send_copy"], expected)
        np.testing.assert_array_equal(tables["token_slot"], _to_padded(want.token_slot, want.send_sizes, chunk))
        np.testing.assert_array_equal(tables["unpack"], _to_padded(want.unpack, want.recv_sizes, chunk))
        expected = np.full(world * chunk, -1)
        expected[_to_padded(np.arange(want.pack_back.size), want.recv_sizes, chunk)] = want.pack_back
        np.testing.assert_array_equal(tables["pack_back"], expected)
        np.testing.assert_array_equal(tables["send_sizes"], want.send_sizes)
        np.testing.assert_array_equal(tables["recv_sizes"], want.recv_sizes)
        most = max(plan.experts_per_rank)
        np.testing.assert_array_equal(
            tables["tokens_per_expert"], np.pad(want.tokens_per_expert, (0, most - want.tokens_per_expert.size))
        )
        assert int(tables["rows"]) == want.rows


# ---------------------------------------------------------------------------------------------------------
# Errors, before any communication (traced only: nothing compiles)
# ---------------------------------------------------------------------------------------------------------


def _trace(body, *args) -> None:
    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(*args)


INDICES = np.zeros((2, 4, 2), np.int64)


@pytest.mark.parametrize(
    ("body", "error", "message"),
    [
        (lambda i: jmoe.route([[0, 1]] * 4, 4, "i"), TypeError, "route: indices must be a jax.Array"),
        (lambda i: jmoe.route(i.astype(jnp.float32), 4, "i"), TypeError, "route: indices must be an integer"),
        (lambda i: jmoe.route(i, 4, "i", layout="exact"), CommError, "JAX is always layout='padded'"),
        (lambda i: jmoe.route(i, 3, "i"), CommError, r"num_experts \(3\) must be divisible by world_size \(2\)"),
        (lambda i: jmoe.route(i[0], 4, "i"), CommError, r"indices must be \[T, K\]"),
        (lambda i: jmoe.route(i, 4, "j"), CommError, "route"),
        (lambda i: jmoe.dispatch(jnp.ones((3, 2)), jmoe.route(i, 4, "i")), CommError, r"dispatch: x has 3 rows"),
        (lambda i: jmoe.dispatch(jnp.ones((4, 2), int), jmoe.route(i, 4, "i")), TypeError, "dispatch: x must be"),
        (lambda i: jmoe.dispatch([1.0], jmoe.route(i, 4, "i")), TypeError, "dispatch: x must be a jax.Array"),
        (lambda i: jmoe.dispatch(jnp.ones((4, 2)), None), TypeError, "dispatch: routing must be"),
        (lambda i: jmoe.combine(jnp.ones((3, 2)), jmoe.route(i, 4, "i")), CommError, r"combine: y has 3 rows"),
        (
            lambda i: jmoe.combine(jnp.ones((16, 2)), jmoe.route(i, 4, "i"), jnp.ones((4, 1))),
            CommError,
            r"combine: weights shape \(4, 1\)",
        ),
    ],
)
def test_errors(body, error, message) -> None:
    with pytest.raises(error, match=message):
        _trace(lambda i: body(i[0]), INDICES)


def test_one_counts_exchange_and_one_dense_all_to_all_per_direction() -> None:
    """route: one all_to_all of the counts; dispatch and combine: one dense all_to_all of rows each (no ragged
    one, no host callback)."""

    def body(x, i):
        routing = jmoe.route(i[0], 4, "i")
        return jmoe.combine(jmoe.dispatch(x[0], routing), routing)[None]

    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
    program = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    text = str(jax.make_jaxpr(program)(np.ones((2, 4, 3)), INDICES))
    assert text.count("all_to_all[") == 3, text
    assert "ragged" not in text and "callback" not in text


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ((1, 2, 0, 9), r"route: indices\[2\] on rank 1 holds expert 9, outside \[-1, 4\)"),
        ((1, 3, 1, -2), r"route: indices\[3\] on rank 1 holds expert -2, outside \[-1, 4\)"),
        ((0, 1, 1, 1), r"route: indices\[1\] on rank 0 routes to expert 1 twice"),
    ],
)
@pytest.mark.parametrize("check_vma", [True, False])
def test_checked_mode_raises_for_bad_indices(monkeypatch, bad, message, check_vma) -> None:
    """COMMLIB_CHECK=1: a bad index (>= E, < -1, an expert twice in a row) raises the spec's bad_route_error,
    the first bad rank's, when the step runs (inside JAX's runtime error); unchecked it is counted in
    ``routing.invalid`` and dropped (the same program runs)."""
    rank, token, column, value = bad
    indices = np.array([[[0, 1], [1, 2], [2, 3], [3, 0]]] * 2, np.int64)
    indices[rank, token, column] = value
    indices[1 - rank, 0, 0] = 9 if rank == 0 else indices[1 - rank, 0, 0]  # a later rank's bad one comes second
    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))

    def body(i):
        return jmoe.route(i[0], 4, "i").invalid[None]

    def program():
        return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma)

    monkeypatch.delenv("COMMLIB_CHECK", raising=False)
    assert jax.jit(program())(indices).sum() >= 1  # unchecked: counted, no error
    monkeypatch.setenv("COMMLIB_CHECK", "1")
    text = _runtime_error(lambda: jax.block_until_ready(jax.jit(program())(indices)))  # the token dropped
    assert re.search(message, text), text


def test_one_row_exchange_per_direction() -> None:
    """jax.grad of route + dispatch + combine (weights and x): one all_to_all of the counts, then rows move once
    per direction, forward and backward (4): combine's weights gradient reads the rows its forward brought back
    (it exchanged y's rows a fifth time), as torch's `test_one_row_exchange_per_direction`."""

    def body(x, i, w):
        def loss(x, w):
            routing = jmoe.route(i[0], 4, "i")
            return jnp.sum(jmoe.combine(jnp.tanh(jmoe.dispatch(x, routing)), routing, w) ** 2)

        return jax.tree.map(lambda g: g[None], jax.grad(loss, argnums=(0, 1))(x[0], w[0]))

    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
    program = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    text = str(jax.make_jaxpr(program)(np.ones((2, 4, 3)), INDICES, np.ones((2, 4, 2))))
    assert text.count("all_to_all[") == 1 + 4, text.count("all_to_all[")
