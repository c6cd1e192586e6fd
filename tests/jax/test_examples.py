"""The worked examples on simulated CPU devices, in every mode of `parity_runner.modes_for(W)`, each
rank's loss being the sum of its output (cotangent 1): exact max/min/product gradients, the two conventions,
accum_dtype, integer tensors; then `Communicator` against the functional ops, world size 1, tuple axis
names in either order, an op over one axis of a 2 x 2 mesh, jit and grad in either order, and a
closed-over (replicated) input. Values are checked exactly where the example states them, and every result
against the numpy reference (`commlib.tools.parity.check`). The rejected calls' error texts are in the case table.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commlib_jax
from commlib import gradients, plans, reference
from commlib.tools import cases, parity
from commlib_jax import Communicator
from commlib_jax.tools.parity_runner import modes_for
from tests.gradient_examples import SCALAR_ALL_REDUCE
from tests.jax import programs

MODES = modes_for(4)


def _stack(arrays) -> jax.Array:
    """Every rank's array stacked on a leading [W] axis, the layout the mapped functions take."""
    return jnp.asarray(np.stack(arrays))


def _ranks(values, dtype="float32") -> list[np.ndarray]:
    return [np.asarray(value, dtype=cases.storage_dtype(dtype)) for value in values]


def _scalar_case(op, world_size, convention="sum", dtype="float32", shape=()) -> cases.Case:
    kwargs = (("op", op), ("convention", convention))
    return cases.Case(f"example:{op},{convention},{dtype}", "all_reduce", world_size, shape, dtype, kwargs)


def _run_and_check(case, arrays, function, mode):
    """`programs.run` after asserting the result also passes `commlib.tools.parity.check` against the reference."""
    outputs, gradients = programs.run(case, arrays, function)
    row = parity.check(case, arrays, outputs, gradients, None, "jax", mode)
    assert row.passed, row
    return outputs, gradients


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("op", "values", "convention", "output", "gradients"), SCALAR_ALL_REDUCE)
def test_scalar_all_reduce_gradients(op, values, convention, output, gradients, mode):
    """E.g. max of [1, 5, 2, 3] -> gradients [0, 4, 0, 0]; ties split: [5, 5, 1, 1] -> [2, 2, 0, 0];
    product of [2, 0, 3, 4] -> [0, 96, 0, 0] (exact at the zero)."""
    case = _scalar_case(op, 4, convention)
    arrays = {"x": _ranks(values), "cotangent": _ranks([1] * 4)}
    outputs, grads = _run_and_check(case, arrays, programs.mapped(case, mode), mode)
    assert [float(out) for out in outputs] == [output] * 4
    assert [float(grad) for grad in grads["x"]] == gradients


@pytest.mark.parametrize("mode", modes_for(2))
@pytest.mark.parametrize(("convention", "gradient"), [("sum", 2.0), ("replicated", 1.0)])
def test_two_conventions(convention, gradient, mode):
    """W=2, x_r = [r + 1], each rank's loss = sum(all_reduce(x)): gradient 2 under "sum", 1 under "replicated"."""
    case = _scalar_case("sum", 2, convention, shape=(1,))
    arrays = {"x": _ranks([[1], [2]]), "cotangent": _ranks([[1], [1]])}
    outputs, grads = _run_and_check(case, arrays, programs.mapped(case, mode), mode)
    assert [out.tolist() for out in outputs] == [[3.0], [3.0]]
    assert [grad.tolist() for grad in grads["x"]] == [[gradient], [gradient]]


