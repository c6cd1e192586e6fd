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

Rules on global positions (``mask=``, video DiTs and sliding-window models): `BlockCausal` (frame-causal) and
`SlidingWindow`, frozen and hashable (static under ``jax.jit``, no graph break under ``torch.compile``: a rule is
arithmetic on position arrays, never a host read). A rule says, for each query position, the interval of key
positions it sees (`MaskRule.bounds`); that one form gives

- the dense mask of any q and k position arrays, on any array module (`MaskRule.visible`: two comparisons), which
  the float64 reference and each partially masked piece use, and
- an exact classification of a whole block pair from its position runs in O(rows) (`MaskRule.classify`: "none",
  "all" or "some" visible), from which the ring's plan skips the pairs the rule masks entirely and drops the mask
  of the pairs it leaves whole -- decided on the host when the plan is built, so nothing is read per piece.

Every mask asked for here is such an interval (causal ``[0, i]``, frame-causal ``[0, end of i's frame]``, a
causal window ``[i - w + 1, i]``), and intervals compose: a rule, ``causal=True`` and segment ids are ANDed.

>>> ids = segment_ids([2, 1], 4)
>>> ids.tolist()
[0, 0, 1, -1]
>>> segment_mask(ids, ids).astype(int).tolist()  # the padding row and column see nothing
[[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from commlib.dtypes import kind
from commlib.errors import comm_error, kind_error
from commlib.validators import iterable

__all__ = [
    "SEGMENT_OP",
    "segment_ids",
    "check_segment_ids",
    "segment_mask",
    "integer_dtype",
    "MaskRule",
    "BlockCausal",
    "SlidingWindow",
    "check_mask",
    "rule_mask",
    "classify_runs",
    "position_runs",
]

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
    if tuple(iterable(shape)) != want:
        raise comm_error(
            op_name,
            f"segment_ids shape {tuple(iterable(shape))} must be q's [batch, seq] {want}",
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


# ---------------------------------------------------------------------------------------------------------
# Rules on global positions (``mask=``)
# ---------------------------------------------------------------------------------------------------------


class MaskRule:
    """A mask on global positions: query position i sees the key positions ``bounds(i) = [lo(i), hi(i)]``
    (inclusive; None: unbounded on that side), lo and hi non-decreasing in i. Subclasses are frozen
    dataclasses (hashable: a rule is part of a plan and of JAX's static arguments) and define `bounds` with
    arithmetic only, so that it runs on numpy, torch and jax.numpy arrays alike, and `check`."""

    def bounds(self, q_positions: Any) -> tuple[Any, Any]:
        """``(lo, hi)``: the first and last key position each query position sees (None: no bound)."""
        raise NotImplementedError

    def check(self, op_name: str, received: dict) -> None:
        """`CommError` / `TypeError` naming `op_name` where the rule's fields are not valid."""
        raise NotImplementedError

    def visible(self, q_positions: Any, k_positions: Any) -> Any:
        """bool ``[..., Sq, Sk]``: query i sees key j (integer position arrays ``[..., Sq]``, ``[..., Sk]`` of any
        array module; padding, a negative position, is the caller's to mask)."""
        lo, hi = self.bounds(q_positions[..., :, None])
        key = k_positions[..., None, :]
        seen = key <= hi if hi is not None else None
        if lo is not None:
            seen = key >= lo if seen is None else seen & (key >= lo)
        return seen if seen is not None else (key >= key) & (q_positions[..., :, None] >= q_positions[..., :, None])

    def classify(self, q_run: tuple[int, int], k_run: tuple[int, int], causal: bool = False) -> str:
        """Whether the queries at positions ``[q_run[0], q_run[1])`` see "none", "all" or "some" of the keys at
        ``[k_run[0], k_run[1])`` under this rule (and causal, when given), exactly, in O(len(q_run)).

        >>> SlidingWindow(2).classify((4, 6), (0, 3)), SlidingWindow(2).classify((4, 6), (3, 5))
        ('none', 'some')
        """
        queries = np.arange(*q_run, dtype=np.int64)
        lo, hi = self.bounds(queries)
        lo = np.full_like(queries, k_run[0]) if lo is None else np.maximum(lo, k_run[0])
        hi = np.full_like(queries, k_run[1] - 1) if hi is None else np.minimum(hi, k_run[1] - 1)
        if causal:
            hi = np.minimum(hi, queries)
        seen = np.maximum(hi - lo + 1, 0)
        if not seen.any():
            return "none"
        return "all" if bool((seen == k_run[1] - k_run[0]).all()) else "some"


def _check_positive(op_name: str, rule: str, name: str, value: object, received: dict) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise kind_error(op_name, f"mask {rule}'s {name} must be an int, not {type(value).__name__}", **received)
    if value < 1:
        raise comm_error(op_name, f"mask {rule}'s {name} ({value}) must be >= 1", **received)


@dataclasses.dataclass(frozen=True)
class BlockCausal(MaskRule):
    """Frame-causal (block-causal) attention: the sequence is cut into blocks of `block_size` positions (a video
    DiT's frames of ``height * width`` tokens) and query i sees key j iff ``j // block_size <= i // block_size``:
    its own block whole and every earlier block. ``BlockCausal(1)`` is causal.

    >>> pos = np.arange(4)
    >>> BlockCausal(2).visible(pos, pos).astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    """

    block_size: int

    def bounds(self, q_positions: Any) -> tuple[Any, Any]:
        return None, (q_positions // self.block_size + 1) * self.block_size - 1

    def check(self, op_name: str, received: dict) -> None:
        _check_positive(op_name, "BlockCausal", "block_size", self.block_size, received)


@dataclasses.dataclass(frozen=True)
class SlidingWindow(MaskRule):
    """Causal attention in a window of `window` positions, transformers' ``sliding_window`` (5.x,
    ``sliding_window_causal_mask_function``: ``q - window < k <= q``): query i sees the keys
    ``i - window + 1 .. i``, itself included. ``SlidingWindow(1)``: each token sees itself only.

    >>> pos = np.arange(4)
    >>> SlidingWindow(2).visible(pos, pos).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """

    window: int

    def bounds(self, q_positions: Any) -> tuple[Any, Any]:
        return q_positions - (self.window - 1), q_positions

    def check(self, op_name: str, received: dict) -> None:
        _check_positive(op_name, "SlidingWindow", "window", self.window, received)


def check_mask(op_name: str, mask: object, received: dict) -> MaskRule | None:
    """`mask` of `op_name`: None, or a `MaskRule` whose fields are valid (`MaskRule.check`), else `TypeError` /
    `CommError` naming the layer.

    >>> check_mask("ring_attention", "causal", {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: ring_attention: mask must be a commlib.masks.MaskRule (BlockCausal, SlidingWindow) or None, not str...
    >>> check_mask("ring_attention", BlockCausal(0), {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: ring_attention: mask BlockCausal's block_size (0) must be >= 1. Received: mask=...
    """
    if mask is None:
        return None
    received = {**received, "mask": mask}
    if not isinstance(mask, MaskRule):
        message = (
            f"mask must be a commlib.masks.MaskRule (BlockCausal, SlidingWindow) or None, not {type(mask).__name__}"
        )
        raise kind_error(op_name, message, **received)
    mask.check(op_name, received)
    return mask


def rule_mask(q_positions: Any, k_positions: Any, causal: bool, rule: MaskRule | None) -> Any:
    """bool ``[..., Sq, Sk]``: both positions real (padding: negative), causal when asked, and the rule's. Integer
    arrays of any array module.

    >>> rule_mask(np.array([0, 3, -1]), np.arange(4), True, SlidingWindow(2)).astype(int).tolist()
    [[1, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]]
    """
    query, key = q_positions[..., :, None], k_positions[..., None, :]
    seen = (query >= 0) & (key >= 0)
    if causal:
        seen = seen & (key <= query)
    return seen if rule is None else seen & rule.visible(q_positions, k_positions)


def position_runs(positions: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """``(first row, stop row, first position)`` of each maximal run of consecutive positions (``p, p + 1, ...``)
    of a block's rows; padding rows (negative) belong to none.

    >>> position_runs(np.array([0, 1, 2, 7, 8, -1]))
    ((0, 3, 0), (3, 5, 7))
    """
    runs: list[tuple[int, int, int]] = []
    for row, position in enumerate(int(p) for p in positions):
        if position < 0:
            continue
        if runs and runs[-1][1] == row and runs[-1][2] + row - runs[-1][0] == position:
            runs[-1] = (runs[-1][0], row + 1, runs[-1][2])
        else:
            runs.append((row, row + 1, position))
    return tuple(runs)


def classify_runs(q_run: tuple[int, int, int], k_run: tuple[int, int, int], causal: bool, rule: MaskRule) -> str:
    """`MaskRule.classify` of two `position_runs` entries."""
    q_first, k_first = q_run[2], k_run[2]
    return rule.classify(
        (q_first, q_first + q_run[1] - q_run[0]), (k_first, k_first + k_run[1] - k_run[0]), causal=causal
    )
