"""Sequence layouts: which global positions of a sequence each shard holds (ring attention, USP).

``"contiguous"``: ring block r is positions ``[r*S/W, (r+1)*S/W)``; ``"zigzag"``: the sequence is cut into 2W
chunks and ring block r is chunk r followed by chunk 2W-1-r (every rank then has the same causal work). With
USP (``ulysses_size`` U > 1) ring block r is cut into U equal contiguous pieces and piece u is shard
``r * U + u``: the Ulysses all-to-all over the U ranks of ring index r gathers exactly ring block r.

>>> shard_positions(16, 4, "zigzag")[0]  # rank 0 of the handed case: chunks 0 and 7 of 8
array([ 0,  1, 14, 15])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from commlib.attention import _check_int
from commlib.errors import comm_error

__all__ = ["SEQUENCE_LAYOUTS", "check_layout", "positions", "shard_positions", "shard_sequence",
           "unshard_sequence"]

SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


def check_layout(op_name: str, seq: int, ring_size: int, layout: object, ulysses_size: int,
                 received: dict) -> None:
    """`layout` known, W and U >= 1, and `seq` (the global length) cut evenly into the layout's chunks."""
    if layout not in SEQUENCE_LAYOUTS:
        raise comm_error(op_name, f"layout ({layout!r}) must be one of {', '.join(SEQUENCE_LAYOUTS)}", **received)
    for name, value in (("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        if value < 1:
            raise comm_error(op_name, f"{name} ({value}) must be >= 1", **received)
    if seq < 1:  # an empty shard: nothing to attend to, and the CPU flash kernels divide by it
        raise comm_error(op_name, f"seq ({seq}) must be >= 1", **received)
    if layout == "zigzag" and seq % (2 * ring_size * ulysses_size):
        raise comm_error(op_name, f"seq ({seq}) must be divisible by 2 * ring_size * ulysses_size "
                         f"({2 * ring_size * ulysses_size}) for layout 'zigzag'", **received)
    if seq % (ring_size * ulysses_size):
        raise comm_error(op_name, f"seq ({seq}) must be divisible by ring_size * ulysses_size "
                         f"({ring_size * ulysses_size})", **received)


def positions(seq: int, ring_size: int, layout: str, ulysses_size: int) -> np.ndarray:
    """`shard_positions` of arguments already checked (`check_layout`)."""
    W, U = ring_size, ulysses_size
    if layout == "contiguous":
        blocks = np.arange(seq).reshape(W, seq // W)
    else:
        chunks = np.arange(seq).reshape(2 * W, seq // (2 * W))
        blocks = np.concatenate([chunks[:W], chunks[::-1][:W]], axis=1)
    return blocks.reshape(W * U, seq // (W * U))


def shard_positions(seq: int, ring_size: int, layout: str = "contiguous", ulysses_size: int = 1) -> np.ndarray:
    """int64 ``[W * U, S / (W * U)]``: row ``r * U + u`` holds the global positions of shard ``r * U + u``
    (ring index r, Ulysses index u; ``U = ulysses_size``), in the order the shard holds them.

    >>> shard_positions(8, 2, "zigzag", ulysses_size=2)  # ring block 0 = chunks 0, 3; block 1 = chunks 1, 2
    array([[0, 1],
           [6, 7],
           [2, 3],
           [4, 5]])

    Raises:
        CommError: an unknown layout, W or U < 1, S not divisible by W * U (2 * W * U for zigzag).
        TypeError: S, W or U not ints.
    """
    received = dict(seq=seq, ring_size=ring_size, layout=layout, ulysses_size=ulysses_size)
    seq, ring_size, ulysses_size = (_check_int(name, value, received, "shard_positions") for name, value in
                                    (("seq", seq), ("ring_size", ring_size), ("ulysses_size", ulysses_size)))
    check_layout("shard_positions", seq, ring_size, layout, ulysses_size, received)
    return positions(seq, ring_size, layout, ulysses_size)


def shard_sequence(x, dim: int, ring_size: int, layout: str = "contiguous", ulysses_size: int = 1) -> list[np.ndarray]:
    """numpy: the W * U shards of a whole sequence `x` along `dim`, shard i holding the rows
    ``shard_positions(S, W, layout, U)[i]`` (``[.., S, ..] -> W * U x [.., S / (W * U), ..]``).

    >>> [shard.tolist() for shard in shard_sequence(np.arange(8), 0, 2, "zigzag")]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    x = np.asarray(x)
    rows = shard_positions(x.shape[dim], ring_size, layout, ulysses_size)
    return [np.take(x, row, axis=dim) for row in rows]


def unshard_sequence(shards: Sequence, dim: int, ring_size: int, layout: str = "contiguous",
                     ulysses_size: int = 1) -> np.ndarray:
    """numpy: the inverse of `shard_sequence`, the whole sequence back in position order.

    >>> unshard_sequence([[0, 1, 6, 7], [2, 3, 4, 5]], 0, 2, "zigzag").tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    shards = [np.asarray(shard) for shard in shards]
    whole = np.concatenate(shards, axis=dim)
    order = shard_positions(whole.shape[dim], ring_size, layout, ulysses_size).reshape(-1)
    return np.take(whole, np.argsort(order), axis=dim)
