"""`commlib parity`: one seeded case table through the numpy reference, torch and JAX, compared.

The driver writes the table (`commlib.tools.cases.write`), runs each frontend's runner as a subprocess
(``python -m commlib_torch.tools.parity_runner IN OUT --world-size N``, same for ``commlib_jax``), reads the
results back and compares every rank's output and input gradients with the reference. Torch and JAX never
share a process and a crashed runner becomes a failed row, not a dead driver.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from commlib.errors import CommError
from commlib.tools import cases, progress

__all__ = ["Row", "Results", "check", "compare", "run", "run_runner", "run_workload", "runner_timeout"]

FRAMEWORKS = ("torch", "jax")
#: A runner's default time limit: `TIMEOUT_BASE` s, or where the rows it reports are known, `TIMEOUT_START` s
#: plus `TIMEOUT_PER_ROW` s a row if more (a loaded 2-core machine compiles one JAX program in seconds).
TIMEOUT_BASE, TIMEOUT_START, TIMEOUT_PER_ROW = 600.0, 60.0, 12.0


def runner_timeout(total: int | None = None) -> float:
    """The default time limit of a runner that reports `total` rows (None: not known)."""
    return TIMEOUT_BASE if total is None else max(TIMEOUT_BASE, TIMEOUT_START + TIMEOUT_PER_ROW * total)


@dataclasses.dataclass
class Row:
    """One line of the parity table."""

    case: str
    framework: str
    mode: str
    out_error: float | None  # max abs error of outputs over ranks, relative to max(1, |reference|)
    grad_error: float | None  # same for every input gradient
    passed: bool
    detail: str = ""


class Results:
    """What a frontend runner writes: per case and mode, every rank's output and input gradients, or an error."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.arrays: dict[str, Any] = {}  # np.savez takes them as keywords
        self.errors: dict[str, str] = {}
        self.entries: list[tuple[str, str]] = []  # (case name, mode) in the order run

    def add(self, case: cases.Case, mode: str, outputs: Sequence[Any], gradients: dict) -> None:
        self.entries.append((case.name, mode))
        progress.done(case.name)
        for rank, value in enumerate(outputs):
            self.arrays[cases.result_key(case, mode, "out", rank)] = np.asarray(value)
        for name, ranks in gradients.items():
            for rank, value in enumerate(ranks):
                self.arrays[cases.result_key(case, mode, f"grad_{name}", rank)] = np.asarray(value)

    def fail(self, case: cases.Case, mode: str, error: BaseException | str) -> None:
        """Record an error: an exception, or its ``"Type: message"`` text."""
        self.entries.append((case.name, mode))
        progress.done(case.name)
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.errors[f"{case.name}|{mode}"] = text

    def save(self, directory: Path, versions: dict[str, str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / "results.npz", **self.arrays)
        meta = {"framework": self.framework, "entries": self.entries, "errors": self.errors, "versions": versions}
        (directory / "results.json").write_text(json.dumps(meta, indent=1))


def _max_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """Max abs error over ranks relative to max(1, max |reference|); a NaN must be where the reference has one
    (anything else there, or a NaN elsewhere, is an infinite error)."""
    worst = 0.0
    for mine, theirs in zip(got, want, strict=True):
        if mine.shape != theirs.shape:
            return float("inf")
        exact = np.complex128 if np.iscomplexobj(mine) or np.iscomplexobj(theirs) else np.float64
        mine, theirs = np.asarray(mine, dtype=exact), np.asarray(theirs, dtype=exact)
        if not np.array_equal(np.isnan(mine), np.isnan(theirs)):
            return float("inf")
        scale = max(1.0, float(np.max(np.abs(theirs), initial=0.0, where=~np.isnan(theirs))))
        difference = np.where((mine == theirs) | np.isnan(theirs), 0.0, np.abs(mine - theirs))
        worst = max(worst, float(np.max(difference, initial=0.0)) / scale)
    return worst


def check(
    case: cases.Case,
    arrays: cases.Arrays,
    outputs: list[np.ndarray] | None,
    gradients: dict[str, list[np.ndarray]] | None,
    error: str | None,
    framework: str = "",
    mode: str = "",
    *,
    forward_only: bool = False,
) -> Row:
    """Compare one frontend's result for `case` with the reference.

    `outputs`: every rank's output; `gradients`: {input name: every rank's gradient}; `error`: the
    ``"Type: message"`` text the frontend raised, or None. An invalid case passes only with the spec's text.
    `forward_only`: compare the outputs only (a run without backward, e.g. under ``torch.no_grad()``).
    """
    want_error = cases.error_text(case)
    if want_error is not None or error is not None:
        passed = error == want_error
        detail = "" if passed else f"expected {want_error!r}, got {error!r}"
        return Row(case.name, framework, mode, None, None, passed, detail)
    want_outputs, want_gradients = cases.expected(case, arrays)
    assert outputs is not None and (forward_only or gradients is not None)  # None only with an error (above)
    out_error = _max_error(outputs, want_outputs)
    names = () if forward_only else want_gradients
    grad_error = max((_max_error((gradients or {})[name], want_gradients[name]) for name in names), default=0.0)
    tol = cases.tolerance(case)
    return Row(case.name, framework, mode, out_error, grad_error, out_error <= tol and grad_error <= tol)


def _compare_case(
    case: cases.Case, arrays: cases.Arrays, framework: str, mode: str, stored: dict[str, np.ndarray], meta: dict
) -> Row:
    error = meta["errors"].get(f"{case.name}|{mode}")
    if error is not None:
        return check(case, arrays, None, None, error, framework, mode)
    W = case.world_size
    try:
        outputs = [stored[cases.result_key(case, mode, "out", r)] for r in range(W)]
        names = case.inputs if case.differentiable else ()
        gradients = {n: [stored[cases.result_key(case, mode, f"grad_{n}", r)] for r in range(W)] for n in names}
    except KeyError as missing:
        return Row(case.name, framework, mode, None, None, False, f"no result {missing}")
    return check(case, arrays, outputs, gradients, None, framework, mode)


def compare(table: Sequence[tuple[cases.Case, cases.Arrays]], framework: str, result_dir: Path) -> list[Row]:
    """Rows for every (case, mode) the runner reported; a case it never ran is a failed row."""
    meta = json.loads((result_dir / "results.json").read_text())
    with np.load(result_dir / "results.npz") as data:
        stored = dict(data)
    rows = []
    for case, arrays in table:
        modes = [mode for name, mode in meta["entries"] if name == case.name]
        rows += [_compare_case(case, arrays, framework, mode, stored, meta) for mode in modes]
        if not modes:
            rows.append(Row(case.name, framework, "-", None, None, False, "not run"))
    return rows


def run_runner(
    framework: str,
    in_dir: Path,
    out_dir: Path,
    world_size: int,
    timeout: float | None,
    extra: tuple[str, ...] = (),
    total: int | None = None,
) -> Row | None:
    """Run ``python -m commlib_<framework>.tools.parity_runner IN OUT --world-size N [extra]``, its progress
    shown on stderr (`commlib.tools.progress`; `total`: the items it will report); None when it exited 0, else
    the failed "(runner)" row (timeout, naming the runner and how to raise it, or exit status with the end of
    its output). `timeout` None: `runner_timeout(total)`."""
    command = [sys.executable, "-m", f"commlib_{framework}.tools.parity_runner", str(in_dir), str(out_dir)]
    command += ["--world-size", str(world_size), *extra]
    workload = extra[extra.index("--workload") + 1] if "--workload" in extra else None
    phase = f"{framework} parity" + (f" ({workload})" if workload else "")
    timeout = runner_timeout(total) if timeout is None else timeout
    try:
        done = progress.run(command, phase=phase, timeout=timeout, total=total)
    except subprocess.TimeoutExpired:
        rows = "" if total is None else f", {total} rows"
        detail = (
            f"timed out after {timeout:.0f} s (the {phase} runner, workload {workload or 'ops'}, world size "
            f"{world_size}{rows}): on a slow or loaded machine raise the limit with --timeout SECONDS "
            f"(commlib parity --timeout {2 * timeout:.0f} ...)"
        )
        return Row("(runner)", framework, "-", None, None, False, detail)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-6:]
        return Row("(runner)", framework, "-", None, None, False, f"exit {done.returncode}: " + " | ".join(tail))
    return None


