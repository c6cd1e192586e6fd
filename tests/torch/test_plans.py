"""The torch walk allocates and copies exactly what the spec's plan says, forward and backward.

Each case runs on real gloo ranks (W = 2 and 4) under a dispatch-mode recorder (the jobs below):
a pass the plan marks identity must be a view (the collective reads the input's storage, or the output is
the collective's buffer), every other pass is one copy into one fresh buffer, and the only other
allocation is the collective's receive buffer.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import commlib_torch
from commlib import gradients, plans

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# A `TorchDispatchMode` records every aten and c10d call of one forward (or backward) on each rank and splits
# them at the first c10d collective.


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


# --- the tests ----------------------------------------------------------------------------------------------


WORLD_SIZES = (2, 4)
IN_PLACE = ("all_reduce",)  # collectives that receive into the send buffer


def _ulysses_shape(world_size: int, batch: int, dims: tuple[int, int]) -> tuple[int, ...]:
    return (batch, 3, 2 * world_size, 5) if dims == (2, 1) else (batch, 3 * world_size, 2, 5)


#: (op, input shape for W, kwargs): every layout the plans produce on dim-0 and inner dims.
CASES = {
    "all_reduce": ("all_reduce", lambda W: (3, 5), {}),
    "all_gather dim 0": ("all_gather", lambda W: (3, 5), {"dim": 0}),
    "all_gather dim -1": ("all_gather", lambda W: (3, 5), {"dim": -1}),
    "all_gather dim 1 (size-1 lead)": ("all_gather", lambda W: (1, 4, 5), {"dim": 1}),
    "reduce_scatter dim 0": ("reduce_scatter", lambda W: (2 * W, 5), {"dim": 0}),
    "reduce_scatter dim 1": ("reduce_scatter", lambda W: (3, 2 * W), {"dim": 1}),
    "all_to_all = all_to_all_single": ("all_to_all", lambda W: (1, 3 * W), {"scatter_dim": 1, "gather_dim": 0}),
    "all_to_all 3d (0, 2)": ("all_to_all", lambda W: (2 * W, 3, 4), {"scatter_dim": 0, "gather_dim": 2}),
    "all_to_all 3d (2, 0)": ("all_to_all", lambda W: (2, 3, 2 * W), {"scatter_dim": 2, "gather_dim": 0}),
}


def _plan(op: str, shape, world_size: int, kwargs: dict):
    return getattr(plans, op)(shape, world_size, **kwargs)


def _check_trace(trace: Trace, plan, input_shared: bool, output_shared: bool) -> None:
    """`trace` made the passes and allocations of `plan`, and the views where the plan says identity."""
    pack, unpack = int(not plan.layout.pack.is_identity), int(not plan.layout.unpack.is_identity)
    receive = int(plan.step.name not in IN_PLACE)
    assert len(trace.collectives) == 1, trace
    assert (trace.passes("before"), trace.passes("after")) == (pack, unpack), trace
    assert (trace.allocations("before"), trace.allocations("after")) == (pack + receive, unpack), trace
    assert input_shared == (not pack), trace  # identity pack: the collective sends the input's own memory
    assert output_shared == (not unpack), trace  # identity unpack: the output is the received buffer
    assert trace.other == [], trace
    # a view step costs no more than one view (or reshape): of the input, for the pack; of the output, for the
    # unpack (the output is made first and received into through that view): no permute, no second view
    assert pack or len(trace.views_before) <= 1 + (not unpack), trace
    assert unpack or len(trace.views_after) <= 1, trace


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_walk_follows_the_plan(pool, world_size, name):
    op, shape_of, kwargs = CASES[name]
    shape = shape_of(world_size)
    plan = _plan(op, shape, world_size, kwargs)
    for result in pool(world_size).run(record, op, shape, kwargs):
        _check_trace(result["forward"], plan, result["input_in_collective"], result["out_in_collective"])
        dual = gradients.vjp_plan(plan)
        _check_trace(result["backward"], dual, result["cotangent_in_collective"], result["grad_in_collective"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dims", [(2, 1), (1, 2)])
def test_ulysses_copies(pool, world_size, batch, dims):
    """Batch 1: exactly one copy per all_to_all_4d (the other side is a view); batch > 1: two. Same backward."""
    shape = _ulysses_shape(world_size, batch, dims)
    kwargs = {"scatter_dim": dims[0], "gather_dim": dims[1]}
    plan = plans.all_to_all_4d(shape, world_size, *dims)
    assert plan.copies == (1 if batch == 1 else 2)
    for result in pool(world_size).run(record, "all_to_all_4d", shape, kwargs):
        for part in ("forward", "backward"):
            trace = result[part]
            assert trace.passes("before") + trace.passes("after") == plan.copies, (part, trace)
        _check_trace(result["forward"], plan, result["input_in_collective"], result["out_in_collective"])
        if batch == 1:  # the view is the pack for (1, 2) and the unpack for (2, 1)
            assert result["input_in_collective"] == (dims == (1, 2))
            assert result["out_in_collective"] == (dims == (2, 1))


@pytest.mark.parametrize(
    ("op", "shape", "kwargs"), [("all_gather", (3, 5), {"dim": 0}), ("reduce_scatter", (4, 5), {"dim": 0})]
)
def test_dim0_gather_scatter_copy_nothing(pool, op, shape, kwargs):
    """all_gather / reduce_scatter on dim 0: no pass before or after the collective, forward or backward."""
    for result in pool(2).run(record, op, shape, kwargs):
        for part in ("forward", "backward"):
            assert result[part].passes("before") == result[part].passes("after") == 0, (part, result[part])


def test_no_grad_input_copies_the_same(pool):
    """An input that does not require grad goes through the same walk (no extra copies, no autograd state)."""
    shape = _ulysses_shape(2, 1, (2, 1))
    (result, _) = pool(2).run(record, "all_to_all_4d", shape, {}, grad=False)
    assert result["forward"].passes("before") + result["forward"].passes("after") == 1
    assert result["autograd_state"] == (False, False, 0)  # no grad_fn, no requires_grad, nothing saved
