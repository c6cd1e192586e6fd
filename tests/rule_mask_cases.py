"""Mask-rule cases (``mask=``: `commlib.masks.BlockCausal`, `SlidingWindow`) shared by tests/spec, tests/torch and
tests/jax: the settings per world size, the rules, and the unsharded float64 reference of a rule."""

from __future__ import annotations

import numpy as np

from commlib import SequenceLayout
from commlib.masks import BlockCausal, MaskRule, SlidingWindow
from commlib.reference.attention import attention, attention_vjp

__all__ = ["RULES", "SEQ", "SHAPE", "settings", "expected", "whole_inputs"]

#: The rules every setting runs: frames of 5 tokens, a window of 7, a window of 1 (each token itself only).
RULES: list[MaskRule] = [BlockCausal(5), SlidingWindow(7), SlidingWindow(1)]
#: B, H, H_kv, D of the inputs (GQA), and the lengths: 37 (uneven shards, a `SequenceLayout`) and 40 (even).
SHAPE = (2, 4, 2, 3)
SEQ = (37, 40)


def settings(world_size: int) -> list[tuple[str, SequenceLayout, object]]:
    """(layer, layout of the shards, the layout the call is given) at `world_size`: ring (both layouts, uneven
    through a `SequenceLayout` and even through the string), Ulysses, and USP 2 x 2 (both layouts) at W = 4."""
    found: list[tuple[str, SequenceLayout, object]] = []
    for seq in SEQ:
        for name in ("contiguous", "zigzag"):
            layout = SequenceLayout(seq, ring_size=world_size, layout=name)
            even = seq % (world_size * (2 if name == "zigzag" else 1)) == 0
            found.append(("ring_attention", layout, name if even else layout))
        if seq == SEQ[0]:  # Ulysses' gathered sequence is the same at any length
            ulysses = SequenceLayout(seq, ulysses_size=world_size)
            found.append(("ulysses_attention", ulysses, ulysses))
        if world_size == 4:
            for name in ("contiguous", "zigzag") if seq == SEQ[0] else ("zigzag",):
                layout = SequenceLayout(seq, ring_size=2, ulysses_size=2, layout=name)
                found.append(("usp_attention", layout, name if seq % 16 == 0 else layout))
    return found


def expected(whole: list, causal: bool, rule: MaskRule, ids=None) -> list:
    """The unsharded reference of a rule: ``[out, dq, dk, dv]`` (float64, whole sequence)."""
    q, k, v, cotangent = whole
    return [
        attention(q, k, v, causal=causal, mask=rule, q_segments=ids),
        *attention_vjp(q, k, v, cotangent, causal=causal, mask=rule, q_segments=ids),
    ]


def whole_inputs(seq: int, seed: int = 0) -> list:
    """Whole-sequence float64 q, k, v and the output cotangent of `SHAPE` at `seq`."""
    batch, heads, kv_heads, dim = SHAPE
    rng = np.random.default_rng(seed)
    shapes = [
        (batch, seq, heads, dim),
        (batch, seq, kv_heads, dim),
        (batch, seq, kv_heads, dim),
        (batch, seq, heads, dim),
    ]
    return [rng.standard_normal(shape) for shape in shapes]
