"""Segment masks: padding and packed documents in the attention layers (``segment_ids=``).

A row of ``segment_ids`` (integers ``[B, S]``, laid out as q's sequence) names the document of each token. A
query attends a key only when their ids are equal (and, with causal, the key's global position is <= the
query's); a negative id is padding: it attends nothing and is attended by nothing. A query that attends nothing
outputs 0 with gradient 0, in the reference and in both frontends.

- `segment_ids`: the ids of documents of given lengths packed into one row (then padding);
- `check_segment_ids`: the validation every layer runs before communicating (shape ``[B, S_r]`` as q's first
  two dims, an integer dtype), messages naming the layer;
- `segment_mask`: ``[..., Sq, Sk]`` bool of two id arrays, on any array module (numpy, torch, jax.numpy).

The ring's skip rule (a piece none of whose queries sees any of its keys is not computed) is `commlib.ring`'s.

>>> ids = segment_ids([2, 1], 4)
>>> ids.tolist()
[0, 0, 1, -1]
>>> segment_mask(ids, ids).astype(int).tolist()  # the padding row and column see nothing
[[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from commlib.dtypes import kind
from commlib.errors import comm_error, kind_error

__all__ = ["SEGMENT_OP", "segment_ids", "check_segment_ids", "segment_mask", "integer_dtype"]

SEGMENT_OP = "segment_ids"


def _index(name: str, value: object, received: dict) -> int:
    """`value` as an int, or `TypeError` (bools and floats are refused, as by `commlib.split_sizes`)."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise kind_error(SEGMENT_OP, f"{name} must be an int, not {type(value).__name__}", **received)
    return operator.index(value)


def segment_ids(lengths: Sequence[int], seq_len: int) -> np.ndarray:
    """int32 ``[seq_len]``: documents of `lengths` packed in order into one row of `seq_len` tokens, document j's
    tokens id j, the rest padding (id -1). A document of length 0 takes an id and no token.

    >>> segment_ids([3, 2], 7).tolist()
    [0, 0, 0, 1, 1, -1, -1]

    Raises:
        CommError: a negative length or seq_len, lengths that sum past seq_len.
        TypeError: lengths not a sequence of ints, seq_len not an int.
    """
    received = dict(lengths=lengths, seq_len=seq_len)
    seq_len = _index("seq_len", seq_len, received)
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise kind_error(SEGMENT_OP, f"lengths must be a sequence of ints, not {type(lengths).__name__}", **received)
    sizes = [_index("lengths[]", length, received) for length in lengths]
    if seq_len < 0:
        raise comm_error(SEGMENT_OP, f"seq_len ({seq_len}) must be >= 0", **received)
    for position, size in enumerate(sizes):
        if size < 0:
            raise comm_error(SEGMENT_OP, f"lengths[{position}] ({size}) must be >= 0", **received)
    if sum(sizes) > seq_len:
        raise comm_error(SEGMENT_OP, f"sum(lengths) ({sum(sizes)}) must be <= seq_len ({seq_len})", **received)
    ids = np.full(seq_len, -1, dtype=np.int32)
    ids[: sum(sizes)] = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    return ids


def integer_dtype(dtype: str) -> bool:
    """Whether a dtype name is a signed or unsigned integer (what segment ids may be)."""
    return kind(dtype) in ("int", "uint")


def check_segment_ids(op_name: str, shape: object, dtype: str, q_shape: tuple[int, ...], received: dict) -> None:
    """`segment_ids` of `op_name`: shape ``[B, S_r]`` (q's batch and seq, as this rank holds q) and an integer
    dtype, else `CommError` (shape) / `TypeError` (dtype), with the layer's name and what was received."""
    received = {**received, "segment_ids_shape": shape, "segment_ids_dtype": dtype}
    if not integer_dtype(dtype):
        raise kind_error(op_name, f"segment_ids dtype ({dtype}) must be an integer dtype", **received)
    want = tuple(q_shape[:2])
    if tuple(shape) != want:  # type: ignore[arg-type]
        raise comm_error(
            op_name,
            f"segment_ids shape {tuple(shape)} must be q's [batch, seq] {want}",  # type: ignore[arg-type]
            **received,
        )


def segment_mask(q_ids, k_ids):
    """bool ``[..., Sq, Sk]``: query i sees key j when ``q_ids[..., i] == k_ids[..., j]`` and the id is not padding
    (>= 0). Integer arrays ``[..., Sq]``, ``[..., Sk]`` of any array module.

    >>> segment_mask(np.array([0, -1, 1]), np.array([1, -1])).astype(int).tolist()
    [[0, 0], [0, 0], [1, 0]]
    """
    query = q_ids[..., :, None]
    return (query == k_ids[..., None, :]) & (query >= 0)
