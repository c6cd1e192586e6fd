"""The worked examples on real gloo process groups, each rank's loss being the sum of its output:
exact max/min/product gradients, the two conventions, accum_dtype, integer tensors, no autograd state where
none is asked for, and double backward through the dual op."""

import numpy as np
import pytest
import torch

from commlib import gradients, plans, reference
from commlib.tools import cases
from tests.gradient_examples import SCALAR_ALL_REDUCE
from tests.torch import jobs


@pytest.mark.parametrize(("op", "values", "convention", "output", "gradients"), SCALAR_ALL_REDUCE)
def test_scalar_all_reduce_gradients(pool, op, values, convention, output, gradients):
    replies = pool(4).run(jobs.scalar_all_reduce, values, op, convention)
    assert [out for out, _ in replies] == [output] * 4
    assert [grad for _, grad in replies] == gradients


@pytest.mark.parametrize(("convention", "gradient"), [("sum", 2.0), ("replicated", 1.0)])
def test_two_conventions(pool, convention, gradient):
    """W=2, x_r = [r+1], each rank's loss = sum(all_reduce(x)): gradient 2 under "sum", 1 under "replicated"."""
    replies = pool(2).run(jobs.scalar_all_reduce, [1, 2], "sum", convention)
    assert replies == [(3.0, gradient), (3.0, gradient)]


def test_sum_grad_is_the_conjugate_of_replicated(pool):
    assert pool(2).run(jobs.conjugate_pair) == [(3.0, 2.0), (3.0, 2.0)]


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_accum_dtype_makes_bfloat16_sums_exact(pool, op):
    """W=4 bf16, each element 256 on one rank and 1 on the others: 260 exactly with float32 accumulation,
    forward and (all_reduce) backward, and returned in bfloat16."""
    replies = pool(4).run(jobs.bf16_sum, "float32", op)
    for _rank, (out, grad) in enumerate(replies):
        assert out.tolist() == [260.0] * 4
        if op == "all_reduce":
            assert grad.tolist() == [260.0] * 4  # the cotangents, summed in float32
        else:  # backward all_gather: every rank's pattern, concatenated
            assert grad.tolist() == torch.cat([jobs.one_hot_256(r, 4) for r in range(4)]).float().tolist()


def test_plain_bfloat16_sum_depends_on_the_order(pool):
    """Without accum_dtype gloo sums in bf16 (spacing 2 at 256): each element is 256, 258 or 260, all ranks alike."""
    replies = pool(4).run(jobs.bf16_sum, None)
    outputs = [out.tolist() for out, _ in replies]
    assert outputs == [outputs[0]] * 4
    assert set(outputs[0]) <= {256.0, 258.0, 260.0}
    print("plain bfloat16 all_reduce:", outputs[0], "gradient:", replies[0][1].tolist())


INTEGER = [(op, dtype) for op in ("sum", "max", "min", "product") for dtype in ("int8", "int32", "int64")]
BOOL = [("max", "bool"), ("min", "bool"), ("product", "bool")]  # sum on bool is a CommError (tests/spec)


@pytest.mark.parametrize(("op", "dtype"), INTEGER + BOOL)
def test_integer_and_bool_tensors_forward_only(pool, op, dtype):
    """Forward matches the reference; asking for a gradient gives torch's own clear errors."""
    replies = pool(4).run(jobs.integer_forward, op, dtype)
    xs = [np.array([rank + 1, -rank, 2]).astype(dtype) for rank in range(4)]
    want = reference.all_reduce(xs, op)[0].tolist()
    for out, out_dtype, requires_grad, (requires_grad_error, backward_error) in replies:
        assert (out, out_dtype, requires_grad) == (want, f"torch.{dtype}", False)
        assert "can require gradients" in requires_grad_error
        assert "does not require grad and does not have a grad_fn" in backward_error


