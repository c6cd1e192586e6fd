"""Layout-only benchmark: the local passes of the Ulysses all-to-all, without communication.

    python benchmarks/layout.py [--device cuda] [--repeats 50] [--check] [--sweep] [--inductor]
                                [--json PATH] [--markdown PATH]

For each shape (bf16, as one rank holds it at W = 8) and direction it times, alternating, median of repeats:

- ``copy``: one device-to-device copy of the input's bytes into a preallocated tensor -- the unit;
- ``clone``: the same copy into a fresh tensor (on the CPU that pays the page faults of new memory);
- ``seed``: the seed's three-copy algorithm (`commlib_torch.tools.baselines.seed_all_to_all_4d`) with the
  exchange skipped: its receive buffer is allocated as the seed allocates it, nothing is sent;
- ``commlib``: commlib's plan walk -- pack pass, the receive buffer of the collective, unpack pass of that
  same-shaped buffer (on CUDA through `commlib_torch._pack`: the Triton kernel at these sizes);
- ``commlib words`` (CUDA): the same without the kernel: torch's copy over the rows as int64 words;
- ``commlib eager`` (CUDA): the same with torch's plain permute copy (bf16 elements);
- ``inductor`` (CUDA, ``--inductor``): the same plan passes compiled by ``torch.compile``.

CUDA times are device time between events (the host's launch time excluded: a sleep kernel keeps the GPU
busy while the call is enqueued); ``host us`` is the host's time to enqueue one call. Memory (CUDA,
``torch.cuda.max_memory_allocated``): the peak during one call minus what was allocated before it (the
input), over the input's bytes: ``peak/in`` counts the output, ``scratch/in`` does not.
``--check`` first runs every variant with the exchange done as a local copy (each rank receiving its own
chunks) and requires identical outputs; ``--sweep`` times the kernel's tile sizes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from commlib import plans
from commlib_torch import _pack, _walk
from commlib_torch.tools.baselines import seed_all_to_all_4d

WORLD_SIZE = 8
#: (batch, seq, heads, head_dim) of the (2, 1) input on one rank; the (1, 2) input is its output's shape.
SHAPES = ((1, 32768, 24, 128), (2, 16384, 24, 128))
TARGETS = {1: 1.3, 2: 2.3}  # pack + unpack over one copy, by batch (H200); scratch memory <= 1x the input
_SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU clock: longer than the host needs to enqueue one call


def _skip(output: torch.Tensor, input_: torch.Tensor) -> None:
    """The benchmark's exchange: nothing moves (the receive buffer is allocated by the caller)."""


def _local(output: torch.Tensor, input_: torch.Tensor) -> None:
    """The check's exchange: every 'rank' receives its own chunks."""
    output.copy_(input_)


def commlib_layout(x: torch.Tensor, plan, exchange=_skip, rearrange=_walk.rearrange) -> torch.Tensor:
    """commlib's walk of `plan` with the collective replaced by `exchange(recv, send)`."""
    send = rearrange(x, plan.layout.pack, plan.layout.send_shape, x.dtype)
    recv = torch.empty(plan.layout.recv_shape, dtype=x.dtype, device=x.device)
    exchange(recv, send)
    del send  # as `_walk.run` does: the unpack's output can take the send buffer's memory
    return rearrange(recv, plan.layout.unpack, plan.out_shape, x.dtype)


def _in_mode(mode: str, fn: Callable) -> Callable:
    """`fn` with `commlib_torch._pack` in `mode` ("words": no Triton kernel, "eager": torch's plain copy_)."""

    def call(*args, **kwargs):
        os.environ[_pack._MODE_ENV] = mode
        try:
            return fn(*args, **kwargs)
        finally:
            del os.environ[_pack._MODE_ENV]

    return call


def _inductor_rearrange():
    for limit in ("recompile_limit", "cache_size_limit"):  # one compiled graph per plan pass
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
            break

    @torch.compile(dynamic=False)
    def rearrange(x, step, shape, dtype):
        return x.reshape(step.split_shape).permute(step.perm).contiguous().view(shape)

    return lambda x, step, shape, dtype: x.view(shape) if step.is_identity else rearrange(x, step, shape, dtype)


def variants(x: torch.Tensor, dims: tuple[int, int], inductor: bool, exchange=_skip) -> dict[str, Callable]:
    plan = plans.all_to_all_4d(x.shape, WORLD_SIZE, *dims)
    copy_target = torch.empty_like(x)
    result = {
        "copy": lambda: copy_target.copy_(x),
        "clone": lambda: x.clone(),
        "seed": lambda: seed_all_to_all_4d(x, WORLD_SIZE, *dims, exchange=exchange),
        "commlib": lambda: commlib_layout(x, plan, exchange),
    }
    if x.is_cuda:
        result["commlib words"] = _in_mode("words", lambda: commlib_layout(x, plan, exchange))
        result["commlib eager"] = _in_mode("eager", lambda: commlib_layout(x, plan, exchange))
        if inductor:
            compiled = _inductor_rearrange()
            result["inductor"] = lambda: commlib_layout(x, plan, exchange, compiled)
    return result


