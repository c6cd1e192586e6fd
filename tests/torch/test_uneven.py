"""Uneven sizes on real gloo groups (the exact layout: rank r's tensor has sizes[r] rows, one all_to_all_single
with split sizes): the handed Ulysses case, hypothesis over every op with uneven sizes (zeros included,
W 1-4, float64, transposed inputs and cotangents) against the reference, two calls with other sizes in one
process, the exact layout's error text on every rank, and checked mode with ranks that disagree on sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import commlib_torch as cl
from commlib import CommError, plans, split_sizes
from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case
from tests.strategies import uneven_calls, uneven_case
from tests.torch import failure_jobs

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------


W, B, S, H, D = 4, 2, 63, 6, 3  # the handed uneven case


def _rows(full: torch.Tensor, sizes, dim: int, rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return full.narrow(dim, start, sizes[rank])


def handed_case(ctx, seed: int = 9):
    """Rank r holds X[:, s_r]: (2, 1) must return X[:, :, h_r], (1, 2) the input, and the gradient of
    sum(out * C[:, :, h_r]) must be C[:, s_r] (the reverse all-to-all of the cotangents). float64; returns this
    rank's max errors (output, round trip, gradient) and the output shape."""
    rng = np.random.default_rng(seed)
    X, C = (torch.from_numpy(rng.standard_normal((B, S, H, D))) for _ in range(2))
    seq, heads = split_sizes(S, W), split_sizes(H, W)
    x = _rows(X, seq, 1, ctx.rank).clone().requires_grad_()
    out = cl.all_to_all_4d(x, 2, 1, scatter_sizes=heads, gather_sizes=seq)
    back = cl.all_to_all_4d(out, 1, 2, scatter_sizes=seq, gather_sizes=heads)
    (out * _rows(C, heads, 2, ctx.rank)).sum().backward()
    errors = [
        (out - _rows(X, heads, 2, ctx.rank)).abs().max(),
        (back - x).abs().max(),
        (x.grad - _rows(C, seq, 1, ctx.rank)).abs().max(),
    ]
    return [float(error) for error in errors], tuple(out.shape)


def two_sizes_in_one_process(ctx):
    """The same ops twice in one process with other sizes (and shapes) each time: nothing is kept between
    calls. Returns, per call, whether this rank's result equals the slice of the whole tensor."""
    rank, equal = ctx.rank, []
    for seq_len, heads_n in ((10, 6), (7, 5), (10, 6)):
        seq, heads = split_sizes(seq_len, ctx.world_size), (0, *split_sizes(heads_n, ctx.world_size - 1))
        whole = torch.arange(2.0 * seq_len * heads_n * 3, dtype=torch.float64).reshape(2, seq_len, heads_n, 3)
        out = cl.all_to_all_4d(_rows(whole, seq, 1, rank), 2, 1, scatter_sizes=heads, gather_sizes=seq)
        equal.append(torch.equal(out, _rows(whole, heads, 2, rank)))
        equal.append(torch.equal(cl.all_gather(_rows(whole, seq, 1, rank), 1, sizes=seq), whole))
    return equal


def wrong_rows(ctx):
    """Every rank passes 2 rows where gather_sizes says otherwise: this rank's error text."""
    try:
        cl.all_to_all_4d(torch.zeros(1, 2, 4, 2), 2, 1, gather_sizes=(3, 3, 1, 1))
    except CommError as error:
        return str(error)
    return None


def _strided(rows: int, columns: int, rng, view: bool) -> torch.Tensor:
    """A float64 [rows, columns] tensor: a stride-2 view (``base[:, ::2]``) when `view`, else contiguous."""
    base = torch.from_numpy(rng.standard_normal((rows, 2 * columns)))
    return base[:, ::2] if view else base[:, ::2].contiguous()


def strided_views(ctx, views: tuple[int, ...], seed: int = 23):
    """``all_gather(x[:, ::2], dim=0, sizes=...)`` on the ranks in `views` (a contiguous x
    elsewhere) and ``reduce_scatter(..., sizes=...)`` whose backward gets a stride-2 cotangent there. Every rank
    draws every rank's tensors from one seed, so it knows the reference; returns this rank's max errors
    (all_gather value, its gradient, reduce_scatter value, its gradient)."""
    sizes, columns, rank = split_sizes(2 * ctx.world_size + 1, ctx.world_size), 3, ctx.rank
    rng = np.random.default_rng(seed)
    inputs = [_strided(n, columns, rng, r in views) for r, n in enumerate(sizes)]
    cotangents = [torch.from_numpy(rng.standard_normal((sum(sizes), columns))) for _ in sizes]
    wholes = [torch.from_numpy(rng.standard_normal((sum(sizes), columns))) for _ in sizes]
    small = [_strided(n, columns, rng, r in views) for r, n in enumerate(sizes)]
    x = inputs[rank].requires_grad_()
    gathered = cl.all_gather(x, 0, sizes=sizes)
    gathered.backward(cotangents[rank])
    start = sum(sizes[:rank])
    expected_grad = sum(c[start : start + sizes[rank]] for c in cotangents)
    whole = wholes[rank].clone().requires_grad_()
    scattered = cl.reduce_scatter(whole, 0, sizes=sizes)
    scattered.backward(small[rank])
    errors = [
        (gathered - torch.cat(inputs)).abs().max(),
        (x.grad - expected_grad).abs().max(),
        (scattered - sum(wholes)[start : start + sizes[rank]]).abs().max(),
        (whole.grad - torch.cat(small)).abs().max(),
    ]
    return [float(error) for error in errors]


# --- the tests ----------------------------------------------------------------------------------------------


pytestmark = pytest.mark.timeout(120)


def test_handed_case(pool):
    replies = pool(4).run(handed_case)
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
    assert pool(3).run(two_sizes_in_one_process) == [[True] * 6] * 3


def test_a_sharded_dim_that_is_not_the_ranks_size_raises_the_spec_text_on_that_rank(pool):
    replies = pool(4).run(wrong_rows)
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
    replies = pool(world_size).run(strided_views, views, timeout=30.0)
    assert replies == [[0.0, 0.0, 0.0, 0.0]] * world_size, replies
