"""Walk a `commlib.Plan` on torch tensors: one pack pass, the dim-0 c10d collective, one unpack pass.

A pass whose permutation keeps memory order is a view (no copy); a pass that must copy writes straight
into the buffer the collective needs, casting to the accumulation dtype in the same pass. The output is a
tensor of its own, never a view of a buffer made inside the autograd Function (autograd would refuse to
modify it in place): where the unpack is a view the collective receives straight into the output, through a
view of it, and a pass writes into a fresh tensor of the output's shape. Rooted ops
(broadcast, reduce, gather, scatter) and permute give zeros on the ranks that receive nothing. The local
steps of gradient plans (identity, slice, pad) move no data between ranks. A dtype the backend lacks travels
as the plan's same-size `wire_view` (a bit view) or its wider `accum_dtype` (a cast).

Uneven sizes are held exactly (`commlib.uneven`): the plan's pack and unpack are `Blocks` and every collective
is one ``all_to_all_single`` with the split sizes they give -- no padding on the wire, one pass each side at
most. An all_gather's pack repeats the input for every rank; in eager mode it is sent as it is, pairwise
(``batch_isend_irecv``: measured faster than the W-fold buffer, and than gloo's padded all_gather). That walk
is `commlib_torch._exact`.

Under torch.compile the rooted ops take calls Dynamo traces (it cannot trace c10d's broadcast, reduce, gather
and scatter): the functional broadcast, and one all_to_all_single with the spec's `rooted_splits` for the
others -- the same bytes on the wire. There every rank runs the same program, only the split sizes differ: a
rank that sends nothing still packs its input and sends none of it, a rank that receives nothing computes its
zeros from its (empty) receive buffer (the exact layout's `Blocks` passes too, for uneven gather and scatter).
Each collective then depends on its op's input and feeds its output on every rank, so AOTAutograd's
partitioner keeps it in the same graph (forward or backward) on every rank. Left alone, the partitioner drops
a collective whose result a rank ignores and moves into the forward a backward one that does not read the
cotangent, and the other ranks wait for it forever.

An asynchronous walk (`started_walk`, for ``async_op=True``) is the same walk with the collective begun and
not waited: it returns a `Started` -- the c10d work and the local pass after it (the unpack, the scale, the
cast back from `accum_dtype`), which `Started.wait` runs once the work is done. all_reduce, all_to_all,
all_gather, reduce_scatter, permute and the exact walk of uneven sizes begin asynchronously; a local step or a
rooted collective runs at once and returns a completed `Started`.

Host work per call is what the plan leaves: every decision is read from it (built once, `commlib.plan_cache`)
and taken once per plan by `walk`, which makes the plan's walk: a small frozen record per walk (`_InPlace`,
`_Exchange`, `_Permute`, `_Rooted`, the local steps', the exact walk's: its fields the passes, the c10d call, the
buffers' shapes and dtype), called for the synchronous walk, its ``start`` the asynchronous one. A call does only
what depends on it: the tensor (contiguous or not) and the group (this rank). Which walk is made
is a small frozen record too, read by every step's builder: `Synchronous` (eager, `EAGER`, or traced,
`COMPILED`) or `Asynchronous` (`STARTED`). Nothing reads a tensor's values on the host and no allocation depends
on them, so a walk can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, assert_never, overload

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commlib import Plan, Rearrange, ReduceOp, dtypes, plan_cache
from commlib.layout import permute_splits, rooted_splits
from commlib.plan_cache import MAX_PLANS
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
)
from commlib_torch import _c10d, _pack
from commlib_torch._c10d import Started
from commlib_torch._compat import COPY_COMPILED_OUTPUT as _COPY_COMPILED_OUTPUT
from commlib_torch._exact import run_exact, scaled_first, zeros_after
from commlib_torch._groups import ResolvedGroup, global_rank, group_rank

__all__ = ["rearrange", "run", "started_walk", "walk"]

_C10D_REDUCE = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # gloo has no AVG: the plan's scale divides by W
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

#: A reduce's local reduction of the blocks it received (dim 0), under torch.compile (avg: the plan's scale).
_LOCAL_REDUCE = {
    ReduceOp.SUM: lambda blocks: blocks.sum(0),
    ReduceOp.AVG: lambda blocks: blocks.sum(0),
    ReduceOp.MAX: lambda blocks: blocks.amax(0),
    ReduceOp.MIN: lambda blocks: blocks.amin(0),
    ReduceOp.PRODUCT: lambda blocks: blocks.prod(0),
}

_CONTIGUOUS = torch.contiguous_format
_Out = TypeVar("_Out")


def rearrange(
    x: torch.Tensor, step: Rearrange, shape: tuple[int, ...], dtype: torch.dtype, *, output: bool = True
) -> torch.Tensor:
    """One local pass of `step` into a contiguous tensor of `shape`: a view (or `x` itself) when nothing moves,
    else one copy into a fresh buffer, cast to `dtype` in the same pass. For the op's `output` the buffer is a
    tensor of `shape` itself, not a view of one of another shape (an autograd Function's output that is a view
    of a tensor made inside it cannot be modified in place); a send buffer may be such a view (one call less)."""
    if step.is_identity and x.dtype == dtype and x.is_contiguous():
        return x if x.shape == shape else x.view(shape)
    moves = not step.keeps_order
    source = x.reshape(step.split_shape).permute(step.perm) if moves else x
    if moves and x.dtype == dtype and not x.is_cuda and not torch.compiler.is_compiling():  # one call: contiguous()
        out = source.contiguous() if source.shape == shape else source.reshape(shape)  # or reshape() copy what
        if out._is_view() and (output or not out.is_contiguous()):  # moves, into a tensor of its own (where x's
            out = out.clone(memory_format=_CONTIGUOUS)  # strides made the permutation a view: a copy)
        return out
    if (source.shape == shape or not output) and not (moves and x.is_cuda):  # one call: clone or to
        same = x.dtype == dtype
        out = source.clone(memory_format=_CONTIGUOUS) if same else source.to(dtype, memory_format=_CONTIGUOUS)
        return out if out.shape == shape else out.view(shape)
    out = x.new_empty(shape, dtype=dtype)  # a cast into the output, or CUDA: a Triton kernel or a wide-word copy
    target = out if out.shape == source.shape else out.view(source.shape)  # (commlib_torch._pack), else copy_
    if not (moves and x.is_cuda and _pack.copy_into(target, x, step)):
        target.copy_(source)
    return out


def _completed(out: torch.Tensor) -> Started:
    """A `Started` whose work is done: `out`."""
    return Started((), _itself_value, out)


def _itself_value(x: Any) -> Any:
    return x


# ---- the rooted collectives: (step, plan, the received buffer's shape `made`: `_finisher`) -> transfer, a
# transfer: (packed send buffer or None, group, rank, input, buffer dtype) -> the received buffer
# (contiguous, of `made`, which the collective receives into as a view of the plan's recv_shape), None where this
# rank receives nothing

Transfer = Callable[[torch.Tensor | None, ResolvedGroup, int, torch.Tensor, torch.dtype], torch.Tensor | None]
Rooted = Broadcast | Reduce | Gather | Scatter


def _reduce(step: Reduce, plan: Plan, made: tuple[int, ...]) -> Transfer:  # (in place: the send buffer, of the
    root = step.root  # output's shape)
    reduce = _c10d.reduce(root, _C10D_REDUCE[step.op], dtypes.is_complex(plan.dtype))

    def transfer(
        send: torch.Tensor | None, group: ResolvedGroup, rank: int, x: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        reduce(send, group)
        return send if rank == root else None

    return transfer


def _broadcast(step: Broadcast, plan: Plan, made: tuple[int, ...]) -> Transfer:  # (recv_shape is the send shape:
    root, recv_shape = step.root, plan.layout.recv_shape  # the root's own buffer)
    broadcast = _c10d.broadcast(root, dtypes.is_complex(plan.dtype))

    def transfer(
        send: torch.Tensor | None, group: ResolvedGroup, rank: int, x: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        buffer = send if rank == root else x.new_empty(recv_shape, dtype=dtype)
        broadcast(buffer, group)
        return buffer

    return transfer


def _gather(step: Gather, plan: Plan, made: tuple[int, ...]) -> Transfer:
    root, recv_shape = step.root, plan.layout.recv_shape
    viewed = made != recv_shape
    gather = _c10d.gather(root)

    def transfer(
        send: torch.Tensor | None, group: ResolvedGroup, rank: int, x: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        recv = x.new_empty(made, dtype=dtype) if rank == root else None
        gather(send, recv.view(recv_shape) if viewed and recv is not None else recv, group)
        return recv

    return transfer


def _scatter(step: Scatter, plan: Plan, made: tuple[int, ...]) -> Transfer:
    recv_shape = plan.layout.recv_shape
    viewed = made != recv_shape
    scatter = _c10d.scatter(step.root)

    def transfer(
        send: torch.Tensor | None, group: ResolvedGroup, rank: int, x: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        recv = x.new_empty(made, dtype=dtype)
        scatter(send, recv.view(recv_shape) if viewed else recv, group)
        return recv

    return transfer


def _nothing_received(recv: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """None (the caller returns zeros) on a rank that receives nothing; under torch.compile, zeros of the
    received buffer's `shape` computed from the empty `recv`, so the collective stays on this rank's data path."""
    return zeros_after(recv, list(shape)) if torch.compiler.is_compiling() else None


def _rooted_traceable(step: Rooted, plan: Plan, made: tuple[int, ...]) -> Transfer:
    """A rooted collective in calls Dynamo traces, the same on every rank: broadcast as the functional
    collective, gather / reduce / scatter as one all_to_all_single with the spec's `rooted_splits`."""
    if isinstance(step, Broadcast):
        root = step.root

        def broadcast(send, group, rank, x, dtype):
            world = dist.group.WORLD if group is None else group
            assert world is not None  # (traced: a default group exists)
            return funcol.broadcast(send, global_rank(group, root), world)

        return broadcast
    return lambda send, group, rank, x, dtype: _traced(step, plan, made, send, group, rank, x, dtype)


