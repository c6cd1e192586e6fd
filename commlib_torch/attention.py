"""Ulysses sequence-parallel softmax attention on commlib's `all_to_all_4d` (the parity workload)."""

from __future__ import annotations

import math

import torch

from commlib_torch._groups import Group, resolve_group
from commlib_torch.functional import all_to_all_4d

__all__ = ["attention", "ulysses_attention"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` per batch and head: ``[B, S, H, D] x3 -> [B, S, H, D]``."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Attention over the full sequence for sequence-sharded inputs: ``[B, S/W, H, D] x3 -> [B, S/W, H, D]``.

    Each input goes ``[B, S/W, H, D] -> [B, S, H/W, D]`` (`all_to_all_4d` (2, 1)), attention runs on H/W
    heads over all S positions, and the output returns by the (1, 2) all-to-all. Equal to `attention` on the
    inputs concatenated along seq, sharded the same way; gradients flow through both all-to-alls. `group`: the
    process group (None: WORLD), a 1-D DeviceMesh or ``(mesh, dim_name)``.
    """
    group = resolve_group("ulysses_attention", group)
    full = [all_to_all_4d(t, 2, 1, group) for t in (q, k, v)]
    return all_to_all_4d(attention(*full), 1, 2, group)
