"""``commlib parity --workload masks``: the attention layers with segment ids (padding and packed documents),
torch vs JAX vs the float64 reference.

Every case of `cases` is one layer (`ulysses_attention`, `ring_attention` contiguous and zigzag, at W = 4 also
`usp_attention` 2 x 2 contiguous and zigzag) on one of two sets of documents (`DOCUMENTS`): issue 22's handed
case (B = 2, S = 40, H = 8, H_kv = 2, D = 16, causal; row 0 documents of 3, 17, 9 and 11 tokens, row 1 25 tokens
then 15 of padding) and a packed batch at the uneven S = 37, not causal (H = 4, H_kv = 2, D = 3; row 0 documents
of 2, 13, 5, 1 and 9 tokens then 7 of padding, row 1 of 20, 3 and 14: documents shorter than a shard, documents
crossing one or two shard boundaries). Each runner calls the layer with ``segment_ids=`` on every
rank (torch: gloo, mode "gloo"; JAX: ``jax.shard_map`` with check_vma on and off, every shard padded to
``layout.max_size`` rows, those rows' inputs 7.0 and ids -1) and stores every rank's output and dq, dk, dv
(float64) in the padded layout (torch pads its exact rows with 0). The driver compares them with the unsharded
masked reference (`commlib.attention.attention` / `attention_vjp`) cut the same way, and torch with JAX:
"err out" is the output's, "err grad" the largest of dq, dk and dv, each relative to max(1, |reference|);
a row passes within `TOLERANCE` and with every padding row (negative id, or a padded row) exactly 0 in the
output and in dq, dk and dv.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from commlib.attention import attention, attention_vjp
from commlib.masks import segment_ids
from commlib.sequence import SequenceLayout
from commlib.tools.parity import FRAMEWORKS, Row, run_workload
from commlib.tools.sequence_parity import SequenceResults, load, relative_error

__all__ = [
    "DOCUMENTS",
    "FILL",
    "OUTPUTS",
    "RESULTS",
    "TOLERANCE",
    "MaskCase",
    "MaskResults",
    "cases",
    "compare",
    "cross",
    "data",
    "expected",
    "padding",
    "run",
    "segment_shards",
    "shards",
]

TOLERANCE = 1e-10  # float64, relative to max(1, |reference|)
FILL = 7.0  # JAX's padded rows of q, k, v and the cotangent: every layer must ignore them
OUTPUTS = ("out", "dq", "dk", "dv")  # what each runner stores per rank, [B, max_size, heads, D]
RESULTS = "mask_results"  # the runners' file names: mask_results.npz / .json
#: name -> (B, S, H, H_kv, D, the documents of each row (lengths; the rest of the row is padding), causal).
DOCUMENTS = {
    "handed": (2, 40, 8, 2, 16, ((3, 17, 9, 11), (25,)), True),
    "packed": (2, 37, 4, 2, 3, ((2, 13, 5, 1, 9), (20, 3, 14)), False),
}


@dataclasses.dataclass(frozen=True)
class MaskCase:
    """One row of the workload: `op` on `layout` (the call is given the `SequenceLayout`), `causal`, on the
    inputs of `documents` (a key of `DOCUMENTS`)."""

    documents: str
    op: str  # ulysses_attention | ring_attention | usp_attention
    layout: SequenceLayout
    causal: bool

    @property
    def name(self) -> str:
        """``ring_attention[handed,S=40,ring=4,zigzag,causal]``."""
        layout = self.layout
        parts = [self.documents, f"S={layout.seq_len}"]
        parts += [f"ring={layout.ring_size}"] if layout.ring_size > 1 else []
        parts += [f"ulysses={layout.ulysses_size}"] if layout.ulysses_size > 1 else []
        parts += [layout.layout] if self.op != "ulysses_attention" else []
        return f"{self.op}[{','.join(parts + (['causal'] if self.causal else []))}]"


def _layers(seq_len: int, world_size: int) -> list[tuple[str, SequenceLayout]]:
    W = world_size
    found = [("ulysses_attention", SequenceLayout(seq_len, ulysses_size=W))]
    found += [
        ("ring_attention", SequenceLayout(seq_len, ring_size=W, layout=name)) for name in ("contiguous", "zigzag")
    ]
    if W == 4:
        found += [
            ("usp_attention", SequenceLayout(seq_len, ring_size=2, ulysses_size=2, layout=name))
            for name in ("contiguous", "zigzag")
        ]
    return found


def cases(world_size: int) -> list[MaskCase]:
    """Every case at `world_size`: both document sets (the handed case causal, the packed one at the uneven S = 37
    not), every layer (USP at W = 4 only). One mask a set keeps the JAX runner's compilations (two per case) to
    about a minute at W = 4."""
    return [
        MaskCase(documents, op, layout, causal)
        for documents, (_, seq_len, *_, causal) in DOCUMENTS.items()
        for op, layout in _layers(seq_len, world_size)
    ]


def data(case: MaskCase, seed: int = 0) -> dict[str, np.ndarray]:
    """The seeded whole-sequence float64 inputs of `case`'s documents (the same for every layer): q ``[B, S, H,
    D]``, k and v ``[B, S, H_kv, D]``, the output's cotangent ``[B, S, H, D]`` and the segment ids ``[B, S]``
    (int32, padding -1)."""
    batch, seq_len, heads, kv_heads, head_dim, rows, _ = DOCUMENTS[case.documents]
    rng = np.random.default_rng([seed, seq_len, heads])
    shapes = {
        "q": (heads, head_dim),
        "k": (kv_heads, head_dim),
        "v": (kv_heads, head_dim),
        "cotangent": (heads, head_dim),
    }
    found = {name: rng.standard_normal((batch, seq_len, *shape)) for name, shape in shapes.items()}
    return found | {"segment_ids": np.stack([segment_ids(lengths, seq_len) for lengths in rows])}


def shards(x: np.ndarray, layout: SequenceLayout, fill: float = 0.0) -> list[np.ndarray]:
    """`x` ``[B, S, H, D]`` cut into `layout`'s shards, each padded to ``max_size`` rows of `fill`."""
    return [
        np.where((np.arange(layout.max_size) >= size)[:, None, None], fill, part)
        for part, size in zip(layout.shard(x, 1, padded=True), layout.sizes, strict=True)
    ]


