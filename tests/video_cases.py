"""The grid layouts and seeded float64 data of the video helpers' tests (torch and JAX run the same table):
world sizes 1-4, video grids ``(F, H, W)`` and an image grid ``(H, W)``, even and uneven over W (30 tokens over
4 ranks: 8, 8, 7, 7), a grid smaller than W (1 or 2 tokens over 3-4 ranks: shards holding none), contiguous,
zigzag, per-rank `seq_sizes` (a shard of 0) and USP 2 x 2 layouts."""

from __future__ import annotations

import math

import numpy as np

from commlib import SequenceLayout

B, C = 2, 3  # batch > 1, channels
GRIDS = ((1, 1, 1), (1, 2, 1), (2, 3, 5), (3, 1, 4), (3, 5))


def layouts(world_size: int) -> list[SequenceLayout]:
    """Every grid layout of the table at `world_size`."""
    found = []
    for grid in GRIDS:
        seq = math.prod(grid)
        found += [
            SequenceLayout(seq, ring_size=world_size, grid=grid),
            SequenceLayout(seq, ring_size=world_size, layout="zigzag", grid=grid),
        ]
        if world_size == 4:
            found.append(SequenceLayout(seq, 2, 2, grid=grid))
    seq_sizes = (0, *range(1, world_size))[::-1]  # (0,), (1, 0), (2, 1, 0), (3, 2, 1, 0): the last rank none
    if sum(seq_sizes) == 0:
        seq_sizes = (1,)
    found.append(SequenceLayout(sum(seq_sizes), ring_size=world_size, seq_sizes=seq_sizes, grid=(1, sum(seq_sizes))))
    return list(dict.fromkeys(found))  # at W = 1 contiguous and zigzag are one


def data(layout: SequenceLayout, seed: int = 0) -> dict:
    """The seeded inputs of one layout: replicated latents ``[B, C, *grid]``, per-rank cotangents of
    shard_latents' tokens (``[B, sizes[r], C]``) and of gather_latents' latents (``[B, C, *grid]``)."""
    assert layout.grid is not None
    key = [seed, *layout.grid, layout.ring_size, layout.ulysses_size, len(layout.layout)]
    rng = np.random.default_rng(key + list(layout.seq_sizes or ()))
    return {
        "x": rng.standard_normal((B, C, *layout.grid)),
        "shard_cotangents": [rng.standard_normal((B, size, C)) for size in layout.sizes],
        "gather_cotangents": [rng.standard_normal((B, C, *layout.grid)) for _ in range(layout.world_size)],
    }
