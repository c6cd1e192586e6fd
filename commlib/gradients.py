"""Every gradient rule of commlib, written once; the torch frontend, the JAX frontend and the numpy
reference walk what this module gives them.

Linear ops: `vjp_plan(plan)` is the plan of the op's VJP -- another plan the frontends walk on the cotangent,
whose own VJP comes from `vjp_plan` again, so every higher derivative is exact too:

=========================================  ==============================================================
forward plan                               VJP plan
=========================================  ==============================================================
all_reduce sum/avg, convention "sum"       all_reduce(sum), the same scale (1/W for avg)
all_reduce sum/avg, "replicated"           identity times the scale (the cotangent is already the total)
all_gather, "sum" / "replicated"           reduce_scatter(sum) / this rank's block (`Slice`)
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

import math
from typing import Any, Protocol, assert_never

from commlib import plans, uneven
from commlib.dtypes import has_nan
from commlib.layout import (
    PLAIN,
    Arithmetic,
    Convention,
    Exact,
    Layout,
    Padded,
    Plan,
    all_gather_layout,
    all_to_all_layout,
    flat_layout,
    local_layout,
    reduce_scatter_layout,
)
from commlib.plan_cache import held_cache
from commlib.reduce_op import ReduceOp
from commlib.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Gather,
    Identity,
    Pad,
    Permute,
    Reduce,
    ReduceScatter,
    Scatter,
    Slice,
    Step,
)

__all__ = ["Backend", "forward", "needs_output", "needs_primal", "vjp", "vjp_plan"]

_EXTREMA = frozenset({ReduceOp.MAX, ReduceOp.MIN})
_READS_PRIMAL = _EXTREMA | {ReduceOp.PRODUCT}


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


@held_cache(maxsize=4096)
def vjp_plan(plan: Plan) -> Plan:
    """The plan of the VJP of a linear `plan` (see the module table); the cotangent has `plan.out_shape`.

    >>> from commlib import plans
    >>> dual = vjp_plan(plans.all_gather((3, 5), 4, dim=0))
    >>> dual.step, dual.in_shape, dual.out_shape
    (ReduceScatter(dim=0, op='sum'), (12, 5), (3, 5))
    >>> vjp_plan(plans.all_gather((3, 5), 4, dim=0, convention="replicated")).step.name
    'slice'
    """
    convention, step = plan.convention, plan.step
    if isinstance(step, (AllReduce, Reduce, ReduceScatter)) and step.op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise NotImplementedError(f"{plan.op_name}: op {step.op.value!r} is not linear: use gradients.vjp")
    if convention is Convention.REPLICATED:
        return _replicated_dual(plan)
    if convention is Convention.REPLICATED_INPUT:
        return _replicated_input_dual(plan)
    if plan.uneven is not None:
        return _uneven_dual(plan, _transposed_step(step))
    return _dual(plan, _transposed_step(step), _transposed_layout(plan))


def _dual(
    plan: Plan, step: Step, layout: Layout, arithmetic: Arithmetic | None = None, sized: Exact | Padded | None = None
) -> Plan:
    """`plan`'s dual: input shape = `plan`'s output shape, convention "sum" (a plain linear map); the same
    arithmetic less the VJP's extra factor, unless given; `sized`: the dual's uneven sizes (None: even)."""
    if arithmetic is None:
        arithmetic = (
            plan.arithmetic
            if plan.arithmetic.grad_scale == 1.0
            else (Arithmetic(plan.arithmetic.scale, plan.arithmetic.scale_first, 1.0, plan.arithmetic.accum_dtype))
        )
    return plan.replace(
        step=step,
        in_shape=plan.out_shape,
        layout=layout,
        convention=Convention.SUM,
        arithmetic=arithmetic,
        uneven=sized,
    )


def _replicated_dual(plan: Plan) -> Plan:
    """The output is replicated: the cotangent is already the gradient of the one loss."""
    shape, step = plan.out_shape, plan.step
    if isinstance(step, AllReduce):  # identity times the scale, in the input's dtype
        arithmetic = Arithmetic(plan.arithmetic.scale, plan.arithmetic.scale_first)
        return _dual(plan, Identity(), local_layout(shape, shape), arithmetic)
    if isinstance(step, AllGather):
        if plan.uneven is not None:
            return _uneven_dual(plan, Slice(step.dim))
        return _dual(plan, Slice(step.dim), local_layout(shape, plan.in_shape))
    raise NotImplementedError(f"{plan.op_name}: no replicated rule for {step.name}")


def _replicated_input_dual(plan: Plan) -> Plan:
    """The input is replicated: its gradient is the sum over ranks of the transpose."""
    shape, step, arithmetic = plan.out_shape, plan.step, plan.arithmetic
    if isinstance(step, Identity):
        return _dual(plan, AllReduce(ReduceOp.SUM), flat_layout(shape, in_place=True))
    if isinstance(step, Slice):  # shard: the sum over ranks of each rank's padded block
        scaled = Arithmetic(
            arithmetic.scale * arithmetic.grad_scale, arithmetic.scale_first, 1.0, arithmetic.accum_dtype
        )
        return _dual(plan, AllGather(step.dim), all_gather_layout(shape, plan.world_size, step.dim), scaled)
    raise NotImplementedError(f"{plan.op_name}: no replicated-input rule for {step.name}")


def _transposed_step(step: Step) -> Step:
    """The step of the transpose over all ranks (convention "sum"): the module table's dual, the same dims."""
    match step:
        case AllReduce():
            return AllReduce(ReduceOp.SUM)
        case AllGather(dim=dim):
            return ReduceScatter(dim, ReduceOp.SUM)
        case Gather(dim=dim, root=root):
            return Scatter(dim, root)
        case ReduceScatter(dim=dim):
            return AllGather(dim)
        case Scatter(dim=dim, root=root):
            return Gather(dim, root)
        case AllToAll(scatter_dim=scatter_dim, gather_dim=gather_dim):
            return AllToAll(gather_dim, scatter_dim)
        case Broadcast(root=root):
            return Reduce(ReduceOp.SUM, root)
        case Reduce(root=root):
            return Broadcast(root)
        case Permute(pairs=pairs):
            return Permute(tuple((destination, source) for source, destination in pairs))
        case Identity():
            return step
        case Slice(dim=dim):
            return Pad(dim)
        case Pad(dim=dim):
            return Slice(dim)
        case _:
            assert_never(step)


