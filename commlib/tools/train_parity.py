"""``commlib parity --workload train``: the block of `commlib.tools.train_block` trained a few SGD steps in float64 on
every SP x TP mesh, through torch (W gloo ranks) and JAX (shard_map with check_vma on and off, pmap), each
rank's loss and every parameter's gradient per step compared with the numpy reference, and torch with JAX.

As for the case table, the driver writes the inputs (`write`), runs each frontend's runner as a subprocess
(``python -m commlib_<framework>.tools.parity_runner IN OUT --world-size W --workload train``) and reads
its `TrainResults` back. Rows "unsharded" run each frontend's block without communication: they measure
the framework's own arithmetic against numpy, so a sharded row's error can be told apart from it.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from commlib.errors import CommError
from commlib.tools import progress, train_block
from commlib.tools.parity import FRAMEWORKS, Row, run_runner

__all__ = [
    "STEPS",
    "TOLERANCE",
    "UNSHARDED",
    "History",
    "TrainResults",
    "check",
    "compare",
    "cross",
    "expected",
    "read",
    "reference",
    "run",
    "unshard_gradients",
    "write",
]

STEPS = 3  # SGD steps per run: losses and gradients of steps 2.. depend on the framework's own updates
TOLERANCE = 1e-10  # float64, relative
UNSHARDED = "unsharded"

#: One run's record: per step, (every rank's loss [sp, tp], {parameter: every rank's gradient [sp, tp, ...]}).
History = list[tuple[np.ndarray, dict[str, np.ndarray]]]


def _case(mesh: tuple[int, int] | None) -> str:
    return "train[unsharded]" if mesh is None else f"train[sp={mesh[0]},tp={mesh[1]}]"


def write(directory: Path, world_size: int, seed: int) -> None:
    """The workload's inputs for the runners: the block's sizes, the meshes, the initial parameters and data."""
    config = train_block.BlockConfig.for_world_size(world_size, steps=STEPS)
    params, x, target = train_block.init(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {"x": x, "target": target, **{f"param|{name}": value for name, value in params.items()}}
    np.savez(directory / "train.npz", **arrays)
    meta = {"config": dataclasses.asdict(config), "meshes": train_block.meshes(world_size), "seed": seed}
    (directory / "train.json").write_text(json.dumps(meta, indent=1))


def read(
    directory: Path,
) -> tuple[train_block.BlockConfig, dict[str, np.ndarray], np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """``(config, params, x, target, meshes)`` as `write` stored them."""
    meta = json.loads((directory / "train.json").read_text())
    with np.load(directory / "train.npz") as data:
        params = {name: data[f"param|{name}"] for name in train_block.TP_DIM}
        x, target = data["x"], data["target"]
    return train_block.BlockConfig(**meta["config"]), params, x, target, [tuple(mesh) for mesh in meta["meshes"]]


def unshard_gradients(grads: dict[str, np.ndarray], tp: int) -> dict[str, np.ndarray]:
    """The unsharded gradients from SP rank 0's TP ranks: ``{name: [sp, tp, ...]} -> {name: full}``."""
    full = {}
    for name, ranks in grads.items():
        dim = train_block.TP_DIM[name]
        full[name] = ranks[0, 0] if dim is None else np.concatenate([ranks[0, t] for t in range(tp)], axis=dim)
    return full


class TrainResults:
    """What a frontend runner writes: per (mode, mesh) a `History`, or the error it raised."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.arrays: dict[str, Any] = {}  # np.savez takes them as keywords
        self.runs: list[dict] = []  # {"mode", "mesh", "steps"} or {"mode", "mesh", "error"}, in the order run

    def add(self, mode: str, mesh: tuple[int, int] | None, history: History) -> None:
        key = f"{mode}|{_case(mesh)}"
        for step, (losses, grads) in enumerate(history):
            self.arrays[f"{key}|{step}|loss"] = np.asarray(losses, dtype=np.float64)
            self.arrays.update({f"{key}|{step}|{name}": np.asarray(value) for name, value in grads.items()})
        self.runs.append({"mode": mode, "mesh": mesh, "steps": len(history)})
        progress.done(key)

    def fail(self, mode: str, mesh: tuple[int, int] | None, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.runs.append({"mode": mode, "mesh": mesh, "error": text})
        progress.done(f"{mode}|{_case(mesh)}")

    def save(self, directory: Path, versions: dict[str, str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / "train_results.npz", **self.arrays)
        meta = {"framework": self.framework, "runs": self.runs, "versions": versions}
        (directory / "train_results.json").write_text(json.dumps(meta, indent=1))


def _load(directory: Path) -> tuple[list[dict], dict[str, History]]:
    """The runner's runs, and the `History` of each that did not fail, by ``"mode|case"``."""
    meta = json.loads((directory / "train_results.json").read_text())
    with np.load(directory / "train_results.npz") as data:
        stored = dict(data)
    histories = {}
    for entry in meta["runs"]:
        if "error" in entry:
            continue
        key = f"{entry['mode']}|{_case(entry['mesh'] and tuple(entry['mesh']))}"
        histories[key] = [
            (stored[f"{key}|{step}|loss"], {name: stored[f"{key}|{step}|{name}"] for name in train_block.TP_DIM})
            for step in range(entry["steps"])
        ]
    return meta["runs"], histories


