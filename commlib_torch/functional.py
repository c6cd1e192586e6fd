"""Differentiable collectives over `torch.distributed` (gloo on CPU, NCCL on CUDA).

Each public function validates through the spec (`commlib.ops`, raising `CommError` / `TypeError`
before any communication), then applies `_Collective`, an autograd Function that walks the plan forward
and applies the transposed plan backward (so double backward works); all_reduce max/min/product use
`_Extremum` / `_Product`, whose VJPs need the primal. Ranks (`src`, `dst`, `perm`) are group-local;
``group=None`` is the default (WORLD) group. Where the op is the identity (world size 1) it returns its
input itself, with no communication.

Gradients follow ``convention="sum"`` (each rank's loss is its own, the objective is their sum) unless
``convention="replicated"`` is given where the op accepts it; see docs/gradients.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlib import ops
from commlib.layout import Plan
from commlib_torch._walk import dtype_name, run
from commlib_torch._checked import guard

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_4d",
    "broadcast",
    "gather",
    "scatter",
    "permute",
    "sum_grad",
]

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


def _incoming(plan: Plan, group: Group, cotangent: torch.Tensor) -> torch.Tensor:
    """The cotangent of the reduced value: summed over ranks ("sum"), or this rank's own ("replicated").
    Differentiable, so a gradient penalty can differentiate the VJP again."""
    if plan.convention == "replicated":
        return cotangent
    summed = ops.all_reduce(cotangent.shape, plan.world_size, dtype=dtype_name(cotangent.dtype),
                            accum_dtype=plan.accum_dtype)
    return _Collective.apply(cotangent, summed, group)


class _Extremum(torch.autograd.Function):
    """all_reduce max/min: the incoming cotangent goes to the rank(s) holding the extremum, split among ties.
    The VJP is linear in the cotangent and locally constant in x, and differentiable as such."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: Plan, group: Group) -> torch.Tensor:
        out = run(plan, x, group)
        ctx.plan, ctx.group = plan, group
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, cotangent: torch.Tensor):
        x, out = ctx.saved_tensors
        with torch.no_grad():
            hits = (x == out).to(cotangent.dtype)
            ties = run(ops.all_reduce(hits.shape, ctx.plan.world_size, dtype=dtype_name(hits.dtype)), hits, ctx.group)
        return _incoming(ctx.plan, ctx.group, cotangent) * (hits / ties), None, None


class _Product(torch.autograd.Function):
    """all_reduce product: the incoming cotangent times the product of the other ranks' values (no
    division, so exact where an input is zero). The VJP is built from differentiable ops (an all_gather of
    x, torch's prod), so its second derivative is exact too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: Plan, group: Group) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        ctx.save_for_backward(x)
        return run(plan, x, group)

    @staticmethod
    def backward(ctx, cotangent: torch.Tensor):
        (x,) = ctx.saved_tensors
        W, rank = ctx.plan.world_size, dist.get_rank(ctx.group)
        everyone = _Collective.apply(x.unsqueeze(0), ops.all_gather((1, *x.shape), W, 0), ctx.group)
        others = torch.cat([everyone[:rank], everyone[rank + 1 :]]).prod(dim=0)
        return _incoming(ctx.plan, ctx.group, cotangent) * others, None, None


_FUNCTIONS = {"max": _Extremum, "min": _Extremum, "product": _Product}


def _apply(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    if plan.is_trivial:
        return x
    return guard(_FUNCTIONS.get(plan.reduce_op, _Collective)).apply(x, plan, group)  # checked mode, failures


def _world_size(group: Group) -> int:
    return dist.get_world_size(group)


def all_reduce(x: torch.Tensor, op="sum", group: Group = None, *, convention="sum", accum_dtype=None) -> torch.Tensor:
    """Reduce `x` over the ranks of `group`; every rank gets the result. ``[*s] -> [*s]``.

    Args:
        op: "sum" | "avg" (= sum / W) | "max" | "min" | "product"; a `commlib.ReduceOp` or
            `torch.distributed.ReduceOp` works too. Integer and bool tensors: forward only.
        convention: "sum": the incoming cotangent is all_reduce(sum) of the cotangents; "replicated": it is
            this rank's own (Megatron's g; `sum_grad` is its conjugate). sum: grad = incoming; avg:
            incoming / W; max/min: incoming on the rank(s) holding the extremum, split equally among ties;
            product: incoming times the product of the other ranks' values.
        accum_dtype: e.g. ``torch.float32`` for bf16 input: reduce in that dtype (forward and backward),
            return x's dtype.

    Raises:
        CommError: unknown op, avg on an integer dtype, non-floating accum_dtype. TypeError: wrong kinds.
    """
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = ops.all_reduce(
        x.shape, _world_size(group), op, dtype=dtype_name(x.dtype), convention=convention, accum_dtype=accum
    )
    return _apply(plan, x, group)


def all_gather(x: torch.Tensor, dim: int = -1, group: Group = None, *, convention="sum") -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order: ``shape[dim] *= W``.

    Backward: "sum" -> reduce_scatter(sum) of the cotangent along `dim`; "replicated" -> this rank's
    block of the cotangent. Identity: ``reduce_scatter(all_gather(x)) == W * x``.

    Raises:
        CommError: `dim` out of range.
    """
    return _apply(ops.all_gather(x.shape, _world_size(group), dim, convention=convention), x, group)


