"""The host path of a call (issue "host time per call"): plans built once, and nothing in the walk that
would stop a CUDA graph from capturing it. Host time itself is measured by ``commlib bench --host``, never
by a timed test; the view steps (no copy, at most one view where the plan says view) are tested in
test_plans.py.
"""

import ast
import inspect

import pytest

import commlib_torch._walk
import commlib_torch.functional
from tests.torch import host_jobs


@pytest.mark.parametrize("world_size", [1, 2])
def test_second_call_builds_no_plan(pool, world_size):
    """Every case of the table, forward and backward: the second call finds every plan it needs."""
    for rebuilt in pool(world_size).run(host_jobs.second_call_builds):
        assert rebuilt == []


def test_no_host_sync_in_forward_or_backward(pool):
    """No ``.item()``, ``bool(tensor)``, ``nonzero`` or other value-dependent op in any case's forward or
    backward (checked mode, which must read the fingerprints on the host, is off)."""
    for found in pool(2).run(host_jobs.host_syncs):
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
    for reply in pool(2).run(host_jobs.cache_memory, timeout=300.0):
        assert reply["kept_bytes"] <= 6 * 2**20, reply
        assert reply["builds_per_round"][1:] == [0, 0], reply
