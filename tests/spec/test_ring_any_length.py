"""`commlib.ring` for any length (a `commlib.SequenceLayout`): the plan (even lengths keep the string's plan;
uneven ones walk padded shards with masks from global positions), the masks against their definition, and the
schedule walked by `simulate_ring` on W simulated numpy ranks against unsharded float64 attention, with empty
shards, GQA, causal and not, USP pieces; bad layouts refused by name before anything runs."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import CommError, SequenceLayout
from commlib import attention as A
from commlib.blockwise import NUMPY, attend, merge_masked
from commlib.reference.ring import reference, simulate_ring
from commlib.ring import USP_OP, ring_plan
from commlib.sequence import SEQUENCE_LAYOUTS, ulysses_seq_sizes

TOLERANCE = 1e-10


@st.composite
def _layouts(draw):
    """A SequenceLayout of any length (1-40) over R 1-4 ring and U 1-2 Ulysses ranks."""
    ring_size, ulysses_size = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    return SequenceLayout(
        draw(st.integers(1, 40)),
        ring_size=ring_size,
        ulysses_size=ulysses_size,
        layout=draw(st.sampled_from(SEQUENCE_LAYOUTS)),
    )


def _plan(layout, causal, heads=4, kv_heads=2, shard=None):
    shape = (2, layout.max_size if shard is None else layout.sizes[shard])
    op_name = USP_OP if layout.ulysses_size > 1 else "ring_attention"
    return ring_plan(
        (*shape, heads, 3),
        (*shape, kv_heads, 3),
        (*shape, kv_heads, 2),
        layout.ring_size,
        causal=causal,
        layout=layout,
        dtypes=("float64",) * 3,
        ulysses_size=layout.ulysses_size,
        op_name=op_name,
        shard=shard,
    )


@given(_layouts(), st.booleans())
def test_even_lengths_keep_the_string_plan(layout, causal):
    """A length the layout string cuts evenly: the string's plan, no masks; else masked over U * max_size rows."""
    plan = _plan(layout, causal)
    unit = layout.world_size * (2 if layout.layout == "zigzag" else 1)
    assert plan.masked == bool(layout.seq_len % unit)
    if not plan.masked:
        string = ring_plan(
            *((2, layout.max_size, n, d) for n, d in ((4, 3), (2, 3), (2, 2))),
            layout.ring_size,
            causal=causal,
            layout=layout.layout,
            dtypes=("float64",) * 3,
            ulysses_size=layout.ulysses_size,
            op_name=plan.op_name,
        )
        assert plan == string
    else:
        assert plan.rows == layout.ulysses_size * layout.max_size and plan.shared_case == (0,) * layout.ring_size


@given(_layouts(), st.booleans())
def test_masks_are_the_causal_mask_at_global_positions(layout, causal):
    """Every (step, rank): the mask is the causal mask (or all True) between the real rows of the q block and of
    the kv block the rank holds, False on padding; the blocks' real rows are the layout's shards, in order."""
    plan = _plan(layout, causal)
    if not plan.masked:
        return
    for block in range(layout.ring_size):
        shards = range(block * layout.ulysses_size, (block + 1) * layout.ulysses_size)
        held = plan.positions(block)
        assert held[held >= 0].tolist() == np.concatenate([layout.positions(i) for i in shards]).tolist()
    for step in range(layout.ring_size):
        masks = plan.key_masks(step)
        for rank in range(layout.ring_size):
            q_pos, kv_pos = plan.positions(rank), plan.positions(plan.kv_block(step, rank))
            real = (q_pos >= 0)[:, None] & (kv_pos >= 0)[None, :]
            visible = A.causal_mask(q_pos, kv_pos) if causal else np.ones_like(real)
            np.testing.assert_array_equal(masks[rank], real & visible)


