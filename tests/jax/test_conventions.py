"""docs/gradients.md, JAX side: the worked examples, Megatron f/g, data parallel, Ulysses, and the table of
factors by which JAX's built-in rules (and commlib's ops) differ from ``convention="sum"`` in each mode.

The factor of a setting is (the gradient JAX returns) / (the torch answer): the gradient of
``sum_r L_r`` with every rank's input its own variable, which is what commlib_torch (and torch.distributed.nn)
give for the same per-rank losses. Runs on the 4 CPU devices tests/jax/conftest.py sets up.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib_jax as cj
from commlib import CommError
from commlib import attention as reference_attention
from commlib_jax.attention import ulysses_attention
from tests.gradient_examples import EXAMPLES

AXIS = "i"
W = 4


def _mesh(world_size=W):
    return Mesh(np.array(jax.devices()[:world_size]), (AXIS,))


def _shard_map(fn, check_vma, in_specs, out_specs, world_size=W):
    return jax.shard_map(fn, mesh=_mesh(world_size), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


# --- the worked examples (tests/gradient_examples.py, also run by tests/torch/test_conventions.py) -------------

MODES = ("check_vma=True", "check_vma=False", "pmap")


def _example_gradients(mode, op, kwargs, xs, cotangents):
    """Rank r's loss is ``sum(cotangents[r] * op(xs[r]))``, per-rank losses summed outside."""
    xs, cotangents = np.asarray(xs), np.asarray(cotangents)

    def loss(x, c):
        return jnp.sum(c * getattr(cj, op)(x, AXIS, **kwargs))

    if mode == "pmap":
        per_rank = jax.pmap(loss, axis_name=AXIS, devices=jax.devices()[: len(xs)])
    else:
        body = lambda x, c: loss(x[0], c[0])[None]  # noqa: E731  (block [1, *s] -> rank's [*s])
        per_rank = _shard_map(body, mode == "check_vma=True", (P(AXIS), P(AXIS)), P(AXIS), len(xs))
    return jax.jit(jax.grad(lambda x: per_rank(x, cotangents).sum()))(xs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("op", "kwargs", "xs", "cotangents", "expected"), [e[1:] for e in EXAMPLES], ids=[e[0] for e in EXAMPLES]
)
def test_example(mode, op, kwargs, xs, cotangents, expected):
    np.testing.assert_array_equal(_example_gradients(mode, op, kwargs, xs, cotangents), np.asarray(expected))


# --- where JAX's built-in rules differ from convention="sum": the factor table -----------------------------------

N = 2  # elements of x per rank
_RNG = np.random.default_rng(0)
COTANGENTS = {  # c[r]: rank r's loss is sum(c[r] * y_r); an all_reduce uses the first N columns
    "varying": _RNG.integers(1, 9, size=(W, W * N)).astype(np.float64),
    "same": np.tile(_RNG.integers(1, 9, size=W * N).astype(np.float64), (W, 1)),
}
OPS = {  # name -> (this rank's op, the same map on all ranks' inputs stacked [W, N] -> [W, ...])
    "lax.psum": (lambda x: lax.psum(x, AXIS), lambda xs: jnp.broadcast_to(xs.sum(0), xs.shape)),
    "lax.all_gather": (lambda x: lax.all_gather(x, AXIS, tiled=True), lambda xs: jnp.tile(xs.ravel(), (W, 1))),
    "commlib.all_reduce": (lambda x: cj.all_reduce(x, AXIS), lambda xs: jnp.broadcast_to(xs.sum(0), xs.shape)),
    "commlib.all_gather": (lambda x: cj.all_gather(x, AXIS, dim=0), lambda xs: jnp.tile(xs.ravel(), (W, 1))),
}


def _rank_loss(op, pattern):
    """L_r(x_r) = sum(c[r] * op(x_r)); c[r] is typed invariant when pattern == "same" (a constant)."""
    collective, _ = OPS[op]
    c = COTANGENTS[pattern]

    def loss(x):
        y = collective(x)
        weights = jnp.asarray(c[0]) if pattern == "same" else jnp.asarray(c)[lax.axis_index(AXIS)]
        return jnp.sum(weights[: y.shape[0]] * y)

    return loss


def _torch_answer(op, pattern, xs):
    """d(sum_r L_r)/dx_r with each rank's x_r its own variable (commlib_torch's and torch.distributed.nn's)."""
    _, everyone = OPS[op]
    c = jnp.asarray(COTANGENTS[pattern])
    return jax.grad(lambda xs: jnp.sum(c[:, : everyone(xs).shape[1]] * everyone(xs)))(xs)


