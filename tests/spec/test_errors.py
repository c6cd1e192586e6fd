"""Validation in `commlib.plans`: which exception, and the one message format both frontends share.

Format: ``"{op}: {quantity} ({number}) must ... ({other number}). Received: k=v, ..."``; `CommError`
(a `ValueError`) for bad values, `TypeError` (not a `ValueError`) for wrong kinds.
"""

import re
import types

import numpy as np
import pytest

from commlib import CommError, frontend_errors, plans, reference, steps

SHAPE = (2, 8, 6, 64)


def _raises(exception, call):
    with pytest.raises(exception) as info:
        call()
    assert type(info.value) is exception  # CommError is a ValueError: pin the exact class
    return str(info.value)


def _check_format(message, op, *numbers):
    """Names the op first, every number in parentheses, and ends with what was received."""
    assert message.startswith(f"{op}: "), message
    for number in numbers:
        assert f"({number})" in message, (number, message)
    assert re.fullmatch(rf"{op}: [^.]+(\.[^.]+)*\. Received: \w+=.+", message), message


# ---------------------------------------------------------------- CommError: exact messages

EXACT = [
    (
        "ulysses-heads",
        lambda: plans.all_to_all_4d((2, 8, 6, 64), 4),
        "all_to_all_4d: heads (6) must be divisible by world_size (4). "
        "Received: shape=(2, 8, 6, 64), scatter_dim=2, gather_dim=1",
    ),
    (
        "ulysses-seq",
        lambda: plans.all_to_all_4d((2, 9, 8, 64), 2, 1, 2),
        "all_to_all_4d: seq (9) must be divisible by world_size (2). "
        "Received: shape=(2, 9, 8, 64), scatter_dim=1, gather_dim=2",
    ),
    (
        "ulysses-3d",
        lambda: plans.all_to_all_4d((2, 8, 6), 2),
        "all_to_all_4d: ndim (3) must be 4 ([batch, seq, heads, head_dim]). "
        "Received: shape=(2, 8, 6), scatter_dim=2, gather_dim=1",
    ),
    (
        "ulysses-same-dim-after-normalising",
        lambda: plans.all_to_all_4d(SHAPE, 2, 1, -3),
        "all_to_all_4d: (scatter_dim, gather_dim) (1, 1) must be (2, 1) or (1, 2). "
        "Received: shape=(2, 8, 6, 64), scatter_dim=1, gather_dim=-3",
    ),
    (
        "ulysses-other-pair",
        lambda: plans.all_to_all_4d(SHAPE, 2, 3, 0),
        "all_to_all_4d: (scatter_dim, gather_dim) (3, 0) must be (2, 1) or (1, 2). "
        "Received: shape=(2, 8, 6, 64), scatter_dim=3, gather_dim=0",
    ),
    (
        "all_to_all-same-dim-not-divisible",
        lambda: plans.all_to_all((2, 6), 4, 1, -1),
        "all_to_all: size of scatter_dim 1 (6) must be divisible by world_size (4). "
        "Received: shape=(2, 6), scatter_dim=1, gather_dim=-1",
    ),
    (
        "all_to_all-scatter-out-of-range",
        lambda: plans.all_to_all(SHAPE, 2, 4, 1),
        "all_to_all: scatter_dim (4) must be in [-4, 4) for ndim 4. "
        "Received: shape=(2, 8, 6, 64), scatter_dim=4, gather_dim=1",
    ),
    (
        "all_to_all-gather-out-of-range-negative",
        lambda: plans.all_to_all(SHAPE, 2, 1, -5),
        "all_to_all: gather_dim (-5) must be in [-4, 4) for ndim 4. "
        "Received: shape=(2, 8, 6, 64), scatter_dim=1, gather_dim=-5",
    ),
    (
        "all_to_all-not-divisible",
        lambda: plans.all_to_all((3, 5), 2, -1, 0),
        "all_to_all: size of scatter_dim 1 (5) must be divisible by world_size (2). "
        "Received: shape=(3, 5), scatter_dim=-1, gather_dim=0",
    ),
    (
        "all_gather-dim-out-of-range",
        lambda: plans.all_gather((2, 8), 2, 2),
        "all_gather: dim (2) must be in [-2, 2) for ndim 2. Received: shape=(2, 8), dim=2",
    ),
    (
        "all_gather-dim-out-of-range-negative",
        lambda: plans.all_gather((2, 8), 2, -3),
        "all_gather: dim (-3) must be in [-2, 2) for ndim 2. Received: shape=(2, 8), dim=-3",
    ),
    (
        "reduce_scatter-dim-out-of-range",
        lambda: plans.reduce_scatter((4, 8), 2, -3),
        "reduce_scatter: dim (-3) must be in [-2, 2) for ndim 2. Received: shape=(4, 8), dim=-3, op='sum'",
    ),
    (
        "reduce_scatter-not-divisible",
        lambda: plans.reduce_scatter((3, 8), 2, 0),
        "reduce_scatter: size of dim 0 (3) must be divisible by world_size (2). "
        "Received: shape=(3, 8), dim=0, op='sum'",
    ),
    (
        "reduce_scatter-not-divisible-negative-dim",
        lambda: plans.reduce_scatter((4, 9), 4, -1),
        "reduce_scatter: size of dim 1 (9) must be divisible by world_size (4). "
        "Received: shape=(4, 9), dim=-1, op='sum'",
    ),
    (
        "reduce_scatter-op-not-sum-or-avg",
        lambda: plans.reduce_scatter((4, 8), 2, 0, "max"),
        "reduce_scatter: op ('max') must be one of sum, avg. Received: shape=(4, 8), dim=0, op='max'",
    ),
    (
        "unknown-op-string",
        lambda: plans.all_reduce((2, 8), 2, "bogus"),
        "all_reduce: op ('bogus') must be one of sum, avg, max, min, product. Received: shape=(2, 8), op='bogus'",
    ),
    (
        "avg-on-int32",
        lambda: plans.all_reduce((4, 8), 2, "avg", dtype="int32"),
        "all_reduce: op ('avg') needs a floating or complex dtype, not int32. "
        "Received: shape=(4, 8), op='avg', dtype='int32'",
    ),
    (
        "reduce_scatter-avg-on-int32",
        lambda: plans.reduce_scatter((4, 8), 2, 0, "avg", dtype="int32"),
        "reduce_scatter: op ('avg') needs a floating or complex dtype, not int32. "
        "Received: shape=(4, 8), dim=0, op='avg', dtype='int32'",
    ),
    (
        "shard-not-divisible",
        lambda: plans.shard((3, 10), 4),
        "shard: size of dim 1 (10) must be divisible by world_size (4). Received: shape=(3, 10), dim=-1",
    ),
    (
        "shard-dim-out-of-range",
        lambda: plans.shard((3, 8), 2, dim=2),
        "shard: dim (2) must be in [-2, 2) for ndim 2. Received: shape=(3, 8), dim=2",
    ),
    (
        "reduce-op-not-sum-or-avg",
        lambda: plans.reduce((3,), 4, 1, "product"),
        "reduce: op ('product') must be one of sum, avg. Received: shape=(3,), dst=1, op='product'",
    ),
    (
        "reduce-dst-out-of-range",
        lambda: plans.reduce((3,), 4, 4),
        "reduce: dst (4) must be in [0, 4) for world_size 4. Received: shape=(3,), dst=4, op='sum'",
    ),
    (
        "reduce-avg-on-int32",
        lambda: plans.reduce((3,), 2, 0, "avg", dtype="int32"),
        "reduce: op ('avg') needs a floating or complex dtype, not int32. "
        "Received: shape=(3,), dst=0, op='avg', dtype='int32'",
    ),
    (
        "world_size-0",
        lambda: plans.all_reduce((4, 8), 0),
        "all_reduce: world_size (0) must be >= 1. Received: shape=(4, 8), op='sum'",
    ),
    (
        "ulysses-world_size-0",
        lambda: plans.all_to_all_4d(SHAPE, 0),
        "all_to_all_4d: world_size (0) must be >= 1. Received: shape=(2, 8, 6, 64), scatter_dim=2, gather_dim=1",
    ),
]


