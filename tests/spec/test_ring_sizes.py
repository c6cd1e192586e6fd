"""Per-rank sizes: ``SequenceLayout(..., seq_sizes=...)`` (shard i holds the run ``[offset_i, offset_i +
seq_sizes[i])``), its validation by name before anything runs, the ring plans it gives (the string's plan where
the sizes are the even rule's, else masked from global positions), and the ring walked on W simulated numpy ranks
against the unsharded float64 masked reference, with causal masks, segment ids and empty shards."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import CommError, SequenceLayout
from commlib.reference.ring import simulate_ring
from commlib.ring import USP_OP, ring_plan
from commlib.sequence import ulysses_seq_sizes
from tests import mask_cases as masks
from tests import sized_cases as sized


@st.composite
def _sized(draw):
    """A layout of per-rank sizes over R 1-4 ring and U 1-2 Ulysses ranks, entries 0-6 (one at least 1)."""
    ring_size, ulysses_size = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    sizes = draw(st.lists(st.integers(0, 6), min_size=ring_size * ulysses_size, max_size=ring_size * ulysses_size))
    sizes[draw(st.integers(0, len(sizes) - 1))] += 1
    return SequenceLayout(sum(sizes), ring_size=ring_size, ulysses_size=ulysses_size, seq_sizes=sizes)


def test_positions_are_runs_in_shard_order():
    """5 text + 5 image tokens on 2 ranks as 6 and 4 rows; USP's shard ``r * U + u`` holds the (r * U + u)-th run."""
    layout = SequenceLayout(10, ring_size=2, seq_sizes=[6, 4])
    assert layout.seq_sizes == (6, 4) and layout.sizes == (6, 4) and layout.max_size == 6
    assert [layout.positions(i).tolist() for i in range(2)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    usp = SequenceLayout(7, ring_size=2, ulysses_size=2, seq_sizes=(3, 0, 4, 0))
    assert [usp.positions(i).tolist() for i in range(4)] == [[0, 1, 2], [], [3, 4, 5, 6], []]
    x = np.arange(20).reshape(2, 10)
    assert np.array_equal(layout.unshard(layout.shard(x, 1), 1), x)
    assert np.array_equal(layout.unshard(layout.shard(x, 1, padded=True), 1, padded=True), x)


def test_sizes_are_part_of_the_layout():
    """Hashable, equal only with the same sizes, shown in the repr only when given; the even rule's sizes name
    the even layout (the attention layers then take the string's plan)."""
    given_sizes = SequenceLayout(10, ring_size=2, seq_sizes=(6, 4))
    assert given_sizes != SequenceLayout(10, ring_size=2) and hash(given_sizes) == hash(
        SequenceLayout(10, ring_size=2, seq_sizes=[6, 4])
    )
    assert repr(given_sizes).endswith("layout='contiguous', seq_sizes=(6, 4))")
    assert repr(SequenceLayout(10, ring_size=2)) == (
        "SequenceLayout(seq_len=10, ring_size=2, ulysses_size=1, layout='contiguous')"
    )
    assert SequenceLayout(10, ring_size=2, seq_sizes=(5, 5)).names_even and not given_sizes.names_even
    shape = (1, 5, 2, 3)
    even = ring_plan(shape, shape, shape, 2, layout=SequenceLayout(10, ring_size=2, seq_sizes=(5, 5)), shard=0)
    assert not even.masked and even == ring_plan(shape, shape, shape, 2)
    assert ring_plan((1, 6, 2, 3), (1, 6, 2, 3), (1, 6, 2, 3), 2, layout=given_sizes, shard=0).masked
    assert ulysses_seq_sizes("ulysses_attention", SequenceLayout(10, ulysses_size=2, seq_sizes=(6, 4)), None, 2) == (
        6,
        4,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        (dict(seq_sizes=(6, 3)), CommError, "sum(seq_sizes) (9) must equal seq_len (10)"),
        (dict(seq_sizes=(6, 4, 0)), CommError, "len(seq_sizes) (3) must equal world_size (2)"),
        (dict(seq_sizes=(11, -1)), CommError, "seq_sizes[1] (-1) must be >= 0"),
        (dict(seq_sizes=(5, 5), layout="zigzag"), CommError, "seq_sizes needs layout 'contiguous'"),
        (dict(seq_sizes=(5.0, 5)), TypeError, "seq_sizes must be a sequence of ints"),
        (dict(seq_sizes=(True, 9)), TypeError, "seq_sizes must be a sequence of ints"),
        (dict(seq_sizes=10), TypeError, "seq_sizes must be a sequence of ints"),
    ],
)
def test_bad_sizes_are_refused_by_name(kwargs, error, text):
    with pytest.raises(error) as raised:
        SequenceLayout(10, ring_size=2, **kwargs)
    assert str(raised.value).startswith(f"SequenceLayout: {text}") and "Received: seq_len=10" in str(raised.value)


def test_rows_other_than_the_sizes_are_refused_by_the_plan():
    """torch (exact): rank r's rows must be ``seq_sizes[r]``; JAX (padded): ``max_size``; both numbers named."""
    layout = SequenceLayout(10, ring_size=2, seq_sizes=(6, 4))
    with pytest.raises(CommError, match=r"^ring_attention: seq \(6\) must be layout.sizes\[1\] \(4\)\. Received"):
        ring_plan((1, 6, 2, 3), (1, 6, 2, 3), (1, 6, 2, 3), 2, layout=layout, shard=1)
    with pytest.raises(CommError, match=r"^ring_attention: seq \(4\) must be layout.max_size \(6\)\. Received"):
        ring_plan((1, 4, 2, 3), (1, 4, 2, 3), (1, 4, 2, 3), 2, layout=layout)


def _simulated_error(layout, causal, ids, seed):
    whole = masks.whole_inputs(2, layout.seq_len, 2 * layout.ulysses_size, layout.ulysses_size, 3, seed=seed)
    shape = (2, layout.max_size)
    op_name = USP_OP if layout.ulysses_size > 1 else "ring_attention"
    plan = ring_plan(
        (*shape, 2 * layout.ulysses_size, 3),
        *((*shape, layout.ulysses_size, 3),) * 2,
        layout.ring_size,
        causal=causal,
        layout=layout,
        dtypes=("float64",) * 3,
        ulysses_size=layout.ulysses_size,
        op_name=op_name,
        segment_ids=None if ids is None else (shape, "int32"),
    )
    if not plan.masked and layout.ulysses_size > 1:
        return 0.0  # the even rule's sizes: the string's USP plan walks ring blocks (tests/spec/test_ring.py)
    # The ring walks USP's heads after the all-to-all: one Ulysses rank's q heads of each shard, here the first U.
    heads = [x[:, :, : (x.shape[2] // layout.ulysses_size)] for x in whole]
    shards = [masks.shards(x, layout) for x in heads]
    got = simulate_ring(plan, *shards, segment_ids=None if ids is None else masks.shards(ids, layout))
    return masks.worst_error(list(got), masks.expected(heads, ids, causal), layout)


@given(_sized(), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_simulated_ring_equals_attention(layout, causal, segmented, seed):
    """The ring over the runs of any per-rank sizes (empty shards included) equals unsharded attention: outputs and
    dq/dk/dv of every shard, causal and segment ids on global positions."""
    ids = sized.documents(layout.seq_len, seed) if segmented else None
    assert _simulated_error(layout, causal, ids, seed) < sized.TOLERANCE