# --- shard, reduce, all_to_all on one dim ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("scale_grad", "factor"), [(False, 1.0), (True, 0.25)])
@pytest.mark.parametrize("via_communicator", [False, True], ids=["shard", "Communicator.slice"])
def test_shard_example(scale_grad, factor, via_communicator, mode):
    """W=4, every rank holding arange(8), cotangent (r+1)*[1, 10] on rank r: rank r gets [2r, 2r+1]; every rank's
    gradient is [1, 10, 2, 20, 3, 30, 4, 40] (a quarter of that with scale_grad)."""
    case = cases.Case(f"example:shard,{scale_grad}", "shard", 4, (8,), "float32", (("scale_grad", scale_grad),))
    arrays = {"x": _ranks([np.arange(8)] * 4), "cotangent": _ranks([(r + 1) * np.array([1, 10]) for r in range(4)])}

    def per_rank(axis_name):
        def body(cotangent, x):
            out = Communicator(axis_name).slice(x[0], -1, scale_grad=scale_grad)
            return out[None], (out * cotangent[0]).sum()[None]

        return body

    function = programs.mapped(case, mode, per_rank if via_communicator else None)
    outputs, grads = _run_and_check(case, arrays, function, mode)
    assert [out.tolist() for out in outputs] == [[2.0 * rank, 2.0 * rank + 1] for rank in range(4)]
    assert [grad.tolist() for grad in grads["x"]] == [[factor * v for v in (1, 10, 2, 20, 3, 30, 4, 40)]] * 4
    print(
        f"shard example (jax {mode}, scale_grad={scale_grad}):",
        [out.tolist() for out in outputs],
        grads["x"][0].tolist(),
    )


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_of_one_shared_value(check_vma):
    """x given with ``in_specs=P()`` is one value shared by the ranks, and JAX sums its gradient over them itself:
    under check_vma=True shard refuses it (its all_gather would make that 4 times the gradient); under
    check_vma=False nothing tells a shared value from per-rank copies and the gradient is 4 times the example's.
    The slice the message suggests gives the example's gradient in both."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("i",))
    cotangents = jnp.stack([(r + 1) * jnp.array([1.0, 10.0]) for r in range(4)])
    want = np.array([1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 4.0, 40.0])

    def gradient(split):
        body = lambda ct, x: (split(x) * ct[0]).sum()[None]  # noqa: E731
        P = jax.sharding.PartitionSpec
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"), check_vma=check_vma)
        return np.asarray(jax.grad(lambda x: mapped(cotangents, x).sum())(jnp.arange(8.0)))

    sliced = gradient(lambda x: jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("i") * 2, 2))
    np.testing.assert_array_equal(sliced, want)
    if not check_vma:
        np.testing.assert_array_equal(gradient(lambda x: commlib_jax.shard(x, "i")), 4 * want)
        return
    with pytest.raises(commlib_jax.CommError) as raised:
        gradient(lambda x: commlib_jax.shard(x, "i"))
    assert str(raised.value) == (
        "shard: x is one value shared by the 4 ranks of ('i',) (typed invariant under check_vma=True), and JAX "
        "already sums a shared value's gradient over them, so shard would sum it again (4 times the gradient). "
        "Take the gradient with commlib_jax.training.value_and_grad, which gives every rank its own copy of the "
        "parameters as torch does, or slice the shared x with lax.dynamic_slice_in_dim at lax.axis_index('i'), "
        "whose gradient JAX sums once. Received: shape=(8,), axis_name='i'"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("op", "factor"), [("sum", 1.0), ("avg", 0.25)])
def test_reduce_example(op, factor, mode):
    """W=4, rank r holding [r+1, 10(r+1)], cotangent (r+1): dst=2 gets [10, 100] (/ 4 for avg), the others
    zeros; every rank's gradient is dst's cotangent, [3, 3] (/ 4 for avg)."""
    case = cases.Case(f"example:reduce,{op}", "reduce", 4, (2,), "float32", (("dst", 2), ("op", op)))
    arrays = {
        "x": _ranks([[r + 1, 10 * (r + 1)] for r in range(4)]),
        "cotangent": _ranks([[r + 1] * 2 for r in range(4)]),
    }
    outputs, grads = _run_and_check(case, arrays, programs.mapped(case, mode), mode)
    assert [out.tolist() for out in outputs] == [[0.0, 0.0]] * 2 + [[10.0 * factor, 100.0 * factor]] + [[0.0, 0.0]]
    assert [grad.tolist() for grad in grads["x"]] == [[3.0 * factor] * 2] * 4


@pytest.mark.parametrize("dim", [0, 1])
def test_all_to_all_on_one_dim_is_lax_all_to_all_with_split_equal_to_concat(dim):
    """Values and gradients equal lax's own ``all_to_all(split_axis=dim, concat_axis=dim, tiled=True)``."""
    case = cases.Case(
        f"example:all_to_all,{dim}", "all_to_all", 4, (8, 8), "float64", (("scatter_dim", dim), ("gather_dim", dim))
    )
    arrays = cases.make_arrays(case, 3)

    def lax_body(axis_name):
        def body(cotangent, x):
            out = jax.lax.all_to_all(x[0], axis_name, dim, dim, tiled=True)
            return out[None], (out * cotangent[0]).sum()[None]

        return body

    mode = "shard_map[check_vma=True]"
    ours = _run_and_check(case, arrays, programs.mapped(case, mode), mode)
    theirs = programs.run(case, arrays, programs.mapped(case, mode, lax_body))
    np.testing.assert_array_equal(np.stack(ours[0]), np.stack(theirs[0]))
    np.testing.assert_array_equal(np.stack(ours[1]["x"]), np.stack(theirs[1]["x"]))


