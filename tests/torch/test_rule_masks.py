"""Mask rules on global positions (``mask=``: `commlib.masks.BlockCausal`, `SlidingWindow`) in
`ulysses_attention`, `ring_attention` and `usp_attention` on real gloo ranks: every rank's output and dq/dk/dv
within 1e-10 of the unsharded float64 reference, W = 1-4, both ring layouts, even and uneven lengths, USP 2 x 2,
with and without causal and segment ids; the pieces the ring skips for a sliding window; bad rules refused by
name on every rank before communicating."""

import numpy as np
import pytest
import torch

from commlib import SequenceLayout
from commlib.masks import BlockCausal, SlidingWindow, rule_mask, segment_ids
from commlib.ring import pieces_computed, ring_plan
from tests import mask_cases as masks
from tests import rule_mask_cases as rules
from tests.torch import mask_jobs as jobs


def _per_rank(replies: list, index: int) -> tuple[list, int]:
    """Case `index` of every rank's `rule_sweep` reply: ``[out, dq, dk, dv]`` as lists over ranks, pieces."""
    values = [reply[index][0] for reply in replies]
    return [list(parts) for parts in zip(*values, strict=True)], sum(reply[index][1] for reply in replies)


def test_sliding_window_is_transformers():
    """`SlidingWindow(w)` is transformers' own sliding-window mask (``sliding_window_causal_mask_function``,
    read on 5.x: ``kv_idx > q_idx - sliding_window`` and causal), position by position."""
    masking = pytest.importorskip("transformers.masking_utils")
    function = masking.sliding_window_causal_mask_function(4)
    index = torch.arange(12)
    want = function(torch.tensor(0), torch.tensor(0), index[:, None], index[None, :]).numpy()
    assert np.array_equal(rule_mask(np.arange(12), np.arange(12), False, SlidingWindow(4)), want)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rules_in_every_layer(pool, world_size):
    """Every setting of `rules.settings` (ring contiguous / zigzag at S = 37 and 40, Ulysses, USP 2 x 2 at W = 4)
    with each rule of `rules.RULES`, causal and not: within 1e-10 on every rank (outputs, dq, dk, dv)."""
    failed, count = [], 0
    for op, layout, name in rules.settings(world_size):
        whole = rules.whole_inputs(layout.seq_len, seed=world_size)
        replies = pool(layout.world_size).run(jobs.rule_sweep, op, layout, name, whole, rules.RULES)
        cases = [(rule, causal) for rule in rules.RULES for causal in (False, True)]
        for index, (rule, causal) in enumerate(cases):
            got, _ = _per_rank(replies, index)
            error = masks.worst_error(got, rules.expected(whole, causal, rule), layout)
            count += 1
            if not error < masks.TOLERANCE:
                failed.append(f"{op} {layout} {rule} causal={causal}: {error:.2e}")
    assert count and not failed, "\n".join(failed)


def test_rules_with_segment_ids(pool):
    """A rule ANDed with packed documents and padding: ring zigzag at S = 37 and USP 2 x 2, W = 4."""
    ids = np.stack([segment_ids([9, 11, 15], 37), segment_ids([30], 37)])
    whole = rules.whole_inputs(37, seed=7)
    failed = []
    for op, layout in [
        ("ring_attention", SequenceLayout(37, ring_size=4, layout="zigzag")),
        ("usp_attention", SequenceLayout(37, ring_size=2, ulysses_size=2)),
        ("ulysses_attention", SequenceLayout(37, ulysses_size=4)),
    ]:
        replies = pool(4).run(jobs.rule_sweep, op, layout, layout, whole, rules.RULES, ids)
        for index, (rule, causal) in enumerate((rule, causal) for rule in rules.RULES for causal in (False, True)):
            got, _ = _per_rank(replies, index)
            error = masks.worst_error(got, rules.expected(whole, causal, rule, ids), layout)
            if not error < masks.TOLERANCE:
                failed.append(f"{op} {layout} {rule} causal={causal}: {error:.2e}")
    assert not failed, "\n".join(failed)


def test_sliding_window_skips_pieces(pool):
    """W = 4, S = 64, contiguous, causal: a window of 8 (half a block) leaves 7 pieces to the ranks' forwards
    (4 own blocks, 3 previous blocks; `commlib.ring.pieces_computed` of the plan says the same), against the
    causal schedule's 10; the values stay within 1e-10."""
    layout = SequenceLayout(64, ring_size=4)
    whole = masks.whole_inputs(2, 64, 4, 2, 8)
    window = SlidingWindow(8)
    replies = pool(4).run(jobs.rule_sweep, "ring_attention", layout, "contiguous", whole, [window])
    got, attended = _per_rank(replies, 1)  # causal
    plan = ring_plan((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8), 4, causal=True, mask=window)
    assert attended == pieces_computed(plan, None)[0] == 7
    assert masks.worst_error(got, rules.expected(whole, True, window), layout) < masks.TOLERANCE
    causal_only = ring_plan((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8), 4, causal=True)
    assert pieces_computed(causal_only, None)[0] == 10


@pytest.mark.parametrize("op", ["ulysses_attention", "ring_attention", "usp_attention"])
@pytest.mark.parametrize(
    ("rule", "text"),
    [
        (BlockCausal(0), "CommError: {op}: mask BlockCausal's block_size (0) must be >= 1"),
        (SlidingWindow(0), "CommError: {op}: mask SlidingWindow's window (0) must be >= 1"),
        (SlidingWindow(2.5), "TypeError: {op}: mask SlidingWindow's window must be an int, not float"),
        (
            "causal",
            "TypeError: {op}: mask must be a commlib.masks.MaskRule (BlockCausal, SlidingWindow) or None, not str",
        ),
    ],
)
def test_bad_rules(pool, op, rule, text):
    """The same text on every rank, naming the layer and the argument, raised before communicating."""
    texts = set(pool(4).run(jobs.rejected_rule, op, rule))
    assert len(texts) == 1
    message = texts.pop()
    assert message.startswith(text.format(op=op) + ". Received: "), message