# Settings: loss -> the gradient JAX returns for x = the [W * N] array sharded P(AXIS) (or, "shared", for x [N]
# given to every rank). Names as in the doc's table.
def _outside(check_vma):
    return lambda L, x: jax.grad(lambda x: _shard_map(lambda x: L(x)[None], check_vma, P(AXIS), P(AXIS))(x).sum())(x)


def _inside(check_vma, psum=False):
    loss = (lambda L: lambda x: lax.psum(L(x), AXIS)) if psum else (lambda L: L)
    return lambda L, x: _shard_map(jax.grad(loss(L)), check_vma, P(AXIS), P(AXIS))(x)


def _replicated_out(check_vma, psum):
    loss = (lambda L: lambda x: lax.psum(L(x), AXIS)) if psum else (lambda L: L)
    return lambda L, x: jax.grad(_shard_map(loss(L), check_vma, P(AXIS), P()))(x)


def _pmap(out_axes, psum=False):
    def grad(L, x):
        loss = (lambda x: lax.psum(L(x), AXIS)) if psum else L
        mapped = jax.pmap(loss, axis_name=AXIS, out_axes=out_axes)
        return jax.grad(lambda x: mapped(x.reshape(W, N)).sum())(x)

    return grad


def _pmap_inside(psum):
    def grad(L, x):
        loss = (lambda x: lax.psum(L(x), AXIS)) if psum else L
        return jax.pmap(jax.grad(loss), AXIS)(x.reshape(W, N)).ravel()

    return grad


def _shared(how, check_vma=True):
    """x [N] given to every rank: in_specs=P(), closed over by the shard_map / pmap body, pmap in_axes=None."""
    ranks = jnp.zeros(W)  # a mapped argument for the bodies that close over x

    def mapped(L, x):
        if how == "in_specs=P()":
            return _shard_map(lambda x: L(x)[None], check_vma, P(), P(AXIS))(x)
        if how == "closed over":
            return _shard_map(lambda _: L(x)[None], check_vma, P(AXIS), P(AXIS))(ranks)
        if how == "pmap in_axes=None":
            return jax.pmap(lambda x, _: L(x), AXIS, in_axes=(None, 0))(x, ranks)
        return jax.pmap(lambda _: L(x), AXIS)(ranks)  # pmap, closed over

    return lambda L, x: jax.grad(lambda x: mapped(L, x).sum())(x)


Q = 1 / W
# (doc table row, setting, pattern) -> factors for (lax.psum, lax.all_gather, commlib.all_reduce,
# commlib.all_gather); ValueError: JAX refuses the program. Pattern "any": both cotangent patterns.
FACTORS = {
    (1, "shard_map check_vma=True, L_r out_specs=P(i), sum outside", "any"): (_outside(True), (1, 1, 1, 1)),
    (1, "shard_map check_vma=False, L_r out_specs=P(i), sum outside", "any"): (_outside(False), (1, 1, 1, 1)),
    (1, "pmap, L_r out_axes=0, sum outside", "any"): (_pmap(0), (1, 1, 1, 1)),
    (2, "grad of L_r inside shard_map, check_vma=True", "varying"): (_inside(True), (1, 1, 1, 1)),
    (3, "grad of L_r inside shard_map, check_vma=True", "same"): (_inside(True), (Q, 1, 1, 1)),
    (4, "grad of L_r inside shard_map, check_vma=False", "any"): (_inside(False), (1, 1, 1, 1)),
    (4, "grad of L_r inside pmap", "any"): (_pmap_inside(psum=False), (1, 1, 1, 1)),
    (5, "grad of psum(L_r) inside shard_map, check_vma=True", "any"): (_inside(True, psum=True), (1, 1, 1, 1)),
    (6, "grad of psum(L_r) inside shard_map, check_vma=False", "any"): (_inside(False, psum=True), (W, W, W, W)),
    (6, "grad of psum(L_r) inside pmap", "any"): (_pmap_inside(psum=True), (W, W, W, W)),
    (7, "psum(L_r) out_specs=P(), check_vma=True", "any"): (_replicated_out(True, psum=True), (1, 1, 1, 1)),
    (7, "psum(L_r) out_specs=P(), check_vma=False", "any"): (_replicated_out(False, psum=True), (1, 1, 1, 1)),
    (7, "pmap, psum(L_r) out_axes=None", "any"): (_pmap(None, psum=True), (1, 1, 1, 1)),
    (8, "L_r out_specs=P(), check_vma=False", "any"): (_replicated_out(False, psum=False), (Q, Q, Q, Q)),
    (8, "pmap, L_r out_axes=None", "any"): (_pmap(None), (Q, Q, Q, Q)),
    (9, "L_r out_specs=P(), check_vma=True", "varying"): (
        _replicated_out(True, psum=False),
        (ValueError, ValueError, ValueError, ValueError),
    ),
    (10, "L_r out_specs=P(), check_vma=True", "same"): (
        _replicated_out(True, psum=False),
        (Q, ValueError, ValueError, ValueError),
    ),
}

