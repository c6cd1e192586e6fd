"""Torch side of ``commlib bench --host``: host time per call, on torch's ``fake`` process group.

``python -m commlib_torch.tools.host_runner OUT.json --world-size 4 --calls 3000``

The fake backend (`torch.testing._internal.distributed.fake_pg`) makes every collective a no-op, so one
process times only the host work around it: building or finding the plan, the autograd Function, the local
passes, the buffers, the c10d call's own Python. Each case (`CASES`) gives, on a small float32 tensor,
commlib and the baselines it is compared with:

- ``torch.distributed.nn``: `torch.distributed.nn.functional` where it has the op (all_reduce, broadcast,
  all_to_all_single), and for all_to_all_4d the hand-written DeepSpeed-style Ulysses layout
  (`baselines.ulysses_by_hand`) around its all_to_all_single;
- ``by hand``: the raw c10d call, its buffers (a clone where it works in place) and one autograd Function
  (`baselines.ByHand`): the floor for a differentiable collective;
- ``commlib`` for the ``checked`` rows, whose subject is commlib in checked mode (one fingerprint all_gather
  more per collective).

Every call is timed on its own (`time.perf_counter`); the variants of a case take turns call by call
(rotating which goes first), so a change in the machine's load, and the state of the caches each call finds,
fall on all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import commlib_torch
from commlib.layout import permute_splits
from commlib.tools import progress
from commlib_torch._c10d import all_gather_single, reduce_scatter_single
from commlib_torch.tools.baselines import ByHand, ulysses_by_hand

__all__ = ["CASES", "HostCase", "init_fake", "main", "time_variants"]


NN, BY_HAND = "torch.distributed.nn", "by hand"
Variants = dict[str, Callable[[], object]]


@dataclasses.dataclass(frozen=True)
class HostCase:
    """One row family: ``build(world_size) -> {variant: call}``, `subject` compared with each of `baselines`."""

    name: str
    build: Callable[[int], Variants]
    baselines: tuple[str, ...]
    subject: str = "commlib"


CASES: dict[str, HostCase] = {}


def _case(name: str, baselines: tuple[str, ...] = (BY_HAND,)):
    def register(build: Callable[[int], Variants]) -> Callable[[int], Variants]:
        CASES[name] = HostCase(name, build, baselines)
        return build

    return register


def _nn():
    import torch.distributed.nn.functional as nn_functional

    return nn_functional


def _input(*shape: int) -> torch.Tensor:
    return torch.randn(shape, requires_grad=True)


def _by_hand(x: torch.Tensor, call, dual) -> Callable[[], torch.Tensor]:
    return lambda: ByHand.apply(x, call, dual)


def _all_reduce_by_hand(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


# ---- the cases (W = world size; 256-1024 float32 per rank) --------------------------------------------------


@_case("all_reduce", (NN, BY_HAND))
def _all_reduce(world_size: int) -> Variants:
    x = _input(256)
    return {
        "commlib": lambda: commlib_torch.all_reduce(x),
        NN: lambda: _nn().all_reduce(x),
        BY_HAND: _by_hand(x, _all_reduce_by_hand, _all_reduce_by_hand),
    }


def _gather_by_hand(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x)
    return out


def _scatter_by_hand(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    reduce_scatter_single(out, x)
    return out


@_case("all_gather (dim 0)")
def _all_gather(world_size: int) -> Variants:
    x = _input(8, 32)
    return {"commlib": lambda: commlib_torch.all_gather(x, 0), BY_HAND: _by_hand(x, _gather_by_hand, _scatter_by_hand)}


@_case("reduce_scatter (dim 0)")
def _reduce_scatter(world_size: int) -> Variants:
    x = _input(8 * world_size, 32)
    return {
        "commlib": lambda: commlib_torch.reduce_scatter(x, 0),
        BY_HAND: _by_hand(x, _scatter_by_hand, _gather_by_hand),
    }


@_case("all_to_all (= all_to_all_single)", (NN, BY_HAND))
def _all_to_all(world_size: int) -> Variants:
    x = _input(1, 64 * world_size)  # scatter dim 1, gather dim 0: the plan is all_to_all_single itself

    def raw(source: torch.Tensor) -> torch.Tensor:
        out = source.new_empty((world_size, 64))
        dist.all_to_all_single(out, source.view(world_size, 64))
        return out

    return {
        "commlib": lambda: commlib_torch.all_to_all(x, 1, 0),
        NN: lambda: _nn().all_to_all_single(x.new_empty((world_size, 64)), x.view(world_size, 64)),
        BY_HAND: _by_hand(x, raw, lambda cotangent: raw(cotangent).view(1, -1)),
    }


def _ulysses_case(batch: int, dims: tuple[int, int]) -> None:
    @_case(f"all_to_all_4d {dims} B={batch}", ("hand-written (torch.distributed.nn)", BY_HAND))
    def build(world_size: int) -> Variants:
        heads = 8 if dims == (2, 1) else 8 // world_size
        x = _input(batch, 8 if dims == (2, 1) else 8 * world_size, heads, 16)

        def nn_exchange(send: torch.Tensor) -> torch.Tensor:
            return _nn().all_to_all_single(torch.empty_like(send), send)

        def raw_exchange(send: torch.Tensor) -> torch.Tensor:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send)
            return recv

        def raw(source: torch.Tensor) -> torch.Tensor:
            return ulysses_by_hand(source, world_size, *dims, raw_exchange)

        def dual(cotangent: torch.Tensor) -> torch.Tensor:
            return ulysses_by_hand(cotangent, world_size, dims[1], dims[0], raw_exchange)

        return {
            "commlib": lambda: commlib_torch.all_to_all_4d(x, *dims),
            "hand-written (torch.distributed.nn)": lambda: ulysses_by_hand(x, world_size, *dims, nn_exchange),
            BY_HAND: _by_hand(x, raw, dual),
        }


_ulysses_case(1, (2, 1))
_ulysses_case(1, (1, 2))
_ulysses_case(2, (2, 1))


def _broadcast_by_hand(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.broadcast(out, src=0)
    return out


def _reduce_by_hand(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.reduce(out, dst=0)
    return out


@_case("broadcast", (NN, BY_HAND))
def _broadcast(world_size: int) -> Variants:
    x = _input(256)
    return {
        "commlib": lambda: commlib_torch.broadcast(x, 0),
        NN: lambda: _nn().broadcast(x, 0),
        BY_HAND: _by_hand(x, _broadcast_by_hand, _reduce_by_hand),
    }


def _gather_to_root(x: torch.Tensor) -> torch.Tensor:  # this process is rank 0, the root
    out = x.new_empty((dist.get_world_size(), *x.shape))
    dist.gather(x, list(out.unbind(0)), dst=0)
    return out.view(-1, *x.shape[1:])


def _scatter_from_root(x: torch.Tensor) -> torch.Tensor:
    world_size = dist.get_world_size()
    out = x.new_empty((x.shape[0] // world_size, *x.shape[1:]))
    dist.scatter(out, list(x.view(world_size, *out.shape).unbind(0)), src=0)
    return out


@_case("gather (dim 0)")
def _gather(world_size: int) -> Variants:
    x = _input(8, 32)
    return {"commlib": lambda: commlib_torch.gather(x, 0, 0), BY_HAND: _by_hand(x, _gather_to_root, _scatter_from_root)}


@_case("scatter (dim 0)")
def _scatter(world_size: int) -> Variants:
    x = _input(8 * world_size, 32)
    return {
        "commlib": lambda: commlib_torch.scatter(x, 0, 0),
        BY_HAND: _by_hand(x, _scatter_from_root, _gather_to_root),
    }


@_case("permute (ring)")
def _permute(world_size: int) -> Variants:
    x = _input(256)
    ring = [(rank, (rank + 1) % world_size) for rank in range(world_size)]
    forward_splits = permute_splits(tuple(ring), world_size, 0, x.numel())
    backward_splits = forward_splits[::-1]

    def exchange(splits):
        def call(source: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(source)
            dist.all_to_all_single(out, source, splits[1], splits[0])
            return out

        return call

    return {
        "commlib": lambda: commlib_torch.permute(x, ring),
        BY_HAND: _by_hand(x, exchange(forward_splits), exchange(backward_splits)),
    }


@_case("sum_grad")
def _sum_grad(world_size: int) -> Variants:
    x = _input(256)
    return {
        "commlib": lambda: commlib_torch.sum_grad(x),
        BY_HAND: _by_hand(x, lambda source: source, _all_reduce_by_hand),
    }  # Megatron's f returns x itself


@_case("shard (dim 0)")
def _shard(world_size: int) -> Variants:
    x = _input(8 * world_size, 32)

    def slice_by_hand(source: torch.Tensor) -> torch.Tensor:  # this process is rank 0: block 0, a fresh tensor
        return source[: source.shape[0] // world_size].clone()

    return {"commlib": lambda: commlib_torch.shard(x, 0), BY_HAND: _by_hand(x, slice_by_hand, _gather_by_hand)}


@_case("reduce")
def _reduce(world_size: int) -> Variants:
    x = _input(256)
    return {"commlib": lambda: commlib_torch.reduce(x, 0), BY_HAND: _by_hand(x, _reduce_by_hand, _broadcast_by_hand)}


def _checked_case(name: str) -> None:
    """Checked mode's cost: the fingerprint all_gather (and its compare) before the collective."""
    case = CASES[name]

    def build(world_size: int) -> Variants:
        call = case.build(world_size)["commlib"]

        def checked():
            with commlib_torch.checked():
                return call()

        return {"commlib checked": checked, "commlib": call}

    CASES[f"{name} checked"] = HostCase(f"{name} checked", build, ("commlib",), subject="commlib checked")


