"""Blockwise attention: the step rules of the ring over an `ArrayMath` (numpy, torch, jax.numpy).

One piece's output and log-sum-exp (`attend`), the online-softmax merge of two (out, lse) pairs (`merge`), and
the blockwise backward that recomputes the probabilities from the saved LSE (`attend_vjp`; FlashAttention-2,
Dao 2023, Algorithm 2): ``dS = P * (dP - rowsum(dO * O))`` (`delta`).

`attend_blocks` / `attend_blocks_vjp` are the same rules walked over the keys `block_size` at a time (a loop the
`ArrayMath` runs: numpy's a Python loop, JAX's ``lax.fori_loop``): the forward keeps the online softmax's
running max, sum and output, the backward recomputes each block's probabilities from the saved LSE, so what a
piece holds is ``[B, H, Sq, block_size]`` scores, never ``[B, H, Sq, Sk]``. Segment ids (`q_ids`, `k_ids`) and a
mask rule on positions (`rule`, a `commlib.masks.MaskRule` over the positions ``0 .. Sq - 1`` and ``0 .. Sk - 1``)
are turned into each block's mask inside the loop (never a ``[Sq, Sk]`` array).

>>> q = k = v = np.eye(2).reshape(1, 2, 1, 2)
>>> out, lse = attend(NUMPY, q, k, v, 1.0, "causal-diagonal")
>>> out[0, :, 0].round(3).tolist(), lse[0, :, 0].round(3).tolist()  # row 0 sees key 0 only
([[1.0, 0.0], [0.269, 0.731]], [1.0, 1.313])
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from commlib.errors import comm_error, kind_error
from commlib.masks import segment_mask

__all__ = [
    "MASKS",
    "BLOCK_SIZE",
    "ArrayMath",
    "NUMPY",
    "position_mask",
    "attend",
    "merge",
    "merge_masked",
    "attend_vjp",
    "delta",
    "check_block_size",
    "attend_blocks",
    "attend_blocks_vjp",
    "SegmentedMask",
    "any_visible",
]

#: A piece's mask: "full" (every q row sees every kv row), "causal-diagonal" (q row i sees kv rows <= i: the
#: q and kv rows hold the same increasing positions) or "positions" (a bool array ``[Sq, Sk]`` that the walk
#: gives in its place, built from global positions: uneven layouts, where a q row may see no key).
MASKS = ("full", "causal-diagonal", "positions")

#: Keys per block of `attend_blocks` where the caller gives none (``block_size=None``). Picked on CPU only (no
#: GPU measured; there cuDNN serves the pieces it can, `commlib_jax._kernels.fused_serves`) from ``PYTHONPATH=.
#: python -m benchmarks.memory --frameworks jax --layers ring ulysses --sizes 8192 --block-sizes 256 512 1024
#: 2048 --repeats 2`` (benchmarks/results/cpu-2026-12-07-memory/block_size.json; B=1, H=8, D=64, W=4, float32,
#: causal, jit(grad) fwd+bwd): 256 gave the least compiled temp memory (ring 137 MiB, Ulysses 100 MiB against
#: 217 / 164 at 512 and 680 / 549 at 2048) and times as fast as any other within the noise of the shared
#: 2-core machine (ring 9.6 s against 10.0 / 12.3 / 16.1; Ulysses 14.3 s against 18.0 / 20.1 / 12.6).
BLOCK_SIZE = 256


class ArrayMath:
    """The array operations the step rules use, over an array module `xp` (numpy, jax.numpy, torch). A frontend
    whose arrays live on devices overrides `causal_mask` to build it where `like` lives."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def einsum(self, subscripts: str, *operands: Any) -> Any:
        return self.xp.einsum(subscripts, *operands)

    def exp(self, x: Any) -> Any:
        return self.xp.exp(x)

    def log(self, x: Any) -> Any:
        return self.xp.log(x)

    def logaddexp(self, x: Any, y: Any) -> Any:
        return self.xp.logaddexp(x, y)

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return self.xp.where(condition, x, y)

    def max_last(self, x: Any) -> Any:
        return self.xp.amax(x, -1)

    def sum_last(self, x: Any) -> Any:
        return self.xp.sum(x, -1)

    def isfinite(self, x: Any) -> Any:
        return self.xp.isfinite(x)

    def causal_mask(self, rows: int, like: Any) -> Any:
        """bool ``[rows, rows]``: True where column <= row."""
        return self.xp.arange(rows)[:, None] >= self.xp.arange(rows)[None, :]

    # The blockwise walk's loop and slices (`attend_blocks`); numpy's here, a traced frontend overrides them.

    def full(self, shape: tuple[int, ...], value: float, dtype: Any, like: tuple[Any, ...]) -> Any:
        """An array of `value` (an accumulator of the loop; a traced frontend types it as `like`'s arrays)."""
        return self.xp.full(shape, value, dtype=dtype)

    def loop(self, count: int, body: Any, carry: Any) -> Any:
        """``carry = body(i, carry)`` for i in ``range(count)``."""
        for index in range(count):
            carry = body(index, carry)
        return carry

    def block(self, x: Any, start: Any, size: int, axis: int) -> Any:
        """``x[start : start + size]`` along `axis` (`start` may be the loop's traced index)."""
        return self.xp.take(x, self.xp.arange(size) + start, axis=axis)

    def set_block(self, x: Any, start: Any, value: Any, axis: int) -> Any:
        """`x` with ``x[start : start + len(value)] = value`` along `axis` (functional where the module is)."""
        x = x.copy()
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + value.shape[axis])
        x[tuple(index)] = value
        return x

    def pad(self, x: Any, axis: int, amount: int, value: Any) -> Any:
        """`x` with `amount` entries of `value` appended along `axis`."""
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, amount)
        return self.xp.pad(x, widths, constant_values=value)

    def arange(self, size: int) -> Any:
        return self.xp.arange(size)


