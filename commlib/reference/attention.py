"""The float64 attention reference: GQA attention with masks over global positions and segment ids, forward
and VJP, in numpy float64 -- the definition every attention layer (Ulysses, ring, USP, cross-attention) and
both frontends are checked against. `commlib.attention` re-exports `attention`, `attention_vjp` and
`causal_mask` (their documented path).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from commlib.masks import MaskRule, rule_mask, segment_mask

__all__ = ["causal_mask", "attention", "attention_vjp"]


def causal_mask(q_positions: npt.ArrayLike, k_positions: npt.ArrayLike) -> np.ndarray:
    """``[Sq, Sk]`` bool: query at global position p sees the keys at positions <= p.

    >>> causal_mask([1, 2], [0, 2, 1]).astype(int)
    array([[1, 0, 1],
           [1, 1, 1]])
    """
    return np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]


def _visible(
    q: np.ndarray,
    k: np.ndarray,
    causal: bool,
    q_positions: npt.ArrayLike | None,
    k_positions: npt.ArrayLike | None,
    q_segments: npt.ArrayLike | None = None,
    k_segments: npt.ArrayLike | None = None,
    mask: MaskRule | None = None,
) -> np.ndarray:
    """Which keys each query sees: ``[Sq, Sk]`` bool (all, or the causal mask over global positions), and with
    segment ids (``[B, Sq]``, ``[B, Sk]``) ``[B, 1, Sq, Sk]``: also only keys of the query's segment, padding
    (a negative id) seeing and seen by nothing (`commlib.masks.segment_mask`); with a `mask` rule also its mask
    of the positions (`commlib.masks.rule_mask`)."""
    query = np.arange(q.shape[1]) if q_positions is None else np.asarray(q_positions)
    key = np.arange(k.shape[1]) if k_positions is None else np.asarray(k_positions)
    if mask is not None:
        visible = rule_mask(query, key, causal, mask)
    elif not causal:
        visible = np.ones((q.shape[1], k.shape[1]), dtype=bool)
    else:
        visible = causal_mask(query, key)
    if q_segments is None and k_segments is None:
        return visible
    q_segments = np.asarray(q_segments)
    k_segments = q_segments if k_segments is None else np.asarray(k_segments)
    return (visible & segment_mask(q_segments, k_segments))[:, None]


def _probabilities(q: np.ndarray, k: np.ndarray, scale: float, visible: np.ndarray) -> np.ndarray:
    """Softmax weights ``[B, H, Sq, Sk]`` (k already has H heads); rows that see no key are all zero."""
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = np.where(visible, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    weights = np.where(visible, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    return weights / np.where(total > 0, total, 1.0)


def _expanded(x: npt.ArrayLike, group: int) -> np.ndarray:
    """kv heads repeated for the q heads that use them: ``[B, S, H_kv, D] -> [B, S, H, D]``."""
    return np.repeat(np.asarray(x, dtype=np.float64), group, axis=2)


def _prepared(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    causal: bool,
    scale: float | None,
    q_positions: npt.ArrayLike | None,
    k_positions: npt.ArrayLike | None,
    q_segments: npt.ArrayLike | None = None,
    k_segments: npt.ArrayLike | None = None,
    mask: MaskRule | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, float, np.ndarray]:
    q = np.asarray(q, dtype=np.float64)
    group = q.shape[2] // max(np.shape(k)[2], 1)  # 0 // 1: a rank with no heads
    k_full, v_full = _expanded(k, group), _expanded(v, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    visible = _visible(q, k_full, causal, q_positions, k_positions, q_segments, k_segments, mask)
    probs = _probabilities(q, k_full, scale, visible)
    return q, k_full, v_full, group, scale, probs


def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    q_positions: npt.ArrayLike | None = None,
    k_positions: npt.ArrayLike | None = None,
    q_segments: npt.ArrayLike | None = None,
    k_segments: npt.ArrayLike | None = None,
    mask: MaskRule | None = None,
) -> np.ndarray:
    """float64 GQA attention: ``softmax(q k^T * scale + mask) v`` per batch and q head, q head i using kv head
    ``i // (H // H_kv)``: q ``[B, Sq, H, D]``, k ``[B, Sk, H_kv, D]``, v ``[B, Sk, H_kv, D_v]`` ->
    ``[B, Sq, H, D_v]``. `scale` defaults to ``1 / sqrt(D)``; `causal`: query at global position p sees keys
    at positions <= p (positions default to ``0..S-1``); `q_segments` / `k_segments` (integers ``[B, Sq]`` /
    ``[B, Sk]``; k's default to q's): a query sees only the keys of its segment, a negative id (padding) sees
    and is seen by nothing; `mask` (a `commlib.masks.MaskRule`: `BlockCausal`, `SlidingWindow`) on the global
    positions, ANDed with the others. A query that sees no key gives zeros (and gradient 0); a NaN in q, k or v
    gives NaN in the rows that see it.

    >>> q = k = v = np.ones((1, 3, 1, 2))
    >>> attention(q, k, v, q_segments=np.array([[0, 0, -1]]))[0, :, 0].tolist()  # the padding row: 0
    [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    """
    _, _, v_full, _, _, probs = _prepared(
        q, k, v, causal, scale, q_positions, k_positions, q_segments, k_segments, mask
    )
    return np.einsum("bhqk,bkhd->bqhd", probs, v_full)


def attention_vjp(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cotangent: npt.ArrayLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    q_positions: npt.ArrayLike | None = None,
    k_positions: npt.ArrayLike | None = None,
    q_segments: npt.ArrayLike | None = None,
    k_segments: npt.ArrayLike | None = None,
    mask: MaskRule | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dq, dk, dv)`` of ``sum(attention(q, k, v, ...) * cotangent)`` (float64; the keywords as
    `attention`'s); a kv head's gradient sums over the q heads that use it. A query that sees no key adds 0."""
    q, k_full, v_full, group, scale, probs = _prepared(
        q, k, v, causal, scale, q_positions, k_positions, q_segments, k_segments, mask
    )
    cotangent = np.asarray(cotangent, dtype=np.float64)
    dv_full = np.einsum("bhqk,bqhd->bkhd", probs, cotangent)
    dprobs = np.einsum("bqhd,bkhd->bhqk", cotangent, v_full)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) * scale
    dq = np.einsum("bhqk,bkhd->bqhd", dscores, k_full)
    dk_full = np.einsum("bhqk,bqhd->bkhd", dscores, q)
    kv_heads = np.shape(k)[2]  # named, not -1: an empty sequence (S = 0) has nothing to infer it from
    fold = lambda x: x.reshape(*x.shape[:2], kv_heads, group, x.shape[-1]).sum(axis=3)  # noqa: E731
    return dq, fold(dk_full), fold(dv_full)
