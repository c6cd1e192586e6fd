"""Numpy references of real workloads built on the collectives (float64).

`attention` is softmax attention on ``[batch, seq, heads, head_dim]``, the layer Ulysses sequence
parallelism shards: each rank holds ``[B, S/W, H, D]``, `all_to_all_4d` turns it into ``[B, S, H/W, D]``,
attention runs over the full sequence for H/W heads, and the reverse all-to-all returns ``[B, S/W, H, D]``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["attention", "attention_vjp"]


def _probabilities(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``softmax(q k^T / sqrt(D)) v`` per batch and head: ``[B, S, H, D] x3 -> [B, S, H, D]``."""
    return np.einsum("bhqk,bkhd->bqhd", _probabilities(q, k), v)


def attention_vjp(q, k, v, cotangent) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dq, dk, dv)`` of ``sum(attention(q, k, v) * cotangent)``."""
    probs = _probabilities(q, k)
    dv = np.einsum("bhqk,bqhd->bkhd", probs, cotangent)
    dprobs = np.einsum("bqhd,bkhd->bhqk", cotangent, v)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) / np.sqrt(q.shape[-1])
    return np.einsum("bhqk,bkhd->bqhd", dscores, k), np.einsum("bhqk,bqhd->bkhd", dscores, q), dv
