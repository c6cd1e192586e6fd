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

import numpy as np

__all__ = ["MASKS", "ArrayMath", "NUMPY", "attend", "merge", "attend_vjp", "delta"]

#: A piece's mask: "full" (every q row sees every kv row) or "causal-diagonal" (q row i sees kv rows <= i: the
#: q and kv rows hold the same increasing positions).
MASKS = ("full", "causal-diagonal")


class ArrayMath:
    """The array operations the step rules use, over an array module `xp` (numpy, jax.numpy, torch). A frontend
    whose arrays live on devices overrides `causal_mask` to build it where `like` lives."""

    def __init__(self, xp) -> None:
        self.xp = xp

    def einsum(self, subscripts: str, *operands):
        return self.xp.einsum(subscripts, *operands)

    def exp(self, x):
        return self.xp.exp(x)

    def log(self, x):
        return self.xp.log(x)

    def logaddexp(self, x, y):
        return self.xp.logaddexp(x, y)

    def where(self, condition, x, y):
        return self.xp.where(condition, x, y)

    def max_last(self, x):
        return self.xp.amax(x, -1)

    def sum_last(self, x):
        return self.xp.sum(x, -1)

    def causal_mask(self, rows: int, like):
        """bool ``[rows, rows]``: True where column <= row."""
        return self.xp.arange(rows)[:, None] >= self.xp.arange(rows)[None, :]


NUMPY = ArrayMath(np)


def _grouped(x, kv_heads: int):
    """``[B, S, H, D] -> [B, S, H_kv, G, D]``: q head ``n * G + g`` uses kv head n."""
    batch, seq, heads, dim = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads, dim)


def _grouped_rows(x, kv_heads: int):
    """``[B, S, H] -> [B, S, H_kv, G]``."""
    batch, seq, heads = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads)


def _probabilities(math_: ArrayMath, q5, k, scale: float, mask: str, lse=None):
    """Scores ``[B, H_kv, G, Sq, Sk]`` masked by `mask`; with `lse` (``[B, Sq, H_kv, G]``) the probabilities."""
    scores = math_.einsum("bqngd,bknd->bngqk", q5, k) * scale
    if mask == "causal-diagonal":
        scores = math_.where(math_.causal_mask(scores.shape[-1], scores), scores, -math.inf)
    if lse is None:
        return scores
    return math_.exp(scores - math_.einsum("bqng->bngq", lse)[..., None])


def attend(math_: ArrayMath, q, k, v, scale: float, mask: str):
    """One piece: q ``[B, Sq, H, D]`` against k ``[B, Sk, H_kv, D]``, v ``[B, Sk, H_kv, D_v]`` (q head i using kv
    head ``i // (H // H_kv)``) -> ``(out [B, Sq, H, D_v], lse [B, Sq, H])``, softmax-normalised within the piece,
    in the dtype of the arrays given (the walk casts to `RingPlan.compute_dtype` first). Every q row must
    see at least one kv row (the plan's pieces do)."""
    batch, rows, heads, _ = q.shape
    scores = _probabilities(math_, _grouped(q, k.shape[2]), k, scale, mask)
    top = math_.max_last(scores)
    lse = top + math_.log(math_.sum_last(math_.exp(scores - top[..., None])))
    weights = math_.exp(scores - lse[..., None])
    out = math_.einsum("bngqk,bknd->bqngd", weights, v)
    return out.reshape(batch, rows, heads, v.shape[-1]), math_.einsum("bngq->bqng", lse).reshape(batch, rows, heads)


def merge(math_: ArrayMath, out, lse, piece_out, piece_lse):
    """The online-softmax merge of two partial results over disjoint keys: ``(out [B, S, H, D_v], lse [B, S, H])``
    with ``lse = logaddexp(lse, piece_lse)`` and each output weighted by ``exp(its lse - lse)``. The LSEs must
    be finite (step 0's own block gives every row a finite one)."""
    total = math_.logaddexp(lse, piece_lse)
    merged = out * math_.exp(lse - total)[..., None] + piece_out * math_.exp(piece_lse - total)[..., None]
    return merged, total


def attend_vjp(math_: ArrayMath, q, k, v, d_out, lse, delta, scale: float, mask: str):
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


def delta(math_: ArrayMath, out, d_out):
    """``rowsum(dO * O)``: ``[B, S, H, D_v] x 2 -> [B, S, H]``."""
    return math_.sum_last(out * d_out)