NUMPY = ArrayMath(np)


def position_mask(q_positions: Any, kv_positions: Any, causal: bool) -> Any:
    """bool ``[..., Sq, Sk]`` (a "positions" piece's mask): q row i sees kv row j when both hold a global position
    (padding: -1) and, when `causal`, ``kv_positions[j] <= q_positions[i]``. Integer arrays ``[..., Sq]``,
    ``[..., Sk]`` of any array module.

    >>> position_mask(np.array([0, 2, -1]), np.array([1, 2]), causal=True).astype(int).tolist()
    [[0, 0], [1, 1], [0, 0]]
    """
    query, key = q_positions[..., :, None], kv_positions[..., None, :]
    visible = (query >= 0) & (key >= 0)
    return visible & (key <= query) if causal else visible


def _grouped(x: Any, kv_heads: int) -> Any:
    """``[B, S, H, D] -> [B, S, H_kv, G, D]``: q head ``n * G + g`` uses kv head n."""
    batch, seq, heads, dim = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads, dim)


def _grouped_rows(x: Any, kv_heads: int) -> Any:
    """``[B, S, H] -> [B, S, H_kv, G]``."""
    batch, seq, heads = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads)


def _probabilities(math_: ArrayMath, q5: Any, k: Any, scale: float, mask: Any, lse: Any = None) -> Any:
    """Scores ``[B, H_kv, G, Sq, Sk]`` masked by `mask` (a name, or a bool array broadcasting against the last two
    dims); with `lse` (``[B, Sq, H_kv, G]``) the probabilities (a row whose LSE is -inf: zeros)."""
    scores = math_.einsum("bqngd,bknd->bngqk", q5, k) * scale
    if not isinstance(mask, str):
        scores = math_.where(mask, scores, -math.inf)
    elif mask == "causal-diagonal":
        scores = math_.where(math_.causal_mask(scores.shape[-1], scores), scores, -math.inf)
    if lse is None:
        return scores
    lse = math_.einsum("bqng->bngq", lse)
    return math_.exp(scores - _finite(math_, lse)[..., None])


