"""Ulysses head groups (issue 26 item 4, Ulysses part): fwd+bwd of `commlib_torch.attention.ulysses_attention`
at W = 4 gloo ranks on CPU, ``chunks=1`` against ``chunks=2`` and ``4``, interleaved call by call in one run (the
order rotating each repeat), with the pieces timed alone at the same size: the q/k/v all-to-all of chunks=1 and
one rank's attention fwd+bwd (its H/W heads over the whole sequence), so communication and compute can be
compared. One torch thread per rank. Ratio: chunks=1 / chunks=c per repeat; median, min and max over the
repeats; the load average before and after. Prints one JSON object.

With ``chunks > 1`` the walk begins each group's all-to-alls with ``async_op=True`` (`commlib_torch.Handle`,
whose backward begins the duals asynchronously too): "chunks=c". "chunks=c sequential" is the same walk with
its seam (`commlib_torch.attention._start_exchange`) forced synchronous, each collective done before the next
step: the ratio sequential / overlapped is what the overlap itself gains, chunks=1 / chunks=c what chunking
gains or costs all told (c times the collectives, c smaller attentions, the output's concatenation).

    PYTHONPATH=. python -m benchmarks.ulysses_overlap > benchmarks/results/<dir>/ulysses_overlap.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import time

import torch
import torch.distributed as dist

from benchmarks.ring_overlap import on_ranks, summary

CHUNKS = (1, 2, 4)
VARIANTS = ("chunks=1", "chunks=2", "chunks=2 sequential", "chunks=4", "chunks=4 sequential")


def _inputs(ctx, shape: tuple) -> list[torch.Tensor]:
    batch, seq, heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(ctx.rank)
    rows = seq // ctx.world_size
    return [
        torch.randn(batch, rows, count, dim, generator=generator).requires_grad_()
        for count in (heads, kv_heads, kv_heads)
    ]


def _seconds(call) -> float:
    """One call's seconds, the ranks starting together (after a barrier)."""
    dist.barrier()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


@contextlib.contextmanager
def _sequential(walk):
    """While inside, the walk's seam runs every collective synchronously (no overlap)."""
    start = walk._start_exchange
    walk._start_exchange = lambda collective, x, *args, overlap, **kwargs: start(
        collective, x, *args, overlap=False, **kwargs
    )
    try:
        yield
    finally:
        walk._start_exchange = start


def _variant(walk, name: str, call):
    """`call` under the variant `name`: "chunks=c" as it is, "chunks=c sequential" with the seam synchronous."""
    with _sequential(walk) if name.endswith("sequential") else contextlib.nullcontext():
        call()


def timed(ctx, shape: tuple, causal: bool, repeats: int) -> dict:
    """This rank's seconds of each fwd+bwd per chunks, of chunks=1's q/k/v all-to-all alone and of one rank's
    attention fwd+bwd alone."""
    from commlib_torch import attention as walk
    from commlib_torch.functional import all_to_all

    torch.set_num_threads(1)  # W ranks share the cores: one thread each (no oversubscription)
    q, k, v = _inputs(ctx, shape)
    batch, seq, heads, kv_heads, dim = shape
    local = [
        torch.randn(batch, seq, count // ctx.world_size, dim).requires_grad_() for count in (heads, kv_heads, kv_heads)
    ]
    send = torch.randn(heads + 2 * kv_heads, batch, seq // ctx.world_size, dim)  # chunks=1's send buffer
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    times.update({"all_to_all": [], "attention": []})
    for repeat in range(repeats + 1):  # the first round warms up
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        for name in order:
            chunks = int(name.split()[0].removeprefix("chunks="))
            elapsed = _seconds(
                lambda name=name, chunks=chunks: _variant(
                    walk, name, lambda: walk.ulysses_attention(q, k, v, causal=causal, chunks=chunks).sum().backward()
                )
            )
            if repeat:
                times[name].append(elapsed)
        pieces = {
            "all_to_all": lambda: all_to_all(send, 0, 2),
            "attention": lambda: walk.attention(*local, causal=causal).sum().backward(),
        }
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
                "threads_per_rank": 1,
                "seam": "chunks > 1: async_op=True (commlib_torch.Handle); 'sequential': forced synchronous",
                "fwd_bwd_s": {name: summary(slowest[name]) for name in slowest if name.startswith("chunks")},
                "qkv_all_to_all_s": summary(slowest["all_to_all"]),
                "one_rank_attention_fwd_bwd_s": summary(slowest["attention"]),
                "ratio_chunks_1_over_chunks_c": {
                    f"chunks={chunks}": summary(
                        [one / other for one, other in zip(whole, slowest[f"chunks={chunks}"], strict=True)]
                    )
                    for chunks in CHUNKS[1:]
                },
                "ratio_sequential_over_overlapped": {
                    f"chunks={chunks}": summary(
                        [
                            sequential / overlapped
                            for sequential, overlapped in zip(
                                slowest[f"chunks={chunks} sequential"], slowest[f"chunks={chunks}"], strict=True
                            )
                        ]
                    )
                    for chunks in CHUNKS[1:]
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
