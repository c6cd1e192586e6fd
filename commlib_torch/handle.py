"""`Handle`: what an op called with ``async_op=True`` returns -- its collective begun, its result on `Handle.wait`.

``all_to_all``, ``all_to_all_4d``, ``all_gather``, ``reduce_scatter``, ``all_reduce`` and ``permute`` take
``async_op=True``. The call validates as the synchronous one (the spec's errors, before anything is sent), runs
checked mode's fingerprint exchange, packs and starts the c10d collective (``asyncOp``: on CUDA, NCCL's own
stream), and returns a `Handle`; the code between the call and ``wait()`` overlaps the transfer.
``wait()`` waits for the work and runs the local pass after it (the unpack, the scale, the cast back from
``accum_dtype``, the placing of uneven blocks), so its tensor is bit for bit the synchronous call's.

Autograd: where `x` requires grad, the call is a pair of autograd Functions sharing one small record (`_Call`):
`_StartNode` (x -> an empty token; its forward starts the collective) and `_WaitNode` (token -> the result; its
forward waits). Backward runs them in the other order: the wait node's backward *starts* the dual collective
(the spec's VJP plan, `commlib.gradients.vjp_plan`) as soon as the cotangent arrives, and the start node's
backward *waits* for it where x's gradient is needed -- so the autograd engine runs the nodes made between the
call and ``wait()`` (the overlapped compute's backward) while the dual collective travels. A double backward
(``create_graph=True``) takes the synchronous VJP there, differentiable as every op's.

Synchronous, a completed Handle returned (the same values and gradients): a call traced by torch.compile
(Dynamo), one under a torch.func transform, one while `commlib_torch.testing_trace.record()` records (the call
is recorded as the synchronous one), max / min / product all_reduce (their VJP reads the primal), and world
size 1 (no communication).
"""

from __future__ import annotations

from typing import Any

import torch

from commlib import frontend_errors, gradients
from commlib.layout import Plan
from commlib_torch._c10d import Started
from commlib_torch._groups import ResolvedGroup
from commlib_torch._op import Origin, apply, at_boundary, reraise, transforms_active
from commlib_torch._walk import started_walk
from commlib_torch.testing_trace import ACTIVE

__all__ = ["Handle"]  # (`start`: the ops' async_op=True path)


class Handle:
    """An asynchronous op under way (``async_op=True``): `wait` gives its differentiable result.

    ``wait()`` returns the tensor the synchronous call returns, bit for bit, values and gradients; a second
    ``wait()`` returns the same tensor. `is_completed` (torch's ``Work`` name) says whether the transfer is
    done, without waiting. A Handle never waited is not an error: its collective still completes on every rank
    (each rank's call started it), the result is dropped with the Handle and `x` gets no gradient from it.
    Every rank must wait its handles in the same order (the backward begins the duals in the reverse order of
    the waits), and leave `x` unchanged until `wait()` (an in-place change is refused there: CommError; only
    changes autograd sees are caught, by x's version counter: an in-place op on x, a view of x or
    ``x.detach()`` advances it; a write through ``x.data``, a numpy view of x or another tensor over x's storage
    does not, and goes out unrefused). Where
    x requires grad and the call recorded it for autograd, ``wait()`` with gradients disabled
    (``torch.no_grad()``) is refused (CommError, after the collective completes): its result would give x no
    gradient.

    Example:
        >>> from commlib_torch import all_gather
        >>> handle = all_gather(torch.ones(2, 3), dim=0, async_op=True)  # started: overlap work here
        >>> handle.wait().shape  # shape[dim] *= W
        torch.Size([2, 3])
        >>> handle.wait() is handle.wait(), handle.is_completed()
        (True, True)
    """

    def __init__(self, call: _Call | None = None, result: torch.Tensor | None = None) -> None:
        self._call, self._result = call, result

    def wait(self) -> torch.Tensor:
        """The op's result, once its collective is done (a backend error as CommTimeout / CommFailure)."""
        if self._call is not None:
            self._result, self._call = self._call.result(), None
        return self._result  # type: ignore[return-value]  # set by the call or by result()

    def is_completed(self) -> bool:
        """True when the collective is done (`wait` would not block); the local pass after it runs in `wait`."""
        return self._call is None or self._call.is_completed()


