"""The corners on real gloo groups: NaN under max/min, half-precision averages whose sum overflows,
dtypes gloo cannot carry, a rank outside the group, arguments that are not tensors, complex avg. Every value
is the one the issue states, or the numpy reference's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commlib import plans, reference
from tests.spec.test_corners import TORCH_DTYPES_GLOO_LACKS
from tests.torch import corner_jobs

pytestmark = pytest.mark.timeout(120)
NAN = np.nan


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize(("convention", "factor"), [("sum", 2.0), ("replicated", 1.0)])
def test_nan_under_max_and_min(pool, op, convention, factor):
    """[nan, 5] and [5, nan] -> [nan, nan] on every rank (numpy's maximum); the gradient goes to the NaN holder."""
    replies = pool(2).run(corner_jobs.nan_extremum, op, convention)
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
    for out, grad in pool(world_size).run(corner_jobs.half_avg, dtype, op_name, value):
        np.testing.assert_allclose(out, expected, rtol=4e-3)
        np.testing.assert_allclose(grad, expected_grad, rtol=4e-3)


@pytest.mark.parametrize("dtype", TORCH_DTYPES_GLOO_LACKS)
def test_every_dtype_gloo_lacks_moves_exactly(pool, dtype):
    """Every data-movement op, send/recv and the seed's gather on random bytes viewed as `dtype`: the output's
    bytes are the reference's op on the input bytes (a carrier moves bits, whatever they mean)."""
    W, kind = 2, getattr(torch, dtype)
    inputs = [corner_jobs._bytes(rank, (2 * W, 2 * W), kind).view(torch.uint8).numpy() for rank in range(W)]
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
    replies = pool(W).run(corner_jobs.moved, dtype)
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
    for out, scattered in pool(2).run(corner_jobs.reduced, dtype, op, values):
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
        for out, _ in pool(2).run(corner_jobs.reduced, dtype, op, values):
            np.testing.assert_array_equal(out, want)
    for out, scattered in pool(2).run(corner_jobs.reduced, dtype, "sum", values):
        assert out.startswith(f"CommError: all_reduce: op ('sum') on {dtype} is not supported: its rounding differs")
        assert scattered.startswith(f"CommError: reduce_scatter: op ('sum') on {dtype} is not supported")


def test_a_rank_outside_the_group(pool):
    errors = pool(3).run(corner_jobs.outside_the_group)[1]
    assert len(errors) == 26
    for name, text in errors.items():
        op = name.removeprefix("comm.").replace("all_to_all_4D", "all_to_all_4d").replace("slice", "shard")
        assert text == (
            f"CommError: {op}: this rank (global rank 1) is not a member of the group (global ranks "
            f"[0, 2]): only its members may call its collectives. Received: rank=1, group_ranks=[0, 2]"
        )


@pytest.mark.parametrize(("kind", "type_name"), [("numpy", "numpy.ndarray"), ("list", "list")])
def test_not_a_tensor(pool, kind, type_name):
    for errors in pool(2).run(corner_jobs.not_a_tensor, kind):
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
    replies = pool(2).run(corner_jobs.complex_avg, dtype, xs, cotangents)
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
    for found in pool(2).run(corner_jobs.lazy_views, kind):
        assert found == dict.fromkeys(corner_jobs.LAZY_VIEW_CALLS, True)


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_gather_and_scatter(pool, dtype):
    """gloo refuses complex tensors in c10d's gather and scatter: they travel as their real views."""
    xs = [(np.arange(4.0).reshape(2, 2) + 10 * rank) * (1 + 2j) for rank in range(2)]
    replies = pool(2).run(corner_jobs.complex_gather_scatter, dtype)
    for rank, (gathered, grad_gather, scattered, grad_scatter) in enumerate(replies):
        np.testing.assert_array_equal(gathered, np.concatenate(xs) if rank == 1 else np.zeros((4, 2)))
        np.testing.assert_array_equal(grad_gather, np.ones((2, 2)))  # scatter of the root's ones
        np.testing.assert_array_equal(scattered, xs[1][rank : rank + 1])
        np.testing.assert_array_equal(grad_scatter, np.ones((2, 2)) if rank == 1 else np.zeros((2, 2)))


@pytest.mark.parametrize("dtype", ["float32", "complex64"])
def test_process_group_methods_match_torch_distributed(pool, dtype):
    """The eager walks call the process group's own methods (`commlib_torch._c10d`): every op's output and
    gradient are those of the same walk through torch.distributed's functions, real and complex."""
    for found in pool(2).run(corner_jobs.direct_against_wrappers, dtype):
        assert found == dict.fromkeys(corner_jobs.LAZY_VIEW_CALLS, True)


def test_torch_function_modes_see_the_collective(pool):
    """Inside a torch function mode the c10d call goes through torch.distributed's function (which dispatches
    to the mode) and the result is unchanged."""
    for right, called in pool(2).run(corner_jobs.under_function_mode):
        assert right
        assert called == ["all_reduce"]


def test_dead_transform_wrappers_are_unwrapped_as_function_apply_does(pool):
    """commlib calls the autograd Function's C apply itself (eager, no transform active): a tensor kept from
    inside a finished torch.func transform comes out as through `Function.apply`, unwrapped (values right, no
    gradient, no wrapper)."""
    for commlib_out, function_apply in pool(2).run(corner_jobs.dead_transform_wrapper):
        assert commlib_out == function_apply == (True, False, False)


def test_an_input_whose_strides_undo_the_pack(pool):
    """The pack pass of an input already in the pack's order is no copy; values and gradients are those of the
    contiguous input, and the output is still a tensor of its own."""
    for found in pool(2).run(corner_jobs.strides_that_undo_the_pack):
        assert found == (True, True, True, True)


def test_a_local_gradient_can_be_doubled_in_place(pool):
    """A gradient the exact layout's local step makes (uneven, replicated all_gather's backward) is a tensor of
    its own too: doubled in place under create_graph, with the right values and second derivative."""
    for found in pool(2).run(corner_jobs.local_gradient_doubled_in_place):
        assert found == (True, True)
