"""Baselines the benchmarks compare commlib with (tooling, not the library): the seed's three-copy Ulysses
all-to-all (FastVideo's ``AllToAll4D``, the algorithm the project started from) and the usual hand-written
Ulysses layout (DeepSpeed-Ulysses / yunchang style: permute + contiguous around a dim-0 all-to-all)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["SeedAllToAll4D", "seed_all_to_all_4d", "ulysses_by_hand"]


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
    input_ = input_.reshape(shard_hn, world_size, shard_seqlen, bs, hd).transpose(0, 1).reshape(
        shard_hn * world_size, shard_seqlen, bs, hd).contiguous()
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
