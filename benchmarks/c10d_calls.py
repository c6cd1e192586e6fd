"""Host time of one c10d call: torch.distributed's function against the process group's own method.

    python benchmarks/c10d_calls.py            # fake process group, W = 4, 256 float32; ~10 s

The numbers behind `commlib_torch._c10d` (its walks call the methods, with options made once). Each row: the
best of 5 tight loops of 20000 calls, in us per call, on torch's ``fake`` backend (no data moves: host work
only).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from commlib_torch._c10d import _options
from commlib_torch._compat import all_gather_single
from commlib_torch._compat import process_group_all_gather as _pg_all_gather
from commlib_torch._compat import process_group_all_to_all as _pg_all_to_all


def us_per_call(call, calls: int) -> float:
    for _ in range(500):
        call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    group = c10d._get_default_group()
    x, out, gathered = torch.randn(256), torch.empty(256), torch.empty(1024)
    reduce_op = dist.ReduceOp.SUM
    all_reduce_options = _options(dist.AllreduceOptions, reduceOp=reduce_op)
    broadcast_options = _options(dist.BroadcastOptions, rootRank=0, rootTensor=0)
    reduce_options = _options(dist.ReduceOptions, reduceOp=reduce_op, rootRank=0)
    all_to_all_options, all_gather_options = _options(dist.AllToAllOptions), _options(c10d.AllgatherOptions)
    rows = [
        ("all_reduce", lambda: dist.all_reduce(x), lambda: group.allreduce([x], all_reduce_options).wait()),
        ("broadcast", lambda: dist.broadcast(x, 0), lambda: group.broadcast([x], broadcast_options).wait()),
        ("reduce", lambda: dist.reduce(x, 0), lambda: group.reduce([x], reduce_options).wait()),
        (
            "all_to_all_single",
            lambda: dist.all_to_all_single(out, x),
            lambda: _pg_all_to_all(group, out, x, [], [], all_to_all_options).wait(),
        ),
        (
            "all_gather (dim 0)",
            lambda: all_gather_single(gathered, x),
            lambda: _pg_all_gather(group, gathered, x, all_gather_options).wait(),
        ),
    ]
    table = []
    for name, function, method in rows:
        function_us, method_us = us_per_call(function, args.calls), us_per_call(method, args.calls)
        table.append((name, f"{function_us:.2f}", f"{method_us:.2f}", f"{function_us - method_us:+.2f}"))
    print(
        tabulate(
            table,
            headers=("call", "torch.distributed function (us)", "process group method (us)", "difference (us)"),
            tablefmt="github",
        )
    )
    print(f"\ntorch {torch.__version__}, {args.calls} calls per loop, best of 5")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
