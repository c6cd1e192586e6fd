"""Segment-mask cases shared by tests/spec, tests/torch and tests/jax: the handed case, whole float64
inputs, their shards in any layout and the unsharded masked reference (`commlib.attention.attention`)."""

from __future__ import annotations

import numpy as np

from commlib import SequenceLayout
from commlib.attention import attention, attention_vjp
from commlib.masks import segment_ids

__all__ = [
    "HANDED",
    "HANDED_SHAPE",
    "TOLERANCE",
    "handed_ids",
    "whole_inputs",
    "expected",
    "shards",
    "worst_error",
    "padding_rows",
    "check_handed",
    "random_documents",
    "nan_or_blind",
    "NAN_LAYOUTS",
    "check_nan_or_blind",
    "NAN_K_SETTINGS",
    "NAN_K_CASES",
    "nan_in_k",
    "check_nan_in_k",
    "setting_id",
    "NAN_K_JAX_SETTINGS",
]

#: B, S, H, H_kv, D of the handed case.
HANDED_SHAPE = (2, 40, 8, 2, 16)
#: (op, SequenceLayout, the layout the call is given) of the handed case: W = 4, S = 40.
HANDED = [
    ("ulysses_attention", SequenceLayout(40, ulysses_size=4), "contiguous"),
    ("ring_attention", SequenceLayout(40, ring_size=4), "contiguous"),
    ("ring_attention", SequenceLayout(40, ring_size=4, layout="zigzag"), "zigzag"),
    ("usp_attention", SequenceLayout(40, ring_size=2, ulysses_size=2), "contiguous"),
    ("usp_attention", SequenceLayout(40, ring_size=2, ulysses_size=2, layout="zigzag"), "zigzag"),
]
TOLERANCE = 1e-10
#: (op, layout) of the NaN-in-q rows (`nan_or_blind`): W = 2, S = 16.
NAN_LAYOUTS = [
    ("ulysses_attention", SequenceLayout(16, ulysses_size=2)),
    ("ring_attention", SequenceLayout(16, ring_size=2)),
    ("ring_attention", SequenceLayout(16, ring_size=2, layout="zigzag")),
]


def handed_ids(seq: int = 40) -> np.ndarray:
    """int32 ``[2, seq]``: row 0 documents of 3, 17, 9 and 11 tokens; row 1 25 tokens of one document then
    padding (the handed case's rows, cut to `seq`)."""
    return np.stack([segment_ids([3, 17, 9, 11], 40), segment_ids([25], 40)])[:, :seq]


def whole_inputs(
    batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0, value_dim: int | None = None
) -> list:
    """Whole-sequence float64 q, k, v (v's head dim `value_dim`, default D) and the output cotangent."""
    rng = np.random.default_rng(seed)
    value_dim = head_dim if value_dim is None else value_dim
    shapes = [
        (batch, seq, heads, head_dim),
        (batch, seq, kv_heads, head_dim),
        (batch, seq, kv_heads, value_dim),
        (batch, seq, heads, value_dim),
    ]
    return [rng.standard_normal(shape) for shape in shapes]


def expected(whole, ids, causal: bool) -> list:
    """The unsharded masked reference: ``[out, dq, dk, dv]`` (float64, whole sequence)."""
    q, k, v, cotangent = whole
    return [
        attention(q, k, v, causal=causal, q_segments=ids),
        *attention_vjp(q, k, v, cotangent, causal=causal, q_segments=ids),
    ]


def shards(x, layout: SequenceLayout, padded: bool = False) -> list:
    """`x` ``[B, S, ...]`` cut into the layout's shards along dim 1 (`padded`: each to ``max_size`` rows, padding
    ids -1 for integer arrays)."""
    x = np.asarray(x)
    if x.ndim == 2:  # segment ids: padding rows -1
        return [part - 1 for part in layout.shard(x + 1, 1, padded=padded)]
    return layout.shard(x, 1, padded=padded)


def worst_error(got: list, want: list, layout: SequenceLayout) -> float:
    """Largest |got - want| over every shard of each of ``[out, dq, dk, dv]`` (`got`: per rank lists, exact rows); a
    NaN on either side counts as inf (``max`` would pass it over)."""
    worst = 0.0
    for per_rank, whole in zip(got, want, strict=True):
        for part, reference in zip(per_rank, shards(whole, layout), strict=True):
            rows = reference.shape[1]
            error = np.abs(np.asarray(part)[:, :rows] - reference)
            worst = max(worst, float(np.max(np.where(np.isnan(error), np.inf, error), initial=0.0)))  # NaN: inf
    return worst