def _finite(math_: ArrayMath, x: Any) -> Any:
    """`x` with its infinities (the LSE of a row that sees no key) replaced by 0."""
    return math_.where(math_.isfinite(x), x, 0.0)


def attend(math_: ArrayMath, q: Any, k: Any, v: Any, scale: float, mask: Any) -> tuple[Any, Any]:
    """One piece: q ``[B, Sq, H, D]`` against k ``[B, Sk, H_kv, D]``, v ``[B, Sk, H_kv, D_v]`` (q head i using kv
    head ``i // (H // H_kv)``) -> ``(out [B, Sq, H, D_v], lse [B, Sq, H])``, softmax-normalised within the piece,
    in the dtype of the arrays given (the walk casts to `RingPlan.compute_dtype` first). `mask` a name, or a bool
    array broadcasting against the scores ``[B, H_kv, G, Sq, Sk]``. A row that sees no key (its mask, or every
    score -inf) gets output 0 and LSE -inf; a NaN score gives a NaN row and LSE."""
    batch, rows, heads, _ = q.shape
    scores = _probabilities(math_, _grouped(q, k.shape[2]), k, scale, mask)
    lse, weights = _masked_softmax(math_, scores)
    out = math_.einsum("bngqk,bknd->bqngd", weights, v)
    return out.reshape(batch, rows, heads, v.shape[-1]), math_.einsum("bngq->bqng", lse).reshape(batch, rows, heads)


def _masked_softmax(math_: ArrayMath, scores: Any) -> Any:
    """``(lse, weights)`` of masked scores where a row may see no key: its LSE -inf, its weights 0 (a NaN score:
    its row's LSE NaN)."""
    top = _finite(math_, math_.max_last(scores))
    sums = math_.sum_last(math_.exp(scores - top[..., None]))
    seen = sums != 0
    lse = math_.where(seen, top + math_.log(math_.where(seen, sums, 1.0)), -math.inf)
    return lse, math_.exp(scores - _finite(math_, lse)[..., None])


def merge(math_: ArrayMath, out: Any, lse: Any, piece_out: Any, piece_lse: Any) -> tuple[Any, Any]:
    """The online-softmax merge of two partial results over disjoint keys: ``(out [B, S, H, D_v], lse [B, S, H])``
    with ``lse = logaddexp(lse, piece_lse)`` and each output weighted by ``exp(its lse - lse)``. The LSEs must
    be finite (step 0's own block gives every row a finite one)."""
    total = math_.logaddexp(lse, piece_lse)
    merged = out * math_.exp(lse - total)[..., None] + piece_out * math_.exp(piece_lse - total)[..., None]
    return merged, total


def merge_masked(math_: ArrayMath, out: Any, lse: Any, piece_out: Any, piece_lse: Any) -> tuple[Any, Any]:
    """`merge` where an LSE may be -inf (a row that has seen no key yet: its output 0): the rows that have seen
    none in both stay 0 with LSE -inf."""
    total = math_.logaddexp(lse, piece_lse)
    finite = _finite(math_, total)
    merged = out * math_.exp(lse - finite)[..., None] + piece_out * math_.exp(piece_lse - finite)[..., None]
    return merged, total


def attend_vjp(
    math_: ArrayMath, q: Any, k: Any, v: Any, d_out: Any, lse: Any, delta: Any, scale: float, mask: Any
) -> tuple[Any, Any, Any]:
    """One piece's share of the gradients, FlashAttention-2's backward: the probabilities recomputed from the
    final `lse` (``[B, Sq, H]``), ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` (``[B, Sq, H]``, see
    `delta`). Returns ``(dq [B, Sq, H, D], dk [B, Sk, H_kv, D], dv [B, Sk, H_kv, D_v])``; dk/dv sum over the q
    heads that share a kv head."""
    kv_heads = k.shape[2]
    q5, d_out5 = _grouped(q, kv_heads), _grouped(d_out, kv_heads)
    weights = _probabilities(math_, q5, k, scale, mask, _grouped_rows(lse, kv_heads))
    dv = math_.einsum("bngqk,bqngd->bknd", weights, d_out5)
    d_weights = math_.einsum("bqngd,bknd->bngqk", d_out5, v)
    d_scores = weights * (d_weights - math_.einsum("bqng->bngq", _grouped_rows(delta, kv_heads))[..., None])
    dq = math_.einsum("bngqk,bknd->bqngd", d_scores, k) * scale
    dk = math_.einsum("bngqk,bqngd->bknd", d_scores, q5) * scale
    return dq.reshape(q.shape), dk, dv


