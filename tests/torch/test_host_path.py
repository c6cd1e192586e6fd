"""The host path of a call (issue "host time per call"): plans built once, and nothing in the walk that
would stop a CUDA graph from capturing it. Host time itself is measured by ``commlib bench --host``, never
by a timed test; the view steps (no copy, at most one view where the plan says view) are tested in
test_plans.py.
"""

from __future__ import annotations

import ast
import inspect

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

import commlib_torch._walk
import commlib_torch.functional
from commlib import plan_cache
from commlib.tools import cases
from commlib_torch._walk import walk
from commlib_torch.tools.parity_jobs import run_case

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# Each job runs the whole case table (forward and backward) on this rank.


#: aten ops that wait for the device or give a result whose size depends on values: none may run in a
#: walk meant to be captured in a CUDA graph (``.item()`` / ``bool(tensor)`` dispatch _local_scalar_dense).
HOST_SYNCS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "equal",
        "nonzero",
        "nonzero_static",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "repeat_interleave",
        "bincount",
        "histc",
        "_assert_async",
    }
)


def _cases(world_size: int) -> list[cases.Case]:
    return [case for case in cases.case_table(world_size) if case.world_size == world_size]


def second_call_builds(ctx) -> list[str]:
    """The valid cases whose second call (forward and backward) built a plan or made a plan's walk
    (`commlib_torch._walk.walk`): should be none. (A call that raises caches nothing, by design.)"""
    rebuilt = []
    for case in _cases(ctx.world_size):
        if cases.error_text(case) is not None:
            continue
        arrays = cases.make_arrays(case, seed=0)
        run_case(ctx, case, arrays)
        built, made = plan_cache.builds(), walk.cache_info().misses
        run_case(ctx, case, arrays)
        if plan_cache.builds() != built:
            rebuilt.append(case.name)
        if walk.cache_info().misses != made:
            rebuilt.append(f"{case.name} (walk)")
    return rebuilt


class _HostSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.partition("::")[2]
        if name in HOST_SYNCS:
            self.found.add(name)
        return func(*args, **(kwargs or {}))


def host_syncs(ctx) -> dict[str, list[str]]:
    """{case: the host-synchronising aten ops its forward and backward ran}: should be empty."""
    found = {}
    for case in _cases(ctx.world_size):
        arrays = cases.make_arrays(case, seed=0)
        with _HostSyncs() as recorder:
            run_case(ctx, case, arrays)
        if recorder.found:
            found[case.name] = sorted(recorder.found)
    return found


def cache_memory(ctx, shapes: int = 4000) -> dict[str, object]:
    """The Python heap the plan and walk caches keep after `shapes` reduce_scatter calls of
    shapes never seen before (traced by tracemalloc, after a collection), and the plans a handful of
    training shapes builds per round afterwards (forward and backward; round one builds)."""
    import gc
    import tracemalloc

    import torch

    import commlib_torch

    plan_cache.clear()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(1, shapes + 1):
        commlib_torch.reduce_scatter(torch.zeros(ctx.world_size, n), 0)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    builds = []
    for _ in range(3):
        start = plan_cache.builds()
        for shape in ((ctx.world_size * 2, 8), (ctx.world_size, 16, 4), (ctx.world_size * 3, 5)):
            x = torch.randn(shape, requires_grad=True)
            commlib_torch.reduce_scatter(x, 0).sum().backward()
        builds.append(plan_cache.builds() - start)
    return {"kept_bytes": kept, "builds_per_round": builds}


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
def test_second_call_builds_no_plan(pool, world_size):
    """Every case of the table, forward and backward: the second call finds every plan it needs."""
    for rebuilt in pool(world_size).run(second_call_builds):
        assert rebuilt == []


def test_no_host_sync_in_forward_or_backward(pool):
    """No ``.item()``, ``bool(tensor)``, ``nonzero`` or other value-dependent op in any case's forward or
    backward (checked mode, which must read the fingerprints on the host, is off)."""
    for found in pool(2).run(host_syncs):
        assert found == {}


_FORBIDDEN_CALLS = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero"}


