"""Host time of three pieces of a call, each against what it replaced (the numbers behind 2026-12-01's changes).

    python benchmarks/host_pieces.py           # fake process group, W = 4; ~5 s

- the autograd Function: `Function.apply` against the C apply `commlib_torch._op.apply` calls (eager, no
  torch.func transform), on a Function that returns its input;
- a permute plan: the general cache keying a list perm against `commlib.plan_cache.pairs` + the fast cache;
- the Ulysses unpack pass (``all_to_all_4d`` (2, 1), batch 2, W = 4, float32): a copy and a view of it (which
  autograd refuses to modify in place when a Function returns it), a fresh tensor of the output's shape and a
  copy into a view of it, and what `commlib_torch._walk.rearrange` makes (reshape's copy).

Each row: the best of 5 tight loops of 20000 calls, in us per call.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from c10d_calls import us_per_call  # (this folder: the same tight loops)
from tabulate import tabulate
from torch.testing._internal.distributed.fake_pg import FakeStore

from commlib import plan_cache, plans
from commlib_torch import _walk


class _Itself(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, call):
        return x

    @staticmethod
    def backward(ctx, cotangent):
        return cotangent, None


def _rows() -> list[tuple[str, object, object]]:
    x = torch.randn(256, requires_grad=True)
    c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Itself)
    unwrap = torch._C._functorch.unwrap_if_dead
    ring = [(rank, (rank + 1) % 4) for rank in range(4)]
    plan = plans.all_to_all_4d((2, 8, 8, 16), 4, 2, 1)
    step, out_shape, recv = plan.layout.unpack, plan.out_shape, torch.randn(plan.layout.recv_shape)

    def copy_into_output():
        out = recv.new_empty(out_shape)
        out.view(step.out_shape).copy_(recv.reshape(step.split_shape).permute(step.perm))
        return out

    return [
        (
            "autograd Function: Function.apply -> C apply",
            lambda: _Itself.apply(x, None),
            lambda: c_apply(unwrap(x), None),
        ),
        (
            "permute plan (list perm): general cache -> pairs + fast cache",
            lambda: plans.permute(x.shape, 4, ring, dtype="float32", backend_dtypes=None),
            lambda: plans.permute(x.shape, 4, plan_cache.pairs(ring), dtype="float32", backend_dtypes=None),
        ),
        (
            "Ulysses unpack: contiguous + view -> new_empty + copy_",
            lambda: recv.reshape(step.split_shape).permute(step.perm).contiguous().view(out_shape),
            copy_into_output,
        ),
        (
            "Ulysses unpack: contiguous + view -> rearrange (reshape's copy)",
            lambda: recv.reshape(step.split_shape).permute(step.perm).contiguous().view(out_shape),
            lambda: _walk.rearrange(recv, step, out_shape, recv.dtype),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    torch.set_num_threads(1)
    table = []
    with torch.no_grad():  # (the passes run inside the Function's forward, where grad mode is off)
        rows = _rows()
    for name, before, after in rows:
        grad = torch.enable_grad() if "Function" in name else torch.no_grad()
        with grad:
            before_us, after_us = us_per_call(before, args.calls), us_per_call(after, args.calls)
        table.append((name, f"{before_us:.2f}", f"{after_us:.2f}", f"{after_us - before_us:+.2f}"))
    print(tabulate(table, headers=("piece: before -> now", "before us", "now us", "difference us")))
    print(f"torch {torch.__version__}; best of 5 loops of {args.calls} calls")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
