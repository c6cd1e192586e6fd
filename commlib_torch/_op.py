"""The torch side of commlib's one autograd rule: `PlanFunction`, the autograd Function every public op applies.

Its forward walks the plan (`commlib.gradients.forward`; for the linear plans the plan's walk itself,
`_walk.walk`), its backward is the spec's VJP (`commlib.gradients.vjp`) whose collectives are `PlanFunction`s
again, so every higher derivative follows the same rules. Every walk runs at commlib's boundary: a backend error that
means a timeout or a lost rank is re-raised as `CommTimeout` / `CommFailure`, and in checked mode the
fingerprint exchange comes first (`at_boundary`; the eager unchecked forward of a linear plan does the same
with two calls fewer). `plan_inputs` turns a public op's ``(x, group)`` into the plan builder's inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from commlib import frontend_errors, gradients, plan_cache
from commlib.layout import Plan
from commlib_torch._checked import exchange, is_checked
from commlib_torch._compat import c_apply, functorch_transforms_active, unwrap_if_dead
from commlib_torch._dtypes import DTYPE_NAMES
from commlib_torch._failures import translate
from commlib_torch._groups import (
    COMMON_DTYPES,
    GroupArgument,
    ResolvedGroup,
    backend_dtypes,
    check_tensor,
    group_size,
    resolve_group,
    world_size,
)
from commlib_torch._walk import run, walk
from commlib_torch.testing_trace import ACTIVE, recorded_op

__all__ = [
    "FunctorchPlanFunction",
    "Origin",
    "PlanFunction",
    "apply",
    "at_boundary",
    "plan_inputs",
    "reraise",
    "transforms_active",
]

#: Whether a torch.func transform (grad, vjp, vmap, ...) is active (`commlib_torch._compat`).
transforms_active = functorch_transforms_active

Result = TypeVar("Result")  # what a step at the boundary returns: the output, or (async_op) the begun collective
# the plan checked mode fingerprints, the phase ("forward" / "backward"), and in a backward the forward call's
# number (`commlib_torch._checked.exchange`; None: unnumbered)
Origin = tuple[Plan, str, "int | None"]

plan_cache.trust_sequence_type(torch.Size)  # its items are ints: x.shape keys the fast plan cache as it is
plan_cache.bypass_while(torch.compiler.is_dynamo_compiling)  # Dynamo traces the builders, not the key making


class _Backend:
    """`commlib.gradients.Backend` on torch tensors. Inside a forward (`origin` None) a collective is the
    plan walked; inside a backward it is a `PlanFunction` again, so the VJP is differentiable too."""

    def __init__(self, group: ResolvedGroup, device: torch.device, origin: Origin | None = None) -> None:
        self.group, self.device, self.origin = group, device, origin

    def collective(self, plan: Plan, x: torch.Tensor) -> torch.Tensor:
        return run(plan, x, self.group) if self.origin is None else apply(plan, x, self.group, self.origin)

    def isnan(self, x: torch.Tensor) -> torch.Tensor:
        return torch.isnan(x)

    def astype(self, x: torch.Tensor, dtype: str | torch.Tensor) -> torch.Tensor:  # (a name, or a tensor's dtype)
        return x.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype.dtype)

    def where(self, condition: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.where(condition, x, y)

    def prod(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.prod(dim=axis)

    def expand_dims(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.unsqueeze(axis)

    def own_rank(self, world_size: int, ndim: int) -> torch.Tensor:
        ranks = torch.arange(world_size, device=self.device).reshape((world_size,) + (1,) * (ndim - 1))
        return ranks == dist.get_rank(self.group)


def _primal_rule(plan: Plan, x: torch.Tensor, group: ResolvedGroup) -> torch.Tensor:
    """The op's output by the spec's rule: the plan walked, and max/min's NaN rule."""
    return gradients.forward(_Backend(group, x.device), plan, x)


def at_boundary(
    step: Callable[[Plan, torch.Tensor, ResolvedGroup], Result],
    plan: Plan,
    x: torch.Tensor,
    group: ResolvedGroup,
    origin: Origin | None,
    record: Any = None,
) -> Result:
    """``step(plan, x, group)`` at commlib's boundary: checked mode's fingerprint exchange first (collectives
    only; `origin`: the plan it fingerprints, the phase and the forward call's number, None: this plan,
    "forward"), and a backend error that means a timeout or a lost rank re-raised as CommTimeout / CommFailure.
    `record` (an autograd ctx, a Handle's call): where the call's number is kept for its backward's origin
    (``record.call_number``; set where the exchange ran). Traced by Dynamo: the step alone."""
    if torch.compiler.is_dynamo_compiling():
        return step(plan, x, group)
    try:
        if is_checked() and not plan.step.is_local and not torch.compiler.is_compiling():
            subject, phase, call = origin or (plan, "forward", None)
            number = exchange(subject, x, group, phase, call)
            if record is not None:
                record.call_number = number
        return step(plan, x, group)
    except RuntimeError as error:
        reraise(error, plan, x, group, origin)


def reraise(error: RuntimeError, plan: Plan, x: torch.Tensor, group: ResolvedGroup, origin: Origin | None) -> NoReturn:
    """Raise `error` as CommTimeout / CommFailure where it means one, else as it is."""
    subject, phase, _ = origin or (plan, "forward", None)
    translated = translate(error, subject.op_name, x, group, phase)
    if translated is error:
        raise error
    raise translated from error