@pytest.mark.parametrize("module", [commlib_torch._walk, commlib_torch.functional])
def test_walk_reads_no_tensor_on_the_host(module):
    """By inspection, for what a dispatch mode cannot see on CPU tensors (``.cpu()``, ``.numpy()`` and
    ``.tolist()`` dispatch nothing there): the walk's modules call none of these."""
    tree = ast.parse(inspect.getsource(module))
    called = {
        node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert called & _FORBIDDEN_CALLS == set()


def test_walks_made_once_per_plan_and_forgotten_with_the_plans():
    """Equal plans share one walk (the walk cache is keyed by the plan, as the plan caches are by the call);
    `plan_cache.clear` forgets the walks too."""
    from commlib import plan_cache, plans
    from commlib_torch._walk import walk

    plan = plans.all_gather((3, 5), 4, dim=1)
    equal = plans.all_gather([3, 5], 4, dim=1)  # the general cache: the same plan object
    assert walk(plan) is walk(equal) is walk(plan.replace())  # an equal, distinct object too
    plan_cache.clear()
    assert walk.cache_info().currsize == 0
    assert plans.all_gather((3, 5), 4, dim=1) == plan


def test_each_walk_is_a_record_of_its_plans_decisions():
    """Every walk is a small frozen record (a collective's: its passes, its c10d call, its buffers' shapes and
    dtype), its asynchronous walk the same kind of record's ``start`` (a local step's or a rooted one's runs at
    once). Ulysses'
    all_to_all_4d at batch 1 receives straight into its output (the unpack is a view); an all_reduce with
    accum_dtype is received into its float32 send buffer."""
    import dataclasses

    import torch

    from commlib import plans
    from commlib_torch._walk import started_walk, walk

    every = [
        plans.all_reduce((3, 5), 4),
        plans.all_gather((3, 5), 4, dim=1),
        plans.reduce_scatter((8, 5), 4),
        plans.all_to_all((4, 6), 2, 0, 1),
        plans.permute((3,), 2, [(0, 1)]),
        plans.broadcast((3,), 2),
        plans.reduce((3,), 2),
        plans.gather((3,), 2),
        plans.scatter((4,), 2),
        plans.shard((8,), 4, dim=0),
        plans.sum_grad((3,), 4),
        plans.all_gather((3, 2), 4, dim=1, sizes=(3, 3, 2, 1), rank=2),
    ]
    for plan in every:
        made = walk(plan)
        assert dataclasses.is_dataclass(made) and type(made).__dataclass_params__.frozen, plan.op_name
    for plan in every:
        started = started_walk(plan)
        assert type(started.__self__) is type(walk(plan)) and started.__name__ == "start", plan.op_name
    ulysses = plans.all_to_all_4d((1, 8, 4, 2), 4)
    assert walk(ulysses).made == ulysses.out_shape and walk(ulysses).accum is None
    accumulated = plans.all_reduce((3, 5), 4, dtype="bfloat16", accum_dtype="float32")
    assert walk(accumulated).send(torch.ones(3, 5, dtype=torch.bfloat16)).dtype == torch.float32


def test_a_started_walk_is_charged_as_its_record():
    """The caches' byte bound counts an asynchronous walk (a walk record's bound ``start``) with everything its
    record holds, as the synchronous walk (the record itself), not as the bound method alone."""
    from commlib import plan_cache, plans
    from commlib_torch._walk import started_walk, walk

    for plan in (plans.all_to_all((4, 6), 2, 0, 1), plans.permute((3,), 2, [(0, 1)])):
        assert plan_cache.estimated_bytes(started_walk(plan)) >= plan_cache.estimated_bytes(walk(plan)) > 500


def test_caches_are_bounded_by_bytes(pool):
    """4,000 new shapes leave a few MiB on the heap (the caches' byte bound,
    `commlib.plan_cache.MAX_BYTES` = 4 MiB estimated, with room for the estimate's error; the count bound alone
    kept every walk and plan: ~14 MiB here, 131 MiB after 60,000), and a handful of training shapes still find
    every plan from their second round on."""
    for reply in pool(2).run(cache_memory, timeout=300.0):
        assert reply["kept_bytes"] <= 6 * 2**20, reply
        assert reply["builds_per_round"][1:] == [0, 0], reply
