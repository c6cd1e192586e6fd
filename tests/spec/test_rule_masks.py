"""Mask rules on global positions (`commlib.masks.BlockCausal`, `SlidingWindow`) in the spec: the dense mask is
the rule's definition, the block-pair classification is exact, the
ring's walk on W simulated ranks equals the float64 reference for every rule, layout and length, and the ring's
plan schedules fewer pieces for a sliding window; bad rules are refused by the layer's name."""

import itertools

import numpy as np
import pytest

from commlib import CommError, SequenceLayout, segment_ids
from commlib.attention import ulysses_plan
from commlib.masks import BlockCausal, SlidingWindow, check_mask, position_runs, rule_mask
from commlib.reference.ring import reference, simulate_ring
from commlib.ring import pieces_computed, ring_plan
from tests import rule_mask_cases as rules


def test_dense_masks_are_the_definitions():
    """BlockCausal(b): j // b <= i // b; SlidingWindow(w): i - w < j <= i (transformers 5.x's
    ``sliding_window_causal_mask_function``: ``kv_idx > q_idx - sliding_window`` and causal)."""
    positions = np.arange(23)
    i, j = positions[:, None], positions[None, :]
    for block in (1, 2, 5, 30):
        assert np.array_equal(BlockCausal(block).visible(positions, positions), j // block <= i // block)
    for window in (1, 3, 8, 40):
        assert np.array_equal(SlidingWindow(window).visible(positions, positions), (j > i - window) & (j <= i))


@pytest.mark.parametrize("rule", [BlockCausal(1), BlockCausal(3), BlockCausal(7), SlidingWindow(1), SlidingWindow(4)])
@pytest.mark.parametrize("causal", [False, True])
def test_classification_is_exact(rule, causal):
    """Every pair of position ranges up to 12 long in [0, 20): "none" / "all" / "some" as the dense mask says."""
    ranges = [(start, stop) for start in range(0, 20, 3) for stop in range(start + 1, min(start + 12, 20) + 1, 2)]
    for q_run, k_run in itertools.product(ranges, ranges):
        dense = rule_mask(np.arange(*q_run), np.arange(*k_run), causal, rule)
        want = "none" if not dense.any() else "all" if dense.all() else "some"
        assert rule.classify(q_run, k_run, causal=causal) == want, (q_run, k_run)


def test_position_runs():
    """A zigzag block holds two runs; padding rows belong to none."""
    assert position_runs(np.array([2, 3, 12, 13, -1])) == ((0, 2, 2), (2, 4, 12))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["contiguous", "zigzag"])
@pytest.mark.parametrize("seq", rules.SEQ)
def test_simulated_ring_equals_the_reference(world_size, name, seq):
    """The ring's walk on W float64 numpy ranks (`simulate_ring`), every rule, causal and not, with and
    without segment ids: within 1e-12 of the unsharded reference on every rank."""
    layout = SequenceLayout(seq, ring_size=world_size, layout=name)
    whole = rules.whole_inputs(seq, seed=world_size)
    shards = [layout.shard(x, 1) for x in whole]
    ids = np.stack([segment_ids([9, 11, 10], seq), segment_ids([seq - 6], seq)])
    id_shards = [x[..., 0, 0] for x in layout.shard(ids[..., None, None], 1)]
    for rule, causal, segmented in itertools.product(rules.RULES, (False, True), (False, True)):
        plan = ring_plan(
            shards[0][0].shape,
            shards[1][0].shape,
            shards[2][0].shape,
            world_size,
            causal=causal,
            layout=layout,
            dtypes=("float64",) * 3,
            shard=0,
            mask=rule,
            segment_ids=((2, shards[0][0].shape[1]), "int64") if segmented else None,
        )
        got = simulate_ring(plan, *shards, segment_ids=id_shards if segmented else None)
        want = reference(
            *shards, world_size, causal=causal, layout=layout, mask=rule, segment_ids=id_shards if segmented else None
        )
        for parts, references in zip(got, want, strict=True):
            for part, expected in zip(parts, references, strict=True):
                assert np.abs(part - expected).max(initial=0.0) < 1e-12, (rule, causal, segmented)


def test_sliding_window_schedules_fewer_scores():
    """W = 4, S = 256, zigzag (chunks of 32; rank r holds chunks r and 7 - r), causal, a window of 16: after the
    own blocks (4 x 64 x 64 score entries) only the chunks next to a rank's own are seen, partly -- chunk pairs
    (1, 0), (2, 1), (3, 2) as 32 x 32 pieces at step 1, (4, 3)-(5, 4) and (6, 5)-(7, 6) at step 1 and 3 -- and
    step 2 (the blocks two ranks away) is skipped on every rank: 8192 entries after step 0 against the causal
    schedule's 24576; contiguous, a window of half a block: 7 of the causal schedule's 10 pieces."""

    def scores(plan, steps):
        return sum(
            (piece.q[1] - piece.q[0]) * (piece.kv[1] - piece.kv[0])
            for step in steps
            for case in plan.case_index[step]
            for piece in plan.cases[case]
        )

    shape = (1, 64, 2, 4)
    causal = ring_plan(shape, shape, shape, 4, causal=True, layout="zigzag")
    window = ring_plan(shape, shape, shape, 4, causal=True, layout="zigzag", mask=SlidingWindow(16))
    assert scores(window, [0]) == scores(causal, [0]) == 4 * 64 * 64
    assert (scores(window, [1, 2, 3]), scores(causal, [1, 2, 3])) == (8192, 24576)
    assert scores(window, [2]) == 0
    contiguous = ring_plan((1, 16, 2, 4), (1, 16, 2, 4), (1, 16, 2, 4), 4, causal=True, mask=SlidingWindow(8))
    assert pieces_computed(contiguous, None) == (7, 7)


@pytest.mark.parametrize(
    ("rule", "error", "text"),
    [
        (BlockCausal(0), CommError, "mask BlockCausal's block_size (0) must be >= 1"),
        (SlidingWindow(-2), CommError, "mask SlidingWindow's window (-2) must be >= 1"),
        (BlockCausal(True), TypeError, "mask BlockCausal's block_size must be an int, not bool"),
        (lambda i, j: j <= i, TypeError, "mask must be a commlib.masks.MaskRule"),
    ],
)
def test_bad_rules_name_the_layer(rule, error, text):
    shape = (1, 4, 2, 4)
    with pytest.raises(error, match="^ring_attention: " + text.replace("(", r"\(").replace(")", r"\)")):
        ring_plan(shape, shape, shape, 2, mask=rule)
    with pytest.raises(error, match="^ulysses_attention: " + text.replace("(", r"\(").replace(")", r"\)")):
        ulysses_plan(shape, shape, shape, 2, rank=0, mask=rule)
    with pytest.raises(error, match=r"^usp_attention: "):
        check_mask("usp_attention", rule, {})