def _traced(
    step: Gather | Reduce | Scatter,
    plan: Plan,
    made: tuple[int, ...],
    send: torch.Tensor | None,
    group: ResolvedGroup,
    rank: int,
    x: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    assert send is not None  # (traced: every rank packs its input)
    layout, root = plan.layout, step.root
    block = math.prod(layout.recv_shape if isinstance(step, Scatter) else layout.send_shape)
    send_splits, recv_splits = rooted_splits(step, plan.world_size, rank, block)
    sent = send.reshape(-1)[: sum(send_splits)]
    if isinstance(step, Scatter) or (isinstance(step, Gather) and rank == root):  # received in the buffer
        out = x.new_empty(made, dtype=dtype)  # `made`: the output itself where the unpack is a view
        dist.all_to_all_single(out.view(-1), sent, recv_splits, send_splits, group=group)
        return out
    recv = x.new_empty((sum(recv_splits),), dtype=dtype)
    dist.all_to_all_single(recv, sent, recv_splits, send_splits, group=group)
    if rank != root or not isinstance(step, Reduce):
        return _nothing_received(recv, made)
    return _LOCAL_REDUCE[step.op](recv.view(plan.world_size, *layout.send_shape))


def _rooted_transfer(step: Rooted, plan: Plan, made: tuple[int, ...]) -> Transfer:
    """The eager rooted collective of `step`: c10d's own."""
    match step:
        case Reduce():
            return _reduce(step, plan, made)
        case Broadcast():
            return _broadcast(step, plan, made)
        case Gather():
            return _gather(step, plan, made)
        case Scatter():
            return _scatter(step, plan, made)
        case _:
            assert_never(step)


# ---- the walks: made once per plan, then called with (x, group) ---------------------------------------------

Walk = Callable[[torch.Tensor, ResolvedGroup], torch.Tensor]  # (this rank's input, the group) -> this rank's output
#: An asynchronous walk: (this rank's input, the group) -> the collective begun (`Started`).
StartedWalk = Callable[[torch.Tensor, ResolvedGroup], Started]
Pass = Callable[[torch.Tensor], torch.Tensor]
_Made = Walk | StartedWalk


@dataclass(frozen=True)
class Synchronous:
    """A walk that returns this rank's output (`walk`, `run`): each collective waited before the walk returns."""

    compiling: bool  # traced by torch.compile: the calls Dynamo traces, every rank packing its input (docstring)
    asynchronous: ClassVar[bool] = False  # (what the c10d calls are told)


@dataclass(frozen=True)
class Asynchronous:
    """An eager walk that begins the collective and returns a `Started` (`started_walk`, ``async_op=True``); a
    local step or a rooted collective runs at once, a completed `Started`."""

    compiling: ClassVar[bool] = False  # (a traced call is synchronous: `commlib_torch.handle.start`)
    asynchronous: ClassVar[bool] = True  # the c10d work returned unwaited


Kind = Synchronous | Asynchronous
EAGER, COMPILED, STARTED = Synchronous(compiling=False), Synchronous(compiling=True), Asynchronous()


def run(plan: Plan, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
    """Output of `plan` on this rank for input `x` (any strides), in x's dtype: ``walk(plan)(x, group)``.
    Under torch.compile the walk is made afresh, so the tracer reads the plan's constants, never the cache
    (before torch 2.13 its output is copied once more: `_COPY_COMPILED_OUTPUT`)."""
    if torch.compiler.is_compiling():
        out = _make_walk(plan, COMPILED)(x, group)
        return out.clone() if _COPY_COMPILED_OUTPUT else out
    return walk(plan)(x, group)


@plan_cache.held_cache(maxsize=8 * MAX_PLANS)  # (every builder keeps MAX_PLANS plans, and the VJP plans come too)
def walk(plan: Plan) -> Walk:
    """The eager walk of `plan`, made once: every decision the plan fixes (which pass is a view, the buffers'
    shapes and dtypes, the scales) is taken here, so a call does only what depends on its tensor (contiguous or
    not, its dtype) and its group (this rank; permute works out its split sizes once per rank, on the first
    call from that rank). Each walk made counts towards the caches' byte bound (`commlib.plan_cache.MAX_BYTES`);
    `commlib.plan_cache.clear` and its flushes forget the walks too."""
    return _make_walk(plan, EAGER)


@plan_cache.held_cache(maxsize=8 * MAX_PLANS)
def started_walk(plan: Plan) -> StartedWalk:
    """The eager asynchronous walk of `plan`, made once (as `walk`): the pack pass and the collective begun,
    the rest left to `Started.wait` (module docstring)."""
    return _make_walk(plan, STARTED)


@overload
def _make_walk(plan: Plan, kind: Synchronous) -> Walk: ...
@overload
def _make_walk(plan: Plan, kind: Asynchronous) -> StartedWalk: ...
def _make_walk(plan: Plan, kind: Kind) -> _Made:
    """The walk of `plan` of `kind`: the step's walk (`_step_walk`), x seen as the plan's `wire_view` around it (a
    dtype the backend lacks: its bits in a same-size dtype, viewed back after), a complex x's lazy conjugate
    resolved first (x.conj() is a lazy bit c10d cannot send: its values)."""
    wire = None if plan.wire_view is None else getattr(torch, plan.wire_view)
    if isinstance(kind, Asynchronous):
        started = _step_walk(plan, kind)
        if wire is not None:
            inner = started
            started = lambda x, group: inner(x.view(wire), group).then(lambda out: out.view(x.dtype))  # noqa: E731
        return _conj_resolved(started) if dtypes.is_complex(plan.dtype) else started
    made = _step_walk(plan, kind)
    if wire is not None:
        step = made
        made = lambda x, group: step(x.view(wire), group).view(x.dtype)  # noqa: E731
    return _conj_resolved(made) if dtypes.is_complex(plan.dtype) else made


def _conj_resolved(
    inner: Callable[[torch.Tensor, ResolvedGroup], _Out],
) -> Callable[[torch.Tensor, ResolvedGroup], _Out]:
    return lambda x, group: inner(x.resolve_conj(), group)


@overload
def _step_walk(plan: Plan, kind: Synchronous) -> Walk: ...
@overload
def _step_walk(plan: Plan, kind: Asynchronous) -> StartedWalk: ...
def _step_walk(plan: Plan, kind: Kind) -> _Made:
    """The walk of `plan`'s step (x in the dtype the wire carries): its record, or the record's `start`."""
    made = _step_record(plan, kind)
    return made.start if kind.asynchronous else made


_BEGIN = (AllReduce, AllToAll, AllGather, ReduceScatter, Permute)  # the steps an asynchronous walk begins


def _step_record(plan: Plan, kind: Kind) -> _Record:
    """The record of `plan`'s walk of `kind`, dispatched by its step."""
    if plan.is_exact:
        return _Exact(plan, isinstance(plan.step, _BEGIN))
    arithmetic = plan.arithmetic
    accum = None if arithmetic.accum_dtype is None else getattr(torch, arithmetic.accum_dtype)
    step = plan.step
    match step:
        case Identity():
            return _Identity(arithmetic.scale)
        case Slice(dim=dim):
            return _Slice(dim, plan.layout.recv_shape[dim], arithmetic.scale)
        case Pad(dim=dim):
            return _Pad(dim, plan.out_shape, arithmetic.scale)
        case AllReduce(op=op):
            return _all_reduce(plan, op, accum, kind)
        case AllToAll():
            return _all_to_all(plan, accum, kind)
        case AllGather(dim=dim):
            return _gather_or_scatter(plan, dim, None, accum, kind)
        case ReduceScatter(dim=dim, op=op):
            return _gather_or_scatter(plan, dim, op, accum, kind)
        case Permute():
            return _permute(step, plan, accum, kind)
        case Broadcast() | Reduce() | Gather() | Scatter():
            made = _finisher(plan, accum, plan.layout.recv_shape)[1]
            transfer = (_rooted_traceable if kind.compiling else _rooted_transfer)(step, plan, made)
            receives_only = isinstance(step, (Broadcast, Scatter)) and not kind.compiling  # non-roots' input is
            return _rooted(plan, transfer, step.root if receives_only else None, accum)  # never read
        case _:
            assert_never(step)


def _pass(step: Rearrange, source_shape: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype | None) -> Pass:
    """`rearrange` into `shape` (in `dtype`, None: the source's), what the step fixes decided once: where nothing
    moves, the source itself or one view of it (when contiguous) or one clone (when the collective needs a
    fresh buffer)."""
    if dtype is not None or not step.keeps_order:
        return lambda x: rearrange(x, step, shape, x.dtype if dtype is None else dtype, output=False)
    reshaped = tuple(source_shape) != tuple(shape)
    if step.is_identity:

        def itself(x: torch.Tensor) -> torch.Tensor:
            if not x.is_contiguous():
                return rearrange(x, step, shape, x.dtype, output=False)
            return x.view(shape) if reshaped else x

        return itself

    def fresh(x: torch.Tensor) -> torch.Tensor:  # (clone keeps a contiguous source's strides)
        out = x.clone() if x.is_contiguous() else x.clone(memory_format=_CONTIGUOUS)
        return out.view(shape) if reshaped else out

    return fresh


def _sender(plan: Plan, accum: torch.dtype | None, shape: tuple[int, ...]) -> Pass:
    """x -> the send buffer, of `shape`: the pack pass, and the scale first where the plan says so."""
    assert isinstance(plan.layout.pack, Rearrange), plan  # (Blocks: the exact walk's, `run_exact`)
    pack = _pass(plan.layout.pack, plan.in_shape, shape, accum)
    scale, first = plan.arithmetic.scale, plan.arithmetic.scale_first
    if not (first and scale != 1.0):
        return pack
    return lambda x: scaled_first(pack(x), x, scale)


def _finisher(
    plan: Plan, accum: torch.dtype | None, shape: tuple[int, ...]
) -> tuple[Callable[..., torch.Tensor], tuple[int, ...]]:
    """((received buffer, x) -> the output, the shape to make the received buffer in) for a collective that
    receives a buffer of `shape`: the scale (where not applied first), then the unpack pass. Where the plan
    says the unpack is identity the buffer is made in the output's shape and is the output (the collective
    receives into a view of it of `shape`: the Function's output is no view, so it can be modified in place)."""
    arithmetic = plan.arithmetic
    scale = arithmetic.scale if arithmetic.scale != 1.0 and not arithmetic.scale_first else None
    unpack, out_shape = plan.layout.unpack, plan.out_shape
    assert isinstance(unpack, Rearrange), plan  # (Blocks: the exact walk's, `run_exact`)
    if accum is not None or not unpack.is_identity:

        def unpacked(recv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            if scale is not None:
                recv.mul_(scale)
            return rearrange(recv, unpack, out_shape, x.dtype)

        return unpacked, shape

    def itself(recv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return recv if scale is None else recv.mul_(scale)

    return itself, out_shape


def _packs(plan: Plan, accum: torch.dtype | None) -> bool:
    """True when the pack is a pass into the send shape, False when x is sent in its own layout."""
    pack = plan.layout.pack
    return accum is not None or not (isinstance(pack, Rearrange) and pack.keeps_order)  # (Blocks: the exact walk's)


# ---- the collectives' walks: one small record per walk, each field a decision its plan fixes; called, it is the
# synchronous walk (`Walk`), its `start` the asynchronous one (`StartedWalk`: the same calls, the work unwaited)

Finish = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (the received buffer, x) -> this rank's output


class _AtOnce:
    """A walk that begins nothing (a local step, a rooted collective): its asynchronous form runs it at once."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        raise NotImplementedError

    def start(self, x: torch.Tensor, group: ResolvedGroup) -> Started:
        """The walk run now: a completed `Started`."""
        return _completed(self(x, group))


@dataclass(frozen=True, slots=True)
class _InPlace:
    """all_reduce: the send buffer, a clone of x's shape, is reduced in place."""

    send: Pass  # x -> the send buffer (the pack pass; the scale first where the plan says so)
    collective: _c10d.Buffers  # (buffer, group): the reduction into it (begun: its work returned)
    finish: Finish  # the scale (where not first) and the unpack

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        buffer = self.send(x)
        self.collective(buffer, group)
        return self.finish(buffer, x)

    def start(self, x: torch.Tensor, group: ResolvedGroup) -> Started:
        buffer = self.send(x)
        return Started((self.collective(buffer, group),), self.finish, buffer, x)


@dataclass(frozen=True, slots=True)
class _Exchange:
    """all_to_all, all_gather, reduce_scatter: one packed send buffer out, one fresh buffer received into."""

    send: Pass  # x -> the send buffer
    collective: _c10d.Buffers  # (receive buffer, send buffer, group) (begun: its work returned)
    finish: Finish  # (the received buffer, x) -> the output
    made: tuple[int, ...]  # the receive buffer's shape: the output's where the unpack is a view (received into)
    view: tuple[int, ...] | None  # the shape the collective receives into, a view of the buffer (None: `made`)
    accum: torch.dtype | None  # the buffers' dtype (None: x's)

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        buffer, view = self.send(x), self.view
        recv = x.new_empty(self.made) if self.accum is None else x.new_empty(self.made, dtype=self.accum)
        self.collective(recv if view is None else recv.view(view), buffer, group)
        del buffer  # dead once sent: the unpack's output can take its memory (peak = send + recv)
        return self.finish(recv, x)

    def start(self, x: torch.Tensor, group: ResolvedGroup) -> Started:
        buffer, view = self.send(x), self.view
        recv = x.new_empty(self.made) if self.accum is None else x.new_empty(self.made, dtype=self.accum)
        work = self.collective(recv if view is None else recv.view(view), buffer, group)
        return Started((work,), _finish_sent, self.finish, recv, x, buffer)


@dataclass(frozen=True, slots=True)
class _Permute:
    """ppermute as one all_to_all_single with uneven splits (the spec's `permute_splits`): one call for every
    pattern, and traceable by torch.compile. A rank sends its whole buffer or nothing, so the splits count rows
    of dim 0 (a 0-d tensor goes as one row): no flat views. A rank that receives nothing gets zeros."""

    send: Pass  # x -> the send buffer, of `shape`
    all_to_all: _c10d.Buffers  # (recv, send, group, recv_splits, send_splits) (begun: its work returned)
    finish: Finish  # (the received buffer, x) -> the output
    shape: tuple[int, ...]  # the send (and receive) buffer's shape
    out_shape: tuple[int, ...]  # the output's (zeros of it where nothing is received)
    pairs: tuple[tuple[int, int], ...]  # (source, destination), group-local
    world_size: int
    accum: torch.dtype | None  # the buffers' dtype (None: x's)
    #: rank -> (send splits, recv splits, sends anything, receives anything): worked out on its first call
    by_rank: dict[int, tuple[list[int], list[int], bool, bool]] = field(default_factory=dict, compare=False)

    def _sent(self, buffer: torch.Tensor, x: torch.Tensor, group: ResolvedGroup) -> tuple[torch.Tensor | None, Any]:
        """(the received buffer, None where nothing is: `_nothing_received`; the call's work)."""
        rank, shape = group_rank(group), self.shape
        rows_shape = shape or (1,)
        splits = self.by_rank.get(rank)
        if splits is None:
            send_splits, recv_splits = permute_splits(self.pairs, self.world_size, rank, rows_shape[0])
            splits = self.by_rank[rank] = (send_splits, recv_splits, any(send_splits), any(recv_splits))
        send_splits, recv_splits, sends, receives = splits
        rows = buffer if shape else buffer.view(rows_shape)
        if not sends:
            rows = rows[:0]
        dtype = x.dtype if self.accum is None else self.accum
        if not receives:
            recv = x.new_empty((0, *rows_shape[1:]), dtype=dtype)
            work = self.all_to_all(recv, rows, group, recv_splits, send_splits)
            return _nothing_received(recv, shape), work
        # the buffer has the plan's shape (a Function's output that is a view costs autograd's view bookkeeping)
        recv = torch.empty_like(buffer, memory_format=_CONTIGUOUS)
        return recv, self.all_to_all(recv if shape else recv.view(rows_shape), rows, group, recv_splits, send_splits)

    def _received(self, recv: torch.Tensor | None, x: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_zeros(self.out_shape) if recv is None else self.finish(recv, x)

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        buffer = self.send(x)
        recv, _ = self._sent(buffer, x, group)
        del buffer
        return self._received(recv, x)

    def start(self, x: torch.Tensor, group: ResolvedGroup) -> Started:
        buffer = self.send(x)
        recv, work = self._sent(buffer, x, group)
        return Started((work,), self._received, recv, x, buffer)  # (the send buffer kept until the work is done)


@dataclass(frozen=True, slots=True)
class _Rooted(_AtOnce):
    """broadcast, reduce, gather, scatter: zeros on a rank that receives nothing; under torch.compile as
    `_rooted_traceable`, every rank packing its input (module docstring). Its asynchronous form runs it at
    once."""

    send: Pass  # x -> the send buffer
    transfer: Transfer  # the collective: (send buffer or None, group, rank, x, dtype) -> the received or None
    finish: Finish  # (the received buffer, x) -> the output
    out_shape: tuple[int, ...]  # the output's (zeros of it where nothing is received)
    receive_only_root: int | None  # an eager broadcast's or scatter's root: other ranks' x is never read (no pack)
    accum: torch.dtype | None  # the buffers' dtype (None: x's)

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        rank, root = group_rank(group), self.receive_only_root
        buffer = None if root is not None and rank != root else self.send(x)
        recv = self.transfer(buffer, group, rank, x, x.dtype if self.accum is None else self.accum)
        del buffer
        return x.new_zeros(self.out_shape) if recv is None else self.finish(recv, x)


def _all_reduce(plan: Plan, op: ReduceOp, accum: torch.dtype | None, kind: Kind) -> _InPlace:
    """all_reduce, in place: the send buffer, a clone of x's shape, is received into."""
    send_shape = plan.layout.send_shape
    send, (finish, _) = _sender(plan, accum, send_shape), _finisher(plan, accum, send_shape)
    reduce = _c10d.all_reduce(_C10D_REDUCE[op], dtypes.is_complex(plan.dtype), kind.compiling, kind.asynchronous)
    return _InPlace(send, reduce, finish)


def _all_to_all(plan: Plan, accum: torch.dtype | None, kind: Kind) -> _Exchange:
    """all_to_all: the send buffer's dim 0 goes out in W blocks (c10d's all_to_all_single)."""
    shape = _a2a_buffers(plan, _packs(plan, accum), accum)
    recv_shape = shape or plan.layout.recv_shape
    send, (finish, made) = _sender(plan, accum, shape or plan.layout.send_shape), _finisher(plan, accum, recv_shape)
    exchange = _c10d.all_to_all(dtypes.is_complex(plan.dtype), kind.compiling, kind.asynchronous)
    return _Exchange(send, exchange, finish, made, None if made == recv_shape else recv_shape, accum)


def _gather_or_scatter(plan: Plan, dim: int, op: ReduceOp | None, accum: torch.dtype | None, kind: Kind) -> _Exchange:
    """all_gather (`op` None) and reduce_scatter: c10d's dim-0 forms, x itself along dim 0 ([n, ...] <->
    [W * n, ...]), else flat buffers."""
    world_size, layout = plan.world_size, plan.layout
    along_0 = not _packs(plan, accum) and dim == 0
    numel = math.prod(layout.send_shape)
    gathers = op is None
    if along_0:
        send_shape, recv_shape = plan.in_shape, plan.out_shape
    else:
        send_shape, recv_shape = (numel,), (numel * world_size if gathers else numel // world_size,)
    send, (finish, made) = _sender(plan, accum, send_shape), _finisher(plan, accum, recv_shape)
    complex_ = dtypes.is_complex(plan.dtype)
    compiling, asynchronous = kind.compiling, kind.asynchronous
    collective = (
        _c10d.all_gather(complex_, compiling, asynchronous)
        if op is None
        else _c10d.reduce_scatter(_C10D_REDUCE[op], complex_, compiling, asynchronous)
    )
    return _Exchange(send, collective, finish, made, None if made == recv_shape else recv_shape, accum)


def _permute(step: Permute, plan: Plan, accum: torch.dtype | None, kind: Kind) -> _Permute:
    """permute: the splits worked out once per rank, on its first call (`_Permute`)."""
    layout = plan.layout
    all_to_all = _c10d.all_to_all(dtypes.is_complex(plan.dtype), kind.compiling, kind.asynchronous)
    send, (finish, _) = _sender(plan, accum, layout.send_shape), _finisher(plan, accum, layout.recv_shape)
    return _Permute(send, all_to_all, finish, layout.send_shape, plan.out_shape, step.pairs, plan.world_size, accum)


def _finish_sent(finish: Finish, recv: torch.Tensor, x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`finish` of an asynchronous walk, the send `buffer` kept until its work is done."""
    return finish(recv, x)


def _a2a_buffers(plan: Plan, packed: bool, accum: torch.dtype | None) -> tuple[int, ...] | None:
    """One shape for both buffers of an even all_to_all_single that saves a view: c10d cuts each buffer into W
    equal parts of memory along dim 0, so any shape whose dim 0 W divides carries the same blocks. The output's
    shape where the unpack is a view (the received buffer is the output), else the input's where the pack is
    (x itself is sent); None: the plan's send and recv shapes."""
    world_size = plan.world_size
    if accum is None and plan.layout.unpack.is_identity and plan.out_shape and plan.out_shape[0] % world_size == 0:
        return plan.out_shape
    if not packed and plan.in_shape and plan.in_shape[0] % world_size == 0:
        return plan.in_shape
    return None


def _rooted(plan: Plan, transfer: Transfer, receive_only_root: int | None, accum: torch.dtype | None) -> _Rooted:
    """broadcast, reduce, gather, scatter (`_Rooted`). `receive_only_root`: the root of an eager broadcast or
    scatter, whose other ranks' input is never read (no pack pass there)."""
    send, (finish, _) = _sender(plan, accum, plan.layout.send_shape), _finisher(plan, accum, plan.layout.recv_shape)
    return _Rooted(send, transfer, finish, plan.out_shape, receive_only_root, accum)


# ---- the local steps of gradient plans, and the exact walk of uneven sizes: records as the collectives'


@dataclass(frozen=True, slots=True)
class _Identity(_AtOnce):
    """identity times the scale (x itself where the scale is 1)."""

    scale: float

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        return x if self.scale == 1.0 else x * self.scale


@dataclass(frozen=True, slots=True)
class _Slice(_AtOnce):
    """This rank's block of `dim`: a copy, not a view (the output may be modified in place, and a gradient
    frees the rest)."""

    dim: int
    block: int  # rows per rank
    scale: float

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        dim, block = self.dim, self.block
        start = group_rank(group) * block
        if dim == 0 and x.is_contiguous():  # the block is contiguous: clone keeps its strides
            out = x[start : start + block].clone()
        else:
            out = x.narrow(dim, start, block).clone(memory_format=_CONTIGUOUS)
        return out if self.scale == 1.0 else out.mul_(self.scale)


@dataclass(frozen=True, slots=True)
class _Pad(_AtOnce):
    """This rank's block of zeros along `dim` (the transpose of `_Slice`)."""

    dim: int
    out_shape: tuple[int, ...]
    scale: float

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        dim = self.dim
        block = x.shape[dim]
        out = x.new_zeros(self.out_shape)
        out.narrow(dim, group_rank(group) * block, block).copy_(x)
        return out if self.scale == 1.0 else out.mul_(self.scale)


@dataclass(frozen=True, slots=True)
class _Exact:
    """Uneven sizes held exactly: `commlib_torch._exact.run_exact` of the plan."""

    plan: Plan
    begins: bool  # its asynchronous form begins the collective (else: a local step or rooted, run at once)

    def __call__(self, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
        return run_exact(self.plan, x, group)

    def start(self, x: torch.Tensor, group: ResolvedGroup) -> Started:
        if self.begins:
            return run_exact(self.plan, x, group, asynchronous=True)
        return _completed(run_exact(self.plan, x, group))


#: Every walk's record (`_step_record`).
_Record = _Identity | _Slice | _Pad | _Exact | _InPlace | _Exchange | _Permute | _Rooted
