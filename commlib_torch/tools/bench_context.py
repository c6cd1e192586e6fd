"""The context-parallel attention cases of `commlib bench` (torch): ring attention, USP and Ulysses attention,
forward and backward, each against the all-gather-KV baseline in the same sequence layout (every rank gathers
the whole k and v with `commlib_torch.all_gather` and attends with SDPA under the causal mask at its global
positions: what a context-parallel layer without a ring does).

Inputs: q ``[1, S/W, 8, 64]``, k and v ``[1, S/W, 2, 64]`` (GQA), float32, causal; the size is q's bytes per
rank (``S/W = bytes / 2048``). Ring and USP use the zigzag layout, Ulysses the contiguous one. USP runs on
``(W/2) x 2`` (Ulysses pairs, ring across them). Each variant returns its output and dq, dk, dv, and the
bench checks the variants agree. Shapes, sizes and wire bytes (all ranks, one forward + backward): the
spec's (`commlib.tools.bench.context_wire`), shared with the JAX cases.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commlib_torch
from commlib import shard_positions
from commlib.tools.bench import CONTEXT_BASELINE as _BASELINE
from commlib.tools.bench import CONTEXT_SHAPE, CONTEXT_SIZES_MIB, context_rows, context_wire
from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from commlib_torch.tools.bench_cases import bench_case
from commlib_torch.tools.pool import WorkerContext

__all__: list[str] = []

_HEADS, _KV_HEADS, _HEAD_DIM = CONTEXT_SHAPE
_USP_GROUPS: dict[int, tuple] = {}


def _inputs(ctx: WorkerContext, rows: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + ctx.rank)
    shapes = [
        (1, rows, _HEADS, _HEAD_DIM),
        (1, rows, _KV_HEADS, _HEAD_DIM),
        (1, rows, _KV_HEADS, _HEAD_DIM),
        (1, rows, _HEADS, _HEAD_DIM),
    ]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _step(attend, q, k, v, cotangent):
    """Forward + backward of `attend`: its output and dq, dk, dv, flat."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves)
    grads = torch.autograd.grad(out, leaves, cotangent)
    return torch.cat([out.detach().reshape(-1), *(grad.reshape(-1) for grad in grads)])


def _all_gather_kv(positions, rank: int, group=None):
    """Attention of this rank's q against the gathered k, v (commlib all_gather along seq, in rank order) with
    the causal mask at the shards' global positions."""
    q_positions = torch.from_numpy(positions[rank])
    k_positions = torch.from_numpy(positions.reshape(-1))
    mask = k_positions[None, :] <= q_positions[:, None]

    def attend(q, k, v):
        keys, values = (commlib_torch.all_gather(x, 1, group) for x in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2)

    return attend


def _case(kind: str, subject: str):
    @bench_case(
        f"{kind} attention fwd+bwd",
        baselines=(_BASELINE,),
        subject=subject,
        wire=lambda W, nbytes: context_wire(kind, W, nbytes),
        sizes_mib=CONTEXT_SIZES_MIB,
    )
    def build(ctx, nbytes):
        W, rows = ctx.world_size, context_rows(nbytes)
        q, k, v, cotangent = _inputs(ctx, rows)
        if kind == "ring":
            positions = shard_positions(rows * W, W, "zigzag")
            attend = lambda *x: ring_attention(*x, causal=True, layout="zigzag")  # noqa: E731
        elif kind == "usp":
            positions = shard_positions(rows * W, W // 2, "zigzag", ulysses_size=2)
            groups = _usp_groups(W)
            attend = lambda *x: usp_attention(*x, *groups, causal=True, layout="zigzag")  # noqa: E731
        else:
            positions = shard_positions(rows * W, W)
            attend = lambda *x: ulysses_attention(*x, causal=True)  # noqa: E731
        baseline = _all_gather_kv(positions, ctx.rank)
        return {
            subject: lambda: _step(attend, q, k, v, cotangent),
            _BASELINE: lambda: _step(baseline, q, k, v, cotangent),
        }


def _usp_groups(world_size: int) -> tuple:
    """(Ulysses group, ring group) of this rank: rank ``r * 2 + u`` (Ulysses pairs, the ring across them)."""
    if world_size not in _USP_GROUPS:
        rank, mine = dist.get_rank(), [None, None]
        for r in range(world_size // 2):
            group = dist.new_group([2 * r, 2 * r + 1])
            mine[0] = group if rank // 2 == r else mine[0]
        for u in range(2):
            group = dist.new_group(list(range(u, world_size, 2)))
            mine[1] = group if rank % 2 == u else mine[1]
        _USP_GROUPS[world_size] = tuple(mine)
    return _USP_GROUPS[world_size]


_case("ring", "commlib ring")
_case("usp", "commlib usp")
_case("ulysses", "commlib ulysses")
