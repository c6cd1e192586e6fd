"""The transformer block of `commlib.tools.train_block` in torch, for the examples, `commlib parity --workload train`
and the tests: RMSNorm, Ulysses attention over the SP group, a Megatron MLP over the TP group (f =
`sum_grad` before the column-parallel matmul, g = ``all_reduce(..., convention="replicated")`` after the
row-parallel one) and the residuals. Parameters are a dict of tensors named as `commlib.tools.train_block.TP_DIM`.
"""

from __future__ import annotations

import torch

import commlib_torch as ct
from commlib.tools import train_block
from commlib_torch._groups import GroupArgument
from commlib_torch.attention import attention, ulysses_attention

__all__ = ["block_loss", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def block_loss(
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    target: torch.Tensor,
    config: train_block.BlockConfig,
    groups: tuple[GroupArgument, GroupArgument] | None = None,
) -> torch.Tensor:
    """This rank's loss: ``0.5 * sum((block(x) - target)^2) / (B * S)`` over its tokens.

    x, target: ``[B, S/SP, D]``, this rank's sequence block. `groups`: the (SP, TP) groups -- process groups or
    mesh dims, ``((mesh, "sp"), (mesh, "tp"))`` -- with this rank's w_in ``[D, hidden/TP]`` and w_out
    ``[hidden/TP, D]``; None: the unsharded block (whole sequence and weights, no communication).
    """
    p = params
    B, S_local, _ = x.shape
    heads = (B, S_local, config.heads, config.head_dim)
    h = rms_norm(x, p["norm1"], config.eps)
    q, k, v = ((h @ p[name]).reshape(heads) for name in ("wq", "wk", "wv"))
    attended = (
        attention(q, k, v, causal=config.causal)
        if groups is None
        else ulysses_attention(q, k, v, groups[0], causal=config.causal)
    )
    y = x + attended.reshape(B, S_local, -1) @ p["wo"]
    u = rms_norm(y, p["norm2"], config.eps)
    if groups is not None:
        u = ct.sum_grad(u, groups[1])  # f: the TP ranks' gradients of u are summed in backward
    m = torch.nn.functional.silu(u @ p["w_in"]) @ p["w_out"]  # [B, S/SP, D]: this TP rank's partial sum
    if groups is not None:
        m = ct.all_reduce(m, group=groups[1], convention="replicated")  # g: the sum; its gradient is this rank's own
    z = y + m
    return 0.5 * (z - target).pow(2).sum() / config.tokens
