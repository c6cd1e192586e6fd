"""The c10d calls of the eager walks: the process group's own methods, their options made once per walk.

``torch.distributed``'s functions (``all_reduce``, ``broadcast``, ...) wrap the process group's methods: per
call they check their arguments, look up the default group, turn a global root into the group's, build an
options struct and pass through two logging decorators. That is 2.4-3.2 us of host time per call on the fake
group (``benchmarks/c10d_calls.py``: torch 2.13, the 2-core VM), as much as the rest of an eager walk. A
walk's plan fixes the reduce op and the root, so here the options are made once, with the walk, and a call is
the method and ``work.wait()`` -- what the wrappers do for a synchronous call (``asyncOp = False``, so NCCL
runs on the current stream).

What the wrappers do that these calls leave out, and why that is safe:

- argument checks, a rank outside the group: the spec validated the call before anything is sent;
- complex tensors: sent as their real views (``torch.view_as_real``), as the wrappers send them;
- ``__torch_function__`` (a tensor subclass, a torch function mode such as non-strict export's), a group that
  is not a plain ``ProcessGroup``, no default group: the call goes to the wrapper, which handles it;
- the coalescing context (``torch.distributed._coalescing_manager``, private): not honoured.

Asynchronous calls (``asynchronous=True``, for ``async_op=True``: `commlib_torch.handle`) are the same calls with
``asyncOp = True`` (NCCL on its own stream, joined by ``work.wait()``) that return the c10d work unwaited; the
wrapper path passes ``async_op=True``. Only the collectives an ``async_op`` op walks have them: all_reduce,
all_to_all (permute's too), all_gather and reduce_scatter.

Under torch.compile the walks call the wrappers (``compiling=True``), which Dynamo maps to functional
collectives. gather and scatter always go through the wrappers, whose list handling changes between torch
releases (2.13 passes other lists to its torchcomms backend); so does the exact walk of uneven sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from commlib_torch._compat import (
    all_gather_single,
    default_group,
    has_torch_function_unary,
    process_group_all_gather,
    process_group_all_to_all,
    process_group_reduce_scatter,
    reduce_scatter_single,
)
from commlib_torch._groups import ResolvedGroup, global_rank

__all__ = [
    "Started",
    "all_gather",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "scatter",
]

#: (tensors..., group) -> None, the collective done; an asynchronous call's: -> its c10d work, not waited
Buffers = Callable[..., "dist.Work | None"]
#: A c10d reduce op as ``dist.ReduceOp.SUM`` gives it (torch's stubs type the members `RedOpType`).
ReduceOpType = dist.ReduceOp | dist.ReduceOp.RedOpType

_PG = dist.ProcessGroup
_as_real = torch.view_as_real


class Started:
    """A collective an asynchronous walk began (`commlib_torch._walk.started_walk`): its c10d works, and the
    local pass that turns what they receive into the output (``complete(*arguments)``), run by `wait` after the
    works. The arguments (the buffers among them) stay referenced until then."""

    __slots__ = ("arguments", "complete", "works")

    def __init__(self, works: Sequence[Any], complete: Callable[..., Any], *arguments: Any) -> None:
        self.works, self.complete, self.arguments = works, complete, arguments

    def is_completed(self) -> bool:
        """True when every work is done (c10d's ``Work.is_completed``)."""
        return all(work.is_completed() for work in self.works)

    def wait(self) -> Any:
        """The works waited, then the local pass: the output (call once)."""
        for work in self.works:
            work.wait()
        return self.complete(*self.arguments)

    def then(self, function: Callable[[Any], Any]) -> Started:
        """The same works, `function` applied to what `wait` would return."""
        return Started(self.works, lambda: function(self.complete(*self.arguments)))


def _options(kind: type, asynchronous: bool = False, **fields: object) -> object:
    """An options struct made once per walk: for a synchronous call (NCCL on the current stream) or an
    asynchronous one (`asynchronous`: NCCL on its own stream, joined by ``work.wait()``)."""
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    if hasattr(options, "asyncOp"):
        options.asyncOp = asynchronous
    return options


def _direct(group: ResolvedGroup, tensor: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group whose method takes this call; None where the wrapper must (module docstring)."""
    process_group = default_group() if group is None else group
    if type(process_group) is not _PG or has_torch_function_unary(tensor):
        return None
    return process_group


def _real(tensor: torch.Tensor) -> torch.Tensor:
    return _as_real(tensor) if tensor.is_complex() else tensor


def all_reduce(op: ReduceOpType, complex_: bool, compiling: bool, asynchronous: bool = False) -> Buffers:
    """``(buffer, group)``: buffer <- the reduction over the group, in place."""
    if compiling:
        return lambda buffer, group: dist.all_reduce(buffer, op=op, group=group)
    options = _options(dist.AllreduceOptions, asynchronous, reduceOp=op)
    if asynchronous:

        def begin(buffer: torch.Tensor, group: ResolvedGroup) -> dist.Work:
            process_group = _direct(group, buffer)
            if process_group is None:
                return dist.all_reduce(buffer, op=op, group=group, async_op=True)
            return process_group.allreduce([_real(buffer) if complex_ else buffer], options)

        return begin

    def call(buffer: torch.Tensor, group: ResolvedGroup) -> None:
        process_group = _direct(group, buffer)
        if process_group is None:
            dist.all_reduce(buffer, op=op, group=group)
        else:
            process_group.allreduce([_real(buffer) if complex_ else buffer], options).wait()

    return call


def all_to_all(complex_: bool, compiling: bool, asynchronous: bool = False) -> Buffers:
    """``(recv, send, group, recv_splits=(), send_splits=())``: dim-0 blocks of send to each rank, in rank
    order, into recv (empty splits: W equal blocks)."""
    if compiling:
        return lambda recv, send, group, recv_splits=None, send_splits=None: dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=group
        )
    options = _options(dist.AllToAllOptions, asynchronous)
    if asynchronous:

        def begin(
            recv: torch.Tensor,
            send: torch.Tensor,
            group: ResolvedGroup,
            recv_splits: Sequence[int] = (),
            send_splits: Sequence[int] = (),
        ) -> dist.Work:
            process_group = _direct(group, send)
            if process_group is None:
                return dist.all_to_all_single(
                    recv, send, recv_splits or None, send_splits or None, group=group, async_op=True
                )
            if complex_:
                recv, send = _real(recv), _real(send)
            return process_group_all_to_all(process_group, recv, send, recv_splits, send_splits, options)

        return begin

    def call(
        recv: torch.Tensor,
        send: torch.Tensor,
        group: ResolvedGroup,
        recv_splits: Sequence[int] = (),
        send_splits: Sequence[int] = (),
    ) -> None:
        process_group = _direct(group, send)
        if process_group is None:
            dist.all_to_all_single(recv, send, recv_splits or None, send_splits or None, group=group)
        elif complex_:
            process_group_all_to_all(process_group, _real(recv), _real(send), recv_splits, send_splits, options).wait()
        else:
            process_group_all_to_all(process_group, recv, send, recv_splits, send_splits, options).wait()

    return call


def all_gather(complex_: bool, compiling: bool, asynchronous: bool = False) -> Buffers:
    """``(recv, send, group)``: recv <- every rank's send, concatenated along dim 0 in rank order."""
    if compiling:
        return lambda recv, send, group: all_gather_single(recv, send, group=group)
    options = _options(c10d.AllgatherOptions, asynchronous)
    if asynchronous:
        return _begin_dim_0(process_group_all_gather, all_gather_single, {}, complex_, options)

    def call(recv: torch.Tensor, send: torch.Tensor, group: ResolvedGroup) -> None:
        process_group = _direct(group, send)
        if process_group is None:
            all_gather_single(recv, send, group=group)
        elif complex_:
            process_group_all_gather(process_group, _real(recv), _real(send), options).wait()
        else:
            process_group_all_gather(process_group, recv, send, options).wait()

    return call


def reduce_scatter(op: ReduceOpType, complex_: bool, compiling: bool, asynchronous: bool = False) -> Buffers:
    """``(recv, send, group)``: recv <- this rank's dim-0 block of the reduction of every rank's send."""
    if compiling:
        return lambda recv, send, group: reduce_scatter_single(recv, send, op=op, group=group)
    options = _options(dist.ReduceScatterOptions, asynchronous, reduceOp=op)
    if asynchronous:
        return _begin_dim_0(process_group_reduce_scatter, reduce_scatter_single, {"op": op}, complex_, options)

    def call(recv: torch.Tensor, send: torch.Tensor, group: ResolvedGroup) -> None:
        process_group = _direct(group, send)
        if process_group is None:
            reduce_scatter_single(recv, send, op=op, group=group)
        elif complex_:
            process_group_reduce_scatter(process_group, _real(recv), _real(send), options).wait()
        else:
            process_group_reduce_scatter(process_group, recv, send, options).wait()

    return call


def _begin_dim_0(
    method: Callable[..., dist.Work], wrapper: Callable[..., dist.Work], keywords: dict, complex_: bool, options: object
) -> Buffers:
    """The asynchronous ``(recv, send, group) -> work`` of a dim-0 collective: the process group's `method`, or
    the torch.distributed `wrapper` (with `keywords`) where the wrapper must take the call."""

    def begin(recv: torch.Tensor, send: torch.Tensor, group: ResolvedGroup) -> dist.Work:
        process_group = _direct(group, send)
        if process_group is None:
            return wrapper(recv, send, group=group, async_op=True, **keywords)
        if complex_:
            recv, send = _real(recv), _real(send)
        return method(process_group, recv, send, options)

    return begin


def broadcast(root: int, complex_: bool) -> Buffers:
    """``(buffer, group)``: buffer <- group rank `root`'s buffer, in place (eager only)."""
    options = _options(dist.BroadcastOptions, rootRank=root, rootTensor=0)

    def call(buffer: torch.Tensor, group: ResolvedGroup) -> None:
        process_group = _direct(group, buffer)
        if process_group is None:
            dist.broadcast(buffer, src=global_rank(group, root), group=group)
        else:
            process_group.broadcast([_real(buffer) if complex_ else buffer], options).wait()

    return call


def reduce(root: int, op: ReduceOpType, complex_: bool) -> Buffers:
    """``(buffer, group)``: on group rank `root`, buffer <- the reduction over the group, in place; the other
    ranks' buffers are left undefined (eager only)."""
    options = _options(dist.ReduceOptions, reduceOp=op, rootRank=root, rootTensor=0)

    def call(buffer: torch.Tensor, group: ResolvedGroup) -> None:
        process_group = _direct(group, buffer)
        if process_group is None:
            dist.reduce(buffer, dst=global_rank(group, root), op=op, group=group)
        else:
            process_group.reduce([_real(buffer) if complex_ else buffer], options).wait()

    return call


def gather(root: int) -> Buffers:
    """``(send, recv or None, group)``: on group rank `root`, recv's dim-0 blocks <- every rank's send, in rank
    order (recv None elsewhere). Always torch.distributed's gather (module docstring); complex buffers as their
    real views (c10d's gather and scatter, unlike its other collectives, hand complex tensors to the backend as
    they are, and gloo refuses them: "Invalid scalar type")."""

    def call(send: torch.Tensor, recv: torch.Tensor | None, group: ResolvedGroup) -> None:
        blocks = None if recv is None else list(_real(recv).unbind(0))
        dist.gather(_real(send), blocks, dst=global_rank(group, root), group=group)

    return call


def scatter(root: int) -> Buffers:
    """``(send or None, recv, group)``: recv <- block r (dim 0) of group rank `root`'s send, on rank r (send
    None elsewhere). Always torch.distributed's scatter, complex as real views (see `gather`)."""

    def call(send: torch.Tensor | None, recv: torch.Tensor, group: ResolvedGroup) -> None:
        blocks = None if send is None else list(_real(send).unbind(0))
        dist.scatter(_real(recv), blocks, src=global_rank(group, root), group=group)

    return call
