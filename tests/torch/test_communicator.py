"""`DeviceCommunicator` keeps the seed's constructor and methods with the seed's semantics, on the world group
and on sub-groups of a world-4 gloo pool ({0,2} non-contiguous, {1,2,3}); ranks are group-local."""

import numpy as np
import pytest
import torch

from commlib import plans, reference
from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge
from tests.torch import jobs

GROUPS = {"world": None, "02": (0, 2), "123": (1, 2, 3)}
WITH_SINGLE = GROUPS | {"3": (3,)}  # world size 1: the identity, no communication
IDLE = ("idle",)


def _members(members):
    return list(range(4)) if members is None else sorted(members)


def _member_replies(replies, members):
    """The replies of the group's ranks in group-local order; the others must have stayed idle."""
    inside = _members(members)
    assert all(replies[rank] == IDLE for rank in range(4) if rank not in inside)
    return [replies[rank] for rank in inside]


@pytest.mark.parametrize("members", WITH_SINGLE.values(), ids=WITH_SINGLE.keys())
def test_constructor_attributes_follow_the_seed(pool, members):
    replies = pool(4).run(jobs.communicator_attributes, members, "tp")
    inside = _members(members)
    for rank, reply in enumerate(replies):
        if rank not in inside:
            assert reply is None
            continue
        local = inside.index(rank)
        assert reply == dict(
            rank=local,
            world_size=len(inside),
            ranks=inside,
            global_rank=rank,
            global_world_size=4,
            rank_in_group=local,
            device="cpu",
            device_group_is_cpu_group=True,
            unique_name="tp",
            destroyed=None,
        )


def test_device_group_is_the_one_used_when_given(pool):
    replies = pool(4).run(jobs.communicator_over_device_group, (1, 3))
    assert replies == [None, (True, 4.0), None, (True, 4.0)]


def _method_cases(W: int) -> list[cases.Case]:
    """A few of the parity table's cases per differentiable method (`cases.per_op`: every keyword each forwards,
    and a rejected call; the table's arithmetic is tests/torch/test_ops.py's), `gather` aside (the seed's, tested
    below)."""
    return cases.per_op([case for case in cases.case_table(W) if case.op not in (cases.ATTENTION, "gather")])


@pytest.mark.parametrize("members", WITH_SINGLE.values(), ids=WITH_SINGLE.keys())
def test_methods_match_the_reference_values_and_gradients(pool, members):
    W = len(_members(members))
    failed = []
    for case in _method_cases(W):
        arrays = cases.make_arrays(case, 0)
        replies = _member_replies(pool(4).run(jobs.run_method, members, case, arrays), members)
        row = parity.check(case, arrays, *merge(case, replies))
        if not row.passed:
            failed.append(f"{case.name}: out {row.out_error} grad {row.grad_error} {row.detail}")
    assert not failed, "\n".join(failed)


SEED_CALLS = [  # the seed's positional argument order
    ("all_reduce", (3, 4), (("op", "sum"),)),
    ("all_gather", (2, 3), (("dim", 0),)),
    ("all_gather", (2, 3), (("dim", -1),)),
    ("all_to_all_4D", (2, 4, 8, 3), (("scatter_dim", 2), ("gather_dim", 1))),
    ("all_to_all_4D", (2, 8, 4, 3), (("scatter_dim", 1), ("gather_dim", 2))),
]


@pytest.mark.parametrize("members", [None, (1, 2, 3)], ids=["world", "123"])
@pytest.mark.parametrize(("method", "shape", "kwargs"), SEED_CALLS)
def test_seed_positional_calls(pool, members, method, shape, kwargs):
    W = len(_members(members))
    shape = tuple(size * W if size in (4, 8) and method == "all_to_all_4D" else size for size in shape)
    op = "all_to_all_4d" if method == "all_to_all_4D" else method
    case = cases.Case(f"seed:{method}{shape}{kwargs}", op, W, shape, "float64", kwargs)
    arrays = cases.make_arrays(case, 1)
    replies = _member_replies(pool(4).run(jobs.run_method, members, case, arrays, True), members)
    row = parity.check(case, arrays, *merge(case, replies))
    assert row.passed, row


def _all_reduce_reference(W: int, op: str):
    xs = [np.array([rank + 1.0, 2.0 - rank]) for rank in range(W)]
    plan = plans.all_reduce((2,), W, op, dtype="float64")
    return reference.run(plan, xs), reference.vjp(plan, xs, [np.ones(2)] * W)


