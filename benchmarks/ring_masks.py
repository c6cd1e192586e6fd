"""Ring attention with packed documents (issue 22's bench): fwd+bwd of `commlib_torch.attention.ring_attention` at
W = 4 gloo ranks on CPU, causal, documents of 1/8 of the sequence (``segment_ids``; ``--documents N``: 1/N) against
the same call without segment ids; the pieces each computes (`commlib.ring.pieces_computed`) and the bytes one
rank sends per forward step (k and v, plus the segment ids when given). Prints one JSON object.

    PYTHONPATH=. python -m benchmarks.ring_masks > benchmarks/results/<dir>/ring_masks.json
    PYTHONPATH=. python -m benchmarks.ring_masks --seq 1024 --repeats 5 --documents 1 > .../ring_masks_one_document.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import commlib
from commlib import SequenceLayout
from commlib.ring import pieces_computed, ring_plan


def _inputs(rank: int, layout: SequenceLayout, shape: tuple, ids: np.ndarray, dtype: torch.dtype):
    batch, _, heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, layout.sizes[rank], heads, dim, generator=generator, dtype=dtype)
    k, v = (torch.randn(batch, layout.sizes[rank], kv_heads, dim, generator=generator, dtype=dtype) for _ in range(2))
    segment_ids = torch.tensor(np.stack([row[layout.positions(rank)] for row in ids]))
    return [x.requires_grad_() for x in (q, k, v)], segment_ids


def timed(ctx, shape: tuple, layout_name: str, ids: np.ndarray, with_ids: bool, repeats: int) -> list[float]:
    """This rank's seconds of each fwd+bwd (the ranks start each one together, after a barrier)."""
    from commlib_torch.attention import ring_attention

    layout = SequenceLayout(shape[1], ring_size=ctx.world_size, layout=layout_name)
    (q, k, v), segment_ids = _inputs(ctx.rank, layout, shape, ids, torch.float32)
    kwargs = {"segment_ids": segment_ids} if with_ids else {}
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        dist.barrier()
        start = time.perf_counter()
        ring_attention(q, k, v, causal=True, layout=layout_name, **kwargs).sum().backward()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--documents",
        type=int,
        default=8,
        help="equal documents per row (1: one document, every id 0, as a tokenizer's all-ones "
        "attention_mask becomes: the mask's cost with nothing to skip)",
    )
    args = parser.parse_args()
    from commlib_torch.tools.pool import WorkerPool

    world_size, shape = 4, (1, args.seq, 8, 2, 64)  # B, S, H, H_kv, D
    ids = np.stack([commlib.segment_ids([args.seq // args.documents] * args.documents, args.seq)])
    job = importlib.import_module("benchmarks.ring_masks").timed  # picklable by its module's name
    rows = []
    with WorkerPool(world_size, timeout=900.0) as pool:
        for layout_name in ("contiguous", "zigzag"):
            layout = SequenceLayout(args.seq, ring_size=world_size, layout=layout_name)
            rows_per_rank = args.seq // world_size
            q_shape, kv_shape = (1, rows_per_rank, 8, 64), (1, rows_per_rank, 2, 64)
            for with_ids in (False, True):
                per_rank = pool.run(job, shape, layout_name, ids, with_ids, args.repeats)
                slowest = [max(step) for step in zip(*per_rank, strict=True)]  # a call ends with its slowest rank
                plan = ring_plan(
                    q_shape,
                    kv_shape,
                    kv_shape,
                    world_size,
                    causal=True,
                    layout=layout_name,
                    segment_ids=((1, rows_per_rank), "int64") if with_ids else None,
                )
                blocks = np.stack([ids[:, layout.positions(rank)] for rank in range(world_size)])
                computed, scheduled = pieces_computed(plan, blocks if with_ids else None)
                sent = plan.wire_elements() * 4 + (rows_per_rank * 8 if with_ids else 0)
                rows.append(
                    {
                        "layout": layout_name,
                        "segment_ids": with_ids,
                        "median_s": statistics.median(slowest),
                        "min_s": min(slowest),
                        "pieces_computed": computed,
                        "pieces_scheduled": scheduled,
                        "bytes_sent_per_forward_step": sent,
                    }
                )
    print(
        json.dumps(
            {
                "world_size": world_size,
                "shape_B_S_H_Hkv_D": shape,
                "dtype": "float32",
                "documents": f"{args.documents} of {args.seq // args.documents} tokens",
                "repeats": args.repeats,
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
