"""`ring_attention`, `usp_attention` (and `ulysses_attention`) with per-rank sizes, a ``SequenceLayout(...,
seq_sizes=...)`` (tests/sized_cases.py), on real gloo ranks, W = 1-4: every rank's output and dq/dk/dv within
1e-10 of the unsharded float64 reference, causal and segment ids on global positions, empty shards; and the
layout's sizes checked against the rank's rows before communicating."""

import pytest

from commlib import SequenceLayout
from tests import mask_cases as masks
from tests import sized_cases as sized
from tests.torch import mask_jobs, ring_jobs


def _error(pool, op, layout, causal, segmented, seed):
    whole = masks.whole_inputs(sized.BATCH, layout.seq_len, sized.HEADS, sized.KV_HEADS, sized.HEAD_DIM, seed)
    ids = sized.documents(layout.seq_len, seed) if segmented else None
    replies = pool(layout.world_size).run(mask_jobs.masked_call, op, layout, layout, whole, ids, causal)
    got = [list(values) for values in zip(*[reply[0] for reply in replies], strict=True)]
    return masks.worst_error(got, masks.expected(whole, ids, causal), layout)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_per_rank_sizes(pool, world_size):
    """Every (layer, seq_sizes) of the world size, causal and not, with and without documents."""
    failed = [
        f"{sized.label(*case)}: {error:.2e}"
        for seed, case in enumerate(sized.cases(world_size))
        if (error := _error(pool, *case, seed)) > sized.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_rows_other_than_the_sizes_are_refused(pool):
    """Rank r given rows other than ``seq_sizes[r]``: CommError on every rank, naming both numbers."""
    layout = SequenceLayout(10, ring_size=2, seq_sizes=(6, 4))
    texts = pool(2).run(ring_jobs.any_length_error, layout, (1, 5, 2, 3))
    assert [text.split(". Received")[0] for text in texts] == [
        f"CommError: ring_attention: seq (5) must be layout.sizes[{rank}] ({size})" for rank, size in enumerate((6, 4))
    ]
