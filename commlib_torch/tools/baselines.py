"""Baselines the benchmarks compare commlib with (tooling, not the library): the seed's three-copy Ulysses
all-to-all (FastVideo's ``AllToAll4D``, the algorithm the project started from), the usual hand-written
Ulysses layout (DeepSpeed-Ulysses / yunchang style: permute + contiguous around a dim-0 all-to-all), and the
training block of `commlib_torch.tools.train_block` written the same way on raw ``torch.distributed``: that
Ulysses layout around ``torch.distributed.nn.functional.all_to_all_single``, and Megatron's f and g as the
autograd Functions Megatron-LM writes (``_CopyToModelParallelRegion``, ``_ReduceFromModelParallelRegion``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "ByHand",
    "CopyToTensorParallel",
    "ReduceFromTensorParallel",
    "SeedAllToAll4D",
    "block_loss_by_hand",
    "seed_all_to_all_4d",
    "ulysses_by_hand",
]


def seed_all_to_all_4d(input_, world_size, scatter_dim, gather_dim, exchange=None):
    """The seed's three-copy ``AllToAll4D.forward``, verbatim but for `exchange(output, input)` (default
    ``dist.all_to_all_single``), so the layout benchmark can run it without communication."""
    exchange = exchange or dist.all_to_all_single
    if scatter_dim == 2 and gather_dim == 1:
        bs, shard_seqlen, hn, hd = input_.shape
        shard_hn = hn // world_size
        input_ = input_.transpose(0, 2).contiguous()  # hn, shard_seqlen, bs, hd
        output = torch.empty_like(input_)
        exchange(output, input_)  # hn, shard_seqlen, bs, hd
        output = torch.cat(output.split(shard_hn), dim=1)  # sharded hn, seqlen, bs, hd
        return output.transpose(0, 2).contiguous()  # bs, seqlen, sharded_hn, hd
    bs, seqlen, shard_hn, hd = input_.shape
    shard_seqlen = seqlen // world_size
    input_ = input_.transpose(0, 2).contiguous()  # shard_hn, seqlen, bs, hd
    input_ = (
        input_.reshape(shard_hn, world_size, shard_seqlen, bs, hd)
        .transpose(0, 1)
        .reshape(shard_hn * world_size, shard_seqlen, bs, hd)
        .contiguous()
    )
    output = torch.empty_like(input_)
    exchange(output, input_)
    return output.transpose(0, 2).contiguous()  # bs, seqlen, sharded_hn, hd


class SeedAllToAll4D(torch.autograd.Function):
    """The seed's autograd Function: backward is the same algorithm with the dims swapped."""

    @staticmethod
    def forward(ctx, input_, world_size, scatter_dim, gather_dim):
        ctx.args = (world_size, gather_dim, scatter_dim)
        return seed_all_to_all_4d(input_, world_size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad_output):
        return SeedAllToAll4D.apply(grad_output, *ctx.args), None, None, None


def ulysses_by_hand(x, world_size, scatter_dim, gather_dim, exchange):
    """The usual hand-written Ulysses all-to-all (DeepSpeed-Ulysses / yunchang style): permute + contiguous
    around a dim-0 all_to_all_single, `exchange(send) -> recv`."""
    if (scatter_dim, gather_dim) == (2, 1):
        bs, shard_seqlen, hn, hd = x.shape
        send = x.reshape(bs, shard_seqlen, world_size, hn // world_size, hd).transpose(0, 2).contiguous()
        recv = exchange(send)  # [W, shard_seqlen, bs, hn/W, hd]
        recv = recv.reshape(world_size * shard_seqlen, bs, hn // world_size, hd)
        return recv.transpose(0, 1).contiguous()
    bs, seqlen, shard_hn, hd = x.shape
    send = x.reshape(bs, world_size, seqlen // world_size, shard_hn, hd).transpose(0, 1).contiguous()
    recv = exchange(send)  # [W, bs, seqlen/W, shard_hn, hd]
    return recv.permute(1, 2, 0, 3, 4).reshape(bs, seqlen // world_size, world_size * shard_hn, hd).contiguous()


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, the gradient all_reduced over the TP group in place."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: the partial sums all_reduced over the TP group in place, the gradient passed through."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def block_loss_by_hand(params, x, target, config, groups):
    """`commlib_torch.tools.train_block.block_loss` on a mesh, written as users write it on raw torch.distributed
    (the same math, the same local attention): `groups` = (SP, TP) process groups."""
    import torch.distributed.nn.functional as nn_functional

    from commlib_torch.attention import attention
    from commlib_torch.tools.train_block import rms_norm

    sp_group, tp_group = groups
    W = dist.get_world_size(sp_group)
    exchange = lambda send: nn_functional.all_to_all_single(torch.empty_like(send), send, group=sp_group)  # noqa: E731
    p, (B, S_local, _) = params, x.shape
    h = rms_norm(x, p["norm1"], config.eps)
    q, k, v = ((h @ p[name]).reshape(B, S_local, config.heads, config.head_dim) for name in ("wq", "wk", "wv"))
    full = [ulysses_by_hand(t, W, 2, 1, exchange) for t in (q, k, v)]
    attended = ulysses_by_hand(attention(*full, causal=config.causal), W, 1, 2, exchange)
    y = x + attended.reshape(B, S_local, -1) @ p["wo"]
    u = CopyToTensorParallel.apply(rms_norm(y, p["norm2"], config.eps), tp_group)
    m = ReduceFromTensorParallel.apply(torch.nn.functional.silu(u @ p["w_in"]) @ p["w_out"], tp_group)
    return 0.5 * (y + m - target).pow(2).sum() / config.tokens


class ByHand(torch.autograd.Function):
    """One autograd Function around a hand-written collective: ``forward = call(x)``, ``backward =
    dual(cotangent)`` (through `ByHand` again). The host-time bench's floor for any differentiable collective:
    the raw c10d call, its buffers and one Function, nothing else."""

    @staticmethod
    def forward(ctx, x, call, dual):
        ctx.call, ctx.dual = call, dual
        return call(x)

    @staticmethod
    def backward(ctx, cotangent):
        return ByHand.apply(cotangent, ctx.dual, ctx.call), None, None
