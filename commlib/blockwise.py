"""Blockwise attention: the step rules of the ring over an `ArrayMath` (numpy, torch, jax.numpy).

One piece's output and log-sum-exp (`attend`), the online-softmax merge of two (out, lse) pairs (`merge`), and
the blockwise backward that recomputes the probabilities from the saved LSE (`attend_vjp`; FlashAttention-2,
Dao 2023, Algorithm 2): ``dS = P * (dP - rowsum(dO * O))`` (`delta`).

>>> q = k = v = np.eye(2).reshape(1, 2, 1, 2)
>>> out, lse = attend(NUMPY, q, k, v, 1.0, "causal-diagonal")
>>> out[0, :, 0].round(3).tolist(), lse[0, :, 0].round(3).tolist()  # row 0 sees key 0 only
([[1.0, 0.0], [0.269, 0.731]], [1.0, 1.313])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["MASKS", "ArrayMath", "NUMPY", "position_mask", "attend", "merge", "merge_masked", "attend_vjp", "delta"]

#: A piece's mask: "full" (every q row sees every kv row), "causal-diagonal" (q row i sees kv rows <= i: the
#: q and kv rows hold the same increasing positions) or "positions" (a bool array ``[Sq, Sk]`` that the walk
#: gives in its place, built from global positions: uneven layouts, where a q row may see no key).
MASKS = ("full", "causal-diagonal", "positions")


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
