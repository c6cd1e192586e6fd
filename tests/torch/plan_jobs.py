"""WorkerPool jobs for tests/torch/test_plans.py: what the torch walk allocates and copies, op by op.

A `TorchDispatchMode` records every aten and c10d call of one forward (or backward) on each rank and splits
them at the first c10d collective; module-level so worker processes can import them by name.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import commlib_torch

#: Where the c10d calls are made: torch.distributed's functions and commlib's calls of the process group's own
#: methods (whose ``work.wait()`` runs, for example, gloo's copy of a reduce_scatter's chunk).
_DISTRIBUTED = (os.path.join("torch", "distributed", ""), os.path.join("commlib_torch", "_c10d.py"))

#: aten ops that read a tensor into new memory (one local pass each).
COPIES = frozenset(
    {
        "copy_",
        "clone",
        "_to_copy",
        "cat",
        "stack",
        "contiguous",
        "index_select",
        "gather",
        "permute_copy",
        "transpose_copy",
        "narrow_copy",
        "_unsafe_view_copy",
    }
)
#: aten ops that allocate without reading (the buffers of a pass or of a collective).
ALLOCATIONS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros"}
)


@dataclasses.dataclass
class Trace:
    """What one call did on one rank, split at the first collective."""

    before: list[str] = dataclasses.field(default_factory=list)  # copies and allocations before it
    collectives: list[str] = dataclasses.field(default_factory=list)  # c10d ops
    after: list[str] = dataclasses.field(default_factory=list)  # copies and allocations after it
    other: list[str] = dataclasses.field(default_factory=list)  # other aten ops that compute (e.g. mul_)
    views_before: list[str] = dataclasses.field(default_factory=list)  # view ops before the first collective
    views_after: list[str] = dataclasses.field(default_factory=list)  # view ops after it
    inside: list[str] = dataclasses.field(default_factory=list)  # aten ops torch.distributed itself ran
    collective_storages: set[int] = dataclasses.field(default_factory=set)  # storages the collectives touched

    def passes(self, part: str) -> int:
        return sum(name in COPIES for name in getattr(self, part))

    def allocations(self, part: str) -> int:
        return sum(name in ALLOCATIONS or name in COPIES - {"copy_"} for name in getattr(self, part))


_VIEWS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "permute",
        "transpose",
        "t",
        "expand",
        "split",
        "chunk",
        "unbind",
        "select",
        "slice",
        "narrow",
        "squeeze",
        "unsqueeze",
        "alias",
        "detach",
        "as_strided",
        "_reshape_alias",
        "lift_fresh",
    }
)


def _inside_torch_distributed() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(place in frame.f_code.co_filename for place in _DISTRIBUTED):
            return True
        frame = frame.f_back
    return False


def _storages(value) -> set[int]:
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, (list, tuple)):
        return set().union(*(_storages(item) for item in value)) if value else set()
    return set()


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        self.alive: list = []  # the collectives' buffers: a freed one's address could be reused by a later one

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func._schema.name.partition("::")
        trace = self.trace
        if namespace == "c10d":
            trace.collectives.append(name)
            trace.collective_storages |= _storages(args) | _storages(list((kwargs or {}).values()))
            self.alive.append((args, kwargs))
        elif _inside_torch_distributed():  # the collective's own work (gloo's reduce_scatter copies its chunk)
            trace.inside.append(name)
        elif name in COPIES or name in ALLOCATIONS:
            (trace.after if trace.collectives else trace.before).append(name)
        elif name in _VIEWS:
            (trace.views_after if trace.collectives else trace.views_before).append(name)
        else:
            trace.other.append(name)
        return func(*args, **(kwargs or {}))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def record(ctx, op: str, shape: tuple[int, ...], kwargs: dict, *, grad: bool = True) -> dict:
    """Forward (and backward) of `op` on a contiguous float32 input: each call's `Trace`, and whether the
    output / input gradient share storage with the input / cotangent or the collective's buffers."""
    torch.manual_seed(ctx.rank)
    x = torch.randn(shape, requires_grad=grad)
    forward, backward, saved = Trace(), Trace(), []
    with (
        _Recorder(forward) as forward_recorder,  # noqa: F841
        torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor),
    ):
        out = getattr(commlib_torch, op)(x, **kwargs)
    result = {
        "forward": forward,
        "out_is_input": _storage(out) == _storage(x),
        "autograd_state": (out.grad_fn is not None, out.requires_grad, len(saved)),
        "out_in_collective": _storage(out) in forward.collective_storages,
        "input_in_collective": _storage(x) in forward.collective_storages,
    }
    if grad:
        cotangent = torch.randn(out.shape)
        with _Recorder(backward) as backward_recorder:  # noqa: F841
            (gradient,) = torch.autograd.grad(out, x, cotangent)
        result.update(
            backward=backward,
            grad_in_collective=_storage(gradient) in backward.collective_storages,
            cotangent_in_collective=_storage(cotangent) in backward.collective_storages,
        )
    return result