@pytest.mark.parametrize("via_communicator", [False, True], ids=["shard", "DeviceCommunicator.slice"])
@pytest.mark.parametrize(("scale_grad", "factor"), [(False, 1.0), (True, 0.25)])
def test_shard_example(pool, scale_grad, factor, via_communicator):
    """W=4, every rank holding arange(8), cotangent (r+1)*[1, 10] on rank r: rank r gets [2r, 2r+1];
    every rank's gradient is [1, 10, 2, 20, 3, 30, 4, 40] (a quarter of that with scale_grad)."""
    replies = pool(4).run(jobs.shard_example, scale_grad, via_communicator)
    assert [out for out, _ in replies] == [[2.0 * rank, 2.0 * rank + 1] for rank in range(4)]
    want = [factor * value for value in (1, 10, 2, 20, 3, 30, 4, 40)]
    assert [grad for _, grad in replies] == [want] * 4
    print(f"shard example (torch, scale_grad={scale_grad}):", replies)


@pytest.mark.parametrize(("op", "factor"), [("sum", 1.0), ("avg", 0.25)])
def test_reduce_example(pool, op, factor):
    """W=4, rank r holding [r+1, 10(r+1)], cotangent (r+1): dst=2 gets the sum [10, 100] (/ 4 for avg), the
    others zeros; every rank's gradient is dst's cotangent, [3, 3] (/ 4 for avg)."""
    replies = pool(4).run(jobs.reduce_example, 2, op)
    assert [out for out, _ in replies] == [[0.0, 0.0]] * 2 + [[10.0 * factor, 100.0 * factor]] + [[0.0, 0.0]]
    assert [grad for _, grad in replies] == [[3.0 * factor] * 2] * 4


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_all_to_all_on_one_dim_is_all_to_all_single(pool, world_size, dim):
    for out, want, grad, want_grad in pool(world_size).run(jobs.all_to_all_single_example, dim):
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(grad, want_grad)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", ["no_grad", "constant"])
def test_no_autograd_state_without_grad(pool, world_size, mode):
    control = pool(world_size).run(jobs.autograd_state, "grad")[0]
    assert all(control.values()) and all(state == (True, True) for state in control.values())
    for result in pool(world_size).run(jobs.autograd_state, mode):
        assert result.keys() == control.keys()
        assert [name for name, state in result.items() if state != (False, False)] == []


LINEAR = [
    ("all_gather", (2, 3), (("dim", -1),)),
    ("all_gather", (2, 3), (("dim", 0),)),
    ("reduce_scatter", (8, 3), (("dim", 0), ("op", "avg"))),
    ("all_to_all", (4, 3, 2), (("scatter_dim", 0), ("gather_dim", 2))),
    ("all_to_all_4d", (2, 3, 8, 2), (("scatter_dim", 2), ("gather_dim", 1))),
    ("all_reduce", (3,), (("op", "avg"),)),
    ("broadcast", (3, 2), (("src", 3),)),
    ("gather", (2, 3), (("dst", 1), ("dim", 1))),
    ("scatter", (4, 3), (("src", 2), ("dim", 0))),
    ("permute", (3,), (("perm", ((0, 2), (2, 3), (3, 0))),)),
    ("sum_grad", (2, 2), ()),
    ("all_to_all", (3, 8), (("scatter_dim", 1), ("gather_dim", 1))),
    ("shard", (2, 8), (("dim", -1), ("scale_grad", True))),
    ("reduce", (3, 2), (("dst", 1), ("op", "avg"))),
]