def delta(math_: ArrayMath, out: Any, d_out: Any) -> Any:
    """``rowsum(dO * O)``: ``[B, S, H, D_v] x 2 -> [B, S, H]``."""
    return math_.sum_last(out * d_out)


# ---------------------------------------------------------------------------------------------------------
# Blockwise: one piece walked over its keys `block_size` at a time
# ---------------------------------------------------------------------------------------------------------


def check_block_size(op_name: str, block_size: object) -> int:
    """`block_size` of a layer (None: `BLOCK_SIZE`) as an int >= 1, else `TypeError` / `CommError`.

    >>> check_block_size("ring_attention", 0)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: ring_attention: block_size (0) must be >= 1. Received: block_size=0
    """
    if block_size is None:
        return BLOCK_SIZE
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)):
        raise kind_error(op_name, f"block_size must be an int, not {type(block_size).__name__}", block_size=block_size)
    if block_size < 1:
        raise comm_error(op_name, f"block_size ({block_size}) must be >= 1", block_size=block_size)
    return int(block_size)


class SegmentedMask(NamedTuple):
    """A piece's mask kept as its parts, for a walk that masks one key block at a time (`attend_blocks`): `mask`
    (a `MASKS` name, or a dense bool "positions" array) and the segment ids of the piece's q rows ``[B, Sq]``
    and keys ``[B, Sk]``; what `dense` gives is never built by the blockwise walk.

    >>> ids = np.array([[0, 0, 1]])
    >>> SegmentedMask("causal-diagonal", ids, ids).dense(NUMPY)[0, 0, 0].astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """

    mask: Any
    q_ids: Any
    k_ids: Any

    def dense(self, math_: ArrayMath) -> Any:
        """The bool ``[B, 1, 1, Sq, Sk]`` of the name's (or the dense) mask and `commlib.masks.segment_mask`."""
        same = segment_mask(self.q_ids, self.k_ids)[:, None, None]
        if not isinstance(self.mask, str):
            return same & self.mask
        if self.mask == "causal-diagonal":
            return same & math_.causal_mask(same.shape[-1], same)
        return same


