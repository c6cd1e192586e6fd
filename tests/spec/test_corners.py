"""The corners on the spec and the numpy reference: NaN under max/min, half-precision averages whose
sum overflows, the carrier rule for dtypes a backend lacks, complex avg, and the messages of the calls only a
frontend can detect (a rank outside the group, not an array, an unbound axis, send/recv plans)."""

from __future__ import annotations

import numpy as np
import pytest

from commlib import CommError, check, dtypes, frontend_errors, gradients, plans, reference
from commlib.reduce_op import ReduceOp

NAN = np.nan
GLOO = frozenset(
    {
        "bool",
        "int8",
        "uint8",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
    }
)


@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_on_any_rank_makes_the_result_nan_on_every_rank(op):
    xs = [np.array([NAN, 5.0]), np.array([5.0, NAN])]
    for out in reference.all_reduce(xs, op):
        np.testing.assert_array_equal(out, [NAN, NAN])


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize(("convention", "factor"), [("sum", 3.0), ("replicated", 1.0)])
def test_nan_gradient_goes_to_the_nan_holders_split_equally(op, convention, factor):
    """W=3: element 0 NaN on rank 0 only, element 1 NaN on ranks 1 and 2, element 2 a plain max/min (rank 2)."""
    xs = [np.array([NAN, 1.0, 0.0]), np.array([2.0, NAN, 0.0]), np.array([3.0, NAN, 9.0 if op == "max" else -9.0])]
    plan = plans.all_reduce((3,), 3, op, dtype="float64", convention=convention)
    grads = reference.vjp(plan, xs, [np.ones(3)] * 3)
    expected = factor * np.array([[1.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.5, 1.0]])
    np.testing.assert_array_equal(np.stack(grads), expected)
    assert np.all(np.isfinite(grads))  # the NaN stays in the value; the gradient is finite and conserved
    np.testing.assert_array_equal(np.sum(grads, axis=0), [factor] * 3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "complex32"])
@pytest.mark.parametrize("op_name", ["all_reduce", "reduce_scatter"])
def test_half_precision_avg_scales_before_the_sum_and_so_does_its_backward(dtype, op_name):
    plan = getattr(plans, op_name)((4,), 2, op="avg", dtype=dtype)
    assert plan.arithmetic.scale == 0.5 and plan.arithmetic.scale_first
    dual = gradients.vjp_plan(plan)
    # the summed cotangent of all_reduce avg's backward too
    assert dual.arithmetic.scale == 0.5 and dual.arithmetic.scale_first
    assert not getattr(plans, op_name)((4,), 2, op="avg", dtype="float32").arithmetic.scale_first
    assert not getattr(plans, op_name)((4,), 2, op="sum", dtype="float16").arithmetic.scale_first


def test_half_precision_avg_reference_value():
    xs = [np.full(2, 40000.0, dtype=np.float16)] * 2
    for out in reference.all_reduce(xs, "avg"):
        np.testing.assert_array_equal(out, [40000.0, 40000.0])
    plan = plans.all_reduce((2,), 2, "avg", dtype="float16")
    for grad in reference.vjp(plan, xs, xs):
        np.testing.assert_array_equal(grad, [40000.0, 40000.0])


def test_complex_avg_forward_and_gradient():
    xs = [np.array([1 + 2j, 3j], dtype=np.complex64), np.array([2 + 4j, 6j], dtype=np.complex64)]
    plan = plans.all_reduce((2,), 2, "avg", dtype="complex64")
    for out in reference.all_reduce(xs, "avg"):
        np.testing.assert_allclose(out, [1.5 + 3j, 4.5j])
    cotangents = [np.array([1j, 2.0]), np.array([2.0, 1j])]
    for grad in reference.vjp(plan, xs, cotangents):  # real coefficients: the same map, no conjugation
        np.testing.assert_allclose(grad, [1 + 0.5j, 1 + 0.5j])
    assert plans.reduce_scatter((4,), 2, op="avg", dtype="complex128").arithmetic.scale == 0.5


@pytest.mark.parametrize("op", ["max", "min", "product"])
def test_complex_extrema_and_product_stay_refused(op):
    with pytest.raises(CommError, match=rf"op \('{op}'\) needs a real dtype, not complex64"):
        plans.all_reduce((2,), 2, op, dtype="complex64")


# --- carriers -----------------------------------------------------------------------------------------------

TORCH_DTYPES_GLOO_LACKS = [
    "int16",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    *(f"int{n}" for n in range(1, 8)),
    *(f"uint{n}" for n in range(1, 8)),
]


@pytest.mark.parametrize("dtype", TORCH_DTYPES_GLOO_LACKS)
def test_every_dtype_gloo_lacks_moves_as_a_same_size_view(dtype):
    view, cast = dtypes.wire_dtypes("all_gather", dtype, None, GLOO)
    assert cast is None and view in GLOO and dtypes.bits(view) == dtypes.bits(dtype)
    plan = plans.all_gather((2, 3), 2, 0, dtype=dtype, backend_dtypes=GLOO)
    assert plan.wire_view == view and plan.dtype == dtype


