"""``commlib parity --workload sequence``: the sequence helpers and the two model examples, torch vs JAX vs the
float64 reference.

Helper rows: on every layout of `layouts` (even and uneven lengths, contiguous, zigzag, Ulysses, USP 2 x 2, an
empty shard) each runner calls `shard_tokens`, `position_ids`, `shard_sequence`, `gather_sequence` (both
conventions) and `cross_entropy` on every rank with the inputs of `data` and stores every rank's outputs and input
gradients in the padded layout (JAX's; torch pads its exact rows: ids 0, positions 0, labels ``ignore_index``,
values 0). The driver compares them with `commlib.sequence_helpers`' references and torch with JAX. Token rows
must be exact; float64 rows within `TOLERANCE` relative to max(1, |reference|).

Model rows (W = 4 only: the examples' world): each example's sharded first step (ulysses, ring zigzag, USP 2 x 2 at
S = 37) against the same model unsharded in the same process, as the example checks itself: "err out" is the
larger relative error of the loss and the logits, "err grad" the largest over every parameter's gradient. They
need the examples (a checkout) and the transformers / flax extras. Torch-vs-JAX agreement of one Llama with
mapped weights is issue 25's port checker, not a row here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from commlib.reference.sequence import (
    cross_entropy_reference,
    gather_sequence_reference,
    shard_sequence_reference,
    shard_tokens_reference,
)
from commlib.sequence import SequenceLayout
from commlib.sequence_helpers import next_token_labels, position_table
from commlib.tools import progress
from commlib.tools.parity import FRAMEWORKS, Row, run_workload

__all__ = [
    "B",
    "D",
    "V",
    "IGNORE",
    "EXAMPLES",
    "MODELS",
    "TOLERANCE",
    "SequenceResults",
    "compare",
    "cross",
    "data",
    "example",
    "expected",
    "layouts",
    "load",
    "model_cases",
    "model_name",
    "name",
    "pad",
    "relative_error",
    "run",
]

B, D, V = 2, 3, 11  # batch > 1, a hidden size, a vocabulary
IGNORE = -100
TOLERANCE = 1e-10  # float64, relative to max(1, |reference|); model rows: relative to the unsharded run
#: The helpers' outputs (and their gradients) each runner stores per layout, rank by rank.
OUTPUTS = (
    "ids",
    "positions",
    "labels",
    "position_ids",
    "shard_out",
    "shard_grad",
    "gather_out",
    "gather_grad",
    "gather_replicated_out",
    "gather_replicated_grad",
    "loss",
    "loss_grad",
)
#: Rows per layout: (helper, the outputs compared as "err out", as "err grad").
HELPERS = (
    ("shard_tokens", ("ids", "positions", "labels"), ()),
    ("position_ids", ("position_ids",), ()),
    ("shard_sequence", ("shard_out",), ("shard_grad",)),
    ("gather_sequence", ("gather_out",), ("gather_grad",)),
    ("gather_sequence,convention=replicated", ("gather_replicated_out",), ("gather_replicated_grad",)),
    ("cross_entropy", ("loss",), ("loss_grad",)),
)
MODELS = ("transformers", "flax")
MODEL_LENGTH = 37


def layouts(world_size: int) -> list[SequenceLayout]:
    """The helper rows' layouts at `world_size`: contiguous and zigzag rings at an even and an uneven length,
    Ulysses at S = 5 (one shard a row longer); at W = 4 also USP 2 x 2 zigzag at S = 37 and a zigzag ring at S = 3
    (a shard holding no row)."""
    W = world_size
    found = [
        SequenceLayout(8 * W, ring_size=W),
        SequenceLayout(37, ring_size=W),
        SequenceLayout(8 * W, ring_size=W, layout="zigzag"),
        SequenceLayout(37, ring_size=W, layout="zigzag"),
        SequenceLayout(5, ulysses_size=W),
    ]
    if W == 4:
        found += [SequenceLayout(37, 2, 2, layout="zigzag"), SequenceLayout(3, ring_size=4, layout="zigzag")]
    return list(dict.fromkeys(found))  # at W = 1 several are one


def name(layout: SequenceLayout) -> str:
    """``S=37,ring=2,ulysses=2,zigzag``: the layout as the rows name it."""
    parts = [f"S={layout.seq_len}"]
    parts += [f"ring={layout.ring_size}"] if layout.ring_size > 1 else []
    parts += [f"ulysses={layout.ulysses_size}"] if layout.ulysses_size > 1 else []
    return ",".join(parts + ([layout.layout] if layout.ring_size > 1 or layout.layout != "contiguous" else []))


def model_cases(world_size: int) -> list[tuple[str, str]]:
    """``(example, attention)`` of the model rows: every example with ulysses, ring and usp at W = 4, else none."""
    return (
        [(model, attention) for model in MODELS for attention in ("ulysses", "ring", "usp")] if world_size == 4 else []
    )


def data(layout: SequenceLayout, seed: int = 0) -> dict[str, Any]:
    """The seeded float64 inputs of one layout, the same bytes on every side: full ids ``[B, S]``, a replicated
    ``x [B, S, D]``, logits ``[B, S, V]`` with next-token labels (a fifth more ignored), and per rank the
    cotangents of shard_sequence (``[B, sizes[r], D]``) and gather_sequence (``[B, S, D]``, one list per
    convention)."""
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
        "shard_cotangents": [rng.standard_normal((B, size, D)) for size in layout.sizes],
        "gather_cotangents": [rng.standard_normal((B, S, D)) for _ in range(W)],
        "replicated_cotangents": [rng.standard_normal((B, S, D)) for _ in range(W)],
    }


def pad(x: np.ndarray, rows: int, value: float = 0) -> np.ndarray:
    """`x` padded along dim 1 to `rows` with `value` (the JAX layout of a torch shard)."""
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, rows - x.shape[1])
    return np.pad(x, widths, constant_values=value)


def expected(layout: SequenceLayout, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Every rank's outputs of `OUTPUTS` from the float64 references, in the padded layout."""
    case = data(layout, seed)
    own = layout.shard(case["x"], 1, padded=True)
    padded = [pad(c, layout.max_size) for c in case["shard_cotangents"]]
    shard_out, shard_grad = shard_sequence_reference(case["x"], padded, layout, padded=True)
    gather = gather_sequence_reference(own, case["gather_cotangents"], layout, padded=True)
    replicated = gather_sequence_reference(
        own, case["replicated_cotangents"], layout, convention="replicated", padded=True
    )
    loss, loss_grad = cross_entropy_reference(case["logits"], case["labels"], IGNORE)
    tokens = shard_tokens_reference(case["ids"], layout, IGNORE, padded=True)
    positions = np.maximum(position_table(layout), 0)
    ranks = []
    for rank in range(layout.world_size):
        values = (
            *tokens[rank],
            positions[rank][None],
            shard_out[rank],
            shard_grad[rank],
            gather[0][rank],
            gather[1][rank],
            replicated[0][rank],
            replicated[1][rank],
            np.asarray(loss),
            layout.shard(loss_grad, 1, padded=True)[rank],
        )
        ranks.append(dict(zip(OUTPUTS, values, strict=True)))
    return ranks