SHARED = {  # row 11, x shared by all ranks: factor 1 against the sum over ranks of the torch answer
    "shard_map check_vma=True, x in_specs=P()": _shared("in_specs=P()", True),
    "shard_map check_vma=False, x in_specs=P()": _shared("in_specs=P()", False),
    "shard_map check_vma=True, x closed over": _shared("closed over", True),
    "shard_map check_vma=False, x closed over": _shared("closed over", False),
    "pmap, x in_axes=None": _shared("pmap in_axes=None"),
    "pmap, x closed over": _shared("pmap closed over"),
}


def _factor_cases():
    for (row, setting, pattern), (grad, factors) in FACTORS.items():
        for each in ("varying", "same") if pattern == "any" else (pattern,):
            for op, factor in zip(OPS, factors, strict=True):
                yield pytest.param(grad, each, op, factor, id=f"row {row}: {setting} [c {each}] {op}")


@pytest.mark.parametrize(("grad", "pattern", "op", "factor"), list(_factor_cases()))
def test_factor(grad, pattern, op, factor):
    x = jnp.arange(1.0, W * N + 1)
    if factor is ValueError:
        with pytest.raises(ValueError, match=r"out_specs is P\(\) which implies"):
            jax.jit(functools.partial(grad, _rank_loss(op, pattern)))(x)
        return
    expected = np.asarray(_torch_answer(op, pattern, x.reshape(W, N))).ravel()
    got = jax.jit(functools.partial(grad, _rank_loss(op, pattern)))(x)
    np.testing.assert_allclose(got, factor * expected, rtol=1e-12)


