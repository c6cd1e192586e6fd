"""Numpy reference: W simulated ranks, each op's outputs and its VJP.

Every function takes the list of per-rank inputs (rank r at index r) and returns the list of per-rank
outputs. It walks the same `Plan` a frontend walks (pack, dim-0 collective, unpack), so the plans are
tested with the reference. Reductions run in float64 (int64 for integers), so the reference is the
exact value the frontends are compared against.

VJPs follow ``convention="sum"`` unless the plan says ``"replicated"``: rank r's loss is L_r(y_r) and
the gradient of x_r is d(sum_r L_r)/dx_r given the per-rank cotangents dL_r/dy_r. all_reduce's max/min
send the summed cotangent to the rank(s) holding the extremum (split equally among ties) and product
multiplies it by the other ranks' values; under "replicated" each rank's own cotangent takes the sum's place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from commlib import ops
from commlib.layout import Plan, Rearrange

__all__ = [
    "run",
    "vjp",
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

Arrays = list[np.ndarray]


def _rearrange(x: np.ndarray, step: Rearrange, shape: tuple[int, ...]) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(step.view).transpose(step.perm)).reshape(shape)


def _wide(x: np.ndarray) -> np.ndarray:
    """float64 for floats, int64 for integers, bool as is: the exact arithmetic of the reference."""
    if x.dtype.kind == "f" or x.dtype.kind == "V" or str(x.dtype) == "bfloat16":
        return x.astype(np.float64)
    if x.dtype.kind in "iu":
        return x.astype(np.int64)
    return x


_REDUCE = {
    "sum": lambda stacked: stacked.sum(axis=0),
    "avg": lambda stacked: stacked.sum(axis=0),  # the plan's scale divides by W
    "max": lambda stacked: stacked.max(axis=0),
    "min": lambda stacked: stacked.min(axis=0),
    "product": lambda stacked: stacked.prod(axis=0),
}


def _collective(plan: Plan, sends: Arrays) -> Arrays:
    """The dim-0 collective on every rank, then the plan's scale (any collective: the transpose of
    reduce_scatter(avg) is an all_gather scaled by 1/W), as the frontends apply it."""
    recvs = _exchange(plan, sends)
    return recvs if plan.scale == 1.0 else [recv * plan.scale for recv in recvs]


def _exchange(plan: Plan, sends: Arrays) -> Arrays:
    W, root = plan.world_size, plan.root
    kind = plan.collective
    if kind == "all_to_all":
        return [np.stack([sends[source][rank] for source in range(W)]) for rank in range(W)]
    if kind in ("all_gather", "gather"):
        gathered = np.stack(sends)
        return [gathered if kind == "all_gather" or rank == root else np.zeros_like(gathered) for rank in range(W)]
    if kind == "broadcast":
        return [sends[root].copy() for _ in range(W)]
    if kind == "scatter":
        return [sends[root][rank] for rank in range(W)]
    if kind == "identity":
        return list(sends)
    if kind == "permute":
        received = [np.zeros_like(send) for send in sends]
        for source, destination in plan.pairs:
            received[destination] = sends[source].copy()
        return received
    reduced = _REDUCE[plan.reduce_op](np.stack(sends))
    if kind == "all_reduce":
        return [reduced.copy() for _ in range(W)]
    if kind == "reduce":
        return [reduced if rank == root else np.zeros_like(reduced) for rank in range(W)]
    if kind == "reduce_scatter":
        return [reduced[rank] for rank in range(W)]
    raise NotImplementedError(kind)


def run(plan: Plan, xs: Sequence[np.ndarray]) -> Arrays:
    """Walk `plan` on every rank's input; returns every rank's output (float64 / int64)."""
    if len(xs) != plan.world_size:
        raise ValueError(f"{plan.op}: reference got {len(xs)} ranks for world_size {plan.world_size}")
    sends = [_rearrange(_wide(np.asarray(x)), plan.pack, plan.send_shape) for x in xs]
    recvs = _collective(plan, sends)
    return [_rearrange(recv, plan.unpack, plan.out_shape) for recv in recvs]


def vjp(plan: Plan, xs: Sequence[np.ndarray], cotangents: Sequence[np.ndarray]) -> Arrays:
    """Every rank's input gradient given every rank's output cotangent (see module docstring).

    `xs` matters only for all_reduce max/min/product; the other ops are linear.
    """
    if plan.collective == "all_reduce":
        return _all_reduce_vjp(plan, xs, cotangents)
    if plan.convention == "replicated" and plan.collective == "all_gather":
        (dim,) = plan.dims
        return [np.split(_wide(np.asarray(ct)), plan.world_size, axis=dim)[rank] for rank, ct in enumerate(cotangents)]
    return run(ops.transpose(plan), cotangents)


def _all_reduce_vjp(plan: Plan, xs: Sequence[np.ndarray], cotangents: Sequence[np.ndarray]) -> Arrays:
    """``dx_s = incoming_s * dy/dx_s``; incoming is the sum of all ranks' cotangents ("sum") or this
    rank's own ("replicated": it is already the gradient of the one replicated loss)."""
    cts = [_wide(np.asarray(ct)) for ct in cotangents]
    incoming = cts if plan.convention == "replicated" else [np.sum(np.stack(cts), axis=0)] * len(cts)
    return [ct * partial for ct, partial in zip(incoming, _all_reduce_partials(plan, xs), strict=True)]