class SequenceResults:
    """What a runner writes: per (case, mode) every rank's named arrays, or the error it raised. A case is a
    layout's `name` (helpers) or ``model[example,attention]``. Saved as ``<stem>.npz`` and ``<stem>.json``."""

    stem = "sequence_results"

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.arrays: dict[str, Any] = {}  # np.savez takes them as keywords
        self.entries: list[tuple[str, str]] = []
        self.errors: dict[str, str] = {}

    def add(self, case: str, mode: str, ranks: list[dict[str, Any]]) -> None:
        self.entries.append((case, mode))
        progress.done(case)
        for rank, values in enumerate(ranks):
            self.arrays.update({f"{case}|{mode}|{key}|{rank}": np.asarray(value) for key, value in values.items()})

    def fail(self, case: str, mode: str, error: BaseException | str) -> None:
        self.entries.append((case, mode))
        progress.done(case)
        self.errors[f"{case}|{mode}"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def save(self, directory: Path, versions: dict[str, str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / f"{self.stem}.npz", **self.arrays)
        meta = {"framework": self.framework, "entries": self.entries, "errors": self.errors, "versions": versions}
        (directory / f"{self.stem}.json").write_text(json.dumps(meta, indent=1))


def load(directory: Path, stem: str = SequenceResults.stem) -> tuple[dict, dict[str, np.ndarray]]:
    """(the runner's entries, errors and versions; every stored array by key) of a saved `SequenceResults`."""
    meta = json.loads((directory / f"{stem}.json").read_text())
    with np.load(directory / f"{stem}.npz") as stored:
        return meta, dict(stored)


def _ranks(stored: dict, case: str, mode: str, keys: Sequence[str], world_size: int) -> list[dict[str, np.ndarray]]:
    return [{key: stored[f"{case}|{mode}|{key}|{rank}"] for key in keys} for rank in range(world_size)]


def relative_error(got: list[dict], want: list[dict], keys: Sequence[str]) -> float:
    """Max abs error over ranks and `keys`, relative to max(1, max |want|) per array (inf on a shape mismatch)."""
    worst = 0.0
    for mine, theirs in zip(got, want, strict=True):
        for key in keys:
            a, b = np.asarray(mine[key], dtype=np.float64), np.asarray(theirs[key], dtype=np.float64)
            if a.shape != b.shape:
                return float("inf")
            worst = max(
                worst, float(np.max(np.abs(a - b), initial=0.0)) / max(1.0, float(np.max(np.abs(b), initial=0.0)))
            )
    return worst


def _helper_rows(case: str, framework: str, mode: str, got: list[dict], want: list[dict]) -> list[Row]:
    rows = []
    for helper, outputs, gradients in HELPERS:
        out_error = relative_error(got, want, outputs)
        grad_error = relative_error(got, want, gradients) if gradients else None
        exact = helper in ("shard_tokens", "position_ids")
        passed = out_error == 0.0 if exact else out_error <= TOLERANCE and (grad_error or 0.0) <= TOLERANCE
        rows.append(Row(f"{helper}[{case}]", framework, mode, out_error, grad_error, passed))
    return rows


def _model_row(case: str, framework: str, mode: str, errors: dict) -> Row:
    out_error = max(float(errors["loss"]), float(errors["logits"]))
    grad_error = float(errors["gradients"])
    return Row(case, framework, mode, out_error, grad_error, out_error <= TOLERANCE and grad_error <= TOLERANCE)


def model_name(model: str, attention: str) -> str:
    return f"model[{model},{attention},S={MODEL_LENGTH}]"


def _expected_cases(framework: str, world_size: int) -> list[str]:
    """The cases a runner of `framework` must report: every layout, and its example's model rows."""
    example = "transformers" if framework == "torch" else "flax"
    return [name(layout) for layout in layouts(world_size)] + [
        model_name(model, attention) for model, attention in model_cases(world_size) if model == example
    ]


def _case_rows(case: str, framework: str, mode: str, meta: dict, stored: dict, world_size: int, want: Any) -> list[Row]:
    """One reported (case, mode): its error as a failed row, a model row, or a layout's helper rows."""
    error = meta["errors"].get(f"{case}|{mode}")
    if error is not None:
        label = case if case.startswith("model[") else f"sequence helpers[{case}]"
        return [Row(label, framework, mode, None, None, False, error)]
    if case.startswith("model["):
        return [_model_row(case, framework, mode, _ranks(stored, case, mode, ("loss", "logits", "gradients"), 1)[0])]
    return _helper_rows(case, framework, mode, _ranks(stored, case, mode, OUTPUTS, world_size), want[case])


def compare(framework: str, result_dir: Path, world_size: int, seed: int) -> list[Row]:
    """Rows of one runner: every helper on every layout against the reference, every model row as measured; a
    case it never ran is a failed row."""
    meta, stored = load(result_dir)
    want = {name(layout): expected(layout, seed) for layout in layouts(world_size)}
    rows = []
    for case, mode in meta["entries"]:
        rows += _case_rows(case, framework, mode, meta, stored, world_size, want)
    ran = {case for case, _ in meta["entries"]}
    return rows + [
        Row(case, framework, "-", None, None, False, "not run")
        for case in _expected_cases(framework, world_size)
        if case not in ran
    ]


def cross(torch_dir: Path, jax_dir: Path, world_size: int) -> list[Row]:
    """torch (gloo) against every JAX mode, helper by helper, on every layout (both in the padded layout)."""
    (torch_meta, torch_stored), (jax_meta, jax_stored) = load(torch_dir), load(jax_dir)
    rows = []
    for layout in layouts(world_size):
        case = name(layout)
        if (case, "gloo") not in map(tuple, torch_meta["entries"]) or f"{case}|gloo" in torch_meta["errors"]:
            continue
        mine = _ranks(torch_stored, case, "gloo", OUTPUTS, world_size)
        for entry_case, mode in jax_meta["entries"]:
            if entry_case == case and f"{case}|{mode}" not in jax_meta["errors"]:
                rows += _helper_rows(
                    case, "torch vs jax", mode, mine, _ranks(jax_stored, case, mode, OUTPUTS, world_size)
                )
    return rows


def run(
    world_size: int, seed: int = 0, frameworks: Sequence[str] = FRAMEWORKS, timeout: float | None = None
) -> list[Row]:
    """The sequence workload at `world_size`: rows per framework, mode, layout and helper, the model rows, then
    torch against JAX."""
    return run_workload(
        "sequence",
        world_size,
        seed,
        frameworks,
        timeout,
        lambda framework, out_dir: compare(framework, out_dir, world_size, seed),
        lambda torch_dir, jax_dir: cross(torch_dir, jax_dir, world_size),
    )


#: The checkout's examples/ folder (the model rows run the examples' own code).
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> types.ModuleType:
    """examples/<name>.py as a module, loaded once (the model rows of both runners run the example's own code)."""
    if name in sys.modules:
        return sys.modules[name]
    path = EXAMPLES / f"{name}.py"
    found = importlib.util.spec_from_file_location(name, path)
    if found is None or found.loader is None or not path.is_file():
        raise FileNotFoundError(f"the model rows run {path}: run commlib parity from a checkout")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    found.loader.exec_module(module)
    return module
