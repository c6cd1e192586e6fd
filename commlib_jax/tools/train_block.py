"""The transformer block of `commlib.tools.train_block` in JAX, for the examples, `commlib parity --workload train` and
the tests: RMSNorm, Ulysses attention over the SP axis, a Megatron MLP over the TP axis (f = `sum_grad`
before the column-parallel matmul, g = ``all_reduce(..., convention="replicated")`` after the row-parallel
one) and the residuals. Parameters are a dict of arrays named as `commlib.tools.train_block.TP_DIM`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import commlib_jax as cj
from commlib.tools import train_block
from commlib_jax.attention import attention, ulysses_attention

__all__ = ["block_loss", "parameter_specs", "rms_norm"]


def rms_norm(x, weight, eps: float):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def parameter_specs(tp_axis: str) -> dict[str, P]:
    """shard_map specs of the parameters: w_in split by columns and w_out by rows over `tp_axis`, the rest P()."""
    specs = {None: P(), 0: P(tp_axis, None), 1: P(None, tp_axis)}
    return {name: specs[dim] for name, dim in train_block.TP_DIM.items()}


def block_loss(params: dict, x, target, config: train_block.BlockConfig, axes: tuple[str, str] | None = None):
    """This rank's loss: ``0.5 * sum((block(x) - target)^2) / (B * S)`` over its tokens.

    x, target: ``[B, S/SP, D]``, this rank's sequence block. `axes`: the (SP, TP) axis names of the enclosing
    shard_map / pmap, with this rank's w_in ``[D, hidden/TP]`` and w_out ``[hidden/TP, D]``; None: the
    unsharded block (whole sequence and weights, no communication).
    """
    p = params
    B, S_local, _ = x.shape
    heads = (B, S_local, config.heads, config.head_dim)
    h = rms_norm(x, p["norm1"], config.eps)
    q, k, v = ((h @ p[name]).reshape(heads) for name in ("wq", "wk", "wv"))
    attended = (
        attention(q, k, v, causal=config.causal)
        if axes is None
        else ulysses_attention(q, k, v, axes[0], causal=config.causal)
    )
    y = x + attended.reshape(B, S_local, -1) @ p["wo"]
    u = rms_norm(y, p["norm2"], config.eps)
    if axes is not None:
        u = cj.sum_grad(u, axes[1])  # f: the TP ranks' gradients of u are summed in backward
    m = jax.nn.silu(u @ p["w_in"]) @ p["w_out"]  # [B, S/SP, D]: this TP rank's partial sum
    if axes is not None:
        m = cj.all_reduce(m, axes[1], convention="replicated")  # g: the sum; its gradient is this rank's own
    z = y + m
    return 0.5 * jnp.sum((z - target) ** 2) / config.tokens