@pytest.mark.parametrize(("call", "message"), [case[1:] for case in EXACT], ids=[case[0] for case in EXACT])
def test_comm_error_message(call, message):
    assert _raises(CommError, call) == message


def test_the_documented_example_names_everything():
    message = _raises(CommError, lambda: plans.all_to_all_4d((2, 8, 6, 64), 4))
    _check_format(message, "all_to_all_4d", 6, 4)
    assert "heads" in message and "world_size" in message


def test_comm_error_is_a_value_error():
    assert issubclass(CommError, ValueError)
    with pytest.raises(ValueError, match=r"all_gather: dim \(5\) must be in"):
        plans.all_gather((2,), 2, 5)


# ---------------------------------------------------------------- CommError: format over many cases

FORMAT = [
    ("all_to_all_4d", lambda: plans.all_to_all_4d((2, 8, 6, 64), 4), (6, 4)),
    ("all_to_all_4d", lambda: plans.all_to_all_4d((1, 7, 4, 8), 2, 1, 2), (7, 2)),
    ("all_to_all_4d", lambda: plans.all_to_all_4d((2, 8, 6, 64, 1), 2), (5,)),
    ("all_to_all", lambda: plans.all_to_all((4, 5), 2, 1, -1), (5, 2)),
    ("shard", lambda: plans.shard((4, 6), 4, 1), (6, 4)),
    ("reduce", lambda: plans.reduce((4,), 2, dst=-1), (-1,)),
    ("all_to_all", lambda: plans.all_to_all((4, 4), 2, 0, 2), (2,)),
    ("all_to_all", lambda: plans.all_to_all((4, 4), 2, -3, 1), (-3,)),
    ("all_to_all", lambda: plans.all_to_all((4, 6), 4, 1, 0), (6, 4)),
    ("all_gather", lambda: plans.all_gather((4,), 3, 1), (1,)),
    ("all_gather", lambda: plans.all_gather((4,), -1, 0), (-1,)),
    ("reduce_scatter", lambda: plans.reduce_scatter((4, 6), 4, 1), (6, 4)),
    ("reduce_scatter", lambda: plans.reduce_scatter((4,), 2, 0, "product"), ()),
    ("all_reduce", lambda: plans.all_reduce((4,), 2, "BOGUS"), ()),
    ("all_reduce", lambda: plans.all_reduce((4,), 2, convention="mean"), ()),
    ("all_reduce", lambda: plans.all_reduce((4,), 2, accum_dtype="int32"), ()),
    ("gather", lambda: plans.gather((4,), 2, dst=2), (2,)),
]