@pytest.mark.parametrize(
    ("dtype", "op", "expected"),
    [
        ("int16", "sum", (None, "int32")),
        ("int16", "product", (None, "int32")),
        ("int16", "max", (None, "int32")),
        ("uint16", "min", (None, "int32")),
        ("uint32", "sum", ("int32", None)),  # two's complement: the same bits modulo 2**32
        ("uint32", "max", (None, "int64")),  # order needs the wider signed integer
        ("uint64", "sum", ("int64", None)),
        ("uint64", "product", ("int64", None)),
        ("float8_e4m3fn", "max", (None, "float32")),
        ("float8_e5m2", "min", (None, "float32")),
    ],
)
def test_reduction_carriers(dtype, op, expected):
    assert dtypes.wire_dtypes("all_reduce", dtype, ReduceOp(op), GLOO) == expected


@pytest.mark.parametrize(
    ("dtype", "op", "message"),
    [
        (
            "uint64",
            "max",
            "all_reduce: op ('max') on uint64 has no exact carrier: the backend lacks uint64 and any "
            "wider integer that holds every uint64 value; cast x to a dtype it carries first. "
            "Received: shape=(3,), op='max', dtype='uint64'",
        ),
        (
            "float8_e4m3fn",
            "sum",
            "all_reduce: op ('sum') on float8_e4m3fn is not supported: its rounding differs "
            "between backends; cast x to float32 or bfloat16 first. Received: shape=(3,), op='sum', "
            "dtype='float8_e4m3fn'",
        ),
        ("float8_e5m2", "avg", "all_reduce: op ('avg') on float8_e5m2 is not supported"),
        (
            "bits16",
            "sum",
            "all_reduce: op ('sum') on bits16 is not supported: the backend lacks bits16, and no other "
            "dtype computes it exactly",
        ),
    ],
)
def test_inexact_reductions_are_refused(dtype, op, message):
    with pytest.raises(CommError) as raised:
        plans.all_reduce((3,), 2, op, dtype=dtype, backend_dtypes=GLOO)
    assert str(raised.value).startswith(message)


def test_float8_reductions_follow_the_spec_on_every_backend():
    """float8 max/min run in float32 and sum is refused even where the backend carries float8 (NCCL, XLA)."""
    assert plans.all_reduce((3,), 2, "max", dtype="float8_e4m3fn").arithmetic.accum_dtype == "float32"
    with pytest.raises(CommError, match="not supported"):
        plans.all_reduce((3,), 2, "sum", dtype="float8_e4m3fn")
    assert plans.all_gather((3,), 2, dtype="float8_e4m3fn").wire_view is None  # movement: as it is


def test_carried_dtypes_need_no_carrier():
    for dtype in sorted(GLOO):
        assert dtypes.wire_dtypes("all_gather", dtype, None, GLOO) == (None, None)
    assert plans.all_reduce((3,), 2, dtype="int16").wire_view is None  # backend_dtypes=None: every dtype


def test_movement_without_a_same_size_dtype_is_refused():
    with pytest.raises(
        CommError,
        match=r"all_gather: data movement of int16 has no carrier: the backend lacks "
        r"int16 and every dtype of its size",
    ):
        plans.all_gather((3,), 2, dtype="int16", backend_dtypes=frozenset({"float32"}))


# --- messages of the calls only a frontend can detect ----------------------------------------------------


def test_messages():
    assert str(frontend_errors.not_a_member("all_reduce", 1, [0])) == (
        "all_reduce: this rank (global rank 1) is not a member of the group (global ranks [0]): only its members "
        "may call its collectives. Received: rank=1, group_ranks=[0]"
    )
    assert str(frontend_errors.wrong_type("all_gather", "x", np.ones(2), "torch.Tensor")) == (
        "all_gather: x must be a torch.Tensor, not numpy.ndarray. Received: type='numpy.ndarray'"
    )
    assert str(frontend_errors.unbound_axis("permute", ("x", "y"))) == (
        "permute: axis_name (('x', 'y')) is not bound here: commlib_jax ops run inside jax.shard_map (over a mesh "
        "with that axis) or jax.pmap (axis_name=...), not outside them. Received: axis_name=('x', 'y')"
    )


def test_point_to_point_plans_of_both_ends_agree():
    send = plans.point_to_point((2, 3), 4, 1, 3, dtype="int16", op_name="send", backend_dtypes=GLOO)
    recv = plans.point_to_point((2, 3), 4, 1, 3, dtype="int16", op_name="recv", backend_dtypes=GLOO)
    assert send.step.pairs == recv.step.pairs == ((1, 3),) and send.wire_view == "float16"
    with pytest.raises(CommError, match=r"send: dst \(4\) must be in \[0, 4\)"):
        plans.point_to_point((2,), 4, 1, 4, op_name="send")
    with pytest.raises(CommError, match=r"recv: dst \(2\) must differ from src \(2\)"):
        plans.point_to_point((2,), 4, 2, 2, op_name="recv")


def test_checked_pair_names_the_two_ranks_of_the_transfer():
    sent = check.fingerprint(plans.point_to_point((3,), 4, 1, 3, op_name="send/recv"), "float32")
    expected = check.fingerprint(plans.point_to_point((4,), 4, 1, 3, op_name="send/recv"), "float32")
    rows = np.stack([sent, expected])
    for rank in (1, 3):
        with pytest.raises(CommError) as raised:
            check.compare(rows, rank, ranks=(1, 3))
        assert str(raised.value).startswith(
            f"send/recv: ranks disagree on shape: rank 1 has (3,), rank 3 has (4,). Received: rank={rank}"
        )
