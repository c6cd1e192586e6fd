"""The layouts and seeded float64 data of the sequence helpers' tests (torch and JAX run the same table): world
sizes 1-4, S in {5, 37, 64} (S = 5 at W = 4: one rank holds a row more than the others), contiguous, zigzag,
Ulysses-only and USP 2 x 2 layouts, and S = 3 zigzag over a ring of 4 (a shard holding none)."""

from __future__ import annotations

import numpy as np

from commlib import SequenceLayout
from commlib.masks import segment_ids
from commlib.sequence_helpers import next_token_labels

B, D, V = 2, 3, 11  # batch > 1, a hidden size, a vocabulary
IGNORE = -100
LENGTHS = (5, 37, 64)


def layouts(world_size: int) -> list[SequenceLayout]:
    """Every layout of the table at `world_size`."""
    found = []
    for seq_len in LENGTHS:
        found += [
            SequenceLayout(seq_len, ring_size=world_size),
            SequenceLayout(seq_len, world_size, layout="zigzag"),
            SequenceLayout(seq_len, ulysses_size=world_size),
        ]
        if world_size == 4:
            found += [SequenceLayout(seq_len, 2, 2), SequenceLayout(seq_len, 2, 2, layout="zigzag")]
    if world_size == 4:
        found.append(SequenceLayout(3, ring_size=4, layout="zigzag"))  # sizes (1, 1, 1, 0)
    return list(dict.fromkeys(found))  # at W = 1 the three layouts are one


def data(layout: SequenceLayout, seed: int = 0) -> dict:
    """The seeded inputs of one layout: full token ids ``[B, S]``, a replicated sequence ``[B, S, D]``, logits
    ``[B, S, V]`` with their labels (next tokens, a few more ignored), and per-rank cotangents of shard_sequence
    (``[B, sizes[r], D]``) and gather_sequence (``[B, S, D]``)."""
    rng = np.random.default_rng([seed, layout.seq_len, layout.ring_size, layout.ulysses_size, len(layout.layout)])
    S, W = layout.seq_len, layout.world_size
    ids = rng.integers(0, V, size=(B, S))
    labels = next_token_labels(ids, IGNORE)
    labels[rng.random((B, S)) < 0.2] = IGNORE
    return {
        "ids": ids,
        "x": rng.standard_normal((B, S, D)),
        "logits": 3 * rng.standard_normal((B, S, V)),
        "labels": labels,
        "shard_cotangents": [rng.standard_normal((B, layout.sizes[rank], D)) for rank in range(W)],
        "gather_cotangents": [rng.standard_normal((B, S, D)) for _ in range(W)],
    }


def model_parameters(seq_len: int, seed: int = 1) -> dict[str, np.ndarray]:
    """A tiny model's float64 parameters: token and position embeddings ``[V, D]``, ``[S, D]`` and a head
    ``[D, V]``."""
    rng = np.random.default_rng([seed, seq_len])
    return {
        "embed": rng.standard_normal((V, D)),
        "position": rng.standard_normal((seq_len, D)),
        "head": rng.standard_normal((D, V)),
    }


def documents(layout: SequenceLayout, seed: int = 0, *, holes: bool = False) -> np.ndarray:
    """Seeded segment ids ``[B, S]`` of packed documents: row 0 documents of random lengths 1..S/3 (shorter than
    a shard and crossing shard boundaries) then a few padding tokens; row 1 one document over most of the row
    then padding (two adjacent documents with the same id would be one document: ids count up). `holes`: about
    a fifth of the tokens made padding besides (holes inside documents, a padding mask's zeros in the middle)."""
    rows = _documents(layout, seed)
    if holes:
        rng = np.random.default_rng([seed, layout.seq_len, layout.world_size, 11])
        rows[rng.random(rows.shape) < 0.2] = -1
    return rows


def _documents(layout: SequenceLayout, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, layout.seq_len, layout.world_size, 7])
    S = layout.seq_len
    lengths: list[int] = []
    while sum(lengths) < S - S // 8:
        lengths.append(int(rng.integers(1, max(2, S // 3) + 1)))
    while sum(lengths) > S - S // 8:
        lengths[-1] -= 1
    return np.stack([segment_ids(lengths, S), segment_ids([S - S // 4], S)]).astype(np.int64)
