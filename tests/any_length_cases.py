"""The any-length ring and USP cases both frontends' tests run: `commlib.SequenceLayout`\\ s at uneven lengths
(S = 37, 5 and 3: shards that differ by a row, or hold none), causal and not, GQA (H = 8, H_kv = 2), batch 2, in
float64, checked against unsharded float64 attention (`commlib.reference.ring.reference`)."""

from __future__ import annotations

import itertools

import numpy as np

from commlib import SequenceLayout
from commlib.reference.ring import reference

TOLERANCE = 1e-10
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 8, 2, 3
LENGTHS = (37, 5, 3)


def ring_settings(world_size: int) -> list[tuple[SequenceLayout, bool]]:
    """(layout, causal) of the ring over `world_size` ranks: both layouts at every length, causal and not."""
    return [
        (SequenceLayout(seq_len, ring_size=world_size, layout=layout), causal)
        for seq_len, layout, causal in itertools.product(LENGTHS, ("contiguous", "zigzag"), (False, True))
    ]


def usp_settings() -> list[tuple[SequenceLayout, bool]]:
    """(layout, causal) of USP on 2 x 2 (ring 2, Ulysses 2) at S = 37 and 5."""
    return [
        (SequenceLayout(seq_len, ring_size=2, ulysses_size=2, layout=layout), causal)
        for seq_len, layout, causal in itertools.product((37, 5), ("contiguous", "zigzag"), (False, True))
    ]


def ulysses_settings() -> list[tuple[SequenceLayout, bool]]:
    """(layout, causal) of Ulysses' ``layout=`` over 4 ranks: ``ulysses_size=4`` at S = 37 and 5, and a contiguous
    ring layout (the same rank order) at S = 3 (an empty shard)."""
    layouts = [
        SequenceLayout(37, ulysses_size=4),
        SequenceLayout(5, ulysses_size=4, layout="zigzag"),
        SequenceLayout(3, ring_size=4),
    ]
    return [(layout, causal) for layout in layouts for causal in (False, True)]


def whole_inputs(seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float64 q, k, v and the output's cotangent over the whole sequence."""
    rng = np.random.default_rng(seed)
    heads = dict(q=HEADS, k=KV_HEADS, v=KV_HEADS, cotangent=HEADS)
    return {name: rng.standard_normal((BATCH, seq_len, count, HEAD_DIM)) for name, count in heads.items()}


def expected(layout: SequenceLayout, whole: dict, causal: bool) -> tuple:
    """``(outs, dqs, dks, dvs)``: every shard's rows of unsharded attention and its gradients."""
    shards = [layout.shard(whole[name], 1) for name in ("q", "k", "v", "cotangent")]
    return reference(*shards, layout.ring_size, causal=causal, layout=layout)


def worst_error(got, want) -> float:
    """Largest absolute difference over every array of every shard (``got[i][shard]`` against ``want[i][shard]``)."""
    return max(
        float(np.max(np.abs(np.asarray(g) - w), initial=0.0))
        for gs, ws in zip(got, want, strict=True)
        for g, w in zip(gs, ws, strict=True)
    )