def reduce_scatter(x: torch.Tensor, dim: int = 0, op="sum", group: Group = None, *, accum_dtype=None) -> torch.Tensor:
    """Reduce over ranks and keep block `rank` of `dim`: ``shape[dim] /= W``; op in {"sum", "avg"}.

    Same value as ``all_reduce(x, op).chunk(W, dim)[rank]``. Backward: all_gather of the cotangent along
    `dim` (divided by W for avg).

    Raises:
        CommError: ``shape[dim]`` not divisible by W, op not sum/avg, avg on integers.
    """
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = ops.reduce_scatter(x.shape, _world_size(group), dim, op, dtype=dtype_name(x.dtype), accum_dtype=accum)
    return _apply(plan, x, group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group = None) -> torch.Tensor:
    """Block j of `scatter_dim` goes to rank j; received blocks are concatenated along `gather_dim` in
    rank order: ``shape[scatter_dim] /= W``, ``shape[gather_dim] *= W`` (``lax.all_to_all`` tiled).

    One local pass before and one after the collective at most, none where the layout allows a view.
    Backward: all_to_all of the cotangent with the dims swapped.

    Raises:
        CommError: dims out of range or equal, ``shape[scatter_dim]`` not divisible by W.
    """
    return _apply(ops.all_to_all(x.shape, _world_size(group), scatter_dim, gather_dim), x, group)


def all_to_all_4d(x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, group: Group = None) -> torch.Tensor:
    """Ulysses all-to-all on ``[batch, seq, heads, head_dim]``.

    ``(2, 1)``: ``[B, S/W, H, D] -> [B, S, H/W, D]``; ``(1, 2)``: ``[B, S, H/W, D] -> [B, S/W, H, D]``.
    Backward: the other direction. At batch 1 one of the two local passes is a view.

    Raises:
        CommError: ndim != 4, other dim pairs, heads (or seq) not divisible by W.
    """
    return _apply(ops.all_to_all_4d(x.shape, _world_size(group), scatter_dim, gather_dim), x, group)


def broadcast(x: torch.Tensor, src: int = 0, group: Group = None) -> torch.Tensor:
    """Every rank gets rank `src`'s `x` (same shape). Backward: the cotangents summed on `src`, zeros elsewhere.

    Raises:
        CommError: `src` not in [0, W).
    """
    return _apply(ops.broadcast(x.shape, _world_size(group), src), x, group)


def gather(x: torch.Tensor, dst: int = 0, dim: int = -1, group: Group = None) -> torch.Tensor:
    """Rank `dst` gets every rank's `x` concatenated along `dim` (``shape[dim] *= W``); the other ranks get
    zeros of that shape, so every rank can run backward. Backward: scatter of `dst`'s cotangent.

    Raises:
        CommError: `dst` not in [0, W), `dim` out of range.
    """
    return _apply(ops.gather(x.shape, _world_size(group), dst, dim), x, group)


def scatter(x: torch.Tensor, src: int = 0, dim: int = 0, group: Group = None) -> torch.Tensor:
    """Rank r gets block r of rank `src`'s `x` along `dim` (``shape[dim] /= W``); the other ranks' `x` is
    not read (its gradient is zero). Backward: gather of the cotangents to `src`.

    Raises:
        CommError: `src` not in [0, W), `dim` out of range, ``shape[dim]`` not divisible by W.
    """
    return _apply(ops.scatter(x.shape, _world_size(group), src, dim), x, group)


def permute(x: torch.Tensor, perm, group: Group = None) -> torch.Tensor:
    """For each ``(src, dst)`` in `perm`, rank dst gets rank src's `x` (``lax.ppermute`` semantics); a rank
    that is no destination gets zeros. Backward: the inverse permutation of the cotangents.

    Raises:
        CommError: a rank out of range, a repeated source or destination. TypeError: `perm` not pairs.
    """
    return _apply(ops.permute(x.shape, _world_size(group), perm), x, group)


def sum_grad(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity forward; backward all_reduce(sum) of the cotangent (Megatron's f, the conjugate of
    ``all_reduce(..., convention="replicated")``; JAX's ``pcast(x, to="varying")``)."""
    return _apply(ops.sum_grad(x.shape, _world_size(group)), x, group)


def gather_to_root(x: torch.Tensor, dst: int, dim: int, group: Group) -> torch.Tensor | None:
    """Forward-only gather (the seed's semantics): the concatenation on `dst`, None on other ranks."""
    plan = ops.gather(x.shape, _world_size(group), dst, dim)
    with torch.no_grad():
        out = x.detach().clone(memory_format=torch.contiguous_format) if plan.is_trivial else run(plan, x, group)
    return out if dist.get_rank(group) == plan.root else None