def _timer(device: torch.device) -> Callable[[Callable], float]:
    """Seconds of one call: wall-clock on the CPU; on CUDA the device time between two events, recorded
    while a sleep kernel keeps the GPU busy so that the host's launch time stays out of it."""
    if device.type != "cuda":

        def wall(fn):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return wall

    def events(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return events


def time_variants(calls: dict[str, Callable], repeats: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call, variants in rotating order."""
    timer, names = _timer(device), list(calls)
    seconds = {name: [] for name in names}
    for index in range(warmup + repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed = timer(calls[name])
            if index >= warmup:
                seconds[name].append(elapsed)
    return {name: statistics.median(values) for name, values in seconds.items()}


def host_seconds(fn: Callable, device: torch.device, calls: int = 20) -> float | None:
    """CUDA: seconds the host spends enqueueing one call (Python, the plan walk, the launches)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


def peak_memory(fn: Callable, device: torch.device) -> tuple[float, int] | None:
    """(peak bytes allocated during `fn` beyond those allocated before, output bytes), CUDA only."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    return peak, out.numel() * out.element_size()


def check(x: torch.Tensor, dims: tuple[int, int], inductor: bool) -> None:
    calls = variants(x, dims, inductor, _local)
    outputs = {name: fn() for name, fn in calls.items() if name not in ("copy", "clone")}
    for name, out in outputs.items():
        if not torch.equal(out, outputs["seed"]):
            raise AssertionError(f"layout check: {name} differs from the seed for {tuple(x.shape)}, dims {dims}")


def bench(device: torch.device, repeats: int, warmup: int, do_check: bool, inductor: bool) -> list[dict]:
    rows = []
    for shape in SHAPES:
        for dims in ((2, 1), (1, 2)):
            plan21 = plans.all_to_all_4d(shape, WORLD_SIZE, 2, 1)
            in_shape = shape if dims == (2, 1) else plan21.out_shape
            x = torch.randn(in_shape, device=device).to(torch.bfloat16)
            if do_check:
                check(x, dims, inductor)
            calls = variants(x, dims, inductor)
            medians = time_variants(calls, repeats, warmup, device)
            in_bytes = x.numel() * x.element_size()
            plan = plans.all_to_all_4d(x.shape, WORLD_SIZE, *dims)
            for name in calls:
                memory = None if name in ("copy", "clone") else peak_memory(calls[name], device)
                host = host_seconds(calls[name], device)
                rows.append(
                    {
                        "shape": list(in_shape),
                        "dims": list(dims),
                        "batch": shape[0],
                        "variant": name,
                        "passes": 1 if name in ("copy", "clone") else 3 if name == "seed" else plan.copies,
                        "ms": 1e3 * medians[name],
                        "over_copy": medians[name] / medians["copy"],
                        "copy_GBps": 2 * in_bytes / medians["copy"] / 1e9,
                        "peak_over_input": None if memory is None else memory[0] / in_bytes,
                        "scratch_over_input": None if memory is None else (memory[0] - memory[1]) / in_bytes,
                        "target": TARGETS[shape[0]] if name == "commlib" and device.type == "cuda" else None,
                        "host_us": None if host is None else 1e6 * host,
                    }
                )
            del x, calls
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def sweep(device: torch.device, repeats: int) -> list[dict]:
    """The kernel's time for the batch-1 pack over tile sizes and warps (CUDA)."""
    plan = plans.all_to_all_4d(SHAPES[0], WORLD_SIZE, 2, 1)
    rows_, columns, size = _pack.row_transpose(plan.layout.pack)
    x = torch.randn(SHAPES[0], device=device).to(torch.bfloat16)
    out = torch.empty(plan.layout.pack.out_shape, dtype=x.dtype, device=device)
    calls = {
        (tile, warps): (
            lambda tile=tile, warps=warps: _pack.transpose_rows(
                x, out, rows_, columns, size, tile_words=tile, num_warps=warps
            )
        )
        for tile in (1024, 2048, 4096, 8192)
        for warps in (4, 8)
    }
    calls[("copy", 0)] = lambda: out.view(-1).copy_(x.view(-1))
    medians = time_variants(calls, repeats, 3, device)
    return [
        {"tile_words": tile, "num_warps": warps, "ms": 1e3 * seconds, "over_copy": seconds / medians[("copy", 0)]}
        for (tile, warps), seconds in medians.items()
    ]


def _markdown(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = []
    for row in rows:
        verdict = "" if row["target"] is None else "met" if row["over_copy"] <= row["target"] else "MISSED"
        memory = "-" if row["peak_over_input"] is None else f"{row['peak_over_input']:.2f}"
        scratch = "-" if row["scratch_over_input"] is None else f"{row['scratch_over_input']:.2f}"
        host = "-" if row["host_us"] is None else f"{row['host_us']:.0f}"
        body.append(
            [
                "x".join(map(str, row["shape"])),
                tuple(row["dims"]),
                row["variant"],
                row["passes"],
                f"{row['ms']:.3f}",
                f"{row['over_copy']:.2f}",
                memory,
                scratch,
                host,
                "" if row["target"] is None else f"<= {row['target']} {verdict}",
            ]
        )
    headers = [
        "input (bf16)",
        "dims",
        "variant",
        "passes",
        "ms",
        "x copy",
        "peak/in",
        "scratch/in",
        "host us",
        "target",
    ]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/layout.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="default 50 on CUDA, 7 on CPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="first check every variant's output")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tile sizes (CUDA)")
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile of the passes (CUDA)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda needs a CUDA GPU and a CUDA build of torch; this torch ({torch.__version__}) "
            "sees none (leave --device out to time the CPU)"
        )
    repeats = args.repeats or (50 if device.type == "cuda" else 7)
    facts = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cpus)",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "repeats": repeats,
        "world_size": WORLD_SIZE,
    }
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    rows = bench(device, repeats, args.warmup, args.check, args.inductor)
    table = _markdown(rows)
    print(json.dumps(facts))
    print(table)
    result = {"facts": facts, "rows": rows}
    if args.sweep and device.type == "cuda":
        result["sweep"] = sweep(device, repeats)
        for row in result["sweep"]:
            print(f"tile {row['tile_words']}, warps {row['num_warps']}: {row['ms']:.3f} ms, {row['over_copy']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
