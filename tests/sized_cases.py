"""Per-rank sizes (``SequenceLayout(..., seq_sizes=...)``) in the attention layers, the cases both frontends'
tests run: rank r holds the rows ``[offset_r, offset_r + seq_sizes[r])`` (a text prefix and image tokens cut
where the model wants them: 5 + 5 tokens on 2 ranks as 6 and 4 rows), empty shards among them, causal and not,
with and without packed documents (segment ids), GQA (H = 4, H_kv = 2), batch 2, float64, against the unsharded
float64 masked reference (`tests.mask_cases.expected`)."""

from __future__ import annotations

import numpy as np

from commlib import SequenceLayout
from commlib.masks import segment_ids

TOLERANCE = 1e-10
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 3


def settings(world_size: int) -> list[tuple[str, SequenceLayout]]:
    """(layer, layout) at `world_size`: the ring at every W (an empty shard from W = 2 on), Ulysses through the
    same layout at W = 2 and 4, USP 2 x 2 at W = 4 (an empty shard, and one ring block of a single row)."""
    sizes = {1: [(10,)], 2: [(6, 4), (0, 9)], 3: [(5, 0, 6)], 4: [(6, 1, 0, 6), (1, 2, 3, 4)]}[world_size]
    found = [("ring_attention", SequenceLayout(sum(s), ring_size=world_size, seq_sizes=s)) for s in sizes]
    if world_size in (2, 4):
        found.append(("ulysses_attention", SequenceLayout(sum(sizes[0]), ulysses_size=world_size, seq_sizes=sizes[0])))
    if world_size == 4:
        found += [
            ("usp_attention", SequenceLayout(13, ring_size=2, ulysses_size=2, seq_sizes=(3, 0, 4, 6))),
            ("usp_attention", SequenceLayout(10, ring_size=2, ulysses_size=2, seq_sizes=(1, 0, 5, 4))),
        ]
    return found


def documents(seq_len: int, seed: int) -> np.ndarray:
    """int32 ``[B, seq_len]``: per row documents of random lengths 1-4 then a padding tail (id -1), cut to fit."""
    rng = np.random.default_rng(seed)
    rows = [segment_ids(rng.integers(1, 5, size=3), 12)[:seq_len] for _ in range(BATCH)]
    return np.pad(np.stack(rows), [(0, 0), (0, max(0, seq_len - 12))], constant_values=-1).astype(np.int32)


def cases(world_size: int, every: bool = True) -> list[tuple[str, SequenceLayout, bool, bool]]:
    """(layer, layout, causal, with segment ids) of every row at `world_size`; `every` False (JAX compiles each
    row): causal with documents for every setting, and causal without them for the first."""
    if not every:
        found = settings(world_size)
        return [(*found[0], True, False)] + [(op, layout, True, True) for op, layout in found]
    return [
        (op, layout, causal, segmented)
        for op, layout in settings(world_size)
        for causal in (False, True)
        for segmented in (False, True)
    ]


def label(op: str, layout: SequenceLayout, causal: bool, segmented: bool) -> str:
    return f"{op} seq_sizes={layout.seq_sizes} ulysses={layout.ulysses_size} causal={causal} segments={segmented}"