def reference(
    config: train_block.BlockConfig, params: dict[str, np.ndarray], x: np.ndarray, target: np.ndarray, steps: int
) -> list[tuple[float, dict]]:
    """The numpy block's (loss, gradients) at each of `steps` SGD steps."""
    trajectory = []
    for _ in range(steps):
        loss, grads = train_block.loss_and_grads(config, params, x, target)
        trajectory.append((loss, grads))
        params = train_block.sgd(params, grads, config.lr)
    return trajectory


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (inf on a shape mismatch)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got - want), initial=0.0) / max(np.max(np.abs(want), initial=0.0), 1e-300))


def _errors(history: History, want: History) -> tuple[float, float, str]:
    """(max loss error, max gradient error, where the gradient error is largest) over steps and ranks."""
    if len(history) != len(want):
        return float("inf"), float("inf"), f"{len(history)} steps, expected {len(want)}"
    loss_error, grad_error, worst = 0.0, 0.0, ""
    for step, ((losses, grads), (want_losses, want_grads)) in enumerate(zip(history, want, strict=True)):
        loss_error = max(loss_error, _relative(losses, want_losses))
        for name in train_block.TP_DIM:
            error = _relative(grads[name], want_grads[name])
            if error > grad_error:
                grad_error, worst = error, f"worst: {name} at step {step + 1}"
    return loss_error, grad_error, worst


def expected(trajectory: list[tuple[float, dict]], mesh: tuple[int, int] | None) -> History:
    """The reference as every rank of `mesh` should hold it: the total loss, its TP block of each gradient."""
    sp, tp = mesh or (1, 1)
    history = []
    for loss, grads in trajectory:
        ranks = {
            name: np.stack([np.stack([train_block.shard_parameter(name, value, tp, t) for t in range(tp)])] * sp)
            for name, value in grads.items()
        }
        history.append((np.full((sp, tp), loss), ranks))
    return history


def check(case: str, framework: str, mode: str, history: History, want: History) -> Row:
    """The row of one run: its history against `want`, both losses and gradients within `TOLERANCE`."""
    loss_error, grad_error, worst = _errors(history, want)
    passed = loss_error <= TOLERANCE and grad_error <= TOLERANCE
    return Row(case, framework, mode, loss_error, grad_error, passed, "" if passed else worst)


def compare(framework: str, result_dir: Path, trajectory: list[tuple[float, dict]]) -> list[Row]:
    """A row per run the runner reported: every rank's losses and gradients at every step against the reference."""
    runs, histories = _load(result_dir)
    rows = []
    for entry in runs:
        mesh = entry["mesh"] and tuple(entry["mesh"])
        case = _case(mesh)
        if "error" in entry:
            rows.append(Row(case, framework, entry["mode"], None, None, False, entry["error"]))
        else:
            history = histories[f"{entry['mode']}|{case}"]
            rows.append(check(case, framework, entry["mode"], history, expected(trajectory, mesh)))
    return rows


def cross(torch_dir: Path, jax_dir: Path) -> list[Row]:
    """torch (gloo) against every JAX mode on the same mesh, and unsharded against unsharded."""
    _, torch_runs = _load(torch_dir)
    _, jax_runs = _load(jax_dir)
    rows = []
    for key, history in jax_runs.items():
        mode, case = key.split("|")
        torch_key = f"{UNSHARDED if mode == UNSHARDED else 'gloo'}|{case}"
        if torch_key in torch_runs:
            rows.append(check(case, "torch vs jax", mode, torch_runs[torch_key], history))
    return rows


def run(
    world_size: int, seed: int = 0, frameworks: Sequence[str] = FRAMEWORKS, timeout: float | None = None
) -> list[Row]:
    """The train workload at `world_size`: rows per framework, mode and mesh, then torch against JAX."""
    if world_size < 1:
        raise CommError(f"parity: world_size ({world_size}) must be >= 1")
    with tempfile.TemporaryDirectory(prefix="commlib-train-") as tmp:
        in_dir = Path(tmp) / "inputs"
        write(in_dir, world_size, seed)
        config, params, x, target, _ = read(in_dir)
        trajectory = reference(config, params, x, target, config.steps)
        rows, done = [], []
        for framework in frameworks:
            out_dir = Path(tmp) / framework
            failed = run_runner(framework, in_dir, out_dir, world_size, timeout, ("--workload", "train"))
            rows += [failed] if failed else compare(framework, out_dir, trajectory)
            done += [] if failed else [framework]
        if {"torch", "jax"} <= set(done):
            rows += cross(Path(tmp) / "torch", Path(tmp) / "jax")
        return rows
