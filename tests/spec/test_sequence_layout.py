"""`commlib.SequenceLayout`: the sequence layout of any length, against its definition written here with
`numpy.array_split`, and against `shard_positions` where the length is even."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import CommError, SequenceLayout, shard_positions
from commlib.sequence import SEQUENCE_LAYOUTS


def _definition(seq_len, ring_size, ulysses_size, layout):
    """Every shard's positions from the definition: array_split chunks, zigzag pairs, Ulysses pieces."""
    if layout == "contiguous":
        blocks = np.array_split(np.arange(seq_len), ring_size)
    else:
        chunks = np.array_split(np.arange(seq_len), 2 * ring_size)
        blocks = [np.concatenate([chunks[r], chunks[2 * ring_size - 1 - r]]) for r in range(ring_size)]
    return [piece.tolist() for block in blocks for piece in np.array_split(block, ulysses_size)]


_SIZES = dict(
    seq_len=st.integers(1, 70),
    ring_size=st.integers(1, 5),
    ulysses_size=st.integers(1, 4),
    layout=st.sampled_from(SEQUENCE_LAYOUTS),
)


@given(**_SIZES)
def test_positions_follow_the_definition_and_tile_the_sequence(seq_len, ring_size, ulysses_size, layout):
    sequence = SequenceLayout(seq_len, ring_size, ulysses_size, layout)
    got = [sequence.positions(i).tolist() for i in range(sequence.world_size)]
    assert got == _definition(seq_len, ring_size, ulysses_size, layout)
    assert sorted(row for rows in got for row in rows) == list(range(seq_len))
    assert sequence.sizes == tuple(len(rows) for rows in got)
    assert sequence.max_size == max(sequence.sizes) and sequence.world_size == ring_size * ulysses_size
    assert sequence.is_even == (len(set(sequence.sizes)) == 1)


@given(
    ring_size=st.integers(1, 4),
    ulysses_size=st.integers(1, 3),
    layout=st.sampled_from(SEQUENCE_LAYOUTS),
    multiple=st.integers(1, 3),
)
def test_an_even_length_is_shard_positions(ring_size, ulysses_size, layout, multiple):
    seq_len = ring_size * ulysses_size * (2 if layout == "zigzag" else 1) * multiple
    sequence = SequenceLayout(seq_len, ring_size, ulysses_size, layout)
    rows = shard_positions(seq_len, ring_size, layout, ulysses_size)
    assert [sequence.positions(i).tolist() for i in range(sequence.world_size)] == rows.tolist()


@given(**_SIZES, batch=st.integers(1, 3), padded=st.booleans())
def test_shard_then_unshard_is_the_identity(seq_len, ring_size, ulysses_size, layout, batch, padded):
    sequence = SequenceLayout(seq_len, ring_size, ulysses_size, layout)
    x = np.random.default_rng(seq_len).normal(size=(batch, seq_len, 3))
    shards = sequence.shard(x, 1, padded=padded)
    for index, shard in enumerate(shards):
        rows = sequence.sizes[index]
        assert shard.shape == (batch, sequence.max_size if padded else rows, 3)
        assert np.array_equal(shard[:, :rows], x[:, sequence.positions(index)])
        assert not shard[:, rows:].any()  # padding rows are zeros
    assert np.array_equal(sequence.unshard(shards, 1, padded=padded), x)


def test_handed_lengths():
    """The issue's cases: S = 5 over 4 ranks (one row on three of them), S = 37 zigzag ring 4, USP 2 x 2."""
    assert SequenceLayout(5, ulysses_size=4).sizes == (2, 1, 1, 1)
    assert SequenceLayout(37, ring_size=4, layout="zigzag").sizes == (9, 9, 9, 10)  # chunks (5,) * 5 + (4,) * 3
    usp = SequenceLayout(37, ring_size=2, ulysses_size=2, layout="zigzag")
    assert usp.sizes == (10, 9, 9, 9)
    assert usp.positions(0).tolist() == list(range(10))  # ring block 0 = chunks 0 and 3 of (10, 9, 9, 9)
    assert usp.positions(1).tolist() == list(range(28, 37))
    assert usp.positions(2).tolist() == list(range(10, 19))


def test_equal_layouts_are_equal_and_hash_alike():
    assert SequenceLayout(9, 2) == SequenceLayout(np.int64(9), 2)
    assert hash(SequenceLayout(9, 2)) == hash(SequenceLayout(9, 2, 1, "contiguous"))
    assert SequenceLayout(9, 2) != SequenceLayout(9, 2, layout="zigzag")


@pytest.mark.parametrize(
    ("arguments", "error", "text"),
    [
        (
            (0,),
            CommError,
            "SequenceLayout: seq_len (0) must be >= 1. Received: seq_len=0, ring_size=1, ulysses_size=1, "
            "layout='contiguous'",
        ),
        ((4, 0), CommError, "SequenceLayout: ring_size (0) must be >= 1."),
        ((4, 1, 1, "ring"), CommError, "SequenceLayout: layout ('ring') must be one of contiguous, zigzag."),
        ((4.0,), TypeError, "SequenceLayout: seq_len must be an int, not float."),
        ((True,), TypeError, "SequenceLayout: seq_len must be an int, not bool."),
        ((4, 1, 1, None), TypeError, "SequenceLayout: layout must be a str, not NoneType."),
    ],
)
def test_bad_layouts_are_refused(arguments, error, text):
    with pytest.raises(error) as raised:
        SequenceLayout(*arguments)
    assert str(raised.value).startswith(text)


def test_bad_shards_are_refused():
    sequence = SequenceLayout(5, ring_size=2)
    with pytest.raises(CommError, match=r"SequenceLayout.shard: x.shape\[1\] \(4\) must be seq_len \(5\)"):
        sequence.shard(np.zeros((1, 4)), 1)
    with pytest.raises(CommError, match=r"SequenceLayout.unshard: len\(shards\) \(1\) must be world_size \(2\)"):
        sequence.unshard([np.zeros((1, 3))], 1)
    with pytest.raises(CommError, match=r"SequenceLayout.unshard: shard 1's dim 1 \(3\) must be 2"):
        sequence.unshard([np.zeros((1, 3)), np.zeros((1, 3))], 1)
    with pytest.raises(CommError, match=r"SequenceLayout.positions: index \(2\) must be in \[0, 2\)"):
        sequence.positions(2)
