"""`ring_attention` / `usp_attention` with a `commlib.SequenceLayout` of any length on real gloo ranks: every
rank's output and dq/dk/dv against unsharded float64 attention (tests/any_length_cases.py), W = 1-4, and the
layout's sizes checked against the group's before communicating."""

import pytest

from tests import any_length_cases as any_length
from tests.torch import ring_jobs as jobs


def _errors(pool, layout, causal, op):
    whole = any_length.whole_inputs(layout.seq_len)
    replies = pool(layout.world_size).run(jobs.any_length, layout, whole, causal, op)
    return any_length.worst_error(list(zip(*replies, strict=True)), any_length.expected(layout, whole, causal))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_any_length(pool, world_size):
    """S = 37, 5, 3 (empty shards at W = 4), contiguous and zigzag, causal and not: within 1e-10 on every rank."""
    failed = [
        f"{layout} causal={causal}: {error:.2e}"
        for layout, causal in any_length.ring_settings(world_size)
        if (error := _errors(pool, layout, causal, "ring_attention")) > any_length.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_usp_any_length(pool):
    """USP 2 x 2 at S = 37 and 5, both layouts, causal and not: within 1e-10 on every rank."""
    failed = [
        f"{layout} causal={causal}: {error:.2e}"
        for layout, causal in any_length.usp_settings()
        if (error := _errors(pool, layout, causal, "usp_attention")) > any_length.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_ulysses_layout(pool):
    """``ulysses_attention(..., layout=SequenceLayout)`` is ``seq_sizes=layout.sizes``: within 1e-10 on every rank."""
    failed = [
        f"{layout} causal={causal}: {error:.2e}"
        for layout, causal in any_length.ulysses_settings()
        if (error := _errors(pool, layout, causal, "ulysses_attention")) > any_length.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_layout_of_another_world_size_is_refused(pool):
    """A layout for 2 ranks on a ring of 4, and a shard of the wrong length: CommError on every rank, naming both."""
    from commlib import SequenceLayout

    texts = set(pool(4).run(jobs.any_length_error, SequenceLayout(9, ring_size=2), (1, 5, 2, 3)))
    assert texts == {
        "CommError: ring_attention: layout.ring_size (2) must be the ring group's world size (4). "
        "Received: q_shape=(1, 5, 2, 3), k_shape=(1, 5, 2, 3), v_shape=(1, 5, 2, 3), ring_size=4, "
        "layout=SequenceLayout(seq_len=9, ring_size=2, ulysses_size=1, layout='contiguous'), "
        "ulysses_size=1"
    }
    texts = set(
        pool(4).run(jobs.any_length_error, SequenceLayout(9, ulysses_size=2), (1, 5, 2, 3), "ulysses_attention")
    )
    assert texts == {
        "CommError: ulysses_attention: layout.world_size (2) must be the group's world size (4). "
        "Received: layout=SequenceLayout(seq_len=9, ring_size=1, ulysses_size=2, layout='contiguous'), "
        "seq_sizes=None, world_size=4"
    }
    texts = set(
        pool(4).run(
            jobs.any_length_error, SequenceLayout(9, ring_size=4, layout="zigzag"), (1, 3, 2, 3), "ulysses_attention"
        )
    )
    assert len(texts) == 1 and "layout must hold the sequence in rank order" in texts.pop()
    texts = pool(4).run(jobs.any_length_error, SequenceLayout(9, ring_size=4), (1, 4, 2, 3))  # sizes (3, 2, 2, 2)
    assert [text.split(". Received")[0] for text in texts] == [
        f"CommError: ring_attention: seq (4) must be layout.sizes[{rank}] ({3 if rank == 0 else 2})"
        for rank in range(4)
    ]