def _backward_case(name: str, baseline: str) -> None:
    """Forward and backward (the VJP plan, a second Function) against `baseline`'s, both through autograd."""
    case = CASES[name]

    def build(world_size: int) -> Variants:
        variants = case.build(world_size)
        cotangents = {}

        def step(variant: str):
            def call():
                out = variants[variant]()
                if variant not in cotangents:
                    cotangents[variant] = torch.ones_like(out)
                out.backward(cotangents[variant])

            return call

        return {"commlib": step("commlib"), baseline: step(baseline)}

    CASES[f"fwd+bwd {name}"] = HostCase(f"fwd+bwd {name}", build, (baseline,))


for _name in [name for name in CASES if name not in ("sum_grad", "shard (dim 0)")]:  # local: nothing to check
    _checked_case(_name)
_backward_case("all_reduce", NN)
_backward_case("all_to_all_4d (2, 1) B=1", "hand-written (torch.distributed.nn)")


# ---- timing ---------------------------------------------------------------------------------------------


def init_fake(world_size: int) -> None:
    """This process as rank 0 of a fake process group of `world_size` (no communication at all)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def time_variants(variants: Variants, calls: int, warmup: int = 200, chunk: int = 100) -> dict[str, list[float]]:
    """Seconds of each of `calls` calls per variant. The variants take turns call by call (the first of each
    turn rotating), so each call follows the others' and finds the caches as they left them: no variant runs
    hot in a loop of its own while another runs cold. The garbage collector runs between chunks of turns."""
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    orders = [
        [(variants[name], samples[name]) for name in names[shift:] + names[:shift]] for shift in range(len(names))
    ]
    clock = time.perf_counter
    for first in range(0, calls, chunk):
        gc.collect()
        gc.disable()
        try:
            for turn in range(first, min(calls, first + chunk)):
                for call, times in orders[turn % len(orders)]:
                    start = clock()
                    call()
                    times.append(clock() - start)
        finally:
            gc.enable()
    return samples


def run(world_size: int, calls: int, names: list[str]) -> list[dict]:
    """Records (the format `commlib.tools.bench.rows` reduces) for the cases `names`."""
    records = []
    for name in names:
        case = CASES[name]
        seconds = time_variants(case.build(world_size), calls)
        records.append(
            {
                "framework": "torch",
                "case": name,
                "world_size": world_size,
                "size_mib": 0.0,
                "subject": case.subject,
                "baselines": list(case.baselines),
                "seconds": seconds,
            }
        )
        progress.done(name)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib_torch.tools.host_runner")
    parser.add_argument("out", type=Path, help="JSON file for the records")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per variant")
    parser.add_argument("--cases", nargs="+", default=None, help="case names (default: all; others ignored)")
    parser.add_argument("--list-cases", action="store_true", help="print the case names, one a line, and stop")
    args = parser.parse_args(argv)
    if args.list_cases:
        print("\n".join(CASES))
        return 0
    torch.set_num_threads(1)
    init_fake(args.world_size)
    names = [name for name in (args.cases or CASES) if name in CASES]
    progress.expect(len(names))
    records = run(args.world_size, args.calls, names)
    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    args.out.write_text(json.dumps({"versions": versions, "records": records}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