def segment_shards(ids: np.ndarray, layout: SequenceLayout) -> list[np.ndarray]:
    """The segment ids ``[B, S]`` cut into `layout`'s shards, padded rows -1 (as `shard_tokens` gives JAX)."""
    return [part - 1 for part in layout.shard(ids + 1, 1, padded=True)]


def padding(case: MaskCase, seed: int = 0) -> list[np.ndarray]:
    """Per rank: bool ``[B, max_size]``, the rows that must be exactly 0 (negative ids and padded rows)."""
    return [part < 0 for part in segment_shards(data(case, seed)["segment_ids"], case.layout)]


def expected(case: MaskCase, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Every rank's `OUTPUTS` from the unsharded masked float64 reference, in the padded layout (padded rows 0)."""
    found = data(case, seed)
    q, k, v, cotangent, ids = (found[name] for name in ("q", "k", "v", "cotangent", "segment_ids"))
    whole = [
        attention(q, k, v, causal=case.causal, q_segments=ids),
        *attention_vjp(q, k, v, cotangent, causal=case.causal, q_segments=ids),
    ]
    per_output = [case.layout.shard(x, 1, padded=True) for x in whole]
    return [dict(zip(OUTPUTS, values, strict=True)) for values in zip(*per_output, strict=True)]


def _nonzero_padding(got: list[dict], rows: list[np.ndarray]) -> list[str]:
    """The outputs (of `OUTPUTS`) that are not exactly 0 on some rank's padding rows."""
    return [
        key
        for key in OUTPUTS
        if any(np.any(np.asarray(mine[key])[mask] != 0) for mine, mask in zip(got, rows, strict=True))
    ]


def _row(case: MaskCase, framework: str, mode: str, got: list[dict], want: list[dict], rows: list[np.ndarray]) -> Row:
    out_error, grad_error = relative_error(got, want, ("out",)), relative_error(got, want, OUTPUTS[1:])
    nonzero = _nonzero_padding(got, rows)
    detail = f"padding rows not exactly 0 in {', '.join(nonzero)}" if nonzero else ""
    passed = out_error <= TOLERANCE and grad_error <= TOLERANCE and not nonzero
    return Row(case.name, framework, mode, out_error, grad_error, passed, detail)


def _ranks(stored: dict, case: MaskCase, mode: str) -> list[dict[str, np.ndarray]]:
    return [
        {key: stored[f"{case.name}|{mode}|{key}|{rank}"] for key in OUTPUTS} for rank in range(case.layout.world_size)
    ]


def compare(framework: str, result_dir: Path, world_size: int, seed: int) -> list[Row]:
    """Rows of one runner: every (case, mode) it reported against the reference; a case it never ran fails."""
    meta, stored = load(result_dir, RESULTS)
    by_name = {case.name: case for case in cases(world_size)}
    rows = []
    for name, mode in meta["entries"]:
        error, case = meta["errors"].get(f"{name}|{mode}"), by_name.get(name)
        if error is not None or case is None:
            rows.append(Row(name, framework, mode, None, None, False, error or "not a case of this world size"))
            continue
        rows.append(_row(case, framework, mode, _ranks(stored, case, mode), expected(case, seed), padding(case, seed)))
    ran = {name for name, _ in meta["entries"]}
    return rows + [Row(name, framework, "-", None, None, False, "not run") for name in by_name if name not in ran]


def cross(torch_dir: Path, jax_dir: Path, world_size: int, seed: int) -> list[Row]:
    """torch (gloo) against every JAX mode, case by case (both in the padded layout)."""
    (torch_meta, torch_stored), (jax_meta, jax_stored) = load(torch_dir, RESULTS), load(jax_dir, RESULTS)
    rows = []
    for case in cases(world_size):
        if [case.name, "gloo"] not in torch_meta["entries"] or f"{case.name}|gloo" in torch_meta["errors"]:
            continue
        mine = _ranks(torch_stored, case, "gloo")
        for name, mode in jax_meta["entries"]:
            if name == case.name and f"{name}|{mode}" not in jax_meta["errors"]:
                rows.append(_row(case, "torch vs jax", mode, mine, _ranks(jax_stored, case, mode), padding(case, seed)))
    return rows


class MaskResults(SequenceResults):
    """What a mask runner writes: per (case name, mode) every rank's `OUTPUTS`, or the error it raised."""

    stem = RESULTS


def run(
    world_size: int, seed: int = 0, frameworks: Sequence[str] = FRAMEWORKS, timeout: float | None = None
) -> list[Row]:
    """The masks workload at `world_size`: rows per framework, mode and case, then torch against JAX."""
    return run_workload(
        "masks",
        world_size,
        seed,
        frameworks,
        timeout,
        lambda framework, out_dir: compare(framework, out_dir, world_size, seed),
        lambda torch_dir, jax_dir: cross(torch_dir, jax_dir, world_size, seed),
    )
