"""The float64 reference of joint attention (MMDiT; `commlib.joint`): attention of the full sequence and the
joint tokens concatenated, cut back into the sequence's part and the joint part, forward and VJP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from commlib.reference.attention import attention, attention_vjp

__all__ = ["concatenated", "reference"]


def concatenated(x: npt.ArrayLike, joint: npt.ArrayLike, position: str) -> np.ndarray:
    """float64 ``[B, S + S_j, ...]``: `joint` before (front) or after (rear) `x` along dim 1."""
    parts = [np.asarray(x, dtype=np.float64), np.asarray(joint, dtype=np.float64)]
    return np.concatenate(parts[::-1] if position == "front" else parts, axis=1)


def reference(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    joint: Sequence[npt.ArrayLike],
    position: str = "front",
    *,
    causal: bool = False,
    scale: float | None = None,
    cotangents: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
) -> tuple[np.ndarray, np.ndarray, Any]:
    """float64 joint attention of the FULL sequence q, k, v ``[B, S, *, D]`` and the joint tensors `joint`
    (``(joint_q, joint_k, joint_v)``, ``[B, S_j, *, D]``): `commlib.reference.attention.attention` of the concatenation
    at `position` (causal over its positions), cut back into ``(out [B, S, H, D_v], joint_out [B, S_j, H, D_v],
    grads)``; with `cotangents` ``(of out, of joint_out)`` ``grads`` = the VJP ``(dq, dk, dv, d joint_q,
    d joint_k, d joint_v)``, else None.

    >>> q = np.random.default_rng(0).normal(size=(1, 3, 2, 4))
    >>> out, joint_out, _ = reference(q, q, q, (q[:, :1],) * 3, "rear", causal=True)
    >>> from commlib.reference.attention import attention
    >>> keys = np.concatenate([q, q[:, :1]], axis=1)  # [sequence | joint]
    >>> bool(np.allclose(joint_out, attention(q[:, :1], keys, keys)))  # the last position sees every key
    True
    """
    seq = np.shape(q)[1]
    inputs = [concatenated(x, joint_x, position) for x, joint_x in zip((q, k, v), joint, strict=True)]
    full = attention(*inputs, causal=causal, scale=scale)
    split = _splitter(seq, np.shape(joint[0])[1], position)
    out, joint_out = split(full)
    if cotangents is None:
        return out, joint_out, None
    cotangent = concatenated(cotangents[0], cotangents[1], position)
    grads = attention_vjp(inputs[0], inputs[1], inputs[2], cotangent, causal=causal, scale=scale)
    pieces = [split(grad) for grad in grads]
    return out, joint_out, tuple(piece[0] for piece in pieces) + tuple(piece[1] for piece in pieces)


def _splitter(seq: int, joint_seq: int, position: str) -> Any:
    """``x [B, S + S_j, ...] -> (x's sequence rows, x's joint rows)``."""
    if position == "front":
        return lambda x: (x[:, joint_seq:], x[:, :joint_seq])
    return lambda x: (x[:, :seq], x[:, seq:])
