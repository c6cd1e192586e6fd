"""Uneven sizes on real gloo groups (the exact layout: rank r's tensor has sizes[r] rows, one all_to_all_single
with split sizes): the handed Ulysses case, hypothesis over every op with uneven sizes (zeros included,
W 1-4, float64, transposed inputs and cotangents) against the reference, two calls with other sizes in one
process, the exact layout's error text on every rank, and checked mode with ranks that disagree on sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import CommError, plans
from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case
from tests.strategies import uneven_calls, uneven_case
from tests.torch import failure_jobs, uneven_jobs

pytestmark = pytest.mark.timeout(120)


def test_handed_case(pool):
    replies = pool(4).run(uneven_jobs.handed_case)
    assert [shape for _, shape in replies] == [(2, 63, 2, 3), (2, 63, 2, 3), (2, 63, 1, 3), (2, 63, 1, 3)]
    assert all(errors == [0.0, 0.0, 0.0] for errors, _ in replies), replies


@given(uneven_calls(), st.booleans(), st.integers(0, 2**16))
def test_uneven_property(pool, call, transposed, seed):
    case = uneven_case(call, transposed=transposed)
    arrays = cases.make_arrays(case, seed)
    outputs, gradients, error = merge(case, pool(case.world_size).run(run_case, case, arrays))
    row = parity.check(case, arrays, outputs, gradients, error)
    assert row.passed, row


def test_other_sizes_in_the_same_process(pool):
    assert pool(3).run(uneven_jobs.two_sizes_in_one_process) == [[True] * 6] * 3


def test_a_sharded_dim_that_is_not_the_ranks_size_raises_the_spec_text_on_that_rank(pool):
    replies = pool(4).run(uneven_jobs.wrong_rows)
    for rank, reply in enumerate(replies):
        with pytest.raises(CommError) as info:
            plans.all_to_all_4d((1, 2, 4, 2), 4, 2, 1, gather_sizes=(3, 3, 1, 1), rank=rank)
        assert reply == str(info.value), reply
    assert replies[2] == (
        "all_to_all_4d: seq (2) must equal gather_sizes[2] (1) on rank 2. Received: "
        "shape=(1, 2, 4, 2), scatter_dim=2, gather_dim=1, gather_sizes=(3, 3, 1, 1)"
    )


def test_checked_mode_ranks_that_disagree_on_sizes_all_raise(pool):
    """Each rank's tensor matches its own sizes (no local error), but rank 2's sizes differ from the others':
    every rank raises the same CommError before the all-to-all runs."""
    agreed, other = (2, 2, 1, 1), (2, 1, 2, 1)
    calls = [
        ("all_to_all_4d", (1, sizes[rank], 4, 2), "float32", dict(gather_sizes=sizes))
        for rank, sizes in enumerate([agreed, agreed, other, agreed])
    ]
    replies = pool(4).run(failure_jobs.call_checked, calls)
    assert all(reply[:2] == ("error", "CommError") for reply in replies), replies
    bodies = {reply[2].split(". Received: ")[0] for reply in replies}
    assert bodies == {
        "all_to_all_4d: ranks disagree on gather_sizes: ranks 0, 1, 3 have (2, 2, 1, 1), rank 2 has (2, 1, 2, 1)"
    }
    agreeing = [("all_to_all_4d", (1, agreed[rank], 4, 2), "float32", dict(gather_sizes=agreed)) for rank in range(4)]
    assert all(reply[0] == "ok" for reply in pool(4).run(failure_jobs.call_checked, agreeing, backward=True))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("viewed", ["every rank", "rank 1 only"])
def test_stride_two_views_with_sizes(pool, world_size, viewed):
    """A stride-2 input of all_gather and a stride-2 cotangent of reduce_scatter's backward,
    with sizes, give the reference's values and gradients on every rank (no raw RuntimeError, and no rank
    left waiting when only some ranks hold views)."""
    views = tuple(range(world_size)) if viewed == "every rank" else (1,)
    replies = pool(world_size).run(uneven_jobs.strided_views, views, timeout=30.0)
    assert replies == [[0.0, 0.0, 0.0, 0.0]] * world_size, replies
