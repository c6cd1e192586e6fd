"""``commlib parity --workload fuzz``: a seeded, bounded differential fuzzer of the attention layers, torch vs JAX
vs the float64 reference.

`cases(count, seed, max_world_size)` draws `count` calls with numpy's seeded generator: a layer
(`ulysses_attention` at any W, `ring_attention` contiguous or zigzag, `usp_attention` 2 x 2 at W = 4), a world
size 1..`max_world_size`, any length (uneven, and S < W: empty shards), batch 1-2, MHA / GQA / MQA (1-3 kv
heads, 1-3 q heads each; USP 2 kv heads, as its spec requires), head dim 1-4, causal or not, float64 or
float32, Ulysses' head groups (``chunks`` 1-3, at most a rank's q heads), and half the time segment ids
(random packed documents, a row's tail of padding). Each runner calls the layer on every rank (torch: gloo
worker pools, mode "gloo"; JAX:
``jax.shard_map``, one mode per case drawn from check_vma on / off, shards padded to ``layout.max_size`` rows
holding `FILL`, ids -1) and stores every rank's output and dq, dk, dv in the padded layout. The driver compares
them with the unsharded masked float64 reference on the same (rounded) inputs and torch with JAX: within
`tolerance` (per dtype, relative to max(1, |reference|)) and with every padding row (negative id, or a padded
row) exactly 0.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from commlib.attention import attention, attention_vjp
from commlib.errors import CommError
from commlib.masks import segment_ids
from commlib.sequence import SequenceLayout
from commlib.tools.mask_parity import FILL, OUTPUTS, segment_shards, shards
from commlib.tools.parity import FRAMEWORKS, Row, run_runner
from commlib.tools.sequence_parity import SequenceResults, load, relative_error
from commlib.uneven import split_sizes

__all__ = [
    "CASES",
    "FILL",
    "OUTPUTS",
    "RESULTS",
    "FuzzCase",
    "FuzzResults",
    "cases",
    "compare",
    "cross",
    "data",
    "expected",
    "padding",
    "run",
    "settings",
    "shards",
    "segment_shards",
    "tolerance",
]

CASES = 40  # the default number of cases: a few minutes on a loaded 2-core machine
RESULTS = "fuzz_results"  # the runners' file names: fuzz_results.npz / .json
_TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One drawn call: `op` on `layout` with these shapes and options; `documents` None (no segment ids) or per
    batch row the document lengths (the rest of the row padding)."""

    index: int  # its place in the draw (the name starts with it: names are unique)
    op: str  # ulysses_attention | ring_attention | usp_attention
    layout: SequenceLayout
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: str
    chunks: int  # Ulysses' head groups (1 elsewhere)
    documents: tuple[tuple[int, ...], ...] | None

    @property
    def name(self) -> str:
        """``#3 ring_attention[W=3,S=5,zigzag,B=1,H=4/2,D=3,float32,causal,docs]``."""
        layout = self.layout
        parts = [f"W={layout.world_size}", f"S={layout.seq_len}"]
        parts += [layout.layout] if self.op != "ulysses_attention" else [f"chunks={self.chunks}"]
        parts += [f"B={self.batch}", f"H={self.heads}/{self.kv_heads}", f"D={self.head_dim}", self.dtype]
        parts += (["causal"] if self.causal else []) + ([] if self.documents is None else ["docs"])
        return f"#{self.index} {self.op}[{','.join(parts)}]"