#: What `PlanFunction` applies besides the tensor: one argument, not three (Function.apply unwraps and inspects
#: each argument: ~0.2 us apiece).
Call = tuple[Plan, ResolvedGroup, "Origin | None"]


def _save(ctx: Any, plan: Plan, group: ResolvedGroup, x: torch.Tensor, out: torch.Tensor) -> None:
    """What the backward reads: the plan and group; x, and the output for max/min (the VJP reads the primal)."""
    ctx.plan, ctx.group = plan, group
    if gradients.needs_primal(plan):
        ctx.save_for_backward(x, out) if gradients.needs_output(plan) else ctx.save_for_backward(x)


class PlanFunction(torch.autograd.Function):
    """One collective (or local step) of a plan at commlib's boundary (`at_boundary`); backward is the spec's
    VJP rule. ``PlanFunction.apply(x, (plan, group, origin))``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: Call) -> torch.Tensor:
        plan, group, origin = call
        if not gradients.needs_primal(plan):  # a linear plan (the hot path): the output is the plan walked
            ctx.plan, ctx.group = plan, group
            if torch.compiler.is_compiling() or is_checked():
                return at_boundary(run, plan, x, group, origin, ctx)
            try:  # `at_boundary(run, ...)` eagerly and unchecked, two calls fewer
                return walk(plan)(x, group)
            except RuntimeError as error:
                reraise(error, plan, x, group, origin)
        out = at_boundary(_primal_rule, plan, x, group, origin, ctx)
        _save(ctx, plan, group, x, out)
        return out

    @staticmethod
    def vmap(info: object, in_dims: object, x: torch.Tensor, call: Call) -> NoReturn:
        raise frontend_errors.no_vmap(call[0].op_name)

    @staticmethod
    def backward(ctx: Any, cotangent: torch.Tensor) -> tuple[torch.Tensor, None]:
        saved = (*ctx.saved_tensors, None, None)
        backend = _Backend(ctx.group, cotangent.device, (ctx.plan, "backward", getattr(ctx, "call_number", None)))
        return gradients.vjp(backend, ctx.plan, saved[0], saved[1], cotangent), None


class FunctorchPlanFunction(PlanFunction):
    """`PlanFunction` with forward and setup_context apart, the form torch.func's transforms (grad, vjp, vmap) require.
    Applied only while a transform is active: `Function.apply` binds the forward's signature on every call of
    this form (inspect.signature: ~60 us), which plain autograd does not need."""

    @staticmethod
    def forward(x: torch.Tensor, call: Call) -> torch.Tensor:  # type: ignore[override]  # torch.func form, no ctx
        plan, group, origin = call
        return at_boundary(_primal_rule if gradients.needs_primal(plan) else run, plan, x, group, origin)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, Call], output: torch.Tensor) -> None:
        x, (plan, group, _) = inputs
        _save(ctx, plan, group, x, output)


# `PlanFunction.apply` without `Function.apply`'s Python layer (~1.1 us per call; `commlib_torch._compat.c_apply`):
# `apply` unwraps the one tensor argument as `Function.apply` would (PlanFunction has no `setup_context`).
# (Dynamo traces `Function.apply` itself, and the transforms take `FunctorchPlanFunction`.)
_apply_plan_function = c_apply(PlanFunction)


def apply(plan: Plan, x: torch.Tensor, group: ResolvedGroup, origin: Origin | None = None) -> torch.Tensor:
    """`plan` applied to `x` through the autograd Function (`PlanFunction`; `FunctorchPlanFunction` under a
    torch.func transform): x itself where the plan is trivial. While `commlib_torch.testing_trace.record()` is
    active, a forward call (no `origin`) is recorded."""
    if ACTIVE and origin is None and not ACTIVE[-1].depth:
        return recorded_op(plan, x, group, apply)
    if plan.is_trivial:
        return x
    if transforms_active():
        return FunctorchPlanFunction.apply(x, (plan, group, origin))
    if torch.compiler.is_dynamo_compiling():
        return PlanFunction.apply(x, (plan, group, origin))
    return _apply_plan_function(unwrap_if_dead(x), (plan, group, origin))


def plan_inputs(
    op_name: str, x: object, group: GroupArgument
) -> tuple[torch.Tensor, ResolvedGroup, int, str, frozenset[str] | None]:
    """`x` checked to be a tensor, the process group `group` names, its world size (this rank checked to be a
    member), x's dtype name and the dtypes the group's backend carries (None: every dtype, x's included): the
    plan builder's inputs. Host time: the common call (a tensor of a dtype every backend carries, a process
    group this rank is in, or None) reads a few attributes and asks the group nothing else."""
    if not isinstance(x, torch.Tensor):
        x = check_tensor(op_name, x)  # raises the spec's TypeError
    # a DeviceMesh or (mesh, dim) resolved, or the spec's error
    process_group = group if group is None or type(group) is dist.ProcessGroup else resolve_group(op_name, group)
    size = group_size(process_group)
    if size < 0:
        world_size(op_name, process_group)  # raises the spec's CommError: this rank is not in `group`
    carried_by_backend = None if x.dtype in COMMON_DTYPES else backend_dtypes(process_group, x)
    return x, process_group, size, DTYPE_NAMES[x.dtype], carried_by_backend