@pytest.mark.parametrize("pattern", ["varying", "same"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("setting", list(SHARED))
def test_factor_shared_input(setting, op, pattern):
    x = jnp.arange(1.0, N + 1)
    expected = np.asarray(_torch_answer(op, pattern, jnp.tile(x, (W, 1)))).sum(0)
    got = jax.jit(functools.partial(SHARED[setting], _rank_loss(op, pattern)))(x)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize("setting", ["shard_map check_vma=False", "pmap out_axes=None"])
def test_unchecked_replicated_output_is_one_rank(setting):
    """Row 8's forward value: one rank's L_r (rank 0's), not the total."""
    L, x = _rank_loss("commlib.all_reduce", "varying"), jnp.arange(1.0, W * N + 1)
    per_rank = jax.jit(_shard_map(lambda x: L(x)[None], True, P(AXIS), P(AXIS)))(x)
    if setting == "shard_map check_vma=False":
        value = jax.jit(_shard_map(L, False, P(AXIS), P()))(x)
    else:
        value = jax.pmap(L, AXIS, out_axes=None)(x.reshape(W, N))
    assert value == per_rank[0] != per_rank.sum()


# --- Megatron f/g, data parallel, Ulysses ---------------------------------------------------------------------


def _mlp(x, A, B, f=lambda x: x, g=lambda z: z):
    """0.5 * sum((tanh(f(x) @ A) @ B) ** 2): x [b, d], A [d, h] (column-parallel), B [h, d] (row-parallel)."""
    return 0.5 * jnp.sum(g(jnp.tanh(f(x) @ A) @ B) ** 2)


def _mlp_problem():
    rng = np.random.default_rng(0)
    x, A, B = rng.standard_normal((3, 4)), rng.standard_normal((4, 2 * W)), rng.standard_normal((2 * W, 4))
    return (x, A, B), jax.grad(_mlp, argnums=(0, 1, 2))(x, A, B)


F = functools.partial(cj.sum_grad, axis_name=AXIS)
G = functools.partial(cj.all_reduce, axis_name=AXIS, convention="replicated")
PARAMS = (P(None, AXIS), P(AXIS, None))  # A: column block r on rank r; B: row block r


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize(("g_convention", "factor"), [("replicated", 1), ("sum", W)])
def test_megatron_mlp(where, check_vma, g_convention, factor):
    """x copied to every rank (P(axis) of W copies, as torch has it), f = sum_grad, g = all_reduce(replicated):
    every rank's dx and the blocks of dA, dB equal the unsharded MLP's, the grad taken inside shard_map of the
    rank's loss or outside of the sum of the per-rank losses. The default convention for g gives W times."""
    (x, A, B), (dx, dA, dB) = _mlp_problem()
    g = functools.partial(cj.all_reduce, axis_name=AXIS, convention=g_convention)
    loss = lambda x, A, B: _mlp(x, A, B, F, g)  # noqa: E731
    if where == "inside":
        grad = _shard_map(jax.grad(loss, argnums=(0, 1, 2)), check_vma, (P(AXIS), *PARAMS), (P(AXIS), *PARAMS))
    else:
        per_rank = _shard_map(lambda *a: loss(*a)[None], check_vma, (P(AXIS), *PARAMS), P(AXIS))
        grad = jax.grad(lambda *a: per_rank(*a).sum(), argnums=(0, 1, 2))
    got = jax.jit(grad)(np.tile(x, (W, 1)), A, B)
    for name, value, expected in zip(("dx", "dA", "dB"), got, (np.tile(dx, (W, 1)), dA, dB), strict=True):
        np.testing.assert_allclose(value, factor * expected, rtol=1e-12, err_msg=name)


@pytest.mark.parametrize(
    ("variant", "check_vma", "dx_factor"),
    [("lax", True, 1), ("commlib g", True, 1), ("commlib f and g", True, CommError), ("commlib f and g", False, W)],
)
def test_megatron_mlp_shared_input(variant, check_vma, dx_factor):
    """x given once with in_specs=P(): JAX's transpose of the shared input already sums dx over ranks. So
    lax.pcast(to="varying") as f and lax.psum as g (check_vma=True, loss out_specs=P()), or commlib's g alone,
    give the unsharded gradients. Adding sum_grad would sum dx twice: under check_vma=True, where x is typed
    invariant, sum_grad refuses it; under check_vma=False nothing can see it and dx is W times too large.
    dA, dB are exact."""
    (x, A, B), (dx, dA, dB) = _mlp_problem()
    if variant == "lax":
        f, g = (lambda x: lax.pcast(x, AXIS, to="varying")), (lambda z: lax.psum(z, AXIS))
        grad = jax.grad(_shard_map(lambda *a: _mlp(*a, f, g), True, (P(), *PARAMS), P()), argnums=(0, 1, 2))
    else:
        f = F if variant == "commlib f and g" else (lambda x: x)
        per_rank = _shard_map(lambda *a: _mlp(*a, f, G)[None], check_vma, (P(), *PARAMS), P(AXIS))
        grad = jax.grad(lambda *a: per_rank(*a).sum(), argnums=(0, 1, 2))
    if dx_factor is CommError:
        with pytest.raises(CommError, match="sum_grad: x is one value shared by the 4 ranks of"):
            jax.jit(grad)(x, A, B)
        return
    got = jax.jit(grad)(x, A, B)
    for name, value, expected in zip(("dx", "dA", "dB"), got, (dx_factor * dx, dA, dB), strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-12, err_msg=name)


def _least_squares(w, features, targets):
    return jnp.mean((features @ w - targets) ** 2)


@pytest.mark.parametrize("mode", ["per-rank losses, mean outside", "pmean of the loss, out_specs=P()"])
def test_data_parallel(mode):
    """w given once (in_specs=P()), batch sharded: the full-batch gradient with no gradient all_reduce."""
    rng = np.random.default_rng(1)
    w, features, targets = rng.standard_normal(3), rng.standard_normal((2 * W, 3)), rng.standard_normal(2 * W)
    specs = (P(), P(AXIS), P(AXIS))
    if mode == "per-rank losses, mean outside":
        per_rank = _shard_map(lambda *a: _least_squares(*a)[None], True, specs, P(AXIS))
        loss = lambda *a: per_rank(*a).mean()  # noqa: E731
    else:
        loss = _shard_map(lambda *a: lax.pmean(_least_squares(*a), AXIS), True, specs, P())
    value, gradient = jax.jit(jax.value_and_grad(loss))(w, features, targets)
    expected_value, expected = jax.value_and_grad(_least_squares)(w, features, targets)
    np.testing.assert_allclose(value, expected_value, rtol=1e-12)
    np.testing.assert_allclose(gradient, expected, rtol=1e-12)


@pytest.mark.parametrize("check_vma", [True, False])
def test_ulysses(check_vma):
    """Ulysses attention (all_to_all_4d both ways), rank r's loss on its sequence block, summed outside: the
    gradients of q, k, v equal the unsharded attention's."""
    rng = np.random.default_rng(2)
    q, k, v, cotangent = (rng.standard_normal((2, 8, 4, 3)) for _ in range(4))  # [B, S, H, D]
    seq = P(None, AXIS)
    per_rank = _shard_map(
        lambda q, k, v, c: jnp.sum(c * ulysses_attention(q, k, v, AXIS))[None], check_vma, (seq,) * 4, P(AXIS)
    )
    got = jax.jit(jax.grad(lambda *a: per_rank(*a, cotangent).sum(), argnums=(0, 1, 2)))(q, k, v)
    for name, value, expected in zip("qkv", got, reference_attention.attention_vjp(q, k, v, cotangent), strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-10, atol=1e-12, err_msg=name)
