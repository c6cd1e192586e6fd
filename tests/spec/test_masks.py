"""Segment masks in the spec: `commlib.segment_ids`, the float64 reference with segment masks against
attention run document by document (forward and VJP, causal, GQA), padding rows exactly 0 with gradient 0, the
ring's walk with segment ids on W simulated ranks against the reference (hypothesis: random lengths, W 1-4,
every layout), the skip rule's count, the validation of ``segment_ids``, and the NaN / -inf rules of a piece."""

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import commlib
from commlib import CommError, SequenceLayout
from commlib.attention import attention, attention_vjp, ulysses_plan
from commlib.blockwise import NUMPY, attend
from commlib.masks import segment_mask
from commlib.reference.ring import SimulatedRanks, _ring_ids, simulate_ring
from commlib.ring import pieces_computed, ring_plan
from commlib.sequence import SEQUENCE_LAYOUTS
from tests import mask_cases as masks


def test_segment_ids():
    """Document j's tokens get id j in order, the rest -1; empty documents take an id and no token."""
    assert commlib.segment_ids([3, 0, 2], 7).tolist() == [0, 0, 0, 2, 2, -1, -1]
    assert commlib.segment_ids([], 2).tolist() == [-1, -1]
    assert commlib.segment_ids([4], 4).dtype == np.int32


@pytest.mark.parametrize(
    ("lengths", "seq_len", "error", "message"),
    [
        (
            [3, 2],
            4,
            CommError,
            "segment_ids: sum(lengths) (5) must be <= seq_len (4). Received: lengths=[3, 2], seq_len=4",
        ),
        ([3, -1], 4, CommError, "segment_ids: lengths[1] (-1) must be >= 0. Received: lengths=[3, -1], seq_len=4"),
        ([1.5], 4, TypeError, "segment_ids: lengths[] must be an int, not float. Received: lengths=[1.5], seq_len=4"),
        ([True], 4, TypeError, "segment_ids: lengths[] must be an int, not bool. Received: lengths=[True], seq_len=4"),
        ([1], 4.0, TypeError, "segment_ids: seq_len must be an int, not float. Received: lengths=[1], seq_len=4.0"),
        (3, 4, TypeError, "segment_ids: lengths must be a sequence of ints, not int. Received: lengths=3, seq_len=4"),
        ([1], -1, CommError, "segment_ids: seq_len (-1) must be >= 0. Received: lengths=[1], seq_len=-1"),
    ],
)
def test_segment_ids_errors(lengths, seq_len, error, message):
    with pytest.raises(error) as raised:
        commlib.segment_ids(lengths, seq_len)
    assert str(raised.value) == message


def _per_document(whole, ids, causal):
    """out, dq, dk, dv of attention run on each document alone (padding rows: zeros)."""
    q, k, v, _ = whole
    results = [np.zeros_like(x) for x in (q, q, k, v)]
    for b in range(q.shape[0]):
        for document in np.unique(ids[b][ids[b] >= 0]):
            rows = np.flatnonzero(ids[b] == document)
            parts = [x[b : b + 1, rows] for x in whole]
            values = [attention(*parts[:3], causal=causal), *attention_vjp(*parts, causal=causal)]
            for result, value in zip(results, values, strict=True):
                result[b, rows] = value[0]
    return results


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_reference_is_attention_per_document(causal, kv_heads):
    """The handed rows (GQA, MQA, MHA): the masked reference equals attention on each document alone, values and
    gradients; padding rows output exactly 0 and have dq exactly 0."""
    batch, seq, heads, _, dim = masks.HANDED_SHAPE
    whole, ids = masks.whole_inputs(batch, seq, heads, kv_heads, dim), masks.handed_ids()
    got, want = masks.expected(whole, ids, causal), _per_document(whole, ids, causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=name)
    padding = ids < 0
    assert np.all(got[0][padding] == 0) and np.all(got[1][padding] == 0)


def test_reference_vjp_finite_differences():
    """The masked VJP against central differences (float64), causal GQA with a padding tail."""
    whole = masks.whole_inputs(1, 7, 4, 2, 3, seed=1)
    ids = commlib.segment_ids([3, 2], 7)[None]
    grads = attention_vjp(*whole, causal=True, q_segments=ids)
    for index, name in enumerate("qkv"):
        x = whole[index]
        numeric = np.zeros_like(x)
        for position in np.ndindex(x.shape):
            shifted = []
            for sign in (1, -1):
                moved = [y.copy() for y in whole[:3]]
                moved[index][position] += sign * 1e-6
                shifted.append((attention(*moved, causal=True, q_segments=ids) * whole[3]).sum())
            numeric[position] = (shifted[0] - shifted[1]) / 2e-6
        np.testing.assert_allclose(grads[index], numeric, rtol=0, atol=1e-7, err_msg=name)


@st.composite
def _problem(draw):
    """Random documents (some shorter than a shard, some crossing shards, a padding tail) in a random layout of
    R 1-4 ranks; any length, or the layout string's even length."""
    ring_size = draw(st.integers(1, 4))
    layout_name = draw(st.sampled_from(SEQUENCE_LAYOUTS))
    seq = draw(st.integers(1, 33))
    lengths = [draw(st.lists(st.integers(0, 9), max_size=6)) for _ in range(2)]
    ids = np.stack([commlib.segment_ids(row[: _fit(row, seq)], seq) for row in lengths])
    return SequenceLayout(seq, ring_size=ring_size, layout=layout_name), ids, draw(st.booleans())