# --- accum_dtype ------------------------------------------------------------------------------------------


def _one_hot_256(world_size: int) -> list[np.ndarray]:
    """Rank r: 256 at element r, 1 elsewhere (exact in bfloat16); every element sums to 256 + W - 1."""
    return [np.where(np.arange(world_size) == rank, 256.0, 1.0).astype(np.float32) for rank in range(world_size)]


def _bf16_case(op, accum_dtype) -> cases.Case:
    kwargs = (("accum_dtype", accum_dtype),) if accum_dtype else ()
    shape = (4,) if op == "all_reduce" else (16,)
    return cases.Case(f"example:{op},bf16,{accum_dtype}", op, 4, shape, "bfloat16", kwargs)


def _bf16_arrays(op):
    pattern = _one_hot_256(4)
    if op == "all_reduce":  # the cotangents have the pattern too: backward sums them, in float32
        return {"x": pattern, "cotangent": pattern}
    return {"x": [np.tile(x, 4) for x in pattern], "cotangent": pattern}


def _reduced_dtypes(program_text: str) -> list[str]:
    """Element types the all_reduce / reduce_scatter ops of a StableHLO program reduce in."""
    pattern = r'"stablehlo\.(?:all_reduce|reduce_scatter)".*?\}\) : \(tensor<(?:\d+x)*(\w+)>'
    return re.findall(pattern, program_text, flags=re.DOTALL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_accum_dtype_makes_bfloat16_sums_exact(op, mode):
    """W=4 bf16, each element 256 on one rank and 1 on the others: 260 exactly everywhere with float32
    accumulation, forward and (all_reduce) backward, returned in bfloat16."""
    case = _bf16_case(op, "float32")
    arrays = _bf16_arrays(op)
    function = programs.mapped(case, mode)
    outputs, grads = _run_and_check(case, arrays, function, mode)
    assert [out.tolist() for out in outputs] == [[260.0] * 4] * 4
    if op == "all_reduce":
        assert [grad.tolist() for grad in grads["x"]] == [[260.0] * 4] * 4
    inputs = [jnp.asarray(np.stack(arrays["x"]), jnp.bfloat16)]
    assert jax.eval_shape(function, inputs[0][:, :4] * 0, *inputs)[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("accum_dtype", [None, "float32"])
def test_accum_dtype_is_the_dtype_of_the_collective(op, accum_dtype):
    """XLA:CPU sums bfloat16 exactly here even without accum_dtype (plain bf16 gives 260 too, unlike gloo's
    256-or-260), so the values alone cannot show the accumulation: the lowered forward (and all_reduce's
    backward) collective must reduce in float32 with accum_dtype and in bfloat16 without."""
    case = _bf16_case(op, accum_dtype)
    arrays = _bf16_arrays(op)
    function = programs.mapped(case, "shard_map[check_vma=True]")
    outputs, _ = _run_and_check(case, arrays, function, "shard_map[check_vma=True]")
    assert [out.tolist() for out in outputs] == [[260.0] * 4] * 4  # what plain bfloat16 gives on XLA:CPU
    inputs = [jnp.asarray(np.stack(arrays["x"]), jnp.bfloat16)]
    cotangent = jnp.asarray(np.stack(arrays["cotangent"]), jnp.bfloat16)
    forward = jax.jit(lambda xs: function(cotangent, *xs)[0]).lower(inputs).as_text()
    want = "f32" if accum_dtype else "bf16"
    assert _reduced_dtypes(forward) == [want]
    if op == "all_reduce":  # (reduce_scatter's backward is an all_gather: nothing to accumulate)
        loss = lambda xs: function(cotangent, *xs)[1].astype(jnp.float32).sum()  # noqa: E731
        assert _reduced_dtypes(jax.jit(jax.grad(loss)).lower(inputs).as_text()) == [want]


# --- integers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("op", "values", "output"),
    [("max", [1, 5, 2, 3], 5), ("min", [4, 0, 6, 7], 0), ("product", [2, 0, 3, 4], 0), ("product", [1, 2, 3, 4], 24)],
)
def test_integer_all_reduce_forward(op, values, output, mode):
    case = _scalar_case(op, 4, dtype="int32")
    arrays = {"x": _ranks(values, "int32")}
    outputs, grads = programs.run(case, arrays, programs.mapped(case, mode))
    assert grads == {} and all(out.dtype == np.int32 for out in outputs)
    assert [int(out) for out in outputs] == [output] * 4
    assert parity.check(case, arrays, outputs, {}, None).passed


def test_grad_of_an_integer_input_is_jax_own_error():
    case = _scalar_case("max", 4, dtype="int32")
    function = programs.mapped(case, "shard_map[check_vma=True]")
    xs = jnp.asarray([1, 5, 2, 3], jnp.int32)
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        jax.grad(lambda x: function(xs, x)[1].sum())(xs)


# --- Communicator --------------------------------------------------------------------------------------------

METHODS = {"all_to_all_4d": "all_to_all_4D", "shard": "slice"}  # the seed's and FastVideo's spellings


def _one_case_per_op(world_size: int) -> list[cases.Case]:
    """The first valid floating case of each op of the table, and of each all_reduce reduction."""
    chosen = {}
    for case in cases.case_table(world_size):
        if case.op in plans.OP_NAMES and case.differentiable and cases.error_text(case) is None:
            chosen.setdefault((case.op, case.params.get("op")), case)
    return list(chosen.values())


def _communicator_body(case):
    def per_rank(axis_name):
        def body(cotangent, x):
            out = getattr(Communicator(axis_name), METHODS.get(case.op, case.op))(x[0], **case.params)
            return out[None], (out * cotangent[0]).sum()[None]

        return body

    return per_rank


def test_communicator_methods_equal_the_functional_ops():
    """Each method, with the case table's keywords, on the 2 x 2 mesh (tuple axis): the functional op's values
    and gradients exactly, and the reference's."""
    mode = "shard_map[2x2 mesh]"
    for case in _one_case_per_op(4):
        arrays = cases.make_arrays(case, 0)
        method = _run_and_check(case, arrays, programs.mapped(case, mode, _communicator_body(case)), mode)
        functional = programs.run(case, arrays, programs.mapped(case, mode))
        np.testing.assert_array_equal(method[0], functional[0], err_msg=case.name)
        np.testing.assert_array_equal(method[1]["x"], functional[1]["x"], err_msg=case.name)


def test_communicator_world_size_default_op_and_point_to_point():
    case = _scalar_case("sum", 4)
    arrays = {"x": _ranks([1, 5, 2, 3]), "cotangent": _ranks([1] * 4)}

    def per_rank(axis_name):
        def body(cotangent, x):
            communicator = Communicator(axis_name)
            assert communicator.world_size == 4
            out = communicator.all_reduce(x[0], None)  # None means sum, as in the torch class
            return out[None], (out * cotangent[0]).sum()[None]

        return body

    outputs, _ = _run_and_check(case, arrays, programs.mapped(case, "shard_map[2x2 mesh]", per_rank), "")
    assert [float(out) for out in outputs] == [11.0] * 4
    with pytest.raises(NotImplementedError, match="use permute"):
        Communicator("i").send(jnp.zeros(2), 1)
    with pytest.raises(NotImplementedError, match="use permute"):
        Communicator("i").recv((2,), jnp.float32, 0)


# --- world size 1, tuple axes, one mesh axis -----------------------------------------------------------------


@pytest.mark.parametrize("mode", modes_for(1))
def test_world_size_one_returns_the_input(mode):
    """Every op at W=1 returns its input, and its gradient is the cotangent."""
    for case in _one_case_per_op(1):
        arrays = cases.make_arrays(case, 0)
        outputs, grads = _run_and_check(case, arrays, programs.mapped(case, mode), mode)
        np.testing.assert_array_equal(outputs[0], arrays["x"][0], err_msg=case.name)
        np.testing.assert_array_equal(grads["x"][0], arrays["cotangent"][0], err_msg=case.name)


@pytest.mark.parametrize("axis_name", [("y", "x"), ["x", "y"]], ids=["reversed", "list"])
def test_tuple_axis_rank_order(axis_name):
    """On a 2 x 2 mesh, the ranks of ``(a, b)`` are row-major over (a, b): ("y", "x") makes rank 1 the
    device at x=1, y=0. Every op against the reference with that rank order (the case table runs ("x", "y"))."""
    for case in _one_case_per_op(4):
        arrays = cases.make_arrays(case, 1)
        _run_and_check(case, arrays, programs.on_mesh(case, (2, 2), ("x", "y"), axis_name), str(axis_name))


def _lines(axis_name: str) -> list[list[int]]:
    """Blocks (row-major over ("x", "y") of a 2 x 2 mesh) of each world of the op over `axis_name`."""
    return [[0, 1], [2, 3]] if axis_name == "y" else [[0, 2], [1, 3]]


@pytest.mark.parametrize("axis_name", ["y", "x"])
def test_op_over_one_axis_of_a_mesh(axis_name):
    """An op over "y" (or "x") inside a ("x", "y") mesh is a world of 2 per row (column), each against the
    reference on that line's own arrays."""
    for case in _one_case_per_op(2):
        lines = _lines(axis_name)
        per_line = [cases.make_arrays(case, seed) for seed in range(len(lines))]
        arrays = {name: [None] * 4 for name in per_line[0]}
        for line, line_arrays in zip(lines, per_line, strict=True):
            for name, ranks in line_arrays.items():
                for block, value in zip(line, ranks, strict=True):
                    arrays[name][block] = value
        outputs, grads = programs.run(case, arrays, programs.on_mesh(case, (2, 2), ("x", "y"), axis_name))
        for line, line_arrays in zip(lines, per_line, strict=True):
            line_grads = {name: [ranks[block] for block in line] for name, ranks in grads.items()}
            row = parity.check(case, line_arrays, [outputs[block] for block in line], line_grads, None)
            assert row.passed, (axis_name, line, row)


# --- jit and grad, closed-over inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_jit_of_grad_equals_grad_of_jit(mode):
    """Both orders give the reference gradient (the Ulysses all-to-all, float32)."""
    case = next(case for case in _one_case_per_op(4) if case.op == "all_to_all_4d")
    arrays = cases.make_arrays(case, 2)
    function = programs.mapped(case, mode)
    cotangent, x = _stack(arrays["cotangent"]), _stack(arrays["x"])
    loss = lambda x: function(cotangent, x)[1].sum()  # noqa: E731
    jit_of_grad, grad_of_jit = jax.jit(jax.grad(loss))(x), jax.grad(jax.jit(loss))(x)
    want = reference.vjp(case.plan(), arrays["x"], arrays["cotangent"])
    np.testing.assert_allclose(np.asarray(jit_of_grad, np.float64), np.stack(want), atol=2e-5)
    np.testing.assert_allclose(np.asarray(grad_of_jit, np.float64), np.stack(want), atol=2e-5)


CLOSED_OVER = [
    ("all_reduce", {}),
    ("all_reduce", {"op": "max"}),
    ("all_gather", {"dim": 0}),
    ("broadcast", {"src": 2}),
    ("permute", {"perm": [[0, 1], [1, 2], [2, 3], [3, 0]]}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scaled", [False, True], ids=["direct", "times-data"])
@pytest.mark.parametrize(("op", "params"), CLOSED_OVER, ids=[f"{op}{params}" for op, params in CLOSED_OVER])
def test_closed_over_input_gets_the_sum_of_all_ranks_gradients(op, params, scaled, mode):
    """A replicated parameter w closed over by the mapped function (no in_spec; JAX types it invariant) gets
    the torch answer: the sum over ranks of each rank's gradient. ``direct``: the op's input is w itself;
    ``times-data``: it is ``w * x_r`` with per-rank data x_r."""
    W, shape = 4, (3,)
    rng = np.random.default_rng(3)
    w = rng.standard_normal(shape)
    data = [rng.standard_normal(shape) if scaled else np.ones(shape) for _ in range(W)]
    plan = getattr(plans, op)(shape, W, **params)
    cotangents = [rng.standard_normal(plan.out_shape) for _ in range(W)]
    case = cases.Case(f"closed:{op}", op, W, shape, "float64", tuple(params.items()))

    def per_rank_of(w):
        def per_rank(axis_name):
            def body(cotangent, x):
                out = getattr(commlib_jax, op)(w * x[0] if scaled else w, axis_name, **params)
                return out[None], (out * cotangent[0]).sum()[None]

            return body

        return per_rank

    def total(w):
        return programs.mapped(case, mode, per_rank_of(w))(_stack(cotangents), _stack(data))[1].sum()

    per_rank_grads = reference.vjp(plan, [w * x for x in data], cotangents)
    want = sum(grad * x for grad, x in zip(per_rank_grads, data, strict=True))
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(total))(jnp.asarray(w))), want, rtol=1e-12, atol=1e-12)


