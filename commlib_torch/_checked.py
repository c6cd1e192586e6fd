"""Checked mode and failed collectives at commlib's boundary (torch).

Every op's autograd Function runs through `guard`, which returns a same-named subclass whose forward and
backward

* in checked mode (``COMMLIB_CHECK=1``, `set_checked`, or ``with checked():``) first all-gather a fixed-size
  int64 fingerprint of the call over the same group (on the input's device; `commlib.check` encodes and
  compares), so a rank that disagrees on op, shape, dtype, dims, reduce op, convention, root, perm or
  accum_dtype makes every rank raise the same `commlib.CommError` before the real collective runs;
* always turn a backend error that means a timeout or a lost rank into `commlib.CommTimeout` /
  `commlib.CommFailure` naming the op and the group (other errors pass unchanged).

Checked mode costs one small all_gather (plus, on CUDA, one device-to-host copy) per collective: see
`overhead`. It is eager-only: under ``torch.compile`` the plain Functions run, unchecked. Ranks must all
be in checked mode or all out of it (the exchange is itself a collective).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from commlib import check
from commlib.layout import Plan
from commlib_torch._walk import _all_gather_single, dtype_name

__all__ = ["checked", "exchange", "guard", "is_checked", "overhead", "set_checked"]

ENV_VARIABLE = "COMMLIB_CHECK"
_override: bool | None = None  # set_checked / checked(); None: follow the environment variable
_guarded: dict[type, type] = {}


def is_checked() -> bool:
    """True when collectives exchange fingerprints first (`set_checked` / `checked`, else ``COMMLIB_CHECK``)."""
    if _override is not None:
        return _override
    return os.environ.get(ENV_VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")


def set_checked(enabled: bool | None) -> None:
    """Turn checked mode on or off in this process, whatever ``COMMLIB_CHECK`` says (None: follow it again)."""
    global _override
    _override = None if enabled is None else bool(enabled)


@contextlib.contextmanager
def checked(enabled: bool = True) -> Iterator[None]:
    """``with checked():`` -- checked mode inside the block (``checked(False)``: off), restored after."""
    global _override
    previous, _override = _override, bool(enabled)
    try:
        yield
    finally:
        _override = previous


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def exchange(plan: Plan, tensor: torch.Tensor, group: dist.ProcessGroup | None, phase: str = "forward") -> None:
    """All-gather this rank's fingerprint of (`plan`, `tensor`'s dtype, `phase`) over `group`; raise the
    spec's `CommError` on every rank if any rank's differs."""
    mine = torch.from_numpy(check.fingerprint(plan, dtype_name(tensor.dtype), phase)).to(tensor.device)
    everyone = torch.empty((plan.world_size, check.FINGERPRINT_SIZE), dtype=torch.int64, device=tensor.device)
    _all_gather_single(everyone.view(-1), mine, group=group)
    check.compare(everyone.cpu().numpy(), dist.get_rank(group))


def _translate(error: RuntimeError, plan: Plan, tensor: torch.Tensor, group, phase: str) -> RuntimeError:
    """The `CommTimeout` / `CommFailure` for a backend error, or `error` itself."""
    if isinstance(error, check.CommFailure):
        return error
    received = dict(shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype))
    try:
        rank, ranks = dist.get_rank(group), _group_ranks(group)
    except Exception:  # the group itself is gone: report what is known
        rank, ranks = -1, []
    translated = check.failure(plan.op, str(error), rank=rank, group_ranks=ranks, phase=phase, received=received)
    return error if translated is None else translated


def _run(call: Callable, plan: Plan, tensor: torch.Tensor, group, phase: str):
    """`call()` (a Function's forward or backward), after the exchange in checked mode; backend failures of
    either translated."""
    try:
        if is_checked():
            exchange(plan, tensor, group, phase)
        return call()
    except RuntimeError as error:
        translated = _translate(error, plan, tensor, group, phase)
        if translated is error:
            raise
        raise translated from error


def _guard_class(function: type) -> type:
    def forward(ctx, x: torch.Tensor, plan: Plan, group):
        return _run(lambda: function.forward(ctx, x, plan, group), plan, x, group, "forward")

    def backward(ctx, *cotangents: torch.Tensor):
        return _run(lambda: function.backward(ctx, *cotangents), ctx.plan, cotangents[0], ctx.group, "backward")

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward),
                 "__module__": function.__module__, "__qualname__": function.__qualname__, "__doc__": function.__doc__}
    return type(function.__name__, (function,), namespace)


def guard(function: type) -> type:
    """`function` (an autograd Function taking ``(x, plan, group)`` that sets ``ctx.plan`` / ``ctx.group``)
    with the fingerprint exchange in checked mode and failure translation; `function` itself under
    ``torch.compile``."""
    if torch.compiler.is_compiling():
        return function
    guarded = _guarded.get(function)
    if guarded is None:
        guarded = _guarded[function] = _guard_class(function)
    return guarded


def _median_seconds(call: Callable[[], object], repeats: int, group) -> float:
    for _ in range(max(2, repeats // 10)):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, repeats: int = 50) -> dict[str, float]:
    """Median seconds per call on this rank (call it on every rank of `group`) of an all_reduce(sum) of `x`:

    ``raw`` (``dist.all_reduce`` of a copy, as commlib's out-of-place op does), ``commlib`` (input
    requiring grad: builds the graph), ``no_grad``, ``inference_mode``, ``constant`` (input not requiring
    grad), ``checked`` (checked mode on, requiring grad) and ``fingerprint`` (the exchange alone).
    For `commlib bench` rows: checked-mode overhead = checked - commlib, inference overhead = no_grad - raw.
    """
    from commlib import ops
    from commlib_torch.functional import all_reduce

    leaf = x.detach().requires_grad_(x.is_floating_point())
    constant = x.detach()
    plan = ops.all_reduce(tuple(x.shape), dist.get_world_size(group), dtype=dtype_name(x.dtype))

    def raw():
        dist.all_reduce(constant.clone(), group=group)

    def in_mode(mode):
        def call():
            with mode():
                all_reduce(leaf, group=group)
        return call

    def with_check():
        with checked():
            all_reduce(leaf, group=group)

    calls = {"raw": raw, "commlib": lambda: all_reduce(leaf, group=group), "no_grad": in_mode(torch.no_grad),
             "inference_mode": in_mode(torch.inference_mode), "constant": lambda: all_reduce(constant, group=group),
             "checked": with_check, "fingerprint": lambda: exchange(plan, constant, group)}
    with checked(False):
        return {name: _median_seconds(call, repeats, group) for name, call in calls.items()}
