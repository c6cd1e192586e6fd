"""Every gradient rule of commlib, written once; the torch frontend, the JAX frontend and the numpy
reference walk what this module gives them.

Linear ops: `vjp_plan(plan)` is the plan of the op's VJP -- another plan the frontends walk on the cotangent,
whose own VJP comes from `vjp_plan` again, so every higher derivative is exact too:

=========================================  ==============================================================
forward plan                               VJP plan
=========================================  ==============================================================
all_reduce sum/avg, convention "sum"       all_reduce(sum), the same scale (1/W for avg)
all_reduce sum/avg, "replicated"           identity times the scale (the cotangent is already the total)
all_gather, "sum" / "replicated"           reduce_scatter(sum) / this rank's block (`SLICE`)
reduce_scatter                             all_gather, the same scale
all_to_all (scatter_dim a, gather_dim b)   all_to_all (scatter_dim b, gather_dim a); a == b: itself
broadcast / reduce sum/avg (root r)        reduce(sum) / broadcast, the same scale (root r)
gather / scatter (root r)                  scatter / gather (root r)
permute (pairs)                            permute (pairs inverted)
sum_grad (identity, replicated input)      all_reduce(sum)
shard (slice, replicated input)            all_gather, times the plan's grad_scale (1/W with scale_grad)
local identity / slice / pad               identity / pad / slice (their transposes)
=========================================  ==============================================================

Uneven sizes (`commlib.uneven`) keep the table: the dual of an uneven op is the dual op with the sizes
swapped (scatter_sizes <-> gather_sizes) in the same layout, e.g. all_gather(sizes) -> reduce_scatter(sizes)
and all_to_all(scatter_sizes=s, gather_sizes=g) -> all_to_all(scatter_sizes=g, gather_sizes=s), dims swapped.

Non-linear reductions (all_reduce max, min, product) need the primal, so their rules are short programs
over the `Backend` operations each frontend provides (array-api-compat style: one implementation, bound
per library): `forward` and `vjp` below. Let ``g`` be the incoming cotangent -- the sum of every rank's
cotangent (convention "sum") or this rank's own ("replicated"):

- max / min: ``g`` goes to the rank(s) holding the result, split equally among ties. A NaN on any rank makes
  the result NaN (as ``numpy.maximum``), and then ``g`` goes to the rank(s) holding a NaN, split equally.
- product: ``g`` times the product of the other ranks' values (no division: exact where an input is 0).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Protocol

from commlib import plans, uneven
from commlib.dtypes import has_nan
from commlib.layout import (
    Collective,
    Convention,
    Plan,
    all_gather_layout,
    all_to_all_layout,
    flat_layout,
    local_layout,
    reduce_scatter_layout,
)
from commlib.reduce_op import ReduceOp

__all__ = ["Backend", "forward", "needs_output", "needs_primal", "vjp", "vjp_plan"]

_EXTREMA = frozenset({ReduceOp.MAX, ReduceOp.MIN})
_READS_PRIMAL = _EXTREMA | {ReduceOp.PRODUCT}
_ALL_REDUCE = Collective.ALL_REDUCE  # per-call tests: a member read through its enum class costs ~0.15 us


class Backend(Protocol):
    """The operations the non-linear rules use, on one rank's arrays (a frontend's tensors, or the numpy
    reference's stacked [W, ...] arrays). Arithmetic (``*``, ``/``, ``|``, ``&``, ``>``) is the arrays' own."""

    def collective(self, plan: Plan, x: Any) -> Any:
        """`plan` walked on `x` (differentiable where the frontend differentiates the rule again)."""

    def isnan(self, x: Any) -> Any:
        """Elementwise NaN test (False for integers)."""

    def astype(self, x: Any, dtype: str | Any) -> Any:
        """`x` cast to a dtype name, or to the dtype of the array given."""

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        """Elementwise select; `x` may be a Python scalar."""

    def prod(self, x: Any, axis: int) -> Any:
        """Product over `axis`."""

    def expand_dims(self, x: Any, axis: int) -> Any:
        """A new axis of size 1 at `axis`."""

    def own_rank(self, world_size: int, ndim: int) -> Any:
        """Boolean ``[W, 1, ..., 1]`` (`ndim` axes) that is True at this rank's index."""