def padding_rows(ids, layout: SequenceLayout) -> list:
    """Per shard: bool ``[B, S_r]``, the padding rows (negative ids)."""
    return [part < 0 for part in shards(ids, layout)]


def check_handed(got: list, ids, layout: SequenceLayout, label: str) -> None:
    """The handed case's assertions on every rank's ``[out, dq, dk, dv]`` (`got`, exact rows): within `TOLERANCE`
    of the unsharded masked reference, padding rows exactly 0 (the worst error printed after `label`)."""
    error = worst_error(got, expected(whole_inputs(*HANDED_SHAPE), ids, True), layout)
    print(f"{label}: worst error {error:.2e}")
    assert error < TOLERANCE
    for values in got:
        for part, padding in zip(values, padding_rows(ids, layout), strict=True):
            assert np.all(part[padding] == 0)


def random_documents(world_size: int) -> tuple[np.ndarray, list, list[tuple[str, SequenceLayout]]]:
    """S = 37 at `world_size`: segment ids ``[2, 37]`` of four documents of random lengths per row (some shorter
    than a shard, some crossing shards, a padding tail), the whole inputs, and the (layer, layout) settings: ring
    (both layouts) and Ulysses at W, USP 2 x 2 zigzag at W = 4."""
    rng = np.random.default_rng(world_size)
    ids = np.stack([segment_ids(rng.integers(1, 12, size=4), 37) for _ in range(2)])
    whole = whole_inputs(2, 37, 4, 2, 3, seed=world_size)
    settings = [
        ("ring_attention", SequenceLayout(37, ring_size=world_size, layout=name)) for name in ("contiguous", "zigzag")
    ] + [("ulysses_attention", SequenceLayout(37, ulysses_size=world_size))]
    if world_size == 4:
        settings.append(("usp_attention", SequenceLayout(37, ring_size=2, ulysses_size=2, layout="zigzag")))
    return ids, whole, settings


def nan_or_blind(row: str, value_dim: int = 4) -> list:
    """The NaN-in-q inputs ``[1, 16]``, 2 heads, 1 kv head: every key positive in dim 0; ``row="nan"``: a
    NaN in q's row 3; ``"blind"``: q's row 9 -inf in dim 0, so its every score is -inf."""
    whole = whole_inputs(1, 16, 2, 1, 4, value_dim=value_dim)
    whole[1][..., 0] = np.abs(whole[1][..., 0]) + 0.5
    if row == "nan":
        whole[0][0, 3] = np.nan
    else:
        whole[0][0, 9, :, 0] = -np.inf
    return whole


def check_nan_or_blind(out: np.ndarray, dq: np.ndarray, whole: list, row: str, float64: bool) -> None:
    """The NaN-in-q assertions on the whole output and dq of `nan_or_blind` inputs (causal): NaN exactly where
    the reference has it (q's row 3 for "nan"); the blind row 9 exactly 0 with dq exactly 0; every other row
    within 1e-10 of the reference (float32: 1e-5)."""
    want_out = expected(whole, None, True)[0]
    assert np.array_equal(np.isnan(out), np.isnan(want_out))
    if row == "nan":
        assert np.all(np.isnan(out[0, 3]))
    else:
        assert np.all(out[0, 9] == 0) and np.all(dq[0, 9] == 0)
    rows = [index for index in range(16) if index != 3]
    np.testing.assert_allclose(out[:, rows], want_out[:, rows], rtol=0, atol=1e-10 if float64 else 1e-5)


def _nan_k_settings() -> list[tuple[str, SequenceLayout]]:
    """(op, layout) of the NaN-in-k rows: W = 1, 2, 4; S = 1, 4 (one row per rank at W = 4), 13 (uneven
    shards) and 16; Ulysses, ring in both layouts, USP (W = 4: 2 x 2)."""
    settings = []
    for seq in (1, 16):
        settings += [
            ("ulysses_attention", SequenceLayout(seq)),
            ("ring_attention", SequenceLayout(seq)),
            ("usp_attention", SequenceLayout(seq)),
        ]
    for world_size, seqs in ((2, (4, 16)), (4, (4, 13, 16))):
        for seq in seqs:
            settings += [
                ("ulysses_attention", SequenceLayout(seq, ulysses_size=world_size)),
                ("ring_attention", SequenceLayout(seq, ring_size=world_size)),
                ("ring_attention", SequenceLayout(seq, ring_size=world_size, layout="zigzag")),
            ]
        usp = (1, 2) if world_size == 2 else (2, 2)
        settings += [
            ("usp_attention", SequenceLayout(16, ring_size=usp[0], ulysses_size=usp[1], layout="zigzag")),
            ("usp_attention", SequenceLayout(13, ring_size=usp[1], ulysses_size=usp[0])),
        ]
    return settings