def _all_reduce_partials(plan: Plan, xs: Sequence[np.ndarray]) -> Arrays:
    """Elementwise dy/dx_s: scale (sum, avg); 1/ties at the extremum (max, min); product of the others."""
    stacked = np.stack([_wide(np.asarray(x)) for x in xs])
    if plan.reduce_op in ("max", "min"):
        hits = stacked == _REDUCE[plan.reduce_op](stacked)
        return list(hits / hits.sum(axis=0))
    if plan.reduce_op == "product":  # no division: exact where some rank holds a zero
        return [np.prod(np.delete(stacked, rank, axis=0), axis=0) for rank in range(len(xs))]
    return [np.full(stacked.shape[1:], plan.scale) for _ in xs]


def _shape_of(xs: Sequence[np.ndarray]) -> tuple[int, ...]:
    return tuple(np.shape(xs[0]))


def _dtype_of(xs: Sequence[np.ndarray]) -> str:
    return str(np.asarray(xs[0]).dtype)


def all_reduce(xs, op="sum", *, convention="sum", accum_dtype=None) -> Arrays:
    """Reference `all_reduce`: ``s -> s``, every rank gets the reduction."""
    plan = ops.all_reduce(
        _shape_of(xs), len(xs), op, dtype=_dtype_of(xs), convention=convention, accum_dtype=accum_dtype
    )
    return run(plan, xs)


def all_gather(xs, dim=-1, *, convention="sum") -> Arrays:
    """Reference `all_gather`: ``shape[dim] *= W``."""
    return run(ops.all_gather(_shape_of(xs), len(xs), dim, convention=convention), xs)


def reduce_scatter(xs, dim=0, op="sum", *, accum_dtype=None) -> Arrays:
    """Reference `reduce_scatter`: ``shape[dim] /= W``."""
    return run(ops.reduce_scatter(_shape_of(xs), len(xs), dim, op, dtype=_dtype_of(xs), accum_dtype=accum_dtype), xs)


def all_to_all(xs, scatter_dim, gather_dim) -> Arrays:
    """Reference `all_to_all`: ``shape[scatter_dim] /= W``, ``shape[gather_dim] *= W``."""
    return run(ops.all_to_all(_shape_of(xs), len(xs), scatter_dim, gather_dim), xs)


def all_to_all_4d(xs, scatter_dim=2, gather_dim=1) -> Arrays:
    """Reference `all_to_all_4d`: ``[B, S/W, H, D] -> [B, S, H/W, D]`` for (2, 1), the reverse for (1, 2)."""
    return run(ops.all_to_all_4d(_shape_of(xs), len(xs), scatter_dim, gather_dim), xs)


def broadcast(xs, src=0) -> Arrays:
    """Reference `broadcast`: every rank gets rank `src`'s input."""
    return run(ops.broadcast(_shape_of(xs), len(xs), src), xs)


def gather(xs, dst=0, dim=-1) -> Arrays:
    """Reference `gather`: the concatenation along `dim` on `dst`, zeros elsewhere."""
    return run(ops.gather(_shape_of(xs), len(xs), dst, dim), xs)


def scatter(xs, src=0, dim=0) -> Arrays:
    """Reference `scatter`: rank r gets block r of rank `src`'s input along `dim`."""
    return run(ops.scatter(_shape_of(xs), len(xs), src, dim), xs)


def permute(xs, perm) -> Arrays:
    """Reference `permute`: rank dst gets rank src's input for each (src, dst) pair; zeros elsewhere."""
    return run(ops.permute(_shape_of(xs), len(xs), perm), xs)


def sum_grad(xs) -> Arrays:
    """Reference `sum_grad`: the identity (its VJP sums the cotangents over ranks)."""
    return run(ops.sum_grad(_shape_of(xs), len(xs)), xs)