def _fit(lengths, seq):
    """How many leading `lengths` fit in `seq` tokens."""
    return int(np.searchsorted(np.cumsum(lengths), seq, side="right"))


@given(_problem())
def test_ring_walk_with_segments_is_the_reference(problem):
    """The ring walked on simulated ranks with segment ids (every block's, gathered once) equals the masked reference on
    every shard, values and gradients within 1e-10; the ranks' computed pieces are `pieces_computed`'s count."""
    layout, ids, causal = problem
    whole = masks.whole_inputs(2, layout.seq_len, 4, 2, 3)
    shape = (2, layout.sizes[0])
    plan = ring_plan(
        (*shape, 4, 3),
        (*shape, 2, 3),
        (*shape, 2, 3),
        layout.ring_size,
        causal=causal,
        layout=layout,
        dtypes=("float64",) * 3,
        shard=0,
        segment_ids=(shape, "int32"),
    )
    assert plan.segmented
    id_shards = masks.shards(ids, layout)
    got = simulate_ring(plan, *(masks.shards(x, layout) for x in whole), segment_ids=id_shards)
    assert masks.worst_error(list(got), masks.expected(whole, ids, causal), layout) < masks.TOLERANCE
    ranks = SimulatedRanks(plan)
    blocks = _ring_ids(plan, id_shards)
    from commlib import ring

    q = np.zeros((layout.ring_size * 2, plan.rows, 4, 3))
    ring.forward(plan, ranks, q, q[:, :, :2], q[:, :, :2], blocks)
    computed, scheduled = pieces_computed(plan, blocks.reshape(layout.ring_size, 2, -1))
    step0 = layout.ring_size  # step 0's first piece is always computed, not counted by the backend's skip
    assert int(ranks.computed.sum()) + step0 == computed <= scheduled


def test_documents_of_an_eighth_skip_pieces():
    """W = 4, S = 64, causal contiguous, documents of 8 tokens (1/8 of the sequence): only the pieces on the
    diagonal are computed, 4 of the schedule's 10."""
    ids = np.repeat(np.arange(8), 8)[None]
    plan = ring_plan((1, 16, 2, 4), (1, 16, 2, 4), (1, 16, 2, 4), 4, causal=True, segment_ids=((1, 16), "int64"))
    layout = SequenceLayout(64, ring_size=4)
    blocks = np.stack(masks.shards(ids, layout))
    assert pieces_computed(plan, blocks) == (4, 10)
    assert pieces_computed(plan, None) == (10, 10)


@pytest.mark.parametrize("build", ["ring", "ulysses"])
@pytest.mark.parametrize(
    ("shape", "dtype", "error", "text"),
    [
        ((2, 5), "float32", TypeError, "segment_ids dtype (float32) must be an integer dtype"),
        ((2, 5), "bool", TypeError, "segment_ids dtype (bool) must be an integer dtype"),
        ((2, 4), "int32", CommError, "segment_ids shape (2, 4) must be q's [batch, seq] (2, 5)"),
        ((1, 5), "int64", CommError, "segment_ids shape (1, 5) must be q's [batch, seq] (2, 5)"),
        ((2, 5, 1), "int64", CommError, "segment_ids shape (2, 5, 1) must be q's [batch, seq] (2, 5)"),
    ],
)
def test_segment_ids_are_validated(build, shape, dtype, error, text):
    """Wrong shape / non-integer dtype: the layer's name, the argument, what was expected and received."""
    shapes = ((2, 5, 4, 3), (2, 5, 2, 3), (2, 5, 2, 3))
    builder = ring_plan if build == "ring" else functools.partial(ulysses_plan, rank=0)
    with pytest.raises(error) as raised:
        builder(*shapes, 2, dtypes=("float64",) * 3, segment_ids=(shape, dtype))
    op = "ring_attention" if build == "ring" else "ulysses_attention"
    message = str(raised.value)
    assert message.startswith(f"{op}: {text}. Received: ") and f"segment_ids_shape={shape}" in message


def test_segment_mask():
    """Equal ids see each other; padding (negative) sees and is seen by nothing."""
    ids = np.array([0, 0, 1, -1, -1])
    assert segment_mask(ids, ids).astype(int).tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]


def test_piece_nan_and_all_minus_inf_rows():
    """A piece's rules: a NaN in q gives a NaN row (and LSE); a row whose every score is -inf outputs exactly 0
    with LSE -inf, under a named mask as under an array."""
    q, k = np.ones((1, 3, 1, 2)), np.ones((1, 4, 1, 2))
    q[0, 0, 0, 0] = np.nan
    q[0, 1, 0] = [-np.inf, 0.0]
    for mask in ("full", np.ones((3, 4), dtype=bool)):
        out, lse = attend(NUMPY, q, k, k, 1.0, mask)
        assert np.all(np.isnan(out[0, 0])) and np.isnan(lse[0, 0, 0])
        assert np.all(out[0, 1] == 0) and lse[0, 1, 0] == -np.inf
        assert np.all(np.isfinite(out[0, 2]))