#: (op, layout) of the NaN-in-k rows (`nan_in_k`).
NAN_K_SETTINGS = _nan_k_settings()
#: The settings the JAX test runs (each row compiles its own program).
NAN_K_JAX_SETTINGS = [
    ("ulysses_attention", SequenceLayout(1)),
    ("ring_attention", SequenceLayout(1)),
    ("ring_attention", SequenceLayout(4, ring_size=4)),
    ("ring_attention", SequenceLayout(13, ring_size=4, layout="zigzag")),
    ("ulysses_attention", SequenceLayout(13, ulysses_size=4)),
    ("usp_attention", SequenceLayout(13, ring_size=2, ulysses_size=2)),
]
#: (where the NaNs are, causal, segment ids given, D_v) of every NaN-in-k row of a setting: "visible" keys (batch 0
#: at position S // 2, batch 1 at 0: with causal, row 0 sees only that key), or "padding" keys (segment id -1).
#: D_v = 4 = D takes the flash kernels (SDPA's and the ring's), 3 the einsum rules.
NAN_K_CASES = [
    (where, causal, segmented, value_dim)
    for where, segmented in (("visible", False), ("visible", True), ("padding", True))
    for causal in (False, True)
    for value_dim in (4, 3)
]


def setting_id(value: object) -> str:
    """A test id: a layer's name, or a layout as ``W<world size>-S<length>-<layout>``."""
    if isinstance(value, SequenceLayout):
        return f"W{value.world_size}-R{value.ring_size}-S{value.seq_len}-{value.layout}"
    return str(value)


def _nan_k_ids(seq: int) -> np.ndarray:
    """int32 ``[2, seq]``: row 0 two documents then padding (S = 1: one token), row 1 one document then padding."""
    return np.stack([segment_ids([(seq + 2) // 3, seq // 3], seq), segment_ids([seq - seq // 4], seq)])


def nan_in_k(seq: int, where: str, segmented: bool, value_dim: int) -> tuple[list, np.ndarray | None]:
    """The NaN-in-k inputs: whole float64 ``[q, k, v, cotangent]`` (B = 2, H = 4, H_kv = 2, D = 4) with NaNs in
    k, and the segment ids (None: not `segmented`). "visible": batch 0's key S // 2 NaN in one dim of kv head 0,
    batch 1's key 0 NaN in every dim of kv head 1; "padding": the last key of each row (segment id -1), NaN in
    kv head 1 (batch 0, every dim) and kv head 0 (batch 1, one dim)."""
    whole = whole_inputs(2, seq, 4, 2, 4, seed=seq, value_dim=value_dim)
    ids = _nan_k_ids(seq)
    if where == "visible":
        whole[1][0, seq // 2, 0, 1] = np.nan
        whole[1][1, 0, 1] = np.nan
    else:
        assert np.all(ids[:, -1] < 0), "padding keys need a padding tail"
        whole[1][0, -1, 1] = np.nan
        whole[1][1, -1, 0, 0] = np.nan
    return whole, ids if segmented else None


def check_nan_in_k(
    got: list, whole: list, ids, causal: bool, where: str, layout: SequenceLayout, gradients: bool = True
) -> None:
    """The NaN-in-k assertions on every rank's ``[out, dq, dk, dv]`` (`got`, exact rows) of `nan_in_k` inputs:
    the output NaN exactly where the float64 reference's is (the rows that see a NaN key) and within `TOLERANCE`
    of it elsewhere, padding rows exactly 0; "padding": no NaN anywhere, and the output and gradients those of
    the same call with the padding keys 0 (what a key no query sees holds is ignored; its gradient exactly 0)."""
    out = layout.unshard(got[0], 1)
    want = attention(*whole[:3], causal=causal, q_segments=ids)
    assert np.array_equal(np.isnan(out), np.isnan(want)), (np.isnan(out).any((2, 3)), np.isnan(want).any((2, 3)))
    seen = ~np.isnan(want)
    np.testing.assert_allclose(out[seen], want[seen], rtol=0, atol=TOLERANCE)
    if ids is not None:
        assert np.all(out[ids < 0] == 0)
    if where == "padding":
        assert np.isnan(want).sum() == 0, "the reference keeps padding keys out"
        ignored = [np.nan_to_num(x, nan=0.0) for x in whole]
        want_all = expected(ignored, ids, causal)
        assert worst_error(got if gradients else got[:1], want_all if gradients else want_all[:1], layout) < TOLERANCE
        if gradients:
            assert np.all(layout.unshard(got[2], 1)[ids < 0] == 0)
