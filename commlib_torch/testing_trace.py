"""`record()`: every commlib call this rank makes inside the block, in order, with the module that made it and its
input and output tensors (as numpy), into a `commlib.testing.trace.Trace`.

Recorded: each public op (`commlib_torch.functional`, and the ops the sequence helpers and the communicator
call), forward only, as the plan it walked; each attention layer run through a `commlib_torch.sequence.parallel`
context (the transformers integration), as one call with inputs q, k, v ``[B, S_r, H, D]`` (the collectives
inside it are part of it). The module is the innermost ``torch.nn.Module`` whose method is on the Python stack,
named as the outermost one's ``named_modules()`` names it (``model.layers.1.self_attn`` under a
``LlamaForCausalLM``). Not recorded: backward passes, and calls traced by ``torch.compile`` (Dynamo).

Off, recording costs one check of an empty list per op (`commlib_torch._op.apply`) and per attention layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from commlib.layout import Plan
from commlib.testing.trace import Recorder, Trace, calling_module, describe_plan
from commlib_torch._compat import host_copy

__all__ = ["record"]  # `ACTIVE`, `recorded_op` and `recorded_layer`: the hooks of the call path

#: The recorders of the enclosing `record()` blocks, innermost last; empty when not recording (the one check).
ACTIVE: list[Recorder] = []


@contextlib.contextmanager
def record() -> Iterator[Trace]:
    """Record this rank's commlib calls inside the block into the `Trace` it yields (filled as the calls run).

    Each rank records its own calls (its arrays under its WORLD rank); join the ranks' traces with
    `commlib.testing.trace.Trace.merge` (save each with ``trace.save(path)``), compare two traces with
    `commlib.testing.divergence.first_divergence`. Nested blocks record into the innermost only.

    Example (WORLD of one rank):
        >>> from commlib_torch import all_reduce
        >>> class Norm(torch.nn.Module):
        ...     def forward(self, x):
        ...         return all_reduce(x)
        >>> model = torch.nn.Sequential(torch.nn.Identity(), Norm())
        >>> with record() as trace:
        ...     out = model(torch.ones(2, 3))
        >>> [(call.op, call.module, call.plan["in_shape"]) for call in trace]
        [('all_reduce', '1', '(2, 3)')]
        >>> trace[0].inputs["x"][0].shape, trace[0].outputs["out"][0].sum()
        ((2, 3), np.float32(6.0))
    """
    recorder = Recorder()
    ACTIVE.append(recorder)
    try:
        yield recorder.trace
    finally:
        ACTIVE.remove(recorder)


def _module(recorder: Recorder) -> str:
    return calling_module(recorder, lambda owner: isinstance(owner, torch.nn.Module), lambda root: root.named_modules())  # type: ignore[attr-defined]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _recording() -> Recorder | None:
    """The innermost recorder, where this call is one to record (not inside a recorded call, not compiled)."""
    recorder = ACTIVE[-1]
    return None if recorder.depth or torch.compiler.is_compiling() else recorder


def recorded_op(plan: Plan, x: torch.Tensor, group: Any, apply: Callable) -> torch.Tensor:
    """``apply(plan, x, group)``, recorded as one call of `plan`'s op: `commlib_torch._op.apply` calls this
    while recording, for a forward call outside every recorded call, and is called back inside the recorded
    call (where it walks the plan)."""
    recorder = ACTIVE[-1]
    if torch.compiler.is_compiling():
        with recorder.inside():
            return apply(plan, x, group)
    index = recorder.open(plan.op_name, _module(recorder), describe_plan(plan))
    recorder.store(index, "inputs", "x", _rank(), host_copy(x))
    with recorder.inside():
        out = apply(plan, x, group)
    recorder.store(index, "outputs", "out", _rank(), host_copy(out))
    return out


def recorded_layer(
    op: str, layer: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **keywords: Any
) -> torch.Tensor:
    """``layer(q, k, v, **keywords)`` recorded as one call of the attention layer `op` (inputs q, k, v)."""
    recorder = _recording()
    if recorder is None:
        return layer(q, k, v, **keywords)
    plan = {name: str(tuple(x.shape)) for name, x in (("q", q), ("k", k), ("v", v))}
    plan.update(dtype=str(q.dtype).removeprefix("torch."), **{key: str(value) for key, value in keywords.items()})
    index = recorder.open(op, _module(recorder), plan, inputs=("q", "k", "v"))
    for name, x in (("q", q), ("k", k), ("v", v)):
        recorder.store(index, "inputs", name, _rank(), host_copy(x))
    with recorder.inside():
        out = layer(q, k, v, **keywords)
    recorder.store(index, "outputs", "out", _rank(), host_copy(out))
    return out
