"""The ring's overlap (issue 26 item 4, ring part): fwd+bwd of `commlib_torch.attention.ring_attention` at W = 4
gloo ranks on CPU, each step's k/v send begun before the step's pieces and waited after them (the default)
against the sequential order (each send completed first: ``commlib.ring.forward(..., overlap=False)``),
interleaved call by call in one run (the order alternating), with one step's send alone timed at the same size
(communication vs compute). Ratio: sequential / overlapped per pair of calls; median, min and max over the
repeats; the load average before and after. Prints one JSON object.

    PYTHONPATH=. python -m benchmarks.ring_overlap > benchmarks/results/<dir>/ring_overlap.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _order(overlap: bool):
    from commlib_torch import ring

    forward, backward = ring._forward, ring._backward
    ring._forward = functools.partial(forward, overlap=overlap)
    ring._backward = functools.partial(backward, overlap=overlap)
    try:
        yield
    finally:
        ring._forward, ring._backward = forward, backward


def timed(ctx, shape: tuple, causal: bool, repeats: int) -> dict:
    """This rank's seconds of each fwd+bwd, overlapped and sequential (the ranks start each call together,
    after a barrier), and of one step's k/v send alone."""
    from commlib_torch import ring
    from commlib_torch.attention import ring_attention

    batch, seq, heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(ctx.rank)
    rows = seq // ctx.world_size
    q = torch.randn(batch, rows, heads, dim, generator=generator).requires_grad_()
    k, v = (torch.randn(batch, rows, kv_heads, dim, generator=generator).requires_grad_() for _ in range(2))
    times: dict[str, list[float]] = {"overlapped": [], "sequential": [], "send": []}
    for repeat in range(repeats + 1):  # the first pair warms up
        orders = (True, False) if repeat % 2 else (False, True)
        for overlap in orders:
            with _order(overlap):
                dist.barrier()
                start = time.perf_counter()
                ring_attention(q, k, v, causal=causal).sum().backward()
                elapsed = time.perf_counter() - start
            if repeat:
                times["overlapped" if overlap else "sequential"].append(elapsed)
        plan = ring.spec.ring_plan(q.shape, k.shape, v.shape, ctx.world_size, causal=causal)
        dist.barrier()
        start = time.perf_counter()
        ring._wait(plan, ring._start(plan, [k.detach(), v.detach()], None, ctx.rank), None)
        if repeat:
            times["send"].append(time.perf_counter() - start)
    return times


def summary(values: list[float]) -> dict:
    """Median, min and max of `values` (shared with benchmarks/ulysses_overlap.py)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def on_ranks(world_size: int, job, *args) -> tuple[dict[str, list[float]], dict]:
    """`job` (a module-level function returning ``{name: [seconds per repeat]}``) on `world_size` gloo ranks:
    per name, each repeat's slowest rank (a call ends with its slowest rank), and the load average before and
    after."""
    from commlib_torch.tools.pool import WorkerPool

    load_before = os.getloadavg()
    with WorkerPool(world_size, timeout=1800.0) as pool:
        per_rank = pool.run(job, *args)
    load = {"load_average_before": load_before, "load_average_after": os.getloadavg()}
    return {
        name: [max(values) for values in zip(*(rank[name] for rank in per_rank), strict=True)] for name in per_rank[0]
    }, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    world_size, shape = 4, (1, args.seq, 8, 8, 64)  # B, S, H, H_kv, D
    job = importlib.import_module("benchmarks.ring_overlap").timed  # picklable by its module's name
    slowest, load = on_ranks(world_size, job, shape, args.causal, args.repeats)
    ratios = [seq / over for seq, over in zip(slowest["sequential"], slowest["overlapped"], strict=True)]
    print(
        json.dumps(
            {
                "world_size": world_size,
                "shape_B_S_H_Hkv_D": shape,
                "dtype": "float32",
                "causal": args.causal,
                "repeats": args.repeats,
                "cpu_count": os.cpu_count(),
                **load,
                "torch": torch.__version__,
                "fwd_bwd_s": {name: summary(slowest[name]) for name in ("overlapped", "sequential")},
                "one_step_send_s": summary(slowest["send"]),
                "sends_per_fwd_bwd": 3 * (world_size - 1) + 1,
                "ratio_sequential_over_overlapped": summary(ratios),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
