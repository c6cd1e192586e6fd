"""Ulysses sequence-parallel softmax attention on commlib's `all_to_all_4d` (the parity workload)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from commlib_jax.functional import all_to_all_4d

__all__ = ["attention", "ulysses_attention"]


def attention(q, k, v):
    """``softmax(q k^T / sqrt(D)) v`` per batch and head: ``[B, S, H, D] x3 -> [B, S, H, D]``."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def ulysses_attention(q, k, v, axis_name):
    """Attention over the full sequence for sequence-sharded inputs: ``[B, S/W, H, D] x3 -> [B, S/W, H, D]``.

    Each input goes ``[B, S/W, H, D] -> [B, S, H/W, D]`` (`all_to_all_4d` (2, 1)), attention runs on H/W
    heads over all S positions, and the output returns by the (1, 2) all-to-all.
    """
    full = [all_to_all_4d(t, axis_name, 2, 1) for t in (q, k, v)]
    return all_to_all_4d(attention(*full), axis_name, 1, 2)
