"""WorkerPool jobs for tests/torch/test_host_path.py: what a call does on the host besides the collective.

Each job runs the whole case table (forward and backward) on this rank; module-level so worker processes can
import them by name.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from commlib import plan_cache
from commlib.tools import cases
from commlib_torch._walk import walk
from commlib_torch.tools.parity_jobs import run_case

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