@pytest.mark.parametrize("members", [None, (0, 2)], ids=["world", "02"])
@pytest.mark.parametrize(
    ("op", "torch_op"),
    [(name, True) for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT")] + [("product", False), (None, False)],
)
def test_all_reduce_takes_torch_reduce_ops_and_none(pool, members, op, torch_op):
    """`all_reduce(input_, op)` with a torch.distributed.ReduceOp, a string, or None (= sum, as in the seed);
    exact gradients where the seed all-reduced the cotangent with the same op."""
    W = len(_members(members))
    outputs, gradients = _all_reduce_reference(W, "sum" if op is None else op.lower())
    replies = _member_replies(pool(4).run(jobs.seed_all_reduce, members, op, torch_op), members)
    for (out, grad), want_out, want_grad in zip(replies, outputs, gradients, strict=True):
        np.testing.assert_allclose(out, want_out, rtol=1e-12)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-12)


def test_all_reduce_rejects_an_unsupported_torch_reduce_op(pool):
    case = cases.Case("seed:band", "all_reduce", 4, (2,), "float32", (("op", torch.distributed.ReduceOp.BAND),))
    replies = pool(4).run(jobs.run_method, None, case, cases.make_arrays(case, 0))
    assert {reply[0] for reply in replies} == {"error"}
    assert replies[0][1].startswith("CommError: all_reduce: op ('BAND') must be one of sum, avg, max, min, product")


@pytest.mark.parametrize("members", WITH_SINGLE.values(), ids=WITH_SINGLE.keys())
@pytest.mark.parametrize(("dst", "dim"), [(0, -1), (-1, 0), (1, 1)])
def test_gather_returns_the_concatenation_on_dst_and_none_elsewhere(pool, members, dst, dim):
    W = len(_members(members))
    dst %= W
    xs = [np.arange(6.0).reshape(2, 3) + 10 * rank for rank in range(W)]
    replies = _member_replies(pool(4).run(jobs.seed_gather, members, xs, dst, dim), members)
    for rank, reply in enumerate(replies):
        if rank != dst:
            assert reply is None
            continue
        out, requires_grad = reply
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=dim))
        assert not requires_grad  # the seed's gather is not differentiable


@pytest.mark.parametrize("members", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize(
    ("explicit", "reverse"),
    [(False, False), (True, False), (True, True)],
    ids=["default", "explicit", "explicit-reverse"],
)
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_send_and_recv(pool, members, explicit, reverse, dtype):
    """Default dst / src = next / previous group-local rank; explicit ranks are group-local too."""
    inside = _members(members)
    W, step = len(inside), -1 if reverse else 1
    replies = _member_replies(pool(4).run(jobs.send_recv, members, explicit, reverse, dtype, timeout=30.0), members)
    for rank, (received, received_dtype) in enumerate(replies):
        sender = inside[(rank - step) % W]
        np.testing.assert_array_equal(received, (np.arange(6.0).reshape(3, 2) + 100 * sender).T)
        assert received_dtype == f"torch.{dtype}"


BAD_RANKS = [
    ("gather", "dst", {"dst": "W"}),
    ("gather", "dst", {"dst": -1}),
    ("send", "dst", {"dst": "W"}),
    ("recv", "src", {"src": -1}),
    ("recv", "src", {"src": "W"}),
    ("broadcast", "src", {"src": "W"}),
    ("scatter", "src", {"src": -1}),
    ("permute", "dst", {"perm": [(0, "W")]}),
]


@pytest.mark.parametrize("members", [None, (1, 3)], ids=["world", "13"])
@pytest.mark.parametrize(("method", "name", "kwargs"), BAD_RANKS)
def test_bad_rank_raises_before_any_communication(pool, members, method, name, kwargs):
    """Only local rank 0 calls, the others do nothing: a call that communicated would hang until the timeout."""
    inside = _members(members)
    W = len(inside)
    fill = lambda value: W if value == "W" else value  # noqa: E731
    kwargs = {
        key: [tuple(map(fill, pair)) for pair in value] if key == "perm" else fill(value)
        for key, value in kwargs.items()
    }
    replies = pool(4).run(jobs.bad_rank_alone, members, method, kwargs, timeout=30.0)
    bad = kwargs["perm"][0][1] if method == "permute" else kwargs[name]
    assert replies[inside[0]].startswith(f"CommError: {method}: {name} ({bad}) must be in [0, {W}) for world_size {W}")
    assert [reply for rank, reply in enumerate(replies) if rank != inside[0]] == [None] * 3