class _Call:
    """One asynchronous call, shared by its start and wait nodes: the plan, the group and the input (for the
    failure messages), the forward's begun collective (`started`, until waited), the autograd token (None
    without autograd), and in backward the cotangent and the dual collective begun (`dual`)."""

    __slots__ = ("call_number", "cotangent", "dual", "group", "inference", "plan", "started", "token", "version", "x")

    def __init__(self, plan: Plan, x: torch.Tensor, group: ResolvedGroup) -> None:
        self.plan, self.group = plan, group
        self.x: torch.Tensor | None = x
        self.version = x._version  # an in-place change before wait() is refused there (`waited`)
        self.inference = torch.is_inference_mode_enabled()  # the local pass after the work runs as begun
        self.started: Started | None = None
        self.token: torch.Tensor | None = None
        self.dual: Started | None = None
        self.cotangent: torch.Tensor | None = None
        self.call_number: int | None = None  # checked mode's number of the call (its backward's fingerprints)

    def is_completed(self) -> bool:
        return self.started is None or self.started.is_completed()

    def result(self) -> torch.Tensor:
        token, self.token = self.token, None  # (held no longer: no reference cycle through the graph)
        if token is None:
            return self.waited()
        if not torch.is_grad_enabled():  # the result would carry no gradient to x: refused, after the collective
            self.waited()  # (completed on this rank, as on every other)
            raise frontend_errors.wait_without_grad(self.plan.op_name)
        return _WaitNode.apply(token, self)

    def waited(self) -> torch.Tensor:
        """The forward's collective waited, its local pass run (in inference mode if begun there); the input is
        let go (the backward reads only the cotangent). An input modified in place since the call is refused
        (`commlib.frontend_errors.modified_before_wait`), after the collective completes on every rank."""
        started, x, self.started, self.x = self.started, self.x, None, None
        if self.inference and not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                out = _waited(started, self.plan, x, self.group, None)  # type: ignore[arg-type]  # started: set at the call
        else:
            out = _waited(started, self.plan, x, self.group, None)  # type: ignore[arg-type]  # started: set at the call
        if x._version != self.version:  # type: ignore[union-attr]  # x: held until this wait
            raise frontend_errors.modified_before_wait(self.plan.op_name, self.version, x._version)  # type: ignore[union-attr]  # held till now
        return out


def _begin(plan: Plan, x: torch.Tensor, group: ResolvedGroup) -> Started:
    return started_walk(plan)(x, group)


def _waited(started: Started, plan: Plan, x: torch.Tensor, group: ResolvedGroup, origin: Origin | None) -> torch.Tensor:
    """`started` waited at commlib's boundary: a backend error re-raised as CommTimeout / CommFailure."""
    try:
        return started.wait()
    except RuntimeError as error:
        reraise(error, plan, x, group, origin)


class _StartNode(torch.autograd.Function):
    """x -> an empty token: forward starts the collective; backward waits for the dual one (`_WaitNode`'s)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: _Call) -> torch.Tensor:
        call.started = at_boundary(_begin, call.plan, x, call.group, None, call)
        ctx.call = call
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, token_cotangent: torch.Tensor) -> tuple[torch.Tensor, None]:
        call = ctx.call
        cotangent, dual, call.cotangent, call.dual = call.cotangent, call.dual, None, None
        origin = (call.plan, "backward", call.call_number)
        if dual is None:  # create_graph: the VJP's own Functions, synchronous and differentiable
            return apply(gradients.vjp_plan(call.plan), cotangent, call.group, origin), None
        return _waited(dual, call.plan, cotangent, call.group, origin), None


class _WaitNode(torch.autograd.Function):
    """token -> the result: forward waits for the collective; backward starts the dual one (the VJP plan)."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, call: _Call) -> torch.Tensor:
        ctx.call = call
        return call.waited()

    @staticmethod
    def backward(ctx: Any, cotangent: torch.Tensor) -> tuple[torch.Tensor, None]:
        call = ctx.call
        call.cotangent = cotangent
        if not torch.is_grad_enabled():  # (create_graph: the start node's backward runs the VJP synchronously)
            call.dual = at_boundary(
                _begin, gradients.vjp_plan(call.plan), cotangent, call.group, (call.plan, "backward", call.call_number)
            )
        return cotangent.new_empty(0), None


def start(plan: Plan, x: torch.Tensor, group: ResolvedGroup, async_op: object = True) -> Handle:
    """`plan` applied to `x` asynchronously (the ops' ``async_op=True``): a `Handle`. Synchronous, a completed
    Handle, where the module docstring says. `async_op` must be True (the ops take a bool: anything but False
    comes here, and anything but True is refused before a collective begins)."""
    if async_op is not True:
        raise frontend_errors.wrong_type(plan.op_name, "async_op", async_op, "bool")
    if (
        plan.is_trivial
        or ACTIVE
        or gradients.needs_primal(plan)
        or torch.compiler.is_compiling()
        or transforms_active()
    ):
        return Handle(result=apply(plan, x, group))
    call = _Call(plan, x, group)
    if x.requires_grad and torch.is_grad_enabled():
        call.token = _StartNode.apply(x, call)
    else:
        call.started = at_boundary(_begin, plan, x, group, None)
    return Handle(call)
