"""Differentiable collectives over `torch.distributed` (gloo on CPU, NCCL on CUDA).

Each public function validates through the spec (`commlib.ops`, raising `CommError` / `TypeError`
before any communication), then applies `_Collective`, an autograd Function that walks the plan forward
and applies the transposed plan backward (so double backward works). Ranks are group-local; ``group=None``
is the default (WORLD) group. At world size 1 every op returns its input itself (no communication).

Gradients follow ``convention="sum"`` (each rank's loss is its own, the objective is their sum) unless
``convention="replicated"`` is given where the op accepts it; see docs/gradients.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlib import ops
from commlib.layout import Plan
from commlib_torch._walk import dtype_name, rearrange, run

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_4d"]

Group = dist.ProcessGroup | None


class _Collective(torch.autograd.Function):
    """A linear collective: forward walks `plan`, backward walks its transpose (or the replicated rule)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: Plan, group: Group) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        return run(plan, x, group)

    @staticmethod
    def backward(ctx, cotangent: torch.Tensor):
        return _vjp(ctx.plan, ctx.group, cotangent), None, None


def _vjp(plan: Plan, group: Group, cotangent: torch.Tensor) -> torch.Tensor:
    if plan.convention == "replicated" and plan.collective == "all_reduce":
        return cotangent if plan.scale == 1.0 else cotangent * plan.scale
    if plan.convention == "replicated" and plan.collective == "all_gather":
        (dim,) = plan.dims
        return cotangent.chunk(plan.world_size, dim)[dist.get_rank(group)]
    return _Collective.apply(cotangent, ops.transpose(plan), group)


def _apply(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if plan.world_size == 1 else _Collective.apply(x, plan, group)


def all_reduce(x: torch.Tensor, op="sum", group: Group = None, *, convention="sum", accum_dtype=None) -> torch.Tensor:
    """Reduce `x` over the ranks of `group`; every rank gets the result. ``[*s] -> [*s]``.

    Args:
        op: "sum" | "avg" (= sum / W); a `commlib.ReduceOp` or `torch.distributed.ReduceOp` works too.
        convention: "sum": backward is all_reduce(sum) of the cotangent (avg: divided by W);
            "replicated": backward is the identity, divided by W for avg (Megatron's g; `sum_grad` is its
            conjugate).
        accum_dtype: e.g. ``torch.float32`` for bf16 input: reduce in that dtype (forward and backward),
            return x's dtype.

    Raises:
        CommError: unknown op, avg on an integer dtype, non-floating accum_dtype. TypeError: wrong kinds.
    """
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = ops.all_reduce(
        x.shape, dist.get_world_size(group), op, dtype=dtype_name(x.dtype), convention=convention, accum_dtype=accum
    )
    return _apply(plan, x, group)


def all_gather(x: torch.Tensor, dim: int = -1, group: Group = None, *, convention="sum") -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order: ``shape[dim] *= W``.

    Backward: "sum" -> reduce_scatter(sum) of the cotangent along `dim`; "replicated" -> this rank's
    block of the cotangent. Identity: ``reduce_scatter(all_gather(x)) == W * x``.

    Raises:
        CommError: `dim` out of range.
    """
    plan = ops.all_gather(x.shape, dist.get_world_size(group), dim, convention=convention)
    return _apply(plan, x, group)


def reduce_scatter(x: torch.Tensor, dim: int = 0, op="sum", group: Group = None, *, accum_dtype=None) -> torch.Tensor:
    """Reduce over ranks and keep block `rank` of `dim`: ``shape[dim] /= W``; op in {"sum", "avg"}.

    Same value as ``all_reduce(x, op).chunk(W, dim)[rank]``. Backward: all_gather of the cotangent along
    `dim` (divided by W for avg).

    Raises:
        CommError: ``shape[dim]`` not divisible by W, op not sum/avg, avg on integers.
    """
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = ops.reduce_scatter(
        x.shape, dist.get_world_size(group), dim, op, dtype=dtype_name(x.dtype), accum_dtype=accum
    )
    return _apply(plan, x, group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group = None) -> torch.Tensor:
    """Block j of `scatter_dim` goes to rank j; received blocks are concatenated along `gather_dim` in
    rank order: ``shape[scatter_dim] /= W``, ``shape[gather_dim] *= W`` (``lax.all_to_all`` tiled).

    One local pass before and one after the collective at most, none where the layout allows a view.
    Backward: all_to_all of the cotangent with the dims swapped.

    Raises:
        CommError: dims out of range or equal, ``shape[scatter_dim]`` not divisible by W.
    """
    plan = ops.all_to_all(x.shape, dist.get_world_size(group), scatter_dim, gather_dim)
    return _apply(plan, x, group)


def all_to_all_4d(x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, group: Group = None) -> torch.Tensor:
    """Ulysses all-to-all on ``[batch, seq, heads, head_dim]``.

    ``(2, 1)``: ``[B, S/W, H, D] -> [B, S, H/W, D]``; ``(1, 2)``: ``[B, S, H/W, D] -> [B, S/W, H, D]``.
    Backward: the other direction. At batch 1 one of the two local passes is a view.

    Raises:
        CommError: ndim != 4, other dim pairs, heads (or seq) not divisible by W.
    """
    plan = ops.all_to_all_4d(x.shape, dist.get_world_size(group), scatter_dim, gather_dim)
    return _apply(plan, x, group)


def check_peer(op: str, peer: int, world_size: int) -> int:
    """A validated group-local peer rank for point-to-point calls."""
    return ops.check_rank(op, "peer", peer, world_size)


def gather_plan(x: torch.Tensor, dst: int, dim: int, group: Group) -> Plan:
    return ops.gather(x.shape, dist.get_world_size(group), dst, dim)


def gather_to_root(x: torch.Tensor, plan: Plan, group: Group) -> torch.Tensor | None:
    """Forward-only gather: the concatenation on `plan.root`, None on other ranks."""
    send = x.contiguous()
    is_root = dist.get_rank(group) == plan.root
    recv = torch.empty(plan.recv_shape, dtype=x.dtype, device=x.device) if is_root else None
    dist.gather(send, list(recv.unbind(0)) if is_root else None, dst=global_rank(group, plan.root), group=group)
    return rearrange(recv, plan.unpack, plan.out_shape, x.dtype) if is_root else None


def global_rank(group: Group, rank: int) -> int:
    """The global rank of group-local `rank`."""
    return rank if group is None else dist.get_global_rank(group, rank)