class _Blocks:
    """A piece's keys cut into `count` blocks of `size` (the last padded: zeros in k and v, masked out)."""

    def __init__(
        self, math_: ArrayMath, k: Any, v: Any, mask: Any, k_ids: Any, block_size: int, rule: Any = None
    ) -> None:
        self.keys, self.rule = k.shape[1], rule
        self.size = max(1, min(block_size, self.keys))
        self.count = -(-self.keys // self.size)
        self.padding = self.count * self.size - self.keys
        self.math, self.mask = math_, mask
        if self.padding:
            k, v = (math_.pad(x, 1, self.padding, 0) for x in (k, v))
            if not isinstance(mask, str):
                mask = math_.pad(mask, -1, self.padding, False)
            if k_ids is not None:
                k_ids = math_.pad(k_ids, 1, self.padding, -1)
        self.k, self.v, self.dense, self.k_ids = k, v, mask, k_ids

    def visible(self, start: Any, rows: int, q_ids: Any) -> Any:
        """bool broadcasting against one block's scores ``[B, H_kv, G, Sq, size]``: its mask name's (or rows of
        the dense mask), the segment ids', the padding's; None where every key is seen."""
        math_, parts = self.math, []
        columns = math_.arange(self.size) + start
        if isinstance(self.mask, str):
            if self.mask == "causal-diagonal":
                parts.append(math_.arange(rows)[:, None] >= columns[None, :])
            elif self.padding:
                parts.append(columns < self.keys)
            if self.rule is not None:  # the rule's mask of the block's positions (and its padding keys)
                parts.append(self.rule.visible(math_.arange(rows), columns))
                if self.padding and self.mask == "causal-diagonal":
                    parts.append(columns < self.keys)
        else:
            parts.append(math_.block(self.dense, start, self.size, -1))
        if q_ids is not None:
            parts.append(segment_mask(q_ids, math_.block(self.k_ids, start, self.size, 1))[:, None, None])
        if not parts:
            return None
        visible = parts[0]
        for part in parts[1:]:
            visible = visible & part
        return visible

    def scores(self, q5: Any, start: Any, scale: float, q_ids: Any) -> tuple[Any, Any, Any]:
        """``(scores [B, H_kv, G, Sq, size] masked to -inf, k block, v block)`` of the block at `start`."""
        math_ = self.math
        k, v = (math_.block(x, start, self.size, 1) for x in (self.k, self.v))
        scores = math_.einsum("bqngd,bknd->bngqk", q5, k) * scale
        visible = self.visible(start, q5.shape[1], q_ids)
        return (scores if visible is None else math_.where(visible, scores, -math.inf)), k, v


def attend_blocks(
    math_: ArrayMath,
    q: Any,
    k: Any,
    v: Any,
    scale: float,
    mask: Any,
    block_size: int,
    q_ids: Any = None,
    k_ids: Any = None,
    rule: Any = None,
) -> tuple[Any, Any]:
    """`attend` walked over the keys `block_size` at a time with the online softmax (the same ``(out [B, Sq, H,
    D_v], lse [B, Sq, H])``, rows that see no key output 0 with LSE -inf, a NaN score a NaN row, to rounding).
    `mask` as `attend`'s (a dense bool array is read one block of columns at a time); `q_ids` ``[B, Sq]``,
    `k_ids` ``[B, Sk]``: segment ids (`commlib.masks.segment_mask`) masking each block as well; `rule` (with a
    `mask` name): a `commlib.masks.MaskRule` on the positions ``0 .. Sq - 1`` and ``0 .. Sk - 1``, the same.

    >>> q, k, v = np.random.default_rng(0).normal(size=(3, 1, 5, 2, 4))
    >>> out, lse = attend_blocks(NUMPY, q, k, v, 0.5, "causal-diagonal", 2)
    >>> [bool(np.allclose(a, b)) for a, b in zip((out, lse), attend(NUMPY, q, k, v, 0.5, "causal-diagonal"))]
    [True, True]
    """
    batch, rows, heads, _ = q.shape
    kv_heads, group = k.shape[2], heads // k.shape[2]
    blocks = _Blocks(math_, k, v, mask, k_ids, block_size, rule)
    q5 = _grouped(q, kv_heads)
    like = tuple(x for x in (q, k, v, mask, q_ids, k_ids) if x is not None and not isinstance(x, str))
    row_shape = (batch, kv_heads, group, rows)
    carry = (
        math_.full(row_shape, -math.inf, q.dtype, like),
        math_.full(row_shape, 0.0, q.dtype, like),
        math_.full((*row_shape, v.shape[-1]), 0.0, q.dtype, like),
    )

    def body(index: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        top, total, out = carry
        scores, _, values = blocks.scores(q5, index * blocks.size, scale, q_ids)
        new_top = math_.xp.maximum(top, math_.max_last(scores))
        shift = _finite(math_, new_top)
        weights = math_.exp(scores - shift[..., None])
        correction = math_.exp(top - shift)
        total = total * correction + math_.sum_last(weights)
        out = out * correction[..., None] + math_.einsum("bngqk,bknd->bngqd", weights, values)
        return new_top, total, out

    top, total, out = math_.loop(blocks.count, body, carry)
    seen = total != 0
    lse = math_.where(seen, top + math_.log(math_.where(seen, total, 1.0)), -math.inf)
    out = out / math_.where(seen, total, 1.0)[..., None]
    out = math_.einsum("bngqd->bqngd", out).reshape(batch, rows, heads, v.shape[-1])
    return out, math_.einsum("bngq->bqng", lse).reshape(batch, rows, heads)


def attend_blocks_vjp(
    math_: ArrayMath,
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    lse: Any,
    delta: Any,
    scale: float,
    mask: Any,
    block_size: int,
    q_ids: Any = None,
    k_ids: Any = None,
    rule: Any = None,
) -> tuple[Any, Any, Any]:
    """`attend_vjp` walked over the keys `block_size` at a time: each block's probabilities recomputed from the
    final `lse`, its dk and dv written in place, dq summed over the blocks (the same ``(dq, dk, dv)``, to
    rounding). Arguments as `attend_vjp`'s and `attend_blocks`'."""
    kv_heads = k.shape[2]
    blocks = _Blocks(math_, k, v, mask, k_ids, block_size, rule)
    q5, d_out5 = _grouped(q, kv_heads), _grouped(d_out, kv_heads)
    shift = _finite(math_, math_.einsum("bqng->bngq", _grouped_rows(lse, kv_heads)))[..., None]
    rowsums = math_.einsum("bqng->bngq", _grouped_rows(delta, kv_heads))[..., None]
    like = tuple(x for x in (q, k, v, d_out, lse, mask, q_ids, k_ids) if x is not None and not isinstance(x, str))
    carry = (
        math_.full(q5.shape, 0.0, q.dtype, like),
        math_.full(blocks.k.shape, 0.0, q.dtype, like),
        math_.full(blocks.v.shape, 0.0, q.dtype, like),
    )

    def body(index: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        dq, dk, dv = carry
        start = index * blocks.size
        scores, keys, values = blocks.scores(q5, start, scale, q_ids)
        weights = math_.exp(scores - shift)
        d_scores = weights * (math_.einsum("bqngd,bknd->bngqk", d_out5, values) - rowsums)
        dq = dq + math_.einsum("bngqk,bknd->bqngd", d_scores, keys) * scale
        dk = math_.set_block(dk, start, math_.einsum("bngqk,bqngd->bknd", d_scores, q5) * scale, 1)
        dv = math_.set_block(dv, start, math_.einsum("bngqk,bqngd->bknd", weights, d_out5), 1)
        return dq, dk, dv

    dq, dk, dv = math_.loop(blocks.count, body, carry)
    if blocks.padding:
        dk, dv = (math_.block(x, 0, blocks.keys, 1) for x in (dk, dv))
    return dq.reshape(q.shape), dk, dv


def any_visible(math_: ArrayMath, mask: SegmentedMask, block_size: int) -> Any:
    """Whether some q row of a piece sees some key of it (the ring's skip rule, `commlib.ring.visible_pieces`),
    decided over the keys `block_size` at a time: a 0-d bool, never a ``[Sq, Sk]`` array.

    >>> ids = np.array([[0, 0, 1, 1]])
    >>> bool(any_visible(NUMPY, SegmentedMask("full", ids[:, :2], ids[:, 2:]), 1))
    False
    """
    k_ids = mask.k_ids
    keys = math_.full((*k_ids.shape, 1, 1), 0.0, "float32", (k_ids,))  # the blocks' shapes only
    blocks = _Blocks(math_, keys, keys, mask.mask, k_ids, block_size)
    rows = mask.q_ids.shape[-1]
    like = tuple(x for x in (mask.q_ids, k_ids, mask.mask) if not isinstance(x, str))

    def body(index: Any, seen: Any) -> Any:
        visible = blocks.visible(index * blocks.size, rows, mask.q_ids)
        return seen | (True if visible is None else math_.xp.any(visible))

    return math_.loop(blocks.count, body, math_.full((), False, bool, like))
