"""Ulysses head groups (issue 26 item 4, Ulysses part): fwd+bwd of `commlib_torch.attention.ulysses_attention`
at W = 4 gloo ranks on CPU, ``chunks=1`` against ``chunks=2`` and ``4``, interleaved call by call in one run (the
order rotating each repeat), with the pieces timed alone at the same size: the q/k/v all-to-all of chunks=1 and
one rank's attention fwd+bwd (its H/W heads over the whole sequence), so communication and compute can be
compared. One torch thread per rank. Ratio: chunks=1 / chunks=c per repeat; median, min and max over the
repeats; the load average before and after. Prints one JSON object.

The walk's seam (`commlib_torch.attention._start_exchange`) is synchronous until ``async_op=True`` is wired in:
then each group's all-to-all is done before its attention starts, so the ratio shows only what chunking itself
costs (smaller collectives and attentions, the output's concatenation); rerun after wiring async_op.

    PYTHONPATH=. python -m benchmarks.ulysses_overlap > benchmarks/results/<dir>/ulysses_overlap.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

import torch
import torch.distributed as dist

from benchmarks.ring_overlap import on_ranks, summary

CHUNKS = (1, 2, 4)


def _inputs(ctx, shape: tuple) -> list[torch.Tensor]:
    batch, seq, heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(ctx.rank)
    rows = seq // ctx.world_size
    return [torch.randn(batch, rows, count, dim, generator=generator).requires_grad_()
            for count in (heads, kv_heads, kv_heads)]


def _seconds(call) -> float:
    """One call's seconds, the ranks starting together (after a barrier)."""
    dist.barrier()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def timed(ctx, shape: tuple, causal: bool, repeats: int) -> dict:
    """This rank's seconds of each fwd+bwd per chunks, of chunks=1's q/k/v all-to-all alone and of one rank's
    attention fwd+bwd alone."""
    from commlib_torch.attention import attention, ulysses_attention
    from commlib_torch.functional import all_to_all

    torch.set_num_threads(1)  # W ranks share the cores: one thread each (no oversubscription)
    q, k, v = _inputs(ctx, shape)
    batch, seq, heads, kv_heads, dim = shape
    local = [torch.randn(batch, seq, count // ctx.world_size, dim).requires_grad_()
             for count in (heads, kv_heads, kv_heads)]
    send = torch.randn(heads + 2 * kv_heads, batch, seq // ctx.world_size, dim)  # chunks=1's send buffer
    times: dict[str, list[float]] = {f"chunks={chunks}": [] for chunks in CHUNKS}
    times.update({"all_to_all": [], "attention": []})
    for repeat in range(repeats + 1):  # the first round warms up
        order = CHUNKS[repeat % len(CHUNKS):] + CHUNKS[:repeat % len(CHUNKS)]
        for chunks in order:
            elapsed = _seconds(lambda chunks=chunks: ulysses_attention(q, k, v, causal=causal,
                                                                       chunks=chunks).sum().backward())
            if repeat:
                times[f"chunks={chunks}"].append(elapsed)
        pieces = {"all_to_all": lambda: all_to_all(send, 0, 2),
                  "attention": lambda: attention(*local, causal=causal).sum().backward()}
        for name, call in pieces.items():
            elapsed = _seconds(call)
            if repeat:
                times[name].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    world_size, shape = 4, (1, args.seq, args.heads, args.heads, 64)  # B, S, H, H_kv, D
    job = importlib.import_module("benchmarks.ulysses_overlap").timed  # picklable by its module's name
    slowest, load = on_ranks(world_size, job, shape, args.causal, args.repeats)
    whole = slowest["chunks=1"]
    print(json.dumps({"world_size": world_size, "shape_B_S_H_Hkv_D": shape, "dtype": "float32",
                      "causal": args.causal, "repeats": args.repeats, "cpu_count": os.cpu_count(), **load,
                      "torch": torch.__version__, "threads_per_rank": 1,
                      "seam": "synchronous (_start_exchange before async_op)",
                      "fwd_bwd_s": {name: summary(slowest[name]) for name in slowest if name.startswith("chunks")},
                      "qkv_all_to_all_s": summary(slowest["all_to_all"]),
                      "one_rank_attention_fwd_bwd_s": summary(slowest["attention"]),
                      "ratio_chunks_1_over_chunks_c": {
                          f"chunks={chunks}": summary([one / other for one, other in
                                                       zip(whole, slowest[f"chunks={chunks}"], strict=True)])
                          for chunks in CHUNKS[1:]}}, indent=1))


if __name__ == "__main__":
    main()
