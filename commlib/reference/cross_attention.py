"""The float64 cross-attention reference: q attends the FULL k, v under `commlib.cross_attention.visible`'s rule,
forward and VJP -- what `cross_attention` is checked against in both kv modes (replicated, sharded)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from commlib.cross_attention import visible
from commlib.reference.attention import _expanded, _probabilities

__all__ = ["reference"]


def reference(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cotangent: npt.ArrayLike | None = None,
    *,
    scale: float | None = None,
    q_ids: npt.ArrayLike | None = None,
    kv_ids: npt.ArrayLike | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """float64 cross-attention of q ``[B, Sq, H, D]`` to the FULL k, v ``[B, S_kv, H_kv, D]`` with the `visible`
    rule, and with a `cotangent` the VJP ``(dq, dk, dv)`` (else None): `commlib.reference.attention.attention`
    with a mask of different query and key lengths."""
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    mask = visible(None if q_ids is None else np.asarray(q_ids), None if kv_ids is None else np.asarray(kv_ids))
    mask = np.ones((q64.shape[0], q64.shape[1], k64.shape[1]), dtype=bool) if mask is None else mask
    mask = np.broadcast_to(mask, (q64.shape[0], q64.shape[1], k64.shape[1]))
    group = q64.shape[2] // k64.shape[2]
    k_full, v_full = _expanded(k64, group), _expanded(v64, group)
    scale = 1.0 / np.sqrt(q64.shape[-1]) if scale is None else scale
    probs = _probabilities(q64, k_full, scale, mask[:, None])
    out = np.einsum("bhqk,bkhd->bqhd", probs, v_full)
    if cotangent is None:
        return out, None
    cot = np.asarray(cotangent, dtype=np.float64)
    dv_full = np.einsum("bhqk,bqhd->bkhd", probs, cot)
    dprobs = np.einsum("bqhd,bkhd->bhqk", cot, v_full)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) * scale
    dq = np.einsum("bhqk,bkhd->bqhd", dscores, k_full)
    dk_full = np.einsum("bhqk,bqhd->bkhd", dscores, q64)
    fold = lambda x: x.reshape(*x.shape[:2], k64.shape[2], group, x.shape[-1]).sum(axis=3)  # noqa: E731
    return out, (dq, fold(dk_full), fold(dv_full))