# --- second derivatives (a gradient penalty differentiates the VJP again) ----------------------------------

LINEAR = [  # (op, one rank's shape, keyword arguments) at W = 4
    ("all_reduce", (3,), (("op", "avg"),)),
    ("all_gather", (2, 3), (("dim", 0),)),
    ("reduce_scatter", (8, 3), (("dim", 0), ("op", "avg"))),
    ("all_to_all", (4, 3, 2), (("scatter_dim", 0), ("gather_dim", 2))),
    ("all_to_all_4d", (2, 3, 8, 2), (("scatter_dim", 2), ("gather_dim", 1))),
    ("broadcast", (3, 2), (("src", 3),)),
    ("gather", (2, 3), (("dst", 1), ("dim", 1))),
    ("scatter", (4, 3), (("src", 2), ("dim", 0))),
    ("permute", (3,), (("perm", ((0, 2), (2, 3), (3, 0))),)),
    ("sum_grad", (2, 2), ()),
    ("all_to_all", (3, 8), (("scatter_dim", 1), ("gather_dim", 1))),
    ("shard", (2, 8), (("dim", -1), ("scale_grad", True))),
    ("reduce", (3, 2), (("dst", 1), ("op", "avg"))),
]


@pytest.mark.parametrize("mode", ["shard_map[check_vma=True]", "pmap"])
def test_double_backward_of_linear_ops(mode):
    """gx = VJP(cotangent), taken inside the map; d(sum(gx * v))/d(cotangent) is the transpose of the VJP
    applied to v: the op itself, except for sum_grad, whose backward all_reduce is its own transpose."""
    for op, shape, kwargs in LINEAR:
        case = cases.Case(f"double:{op}", op, 4, shape, "float64", kwargs, inputs=("x", "v"))
        arrays = cases.make_arrays(case, 0)

        def per_rank(axis_name, op=op, kwargs=kwargs):
            def body(cotangent, x, v):
                def local(x):
                    return (getattr(commlib_jax, op)(x[0], axis_name, **dict(kwargs)) * cotangent[0]).sum()

                gx = jax.grad(local)(x)
                return gx, (gx * v).sum()[None]

            return body

        function = programs.mapped(case, mode, per_rank)

        def penalty(cotangent, function=function, arrays=arrays):
            return function(cotangent, _stack(arrays["x"]), _stack(arrays["v"]))[1].sum()

        got = jax.jit(jax.grad(penalty))(_stack(arrays["cotangent"]))
        want = reference.run(gradients.vjp_plan(gradients.vjp_plan(case.plan())), arrays["v"])
        np.testing.assert_allclose(np.asarray(got), np.stack(want), rtol=1e-12, atol=1e-12, err_msg=op)