@pytest.mark.parametrize(("op", "shape", "kwargs"), LINEAR, ids=[f"{op}{kwargs}" for op, _, kwargs in LINEAR])
@pytest.mark.parametrize("transposed", [False, True])
def test_double_backward_of_linear_ops(pool, op, shape, kwargs, transposed):
    """gx = VJP(cotangent) is the dual op applied to the cotangent; its gradient with respect to the cotangent,
    against v, is the dual's transpose applied to v: the op itself, except for sum_grad, whose backward
    all_reduce is its own transpose (backward calls the dual op's apply, so this is differentiable)."""
    case = cases.Case(f"double:{op}{shape}{kwargs}", op, 4, shape, "float64", kwargs, transposed)
    arrays = cases.make_arrays(case, 0)
    arrays["v"] = cases.make_arrays(case, 1)["x"]
    replies = pool(4).run(jobs.double_backward, case, arrays)
    twice = gradients.vjp_plan(gradients.vjp_plan(case.plan()))
    assert (twice.step.name == "all_reduce") == (op in ("sum_grad", "all_reduce"))
    for got, want in zip(replies, reference.run(twice, arrays["v"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _penalty(plan, xs, cotangents, vs) -> float:
    """sum_r <vjp(xs, cotangents)_r, v_r> by the reference."""
    return sum(float(np.sum(g * v)) for g, v in zip(reference.vjp(plan, xs, cotangents), vs, strict=True))


def _finite_difference(function, arrays, step=1e-5):
    """Central differences of `function(arrays)` with respect to every element of every rank's array."""
    gradients = []
    for rank, array in enumerate(arrays):
        gradient = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            shifted = [[a.copy() for a in arrays] for _ in range(2)]
            shifted[0][rank][index] += step
            shifted[1][rank][index] -= step
            gradient[index] = (function(shifted[0]) - function(shifted[1])) / (2 * step)
        gradients.append(gradient)
    return gradients


SECOND_ORDER = [  # distinct values, away from ties: max/min are locally linear in the cotangent, flat in x
    ("product", [[2.0, 0.0], [3.0, -1.5], [0.5, 4.0]], "sum"),
    ("product", [[2.0, 0.0], [3.0, -1.5], [0.5, 4.0]], "replicated"),
    ("max", [[2.0, 0.3], [3.0, -1.5], [0.5, 4.0]], "sum"),
    ("min", [[2.0, 0.3], [3.0, -1.5], [0.5, 4.0]], "replicated"),
    ("avg", [[2.0, 0.3], [3.0, -1.5], [0.5, 4.0]], "sum"),
]


@pytest.mark.parametrize("cotangent_requires_grad", [True, False])
@pytest.mark.parametrize(("op", "xs", "convention"), SECOND_ORDER)
def test_second_derivatives_of_reductions(pool, op, xs, convention, cotangent_requires_grad):
    """A gradient penalty through all_reduce (plus a local x**3 / 3 term): the gradients of sum(gx * v) with
    respect to x and to the cotangent match finite differences of the reference VJP; product's second
    derivative is not silently dropped."""
    xs = [np.array(x) for x in xs]
    cotangents = [np.array([1.0, -2.0]), np.array([0.5, 1.0]), np.array([-1.0, 3.0])]
    vs = [np.array([0.7, 1.1]), np.array([-0.3, 2.0]), np.array([1.3, -0.6])]
    plan = plans.all_reduce((2,), 3, op, dtype="float64", convention=convention)
    replies = pool(3).run(
        jobs.second_order,
        op,
        [x.tolist() for x in xs],
        [c.tolist() for c in cotangents],
        [v.tolist() for v in vs],
        convention,
        cotangent_requires_grad,
    )
    want_x = _finite_difference(lambda shifted: _penalty(plan, shifted, cotangents, vs), xs)
    want_cotangent = _finite_difference(lambda shifted: _penalty(plan, xs, shifted, vs), cotangents)
    for rank, (gx, grad_x, grad_cotangent) in enumerate(replies):
        np.testing.assert_allclose(gx, reference.vjp(plan, xs, cotangents)[rank] + xs[rank] ** 2, rtol=1e-12)
        np.testing.assert_allclose(grad_x, want_x[rank] + 2 * xs[rank] * vs[rank], atol=1e-7)
        if cotangent_requires_grad:
            np.testing.assert_allclose(grad_cotangent, want_cotangent[rank], atol=1e-7)
