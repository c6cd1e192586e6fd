"""Segment-mask cases shared by tests/spec, tests/torch and tests/jax (issue 22): the handed case, whole float64
inputs, their shards in any layout and the unsharded masked reference (`commlib.attention.attention`)."""

from __future__ import annotations

import numpy as np

from commlib import SequenceLayout
from commlib.attention import attention, attention_vjp
from commlib.masks import segment_ids

__all__ = ["HANDED_SHAPE", "TOLERANCE", "handed_ids", "whole_inputs", "expected", "shards", "worst_error",
           "padding_rows"]

#: B, S, H, H_kv, D of the handed case.
HANDED_SHAPE = (2, 40, 8, 2, 16)
TOLERANCE = 1e-10


def handed_ids(seq: int = 40) -> np.ndarray:
    """int32 ``[2, seq]``: row 0 documents of 3, 17, 9 and 11 tokens; row 1 25 tokens of one document then
    padding (the handed case's rows, cut to `seq`)."""
    return np.stack([segment_ids([3, 17, 9, 11], 40), segment_ids([25], 40)])[:, :seq]


def whole_inputs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0,
                 value_dim: int | None = None) -> list:
    """Whole-sequence float64 q, k, v (v's head dim `value_dim`, default D) and the output cotangent."""
    rng = np.random.default_rng(seed)
    value_dim = head_dim if value_dim is None else value_dim
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, value_dim),
              (batch, seq, heads, value_dim)]
    return [rng.standard_normal(shape) for shape in shapes]


def expected(whole, ids, causal: bool) -> list:
    """The unsharded masked reference: ``[out, dq, dk, dv]`` (float64, whole sequence)."""
    q, k, v, cotangent = whole
    return [attention(q, k, v, causal=causal, q_segments=ids),
            *attention_vjp(q, k, v, cotangent, causal=causal, q_segments=ids)]


def shards(x, layout: SequenceLayout, padded: bool = False) -> list:
    """`x` ``[B, S, ...]`` cut into the layout's shards along dim 1 (`padded`: each to ``max_size`` rows, padding
    ids -1 for integer arrays)."""
    x = np.asarray(x)
    if x.ndim == 2:  # segment ids: padding rows -1
        return [part - 1 for part in layout.shard(x + 1, 1, padded=padded)]
    return layout.shard(x, 1, padded=padded)


def worst_error(got: list, want: list, layout: SequenceLayout) -> float:
    """Largest |got - want| over every shard of each of ``[out, dq, dk, dv]`` (`got`: per rank lists, exact rows)."""
    worst = 0.0
    for per_rank, whole in zip(got, want, strict=True):
        for part, reference in zip(per_rank, shards(whole, layout), strict=True):
            rows = reference.shape[1]
            worst = max(worst, float(np.max(np.abs(np.asarray(part)[:, :rows] - reference), initial=0.0)))
    return worst


def padding_rows(ids, layout: SequenceLayout) -> list:
    """Per shard: bool ``[B, S_r]``, the padding rows (negative ids)."""
    return [part < 0 for part in shards(ids, layout)]