def _transposed_layout(plan: Plan) -> Layout:
    """The layout of the transpose of an even `plan`: its input is `plan`'s output."""
    W, shape, step = plan.world_size, plan.out_shape, plan.step
    match step:
        case AllReduce() | Broadcast() | Reduce():
            return flat_layout(shape, in_place=True)
        case Permute():
            return plan.layout
        case AllGather(dim=dim) | Gather(dim=dim):
            return reduce_scatter_layout(shape, W, dim)
        case ReduceScatter(dim=dim) | Scatter(dim=dim):
            return all_gather_layout(shape, W, dim)
        case AllToAll(scatter_dim=scatter_dim, gather_dim=gather_dim):
            return all_to_all_layout(shape, W, gather_dim, scatter_dim)
        case Identity() | Slice() | Pad():
            return local_layout(shape, plan.in_shape)
        case _:
            assert_never(step)


def _uneven_dual(plan: Plan, step: Step) -> Plan:
    """The uneven `step` that transposes `plan`: sizes swapped (its dims are `plan`'s reversed), the same
    layout and rank."""
    sized = plan.uneven
    assert sized is not None, plan
    rank = sized.rank if isinstance(sized, Exact) else None
    layout, held = uneven.layout(step, plan.out_shape, plan.world_size, sized.gather_sizes, sized.scatter_sizes, rank)
    return _dual(plan, step, layout, sized=held)


def needs_primal(plan: Plan) -> bool:
    """True when the VJP reads the input (max, min, product), so a frontend must save it."""
    step = plan.step
    return type(step) is AllReduce and step.op in _READS_PRIMAL


def needs_output(plan: Plan) -> bool:
    """True when the VJP reads the output too (max, min), so a frontend must save it."""
    step = plan.step
    return type(step) is AllReduce and step.op in _EXTREMA


def forward(backend: Backend, plan: Plan, x: Any) -> Any:
    """The op's output on this rank: the plan walked, and for max/min of a dtype with NaN (floating, float8)
    the NaN rule (an extra one-byte all_reduce(max) of the NaN mask: backends differ on NaN -- gloo keeps or
    drops one depending on the rank holding it, XLA drops it -- while numpy's maximum propagates it).

    Where not `needs_primal(plan)` this is ``backend.collective(plan, x)`` alone: a frontend may walk such a
    plan directly."""
    out = backend.collective(plan, x)
    if not needs_output(plan) or not has_nan(plan.dtype):
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
    if not needs_output(plan):  # product
        return incoming * _others_product(backend, plan, x)
    hits = backend.astype((x == out) | (backend.isnan(x) & backend.isnan(out)), cotangent)
    count = plans.all_reduce(plan.in_shape, plan.world_size, dtype=plan.dtype, op_name=plan.op_name)
    return incoming * (hits / backend.collective(count, hits))


@held_cache(maxsize=4096)
def _incoming_plan(plan: Plan) -> Plan:
    """The cotangent of the reduced value: summed over ranks ("sum"), or this rank's own ("replicated")."""
    shape = plan.out_shape
    if plan.convention is Convention.REPLICATED:
        return plan.replace(
            step=Identity(), layout=local_layout(shape, shape), convention=Convention.SUM, arithmetic=PLAIN
        )
    return plans.all_reduce(
        shape,
        plan.world_size,
        ReduceOp.SUM,
        dtype=plan.dtype,
        accum_dtype=plan.arithmetic.accum_dtype,
        op_name=plan.op_name,
    )


def _others_product(backend: Backend, plan: Plan, x: Any) -> Any:
    """The product of the other ranks' values: every rank's x gathered, this rank's replaced by 1."""
    stacked = plans.all_gather((1, *plan.in_shape), plan.world_size, 0, dtype=plan.dtype, op_name=plan.op_name)
    everyone = backend.collective(stacked, backend.expand_dims(x, 0))
    own = backend.own_rank(plan.world_size, len(plan.in_shape) + 1)
    return backend.prod(backend.where(own, 1, everyone), 0)