def _run_framework(
    framework: str, in_dir: Path, out_dir: Path, world_size: int, timeout: float | None, total: int
) -> list[Row]:
    failed = run_runner(framework, in_dir, out_dir, world_size, timeout, total=total)
    return [failed] if failed else compare(cases.read(in_dir), framework, out_dir)


def run(
    world_size: int, seed: int = 0, frameworks: Sequence[str] = FRAMEWORKS, timeout: float | None = None
) -> list[Row]:
    """The whole parity table at `world_size` (`timeout`: seconds per runner; None: `runner_timeout` of the
    table's rows)."""
    if world_size < 1:
        raise CommError(f"parity: world_size ({world_size}) must be >= 1")
    with tempfile.TemporaryDirectory(prefix="commlib-parity-") as tmp:
        in_dir = Path(tmp) / "cases"
        table = cases.parity_table(world_size)
        cases.write(in_dir, table, seed)
        rows = []
        for framework in frameworks:
            rows += _run_framework(framework, in_dir, Path(tmp) / framework, world_size, timeout, len(table))
        return rows


def run_workload(
    workload: str,
    world_size: int,
    seed: int,
    frameworks: Sequence[str],
    timeout: float | None,
    compare: Callable[[str, Path], list[Row]],
    cross: Callable[[Path, Path], list[Row]],
) -> list[Row]:
    """A workload whose runners read ``<workload>.json`` (seed and world size): each framework's runner
    (``--workload <workload>``), its rows ``compare(framework, out_dir)`` (or its failed "(runner)" row), then
    ``cross(torch_dir, jax_dir)`` when both ran."""
    if world_size < 1:
        raise CommError(f"parity: world_size ({world_size}) must be >= 1")
    with tempfile.TemporaryDirectory(prefix=f"commlib-{workload}-") as tmp:
        in_dir = Path(tmp) / "inputs"
        in_dir.mkdir()
        (in_dir / f"{workload}.json").write_text(json.dumps({"seed": seed, "world_size": world_size}))
        rows, done = [], []
        for framework in frameworks:
            out_dir = Path(tmp) / framework
            failed = run_runner(framework, in_dir, out_dir, world_size, timeout, ("--workload", workload))
            rows += [failed] if failed else compare(framework, out_dir)
            done += [] if failed else [framework]
        if {"torch", "jax"} <= set(done):
            rows += cross(Path(tmp) / "torch", Path(tmp) / "jax")
        return rows