@given(_layouts(), st.booleans(), st.sampled_from([(4, 2), (2, 2), (2, 1)]), st.integers(0, 2**16))
def test_simulated_ring_equals_attention(layout, causal, heads, seed):
    """The ring over ring blocks of uneven pieces (the heads one Ulysses rank attends with) equals unsharded
    attention: outputs and dq/dk/dv of every shard, padding inputs ignored."""
    rng = np.random.default_rng(seed)
    heads, kv_heads = heads
    shapes = dict(
        q=(2, layout.seq_len, heads, 3),
        k=(2, layout.seq_len, kv_heads, 3),
        v=(2, layout.seq_len, kv_heads, 2),
        cotangent=(2, layout.seq_len, heads, 2),
    )
    shards = [layout.shard(rng.standard_normal(shape), 1) for shape in shapes.values()]
    padded = [
        [np.concatenate([x, np.full((2, layout.max_size - x.shape[1], *x.shape[2:]), np.nan)], axis=1) for x in xs]
        for xs in shards
    ]
    plan = _plan(layout, causal, heads * layout.ulysses_size, kv_heads * layout.ulysses_size)
    if not plan.masked and layout.ulysses_size > 1:
        return  # an even USP plan walks ring blocks, not shards (tests/spec/test_ring.py)
    got = simulate_ring(plan, *padded)
    want = reference(*shards, layout.ring_size, causal=causal, layout=layout)
    for gs, ws in zip(got, want, strict=True):
        for g, w in zip(gs, ws, strict=True):
            assert g.shape == w.shape and float(np.max(np.abs(g - w), initial=0.0)) <= TOLERANCE


def test_a_row_that_sees_no_key_is_zero():
    """A bool mask that hides every key of a row: output 0, LSE -inf, and merging two such stays 0 (no NaN)."""
    q = k = v = np.ones((1, 2, 1, 1))
    mask = np.array([[True, False], [False, False]])
    out, lse = attend(NUMPY, q, k, v, 1.0, mask)
    assert out[0, 1, 0, 0] == 0 and lse[0, 1, 0] == -np.inf and np.isfinite(out).all()
    merged, total = merge_masked(NUMPY, out, lse, out, lse)
    assert merged[0, 1, 0, 0] == 0 and total[0, 1, 0] == -np.inf and np.isfinite(merged).all()


def test_bad_layouts_are_refused_by_name():
    shape = (1, 3, 2, 3)
    with pytest.raises(
        CommError,
        match=r"^ring_attention: layout.ring_size \(2\) must be the ring group's world "
        r"size \(4\)\. Received: ",
    ):
        ring_plan(shape, shape, shape, 4, layout=SequenceLayout(9, ring_size=2))
    with pytest.raises(CommError, match=r"^usp_attention: layout.ulysses_size \(1\) must be the Ulysses group's"):
        ring_plan(shape, shape, shape, 2, layout=SequenceLayout(9, ring_size=2), ulysses_size=2, op_name=USP_OP)
    with pytest.raises(CommError, match=r"seq \(3\) must be layout.sizes\[3\] \(2\)"):
        ring_plan(shape, shape, shape, 4, layout=SequenceLayout(9, ring_size=4), shard=3)
    with pytest.raises(CommError, match=r"seq \(3\) must be layout.max_size \(4\)"):
        ring_plan(shape, shape, shape, 3, layout=SequenceLayout(10, ring_size=3))


def test_ulysses_layout_is_seq_sizes():
    assert ulysses_seq_sizes("u", SequenceLayout(5, ulysses_size=4), None, 4) == (2, 1, 1, 1)
    assert ulysses_seq_sizes("u", SequenceLayout(3, ring_size=4), [1, 1, 1, 0], 4) == (1, 1, 1, 0)
    assert ulysses_seq_sizes("u", "contiguous", [3, 2], 2) == [3, 2]
    with pytest.raises(CommError, match=r"^u: layout \('zigzag'\) must be 'contiguous' or a SequenceLayout"):
        ulysses_seq_sizes("u", "zigzag", None, 2)
    with pytest.raises(CommError, match=r"^u: layout must hold the sequence in rank order"):
        ulysses_seq_sizes("u", SequenceLayout(8, ring_size=2, layout="zigzag"), None, 2)
    with pytest.raises(CommError, match=r"^u: seq_sizes \(\[2, 3\]\) must be layout.sizes \(\(3, 2\)\)"):
        ulysses_seq_sizes("u", SequenceLayout(5, ulysses_size=2), [2, 3], 2)
    with pytest.raises(TypeError, match=r"^u: layout must be a str or a commlib.SequenceLayout, not int"):
        ulysses_seq_sizes("u", 3, None, 2)