@functools.lru_cache(maxsize=4096)
def vjp_plan(plan: Plan) -> Plan:
    """The plan of the VJP of a linear `plan` (see the module table); the cotangent has `plan.out_shape`.

    >>> from commlib import plans
    >>> dual = vjp_plan(plans.all_gather((3, 5), 4, dim=0))
    >>> dual.collective.value, dual.in_shape, dual.out_shape
    ('reduce_scatter', (12, 5), (3, 5))
    >>> vjp_plan(plans.all_gather((3, 5), 4, dim=0, convention="replicated")).collective.value
    'slice'
    """
    convention = plan.convention
    if plan.reduce_op is not None and plan.reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise NotImplementedError(f"{plan.op_name}: op {plan.reduce_op.value!r} is not linear: use gradients.vjp")
    if convention is Convention.REPLICATED:
        return _replicated_dual(plan)
    if convention is Convention.REPLICATED_INPUT:
        return _replicated_input_dual(plan)
    return _transpose(plan)


def _dual(plan: Plan, collective: Collective, **changes: object) -> Plan:
    """`plan`'s dual: input shape = `plan`'s output shape, convention "sum" (a plain linear map)."""
    return plan.replace(collective=collective, in_shape=plan.out_shape, convention=Convention.SUM, grad_scale=1.0,
                        **changes)


def _replicated_dual(plan: Plan) -> Plan:
    """The output is replicated: the cotangent is already the gradient of the one loss."""
    shape = plan.out_shape
    if plan.collective is Collective.ALL_REDUCE:
        return _dual(plan, Collective.IDENTITY, reduce_op=None, accum_dtype=None, **local_layout(shape, shape))
    if plan.collective is Collective.ALL_GATHER:
        if plan.is_uneven:
            return _uneven_dual(plan, Collective.SLICE)
        return _dual(plan, Collective.SLICE, **local_layout(shape, plan.in_shape))
    raise NotImplementedError(f"{plan.op_name}: no replicated rule for {plan.collective.value}")


def _replicated_input_dual(plan: Plan) -> Plan:
    """The input is replicated: its gradient is the sum over ranks of the transpose."""
    shape = plan.out_shape
    if plan.collective is Collective.IDENTITY:
        return _dual(plan, Collective.ALL_REDUCE, reduce_op=ReduceOp.SUM, **flat_layout(shape, in_place=True))
    if plan.collective is Collective.SLICE:  # shard: the sum over ranks of each rank's padded block
        (dim,) = plan.dims
        return _dual(plan, Collective.ALL_GATHER, scale=plan.scale * plan.grad_scale,
                     **all_gather_layout(shape, plan.world_size, dim))
    raise NotImplementedError(f"{plan.op_name}: no replicated-input rule for {plan.collective.value}")


_UNEVEN_DUALS = {
    Collective.ALL_GATHER: Collective.REDUCE_SCATTER, Collective.REDUCE_SCATTER: Collective.ALL_GATHER,
    Collective.GATHER: Collective.SCATTER, Collective.SCATTER: Collective.GATHER,
    Collective.ALL_TO_ALL: Collective.ALL_TO_ALL, Collective.SLICE: Collective.PAD, Collective.PAD: Collective.SLICE,
}


def _uneven_dual(plan: Plan, kind: Collective) -> Plan:
    """The uneven `kind` that transposes `plan`: sizes swapped, dims reversed, the same layout and rank."""
    dims, scatter_sizes, gather_sizes = plan.dims[::-1], plan.gather_sizes, plan.scatter_sizes
    reduce_op = ReduceOp.SUM if kind is Collective.REDUCE_SCATTER else None
    fields = uneven.layout(kind, plan.out_shape, plan.world_size, dims, scatter_sizes, gather_sizes, plan.rank,
                           plan.root)
    return _dual(plan, kind, dims=dims, scatter_sizes=scatter_sizes, gather_sizes=gather_sizes, reduce_op=reduce_op,
                 **fields)