@pytest.mark.parametrize(("op", "call", "numbers"), FORMAT)
def test_comm_error_format(op, call, numbers):
    _check_format(_raises(CommError, call), op, *numbers)


# ---------------------------------------------------------------- reduce ops: values vs kinds


class DuckOp:
    """Stands in for ``torch.distributed.ReduceOp.BAND`` (the spec never imports torch)."""

    name = "BAND"


def test_duck_typed_unknown_op_is_a_comm_error():
    message = _raises(CommError, lambda: plans.all_reduce((4,), 2, DuckOp()))
    assert message.startswith("all_reduce: op ('BAND') must be one of sum, avg, max, min, product. Received: ")


def test_duck_typed_known_op_is_accepted():
    assert plans.all_reduce((4,), 2, types.SimpleNamespace(name="AVG")).step.op == "avg"


@pytest.mark.parametrize("op", [3, None, 1.5, types.SimpleNamespace(name=7)])
def test_op_of_the_wrong_kind_is_a_type_error(op):
    message = _raises(TypeError, lambda: plans.all_reduce((4,), 2, op))
    assert (
        message == f"all_reduce: op must be a string or a ReduceOp, not {type(op).__name__}. "
        f"Received: shape=(4,), op={op!r}"
    )


def test_type_errors_are_not_value_errors():
    with pytest.raises(TypeError) as info:
        plans.all_reduce((4,), 2, None)
    assert not isinstance(info.value, ValueError)


# ---------------------------------------------------------------- dims and sizes of the wrong kind


@pytest.mark.parametrize("dim", [1.0, True, False, "1", None])
def test_dim_of_the_wrong_kind_is_a_type_error(dim):
    kind = type(dim).__name__
    message = _raises(TypeError, lambda: plans.all_gather((2, 8), 2, dim))
    assert message == f"all_gather: dim must be an int, not {kind}. Received: shape=(2, 8), dim={dim!r}"
    _raises(TypeError, lambda: plans.reduce_scatter((4, 8), 2, dim))
    _raises(TypeError, lambda: plans.all_to_all((4, 8), 2, dim, 0))
    _raises(TypeError, lambda: plans.all_to_all((4, 8), 2, 0, dim))
    _raises(TypeError, lambda: plans.all_to_all_4d(SHAPE, 2, dim, 1))


