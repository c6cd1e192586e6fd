"""The corners on simulated CPU devices (shard_map with check_vma, and pmap): NaN under max/min,
half-precision averages whose sum overflows, complex avg, the spec's float8 rules, int16, and the errors of an
op called outside shard_map/pmap (or over an axis no map binds) or given a list."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib_jax
from commlib import CommError, plans, reference

NAN = np.nan
MODES = ("shard_map", "pmap")


def _mapped(body, world_size: int, mode: str):
    """`body(x) -> out` on each rank's row of a stacked [W, ...] array, rank outputs stacked again."""
    if mode == "pmap":
        return jax.pmap(body, axis_name="i")
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("i",))
    return jax.shard_map(lambda x: body(x[0])[None], mesh=mesh, in_specs=P("i"), out_specs=P("i"))


def _value_and_grad(body, xs, cotangents, mode):
    """Every rank's output and input gradient (each rank's cotangent its own: convention "sum")."""
    out, vjp = jax.vjp(_mapped(body, len(xs), mode), jnp.asarray(np.stack(xs)))
    (grad,) = vjp(jnp.asarray(np.stack(cotangents), dtype=out.dtype))
    return np.asarray(out), np.asarray(grad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize(("convention", "factor"), [("sum", 2.0), ("replicated", 1.0)])
def test_nan_under_max_and_min(mode, op, convention, factor):
    """[nan, 5] and [5, nan] -> [nan, nan] on every rank (numpy's maximum); the gradient goes to the NaN holder."""
    xs = [np.array([NAN, 5.0, 1.0]), np.array([5.0, NAN, 2.0 if op == "max" else 0.0])]
    body = lambda x: commlib_jax.all_reduce(x, "i", op, convention=convention)  # noqa: E731
    out, grad = _value_and_grad(body, xs, [np.ones(3)] * 2, mode)
    np.testing.assert_array_equal(out[:, :2], [[NAN, NAN]] * 2)
    np.testing.assert_array_equal(out[:, 2], [2.0 if op == "max" else 0.0] * 2)
    np.testing.assert_array_equal(grad, factor * np.array([[1, 0, 0], [0, 1, 1]]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("dtype", "value"), [("float16", 40000.0), ("bfloat16", 3.0e38)])
@pytest.mark.parametrize("op_name", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_half_precision_avg_whose_sum_overflows(mode, dtype, value, op_name, world_size):
    """`value` on every rank: the average is `value`; all_reduce's backward (cotangents `value`) too,
    reduce_scatter's (a gather) `value` / W."""
    shape = (2 * world_size,) if op_name == "reduce_scatter" else (2,)
    xs = [np.full(shape, value, dtype=np.float32)] * world_size
    body = lambda x: getattr(commlib_jax, op_name)(x.astype(dtype), "i", op="avg")  # noqa: E731
    out_shape = (2,)
    out, grad = _value_and_grad(body, xs, [np.full(out_shape, value, dtype=np.float32)] * world_size, mode)
    expected = float(jnp.asarray(value, dtype))
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=4e-3)
    expected_grad = expected if op_name == "all_reduce" else expected / world_size
    np.testing.assert_allclose(np.asarray(grad, np.float64), expected_grad, rtol=4e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op_name", ["all_reduce", "reduce_scatter"])
def test_complex_avg_forward_and_gradient(mode, op_name):
    rng = np.random.default_rng(3)
    draw = lambda n: rng.standard_normal(n) + 1j * rng.standard_normal(n)  # noqa: E731
    xs, cotangents = [draw(4) for _ in range(2)], [draw(4 if op_name == "all_reduce" else 2) for _ in range(2)]
    out, grad = _value_and_grad(lambda x: getattr(commlib_jax, op_name)(x, "i", op="avg"), xs, cotangents, mode)
    plan = getattr(plans, op_name)((4,), 2, op="avg", dtype="complex128")
    np.testing.assert_allclose(out, np.stack(reference.forward(plan, xs)), rtol=1e-12)
    np.testing.assert_allclose(grad, np.stack(reference.vjp(plan, xs, cotangents)), rtol=1e-12)


def test_int16_and_float8_follow_the_spec():
    gathered = _mapped(lambda x: commlib_jax.all_gather(x, "i", 0), 2, "shard_map")(
        jnp.asarray([[1], [2]], dtype=jnp.int16)
    )
    assert gathered.dtype == jnp.int16
    np.testing.assert_array_equal(np.asarray(gathered), [[1, 2], [1, 2]])
    x = jnp.asarray([[1.5, NAN, -2.0], [2.5, 1.0, -3.0]], dtype=jnp.float8_e4m3fn)
    out = _mapped(lambda x: commlib_jax.all_reduce(x, "i", "max"), 2, "shard_map")(x)
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[2.5, NAN, -2.0]] * 2)
    with pytest.raises(CommError, match=r"all_reduce: op \('sum'\) on float8_e4m3fn is not supported: its rounding"):
        _mapped(lambda x: commlib_jax.all_reduce(x, "i"), 2, "shard_map")(x)


CALLS = {  # op -> its arguments after (x, axis_name)
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


@pytest.mark.parametrize("op", CALLS)
def test_an_op_outside_shard_map_or_pmap(op):
    message = (
        f"{op}: axis_name ('i') is not bound here: commlib_jax ops run inside jax.shard_map (over a mesh "
        f"with that axis) or jax.pmap (axis_name=...), not outside them. Received: axis_name='i'"
    )
    with pytest.raises(CommError) as raised:
        getattr(commlib_jax, op)(jnp.ones((2, 2)), "i", *CALLS[op])
    assert str(raised.value) == message
    with pytest.raises(CommError) as raised:  # inside a map, over an axis it does not bind
        _mapped(lambda x: getattr(commlib_jax, op)(x, ("i", "j"), *CALLS[op]), 2, "shard_map")(jnp.ones((2, 2, 2)))
    assert str(raised.value).startswith(f"{op}: axis_name (('i', 'j')) is not bound here")


@pytest.mark.parametrize("mode", MODES)
def test_a_wrong_axis_name_inside_a_map_lists_the_bound_axes(mode):
    """Inside a shard_map / pmap, a wrong name lists the names bound there (not the text of a
    call outside every map)."""
    with pytest.raises(CommError) as raised:
        _mapped(lambda x: commlib_jax.all_reduce(x, "j"), 2, mode)(jnp.ones((2, 2)))
    assert str(raised.value) == (
        "all_reduce: axis_name ('j') is not bound here: the enclosing jax.shard_map / "
        "jax.pmap bind ('i',). Received: axis_name='j'"
    )


@pytest.mark.parametrize("op", CALLS)
@pytest.mark.parametrize(
    ("axis_name", "error", "message"),
    [
        ((), CommError, "axis_name (()) must name at least one mesh axis. Received: axis_name=()"),
        (0, TypeError, "axis_name must be a mesh axis name (str) or a tuple of them, not int. Received: axis_name=0"),
        (("i", "i"), CommError, "axis_name (('i', 'i')) names 'i' twice. Received: axis_name=('i', 'i')"),
    ],
)
def test_an_axis_name_that_names_no_axis(op, axis_name, error, message):
    with pytest.raises(error) as raised:
        _mapped(lambda x: getattr(commlib_jax, op)(x, axis_name, *CALLS[op]), 2, "shard_map")(jnp.ones((2, 2)))
    assert type(raised.value) is error and str(raised.value) == f"{op}: {message}"


@pytest.mark.parametrize("op", ["broadcast", "gather", "scatter", "reduce"])
def test_a_traced_rank(op):
    with pytest.raises(TypeError) as raised:
        _mapped(lambda x: getattr(commlib_jax, op)(x, "i", lax.axis_index("i")), 2, "shard_map")(jnp.ones((2, 2)))
    assert str(raised.value).startswith(
        f"{op}: {'src' if op in ('broadcast', 'scatter') else 'dst'} must be a static int, not a traced "
    )


@pytest.mark.parametrize("op", CALLS)
def test_an_op_given_a_list(op):
    with pytest.raises(TypeError) as raised:
        _mapped(lambda x: getattr(commlib_jax, op)([[1.0, 2.0]], "i", *CALLS[op]), 2, "shard_map")(jnp.ones((2, 2)))
    assert str(raised.value) == f"{op}: x must be a jax.Array or numpy.ndarray, not list. Received: type='list'"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", [None, (3, 0, 2, 1)])
def test_scatter_of_bool(mode, sizes):
    """Scatter of bool (even and with sizes) gives src's chunks, as torch and the reference
    (psum_scatter has no bool)."""
    world_size, rows = 4, 2 if sizes is None else max(sizes)
    rng = np.random.default_rng(23)
    xs = [rng.random((8 if sizes is None else sum(sizes), 3)) < 0.5 for _ in range(world_size)]
    out = _mapped(lambda x: commlib_jax.scatter(x, "i", 1, 0, sizes=sizes), world_size, mode)(jnp.asarray(np.stack(xs)))
    bounds = np.cumsum((0, *(sizes or (2,) * world_size)))
    assert out.dtype == jnp.bool_ and out.shape == (world_size, rows, 3)
    for rank in range(world_size):
        valid = bounds[rank + 1] - bounds[rank]
        np.testing.assert_array_equal(np.asarray(out[rank])[:valid], xs[1][bounds[rank] : bounds[rank + 1]])
        assert not np.asarray(out[rank])[valid:].any()


def test_permute_with_a_partial_perm_under_vmap():
    """Under ``jax.vmap(axis_name=...)`` a partial perm gives what it gives under shard_map:
    src's row at each dst, zeros at ranks that are no dst; the gradient is the inverse permute."""
    perm = ((0, 1), (1, 2))
    xs = np.arange(8.0).reshape(4, 2)
    body = lambda x: commlib_jax.permute(x, "i", perm)  # noqa: E731
    out = jax.vmap(body, axis_name="i")(jnp.asarray(xs))
    np.testing.assert_array_equal(out, [[0, 0], [0, 1], [2, 3], [0, 0]])
    grad = jax.vmap(lambda x, c: jax.vjp(body, x)[1](c)[0], axis_name="i")(jnp.asarray(xs), jnp.asarray(xs + 10))
    np.testing.assert_array_equal(grad, [[12, 13], [14, 15], [0, 0], [0, 0]])
    expected, expected_grad = _value_and_grad(body, list(xs), list(xs + 10), "shard_map")
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(grad, expected_grad)