def _transpose(plan: Plan) -> Plan:
    """The exact transpose of the collective over all ranks (convention "sum")."""
    W, shape, kind = plan.world_size, plan.out_shape, plan.collective
    if plan.is_uneven:
        return _uneven_dual(plan, _UNEVEN_DUALS[kind])
    if kind is Collective.ALL_REDUCE:
        return _dual(plan, kind, reduce_op=ReduceOp.SUM, **flat_layout(shape, in_place=True))
    if kind in (Collective.ALL_GATHER, Collective.GATHER):
        (dim,) = plan.dims
        dual = Collective.REDUCE_SCATTER if kind is Collective.ALL_GATHER else Collective.SCATTER
        reduce_op = ReduceOp.SUM if dual is Collective.REDUCE_SCATTER else None
        return _dual(plan, dual, reduce_op=reduce_op, **reduce_scatter_layout(shape, W, dim))
    if kind in (Collective.REDUCE_SCATTER, Collective.SCATTER):
        (dim,) = plan.dims
        dual = Collective.ALL_GATHER if kind is Collective.REDUCE_SCATTER else Collective.GATHER
        return _dual(plan, dual, reduce_op=None, **all_gather_layout(shape, W, dim))
    if kind is Collective.ALL_TO_ALL:
        scatter_dim, gather_dim = plan.dims
        return _dual(plan, kind, dims=(gather_dim, scatter_dim),
                     **all_to_all_layout(shape, W, gather_dim, scatter_dim))
    if kind is Collective.BROADCAST:
        return _dual(plan, Collective.REDUCE, reduce_op=ReduceOp.SUM, **flat_layout(shape, in_place=True))
    if kind is Collective.REDUCE:
        return _dual(plan, Collective.BROADCAST, reduce_op=None, **flat_layout(shape, in_place=True))
    if kind is Collective.PERMUTE:
        return _dual(plan, kind, pairs=tuple((dst, src) for src, dst in plan.pairs))
    locals_ = {Collective.IDENTITY: Collective.IDENTITY, Collective.SLICE: Collective.PAD,
               Collective.PAD: Collective.SLICE}
    return _dual(plan, locals_[kind], **local_layout(shape, plan.in_shape))


def needs_primal(plan: Plan) -> bool:
    """True when the VJP reads the input (max, min, product), so a frontend must save it."""
    return plan.reduce_op in _READS_PRIMAL and plan.collective is _ALL_REDUCE


def needs_output(plan: Plan) -> bool:
    """True when the VJP reads the output too (max, min), so a frontend must save it."""
    return plan.reduce_op in _EXTREMA and plan.collective is _ALL_REDUCE


def forward(backend: Backend, plan: Plan, x: Any) -> Any:
    """The op's output on this rank: the plan walked, and for max/min of a dtype with NaN (floating, float8)
    the NaN rule (an extra one-byte all_reduce(max) of the NaN mask: backends differ on NaN -- gloo keeps or
    drops one depending on the rank holding it, XLA drops it -- while numpy's maximum propagates it).

    Where not `needs_primal(plan)` this is ``backend.collective(plan, x)`` alone: a frontend may walk such a
    plan directly."""
    out = backend.collective(plan, x)
    if plan.collective is not Collective.ALL_REDUCE or plan.reduce_op not in _EXTREMA or not has_nan(plan.dtype):
        return out
    mask = plans.all_reduce(plan.in_shape, plan.world_size, ReduceOp.MAX, dtype="uint8", op_name=plan.op_name)
    any_nan = backend.collective(mask, backend.astype(backend.isnan(x), "uint8"))
    return backend.where(any_nan > 0, math.nan, out)


def vjp(backend: Backend, plan: Plan, x: Any, out: Any, cotangent: Any) -> Any:
    """This rank's input cotangent for its output `cotangent` (`x` is read only where `needs_primal`, `out`
    only where `needs_output`)."""
    if not needs_primal(plan):
        return backend.collective(vjp_plan(plan), cotangent)
    incoming = backend.collective(_incoming_plan(plan), cotangent)
    if plan.reduce_op is ReduceOp.PRODUCT:
        return incoming * _others_product(backend, plan, x)
    hits = backend.astype((x == out) | (backend.isnan(x) & backend.isnan(out)), cotangent)
    count = plans.all_reduce(plan.in_shape, plan.world_size, dtype=plan.dtype, op_name=plan.op_name)
    return incoming * (hits / backend.collective(count, hits))


@functools.lru_cache(maxsize=4096)
def _incoming_plan(plan: Plan) -> Plan:
    """The cotangent of the reduced value: summed over ranks ("sum"), or this rank's own ("replicated")."""
    shape = plan.out_shape
    if plan.convention is Convention.REPLICATED:
        return plan.replace(collective=Collective.IDENTITY, reduce_op=None, scale=1.0, accum_dtype=None,
                            convention=Convention.SUM, **local_layout(shape, shape))
    return plans.all_reduce(shape, plan.world_size, ReduceOp.SUM, dtype=plan.dtype, accum_dtype=plan.accum_dtype,
                            op_name=plan.op_name)


def _others_product(backend: Backend, plan: Plan, x: Any) -> Any:
    """The product of the other ranks' values: every rank's x gathered, this rank's replaced by 1."""
    stacked = plans.all_gather((1, *plan.in_shape), plan.world_size, 0, dtype=plan.dtype, op_name=plan.op_name)
    everyone = backend.collective(stacked, backend.expand_dims(x, 0))
    own = backend.own_rank(plan.world_size, len(plan.in_shape) + 1)
    return backend.prod(backend.where(own, 1, everyone), 0)
