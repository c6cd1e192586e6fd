"""Torch side of `commlib bench`: ``python -m commlib_torch.tools.bench_runner OUT.json --world-sizes 2 4
--sizes-mib 1 16 --repeats 7 [--cases NAME ...]``.

Runs the cases of `commlib_torch.tools.bench_cases` on one `WorkerPool` of gloo ranks per world size and writes
the records the driver (`commlib.tools.bench`) reduces.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from commlib.tools import progress
from commlib_torch.tools import bench_context, bench_train, bench_uneven  # noqa: F401  (register those cases)
from commlib_torch.tools.bench_cases import CASES, time_case
from commlib_torch.tools.pool import WorkerContext, WorkerPool

__all__ = ["main", "run"]


def _set_threads(ctx: WorkerContext, threads: int) -> None:
    torch.set_num_threads(threads)


def run(
    world_size: int, names: list[str], sizes_mib: list[float], repeats: int, warmup: int, threads: int
) -> list[dict]:
    """Every case at every size on one pool of `world_size` gloo ranks: records for the driver."""
    records = []
    with WorkerPool(world_size, timeout=600.0) as pool:
        pool.run(_set_threads, threads)
        for name in names:
            case = CASES[name]
            for size in case.sizes_mib or sizes_mib:
                nbytes = int(size * 2**20)
                per_rank = pool.run(time_case, name, nbytes, repeats, warmup)
                variants = per_rank[0][0]["wall"]
                slowest = {v: [max(rank[i]["wall"][v] for rank in per_rank) for i in range(repeats)] for v in variants}
                work = {v: [sum(rank[i]["cpu"][v] for rank in per_rank) for i in range(repeats)] for v in variants}
                wire = case.wire(world_size, nbytes) if case.wire else None
                records.append(
                    {
                        "framework": "torch",
                        "case": name,
                        "world_size": world_size,
                        "size_mib": size,
                        "subject": case.subject,
                        "baselines": list(case.baselines),
                        "seconds": slowest,
                        "cpu_seconds": work,
                        "wire_bytes": wire,
                    }
                )
                progress.done(f"W={world_size} {name} {size:g} MiB")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib_torch.tools.bench_runner")
    parser.add_argument("out", type=Path, help="JSON file for the records")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--cases", nargs="+", default=None, help="case names (default: all; others ignored)")
    parser.add_argument("--quick", action="store_true", help="only the cases marked quick")
    parser.add_argument("--list-cases", action="store_true", help="print the case names, one a line, and stop")
    args = parser.parse_args(argv)
    if args.list_cases:
        print("\n".join(CASES))
        return 0
    names = args.cases or [name for name, case in CASES.items() if case.quick or not args.quick]
    names = [name for name in names if name in CASES]  # --cases may name the other framework's cases
    progress.expect(len(args.world_sizes) * sum(len(CASES[name].sizes_mib or args.sizes_mib) for name in names))
    records = []
    for world_size in args.world_sizes:
        records += run(world_size, names, args.sizes_mib, args.repeats, args.warmup, args.threads)
    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    args.out.write_text(json.dumps({"versions": versions, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