SECOND_ORDER = [  # distinct values, away from ties: max/min are locally linear in the cotangent, flat in x
    ("product", "sum"),
    ("product", "replicated"),
    ("max", "sum"),
    ("min", "replicated"),
    ("avg", "sum"),
]
XS = np.array([[2.0, 0.3], [3.0, -1.5], [0.5, 4.0]])
COTANGENTS = np.array([[1.0, -2.0], [0.5, 1.0], [-1.0, 3.0]])
VS = np.array([[0.7, 1.1], [-0.3, 2.0], [1.3, -0.6]])


def _finite_difference(function, arrays: np.ndarray, step=1e-5) -> np.ndarray:
    """Central differences of `function(arrays)` with respect to every element of the stacked ranks' arrays."""
    gradient = np.zeros_like(arrays)
    for index in np.ndindex(arrays.shape):
        up, down = arrays.copy(), arrays.copy()
        up[index] += step
        down[index] -= step
        gradient[index] = (function(up) - function(down)) / (2 * step)
    return gradient


@pytest.mark.parametrize("mode", modes_for(3))
@pytest.mark.parametrize(("op", "convention"), SECOND_ORDER)
def test_second_derivatives_of_reductions(op, convention, mode):
    """A gradient penalty through all_reduce (plus a local x**3 / 3 term so gx stays in the graph): the
    gradients of sum(gx * v) with respect to x and to the cotangent match finite differences of the
    reference VJP (lax has no differentiation rule for pmax / pmin: commlib's forward must be used)."""
    plan = plans.all_reduce((2,), 3, op, dtype="float64", convention=convention)
    case = cases.Case(
        f"second:{op},{convention}",
        "all_reduce",
        3,
        (2,),
        "float64",
        (("op", op), ("convention", convention)),
        inputs=("x", "v"),
    )

    def per_rank(axis_name):
        def body(cotangent, x, v):
            def local(x):
                out = commlib_jax.all_reduce(x[0], axis_name, op, convention=convention)
                return (out * cotangent[0]).sum() + (x**3).sum() / 3

            gx = jax.grad(local)(x)
            return gx, (gx * v).sum()[None]

        return body

    function = programs.mapped(case, mode, per_rank)
    penalty = lambda x, cotangent: function(cotangent, x, _stack(VS))[1].sum()  # noqa: E731
    gx, _ = jax.jit(lambda x, c: function(c, x, _stack(VS)))(_stack(XS), _stack(COTANGENTS))
    grad_x, grad_cotangent = jax.jit(jax.grad(penalty, argnums=(0, 1)))(_stack(XS), _stack(COTANGENTS))

    def reference_penalty(xs, cotangents):
        gradients = reference.vjp(plan, list(xs), list(cotangents))
        return sum(float(np.sum(g * v)) for g, v in zip(gradients, VS, strict=True))

    want_gx = np.stack(reference.vjp(plan, list(XS), list(COTANGENTS))) + XS**2
    np.testing.assert_allclose(np.asarray(gx), want_gx, rtol=1e-12)
    want_x = _finite_difference(lambda xs: reference_penalty(xs, COTANGENTS), XS) + 2 * XS * VS
    np.testing.assert_allclose(np.asarray(grad_x), want_x, atol=1e-7)
    want_cotangent = _finite_difference(lambda cts: reference_penalty(XS, cts), COTANGENTS)
    np.testing.assert_allclose(np.asarray(grad_cotangent), want_cotangent, atol=1e-7)