@pytest.mark.parametrize("scale_grad", [1, 0, None, "yes", 1.0])
def test_scale_grad_of_the_wrong_kind_is_a_type_error(scale_grad):
    message = _raises(TypeError, lambda: plans.shard((2, 8), 2, scale_grad=scale_grad))
    kind = type(scale_grad).__name__
    assert message == f"shard: scale_grad must be a bool, not {kind}. Received: shape=(2, 8), dim=-1"


def test_numpy_bools_are_bools():
    assert plans.shard((2, 8), 2, scale_grad=np.bool_(True)).arithmetic.grad_scale == 0.5
    assert plans.shard((2, 8), 2, scale_grad=np.bool_(False)).arithmetic.grad_scale == 1.0


def test_equal_scatter_and_gather_dims_are_valid():
    """torch's all_to_all_single / lax's split_axis == concat_axis: the shape is unchanged (it was an error)."""
    assert plans.all_to_all(SHAPE, 2, 1, -3).out_shape == SHAPE
    assert steps.dims(plans.all_to_all((8, 3), 4, 0, 0).step) == (0, 0)


def test_numpy_integers_are_ints():
    assert steps.dims(plans.all_gather((2, 8), 2, np.int64(-1)).step) == (1,)
    assert plans.all_to_all((4, 8), np.int32(2), 0, np.int64(1)).world_size == 2


@pytest.mark.parametrize("world_size", [2.0, True, "2"])
def test_world_size_of_the_wrong_kind_is_a_type_error(world_size):
    message = _raises(TypeError, lambda: plans.all_gather((2, 8), world_size, 0))
    assert message.startswith(f"all_gather: world_size must be an int, not {type(world_size).__name__}. Received: ")


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_1_is_a_comm_error(world_size):
    for call in (
        lambda: plans.all_reduce((4,), world_size),
        lambda: plans.all_gather((4,), world_size, 0),
        lambda: plans.reduce_scatter((4,), world_size, 0),
        lambda: plans.all_to_all((4, 4), world_size, 0, 1),
        lambda: plans.all_to_all_4d(SHAPE, world_size),
    ):
        assert f"world_size ({world_size}) must be >= 1. Received: " in _raises(CommError, call)


def test_shape_of_the_wrong_kind_is_a_type_error():
    _raises(TypeError, lambda: plans.all_gather((2.0, 8), 2, 0))


def test_negative_size_is_a_comm_error():
    _check_format(_raises(CommError, lambda: plans.all_gather((2, -8), 2, 0)), "all_gather")


# ---------------------------------------------------------------- the reference raises the same errors


def test_reference_raises_the_spec_errors():
    xs = [np.zeros((2, 8, 6, 64)) for _ in range(4)]
    message = _raises(CommError, lambda: reference.all_to_all_4d(xs))
    assert message == (
        "all_to_all_4d: heads (6) must be divisible by world_size (4). "
        "Received: shape=(2, 8, 6, 64), scatter_dim=2, gather_dim=1"
    )
    ints = [np.zeros((4,), dtype=np.int32)] * 2
    _raises(CommError, lambda: reference.all_reduce(ints, "avg"))
    _raises(CommError, lambda: reference.reduce_scatter(ints, 0, "avg"))
    _raises(TypeError, lambda: reference.all_gather(ints, 0.0))