def _documents(rng: np.random.Generator, batch: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    rows = []
    for _ in range(batch):
        lengths, left = [], int(rng.integers(0, seq_len + 1)) if rng.random() < 0.5 else seq_len
        while left > 0:
            lengths.append(int(rng.integers(1, left + 1)))
            left -= lengths[-1]
        rows.append(tuple(lengths))
    return tuple(rows)


def _case(rng: np.random.Generator, index: int, max_world_size: int) -> FuzzCase:
    world_size = int(rng.integers(1, max_world_size + 1))
    op = str(rng.choice(["ulysses_attention", "ring_attention"] + (["usp_attention"] if world_size == 4 else [])))
    seq_len, layout_name = int(rng.integers(1, 3 * world_size + 3)), str(rng.choice(["contiguous", "zigzag"]))
    if op == "ulysses_attention":
        layout = SequenceLayout(seq_len, ulysses_size=world_size)
    elif op == "ring_attention":
        layout = SequenceLayout(seq_len, ring_size=world_size, layout=layout_name)
    else:
        layout = SequenceLayout(seq_len, ring_size=2, ulysses_size=2, layout=layout_name)
    kv_heads, batch = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    if op == "usp_attention":  # the spec's USP splits the kv heads over the Ulysses axis: H_kv % 2 == 0
        kv_heads = 2
    heads = kv_heads * int(rng.integers(1, 4))
    most = min(3, max(split_sizes(heads, world_size)))  # the spec refuses more chunks than a rank's q heads
    return FuzzCase(
        index,
        op,
        layout,
        batch,
        heads,
        kv_heads,
        int(rng.integers(1, 5)),
        bool(rng.random() < 0.5),
        str(rng.choice(["float64", "float32"])),
        int(rng.integers(1, most + 1)) if op == "ulysses_attention" else 1,
        _documents(rng, batch, seq_len) if rng.random() < 0.5 else None,
    )


def cases(count: int = CASES, seed: int = 0, max_world_size: int = 4) -> list[FuzzCase]:
    """`count` cases drawn from ``numpy.random.default_rng([seed, max_world_size])`` (see the module)."""
    rng = np.random.default_rng([seed, max_world_size])
    return [_case(rng, index, max_world_size) for index in range(count)]


def tolerance(case: FuzzCase) -> float:
    return _TOLERANCE[case.dtype]


def data(case: FuzzCase, seed: int = 0) -> dict[str, np.ndarray]:
    """The whole-sequence inputs of `case`, float64 values rounded to its dtype: q ``[B, S, H, D]``, k, v ``[B,
    S, H_kv, D]``, the output's cotangent, and (with documents) the segment ids ``[B, S]`` (int32, padding -1)."""
    rng = np.random.default_rng([seed, case.index, 7])
    S, B, D = case.layout.seq_len, case.batch, case.head_dim
    heads = {"q": case.heads, "k": case.kv_heads, "v": case.kv_heads, "cotangent": case.heads}
    found = {
        name: rng.standard_normal((B, S, count, D)).astype(case.dtype).astype(np.float64)
        for name, count in heads.items()
    }
    if case.documents is not None:
        found["segment_ids"] = np.stack([segment_ids(lengths, S) for lengths in case.documents]).astype(np.int32)
    return found


def expected(case: FuzzCase, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Every rank's `OUTPUTS` from the unsharded masked float64 reference, in the padded layout."""
    found = data(case, seed)
    q, k, v, cotangent = (found[name] for name in ("q", "k", "v", "cotangent"))
    ids = found.get("segment_ids")
    whole = [
        attention(q, k, v, causal=case.causal, q_segments=ids),
        *attention_vjp(q, k, v, cotangent, causal=case.causal, q_segments=ids),
    ]
    per_output = [case.layout.shard(x, 1, padded=True) for x in whole]
    return [dict(zip(OUTPUTS, values, strict=True)) for values in zip(*per_output, strict=True)]


def padding(case: FuzzCase, seed: int = 0) -> list[np.ndarray]:
    """Per rank: bool ``[B, max_size]``, the rows that must be exactly 0 (negative ids and padded rows)."""
    ids = data(case, seed).get("segment_ids")
    if ids is None:
        ids = np.zeros((case.batch, case.layout.seq_len), np.int32)
    return [part < 0 for part in segment_shards(ids, case.layout)]


def _row(case: FuzzCase, framework: str, mode: str, got: list[dict], want: list[dict], rows: list[np.ndarray]) -> Row:
    out_error, grad_error = relative_error(got, want, ("out",)), relative_error(got, want, OUTPUTS[1:])
    nonzero = [
        key
        for key in OUTPUTS
        if any(np.any(np.asarray(mine[key])[mask] != 0) for mine, mask in zip(got, rows, strict=True))
    ]
    detail = f"padding rows not exactly 0 in {', '.join(nonzero)}" if nonzero else ""
    limit = tolerance(case)
    passed = out_error <= limit and grad_error <= limit and not nonzero  # a NaN error fails too
    return Row(case.name, framework, mode, out_error, grad_error, passed, detail)


def _ranks(stored: dict, case: FuzzCase, mode: str) -> list[dict[str, np.ndarray]]:
    return [
        {key: stored[f"{case.name}|{mode}|{key}|{rank}"] for key in OUTPUTS} for rank in range(case.layout.world_size)
    ]


def settings(in_dir: Path) -> tuple[list[FuzzCase], int]:
    """The cases a runner runs (from ``fuzz.json``: count, seed, max world size) and the seed."""
    found = json.loads((in_dir / "fuzz.json").read_text())
    return cases(found["cases"], found["seed"], found["world_size"]), found["seed"]


def compare(framework: str, result_dir: Path, table: list[FuzzCase], seed: int) -> list[Row]:
    """Rows of one runner: every (case, mode) it reported against the reference; a case it never ran fails."""
    meta, stored = load(result_dir, RESULTS)
    by_name = {case.name: case for case in table}
    rows = []
    for name, mode in meta["entries"]:
        error, case = meta["errors"].get(f"{name}|{mode}"), by_name.get(name)
        if error is not None or case is None:
            rows.append(Row(name, framework, mode, None, None, False, error or "not a drawn case"))
            continue
        rows.append(_row(case, framework, mode, _ranks(stored, case, mode), expected(case, seed), padding(case, seed)))
    ran = {name for name, _ in meta["entries"]}
    return rows + [Row(name, framework, "-", None, None, False, "not run") for name in by_name if name not in ran]


def cross(torch_dir: Path, jax_dir: Path, table: list[FuzzCase], seed: int) -> list[Row]:
    """torch (gloo) against the JAX mode each case ran in (both in the padded layout)."""
    (torch_meta, torch_stored), (jax_meta, jax_stored) = load(torch_dir, RESULTS), load(jax_dir, RESULTS)
    rows = []
    for case in table:
        if [case.name, "gloo"] not in torch_meta["entries"] or f"{case.name}|gloo" in torch_meta["errors"]:
            continue
        mine = _ranks(torch_stored, case, "gloo")
        for name, mode in jax_meta["entries"]:
            if name == case.name and f"{name}|{mode}" not in jax_meta["errors"]:
                rows.append(_row(case, "torch vs jax", mode, mine, _ranks(jax_stored, case, mode), padding(case, seed)))
    return rows


class FuzzResults(SequenceResults):
    """What a fuzz runner writes: per (case name, mode) every rank's `OUTPUTS`, or the error it raised."""

    stem = RESULTS


def run(
    world_size: int,
    seed: int = 0,
    frameworks: Sequence[str] = FRAMEWORKS,
    timeout: float | None = None,
    count: int = CASES,
) -> list[Row]:
    """`count` fuzz cases (world sizes 1..`world_size`): rows per framework and case, then torch against JAX."""
    if world_size < 1 or count < 1:
        raise CommError(f"parity: world_size ({world_size}) and cases ({count}) must be >= 1")
    table = cases(count, seed, world_size)
    with tempfile.TemporaryDirectory(prefix="commlib-fuzz-") as tmp:
        in_dir = Path(tmp) / "inputs"
        in_dir.mkdir()
        (in_dir / "fuzz.json").write_text(json.dumps({"seed": seed, "world_size": world_size, "cases": count}))
        rows, done = [], []
        for framework in frameworks:
            out_dir = Path(tmp) / framework
            extra = ("--workload", "fuzz")
            failed = run_runner(framework, in_dir, out_dir, world_size, timeout, extra, total=count)
            rows += [failed] if failed else compare(framework, out_dir, table, seed)
            done += [] if failed else [framework]
        if {"torch", "jax"} <= set(done):
            rows += cross(Path(tmp) / "torch", Path(tmp) / "jax", table, seed)
        return rows
