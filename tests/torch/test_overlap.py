"""The ring's overlap (DESIGN "Overlap") on real gloo ranks: `ring_attention` and
`usp_attention` with step t+1's k/v (and segment ids) sent asynchronously while step t computes give the same
outputs and dq/dk/dv, bit for bit, as the sequential order (each send completed before the step's pieces) --
W = 2-4, contiguous and zigzag, causal or not, segment ids, uneven `SequenceLayout`\\ s, float32 and bfloat16,
GQA with ``D_v != D`` -- and the overlapped calls do send asynchronously."""

import numpy as np
import pytest

from commlib import SequenceLayout, segment_ids
from tests import mask_cases as masks
from tests.torch import overlap_jobs as jobs

#: (op, SequenceLayout, the layout the call is given, causal, segment ids, dtype)
CASES = [
    ("ring_attention", SequenceLayout(24, ring_size=2), "contiguous", True, False, "float32"),
    ("ring_attention", SequenceLayout(24, ring_size=3, layout="zigzag"), "zigzag", True, True, "float32"),
    ("ring_attention", SequenceLayout(32, ring_size=4), "contiguous", False, True, "bfloat16"),
    ("ring_attention", SequenceLayout(32, ring_size=4, layout="zigzag"), "zigzag", True, False, "float64"),
    ("ring_attention", SequenceLayout(23, ring_size=4), None, True, True, "float32"),  # uneven: 6, 6, 6, 5
    ("ring_attention", SequenceLayout(21, ring_size=3, layout="zigzag"), None, False, False, "float32"),
    (
        "usp_attention",
        SequenceLayout(32, ring_size=2, ulysses_size=2, layout="zigzag"),
        "zigzag",
        True,
        True,
        "float32",
    ),
    ("usp_attention", SequenceLayout(22, ring_size=2, ulysses_size=2), None, True, False, "float32"),
]


def _name(case) -> str:
    op, layout, name, causal, segmented, dtype = case
    shape = "x".join(map(str, (layout.ring_size, layout.ulysses_size)))
    return (
        f"{op}-{shape}-S{layout.seq_len}-{name or 'uneven'}-{'causal' if causal else 'full'}"
        f"{'-segments' if segmented else ''}-{dtype}"
    )


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_overlapped_equals_sequential_bit_for_bit(pool, case):
    op, layout, name, causal, segmented, dtype = case
    whole = masks.whole_inputs(2, layout.seq_len, 4, 2, 8, seed=layout.seq_len, value_dim=5)
    ids = (
        np.stack(
            [segment_ids([5, 2, layout.seq_len - 9], layout.seq_len), segment_ids([layout.seq_len - 4], layout.seq_len)]
        )
        if segmented
        else None
    )
    replies = pool(layout.world_size).run(
        jobs.overlapped_and_sequential, op, layout, name or layout, whole, ids, causal, dtype
    )
    # forward W - 1 steps, backward W - 1 of k/v and W of dk/dv; the ids go in the same steps as k/v
    ring_steps = 3 * (layout.ring_size - 1) + 1
    for rank, (overlapped, walked, started) in enumerate(replies):
        for what, got, want in zip(("out", "dq", "dk", "dv"), overlapped, walked, strict=True):
            assert np.array_equal(got, want, equal_nan=True), (rank, what, np.abs(got - want).max())
        assert started == ring_steps, (rank, started)
        assert np.isfinite(overlapped[0]).all() and np.abs(overlapped[1]).max() > 0, rank