def test_sum_of_bools_is_refused():
    """gloo ORs bools, numpy counts them: the spec refuses the ambiguous sum and names the alternatives."""
    with pytest.raises(CommError) as info:
        plans.all_reduce((3,), 4, "sum", dtype="bool")
    assert str(info.value) == (
        "all_reduce: op ('sum') on bool is ambiguous: use 'max' (any) or 'min' (all). "
        "Received: shape=(3,), op='sum', dtype='bool'"
    )
    assert plans.all_reduce((3,), 4, "max", dtype="bool").step.op == "max"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: plans.all_reduce((2,), 2, dtype="float64", accum_dtype="float16"),
            "all_reduce: accum_dtype (float16: 5 exponent, 10 mantissa bits) must hold every value of the input dtype "
            "(float64: 11, 52). Received: shape=(2,), op='sum', dtype='float64', accum_dtype='float16'",
        ),
        (
            lambda: plans.all_reduce((2,), 2, dtype="bfloat16", accum_dtype="float16"),  # 40000 would overflow
            "all_reduce: accum_dtype (float16: 5 exponent, 10 mantissa bits) must hold every value of the input dtype "
            "(bfloat16: 8, 7). Received: shape=(2,), op='sum', dtype='bfloat16', accum_dtype='float16'",
        ),
        (
            lambda: plans.reduce_scatter((4,), 2, 0, dtype="float16", accum_dtype="bfloat16"),  # 1 + 2**-10 rounds
            "reduce_scatter: accum_dtype (bfloat16: 8 exponent, 7 mantissa bits) must hold every value of the input "
            "dtype (float16: 5, 10). Received: shape=(4,), dim=0, op='sum', dtype='float16', accum_dtype='bfloat16'",
        ),
        (
            lambda: plans.all_reduce((2,), 2, "max", dtype="complex64"),
            "all_reduce: op ('max') needs a real dtype, not complex64. Received: shape=(2,), "
            "op='max', dtype='complex64'",
        ),
        (
            lambda: plans.all_reduce((2,), 2, convention="mean"),
            "all_reduce: convention ('mean') must be one of sum, replicated. "
            "Received: shape=(2,), op='sum', convention='mean'",
        ),
        (
            lambda: plans.reduce_scatter((4,), 2, dtype="float32", accum_dtype="int8"),
            "reduce_scatter: accum_dtype (int8) and the input dtype (float32) must be floating. "
            "Received: shape=(4,), dim=0, op='sum', dtype='float32', accum_dtype='int8'",
        ),
    ],
)
def test_dtype_and_convention_messages(call, message):
    """A narrower accumulation, complex extrema and bad conventions are refused, naming what was received."""
    with pytest.raises(CommError) as info:
        call()
    assert str(info.value) == message


_MESH = dict(mesh_shape=(2, 2), dim_names=("sp", "tp"))


@pytest.mark.parametrize(
    ("mesh", "dim", "expected"),
    [
        (dict(mesh_shape=(4,), dim_names=None), None, 0),
        (dict(mesh_shape=(4,), dim_names=("sp",)), "sp", 0),
        (_MESH, "sp", 0),
        (_MESH, "tp", 1),
        (_MESH, 1, 1),
        (_MESH, -2, 0),
        (dict(mesh_shape=(2, 1, 2), dim_names=None), 2, 2),
    ],
)
def test_mesh_dim(mesh, dim, expected):
    """The dim a ``group=mesh`` / ``group=(mesh, dim)`` argument names: by name or index; none for a 1-D mesh."""
    assert frontend_errors.mesh_dim("all_gather", **mesh, dim=dim) == expected


@pytest.mark.parametrize(
    ("mesh", "dim", "exception", "message"),
    [
        (
            _MESH,
            None,
            CommError,
            "all_gather: mesh ndim (2) must be 1 when group is a mesh without a dim: pass (mesh, "
            "name) with name one of "
            "('sp', 'tp'). Received: mesh_shape=(2, 2), mesh_dim_names=('sp', 'tp')",
        ),
        (
            dict(mesh_shape=(2, 2), dim_names=None),
            None,
            CommError,
            "all_gather: mesh ndim (2) must be 1 when group is a mesh without a dim: pass (mesh, index) with index in "
            "[0, 2) (the mesh has no dim names). Received: mesh_shape=(2, 2), mesh_dim_names=None",
        ),
        (
            _MESH,
            "dp",
            CommError,
            "all_gather: mesh dim ('dp') must be one of the mesh's dim names ('sp', 'tp'). "
            "Received: mesh_shape=(2, 2), mesh_dim_names=('sp', 'tp'), dim='dp'",
        ),
        (
            dict(mesh_shape=(2, 2), dim_names=None),
            "sp",
            CommError,
            "all_gather: mesh dim ('sp') must be an index in [0, 2): the mesh has no dim names. "
            "Received: mesh_shape=(2, 2), mesh_dim_names=None, dim='sp'",
        ),
        (
            _MESH,
            2,
            CommError,
            "all_gather: mesh dim (2) must be in [-2, 2) for ndim 2. "
            "Received: mesh_shape=(2, 2), mesh_dim_names=('sp', 'tp'), dim=2",
        ),
        (
            _MESH,
            True,
            TypeError,
            "all_gather: mesh dim must be a dim name (str) or an index (int), not bool. "
            "Received: mesh_shape=(2, 2), mesh_dim_names=('sp', 'tp'), dim=True",
        ),
    ],
)
def test_mesh_dim_messages(mesh, dim, exception, message):
    """A mesh that is not 1-D needs a dim; an unknown name or index names the mesh's shape and dim names."""
    text = _raises(exception, lambda: frontend_errors.mesh_dim("all_gather", **mesh, dim=dim))
    assert text == message
    _check_format(text, "all_gather")
