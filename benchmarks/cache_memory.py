"""What the plan and walk caches hold after many distinct shapes (issue 23 item 6).

One process, rank 0 of a fake torch process group of W ranks (no communication): RSS before and after
`--shapes` reduce_scatter calls, each with a shape never seen before ([W, n] along dim 0, n = 1, 2, ...), the
entries the caches hold and their estimated bytes; then a training-like loop (a handful of shapes, repeated)
whose plan builds after the first round must be 0 (a 100% hit rate). Prints one JSON object.

    python benchmarks/cache_memory.py --shapes 60000 > benchmarks/results/<dir>/cache_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

import commlib_torch
from commlib import plan_cache
from commlib_torch import _walk
from commlib_torch.tools.host_runner import init_fake


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def held() -> dict:
    """Entries the caches hold now (and their estimated bytes, where the code measured has the estimate: the
    same script measures the code before the byte bound)."""
    plans = sum(fast.cache_info().currsize + len(general) for fast, general in plan_cache._caches.values())
    return {
        "plans": plans,
        "walks": _walk.walk.cache_info().currsize,  # (an lru_cache before the byte bound, a held_cache since)
        "estimated_bytes": plan_cache.held_bytes() if hasattr(plan_cache, "held_bytes") else None,
    }


def distinct_shapes(world_size: int, shapes: int) -> float:
    start = time.perf_counter()
    for n in range(1, shapes + 1):
        commlib_torch.reduce_scatter(torch.zeros(world_size, n), 0)
    return time.perf_counter() - start


def training_like(world_size: int, rounds: int) -> dict:
    """A handful of shapes (a model's layers), forward and backward, `rounds` times: builds after round one."""
    shapes = [(world_size * 2, 64), (world_size * 8, 16), (world_size, 1024), (world_size * 4, 4, 8)]
    builds = []
    for _ in range(rounds):
        before = plan_cache.builds()
        for shape in shapes:
            x = torch.randn(shape, requires_grad=True)
            commlib_torch.reduce_scatter(x, 0).sum().backward()
            commlib_torch.all_gather(x.detach(), 0)
        builds.append(plan_cache.builds() - before)
    return {"rounds": rounds, "builds_per_round": builds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=int, default=60000)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_fake(args.world_size)
    commlib_torch.reduce_scatter(torch.zeros(args.world_size, 1), 0)  # imports and first allocations done
    gc.collect()
    before = rss_mib()
    seconds = distinct_shapes(args.world_size, args.shapes)
    gc.collect()
    after = rss_mib()
    report = {
        "world_size": args.world_size,
        "shapes": args.shapes,
        "rss_mib_before": round(before, 1),
        "rss_mib_after": round(after, 1),
        "rss_mib_growth": round(after - before, 1),
        "seconds": round(seconds, 2),
        "held": held(),
        "limits": {"max_plans": plan_cache.MAX_PLANS, "max_bytes": getattr(plan_cache, "MAX_BYTES", None)},
        "training": training_like(args.world_size, 20),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
