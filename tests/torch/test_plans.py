"""The torch walk allocates and copies exactly what the spec's plan says, forward and backward.

Each case runs on real gloo ranks (W = 2 and 4) under a dispatch-mode recorder (tests/torch/plan_jobs.py):
a pass the plan marks identity must be a view (the collective reads the input's storage, or the output is
the collective's buffer), every other pass is one copy into one fresh buffer, and the only other
allocation is the collective's receive buffer.
"""

import pytest

from commlib import gradients, plans
from tests.torch import plan_jobs

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


def _check_trace(trace: plan_jobs.Trace, plan, input_shared: bool, output_shared: bool) -> None:
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
    for result in pool(world_size).run(plan_jobs.record, op, shape, kwargs):
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
    for result in pool(world_size).run(plan_jobs.record, "all_to_all_4d", shape, kwargs):
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
    for result in pool(2).run(plan_jobs.record, op, shape, kwargs):
        for part in ("forward", "backward"):
            assert result[part].passes("before") == result[part].passes("after") == 0, (part, result[part])


def test_no_grad_input_copies_the_same(pool):
    """An input that does not require grad goes through the same walk (no extra copies, no autograd state)."""
    shape = _ulysses_shape(2, 1, (2, 1))
    (result, _) = pool(2).run(plan_jobs.record, "all_to_all_4d", shape, {}, grad=False)
    assert result["forward"].passes("before") + result["forward"].passes("after") == 1
    assert result["autograd_state"] == (False, False, 0)  # no grad_fn, no requires_grad, nothing saved
