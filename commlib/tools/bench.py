"""`commlib bench`: commlib side by side with the raw collectives, the seed's algorithm and bare `jax.lax`.

As `commlib parity` does, the driver runs each frontend's runner as a subprocess
(``python -m commlib_torch.tools.bench_runner OUT.json ...`` on W gloo worker processes, ``python -m
commlib_jax.tools.bench_runner OUT.json ...`` on W CPU devices), reads their records back and reduces them: the
median of each variant's rounds, and ratio = commlib's median / the baseline's. Torch and JAX never share
a process and never run at the same time. Benchmarks, not tests: a missed target is reported, not raised.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commlib import attention, split_sizes, uneven
from commlib.layout import Plan
from commlib.tools import progress, train_block

__all__ = [
    "case_names",
    "CONTEXT_BASELINE",
    "CONTEXT_SHAPE",
    "CONTEXT_SIZES_MIB",
    "context_rows",
    "context_wire",
    "FRAMEWORKS",
    "FULL",
    "QUICK",
    "TARGETS",
    "TRAIN_STEP",
    "TRAIN_STEP_SIZES_MIB",
    "Row",
    "Target",
    "markdown",
    "plot",
    "rows",
    "run",
    "train_step_config",
    "uneven_ulysses",
    "wire_bytes",
]

FRAMEWORKS = ("torch", "jax")
#: `commlib bench` settings; --quick takes QUICK (only the cases marked quick), explicit options win.
FULL = {"world_sizes": [2, 4], "sizes_mib": [1, 4, 16, 64], "repeats": 9, "warmup": 1}
QUICK = {"world_sizes": [4], "sizes_mib": [4], "repeats": 9, "warmup": 1}

#: The whole-step case: the training block (`commlib.tools.train_block`) forward and backward on an SP x TP mesh
#: (`commlib.tools.train_block.mesh_shape`), at its own sizes -- the bytes of each rank's activations -- whatever
#: --sizes-mib says: the smaller one is bound by per-call overhead, the larger one by attention and matmuls.
TRAIN_STEP = "train-step"
TRAIN_STEP_SIZES_MIB = (0.0625, 0.25)


@dataclasses.dataclass(frozen=True)
class Target:
    """An upper bound on ``commlib / baseline`` at one world size and size per rank."""

    framework: str
    case: str  # case name, or its prefix when it ends with "*"
    baseline: str
    limit: float
    world_size: int = 4
    size_mib: float = 16

    def applies(self, row: Row) -> bool:
        name = self.case.removesuffix("*")
        matches = row.case.startswith(name) if self.case.endswith("*") else row.case == name
        return (
            matches
            and row.framework == self.framework
            and row.baseline == self.baseline
            and row.world_size == self.world_size
            and row.size_mib == self.size_mib
        )


#: The issue's targets (CPU, gloo, world 4, 16 MiB per rank).
TARGETS = (
    Target("torch", "all_reduce", "torch.distributed", 1.10),
    Target("torch", "all_gather (dim 0)", "torch.distributed", 1.10),
    Target("torch", "reduce_scatter (dim 0)", "torch.distributed", 1.10),
    Target("torch", "all_to_all_4d (2, 1) B=1", "seed (3 copies)", 0.8),
    Target("torch", "all_to_all_4d (1, 2) B=1", "seed (3 copies)", 0.8),
    Target("jax", "*", "jax.lax", 1.05),
    Target("torch", TRAIN_STEP, "torch.distributed", 1.05, size_mib=0.25),
    Target("jax", TRAIN_STEP, "jax.lax", 1.05, size_mib=0.25),
)


def train_step_config(nbytes: int, sp: int) -> train_block.BlockConfig:
    """The float32 training block of the train-step case whose activations ``x [1, S/SP, 256]`` on each of `sp`
    sequence ranks take `nbytes`: 8 heads of 32, MLP width 1024.

    >>> config = train_step_config(2**18, 2)
    >>> config.seq, config.dim, config.heads * config.head_dim, config.hidden
    (512, 256, 256, 1024)
    """
    dim = 256
    return train_block.BlockConfig(
        batch=1, seq=sp * max(1, nbytes // (4 * dim)), dim=dim, heads=8, head_dim=32, hidden=4 * dim
    )


@dataclasses.dataclass
class Row:
    """One comparison: the subject (commlib) against one baseline, at one world size and size."""

    framework: str
    case: str
    world_size: int
    size_mib: float
    subject: str
    subject_ms: float | None  # median over rounds
    baseline: str
    baseline_ms: float | None
    ratio: float | None  # subject / baseline, median wall-clock times
    spread: float | None  # larger interquartile range of the two wall-clock times, relative to its median
    cpu_ratio: float | None = None  # subject / baseline, median CPU times (all threads, all ranks)
    subject_wire_mib: float | None = None  # bytes all ranks send to other ranks per call (the spec's count), MiB
    baseline_wire_mib: float | None = None
    target: float | None = None
    met: bool | None = None
    detail: str = ""


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def _spread(seconds: list[float]) -> float:
    if len(seconds) < 4:
        return (max(seconds) - min(seconds)) / statistics.median(seconds)
    quartiles = statistics.quantiles(seconds, n=4)
    return (quartiles[2] - quartiles[0]) / statistics.median(seconds)


def rows(records: list[dict], targets: Sequence[Target] = TARGETS) -> list[Row]:
    """Runner records -> one row per (record, baseline), with the target that applies to it."""
    result = []
    for record in records:
        seconds, subject = record["seconds"], record["subject"]
        for baseline in record["baselines"]:
            mine, theirs = _median_ms(seconds[subject]), _median_ms(seconds[baseline])
            row = Row(
                record["framework"],
                record["case"],
                record["world_size"],
                record["size_mib"],
                subject,
                mine,
                baseline,
                theirs,
                mine / theirs,
                max(_spread(seconds[subject]), _spread(seconds[baseline])),
            )
            cpu = record.get("cpu_seconds")
            if cpu:
                row.cpu_ratio = statistics.median(cpu[subject]) / statistics.median(cpu[baseline])
            wire = record.get("wire_bytes") or {}
            if subject in wire and baseline in wire:
                row.subject_wire_mib, row.baseline_wire_mib = wire[subject] / 2**20, wire[baseline] / 2**20
            for target in targets:
                if target.applies(row):
                    row.target, row.met = target.limit, mine / theirs <= target.limit  # row.ratio
            result.append(row)
    return result


#: The uneven Ulysses bench: [1, S_r, H, 64] float32 with S = W * n - 1 rows, H = 2W - 2 heads (6 at W = 4),
#: against the even all-to-all on the padded size [1, n, 2W, 64] (n rows and 2 heads per rank).
UNEVEN_HEAD_DIM = 64


def uneven_ulysses(world_size: int, nbytes: int) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """``(seq sizes, head sizes, padded rows per rank, padded heads)`` of the uneven Ulysses bench at about
    `nbytes` per rank (padded, float32)."""
    heads = split_sizes(max(1, 2 * world_size - 2), world_size)
    padded_heads = max(heads) * world_size
    rows = max(2, nbytes // 4 // (padded_heads * UNEVEN_HEAD_DIM))
    return split_sizes(world_size * rows - 1, world_size), heads, rows, padded_heads


#: The context-parallel attention cases (ring, USP, Ulysses attention fwd+bwd, both frameworks): q ``[1, S/W, H,
#: D]``, k and v ``[1, S/W, H_kv, D]`` with (H, H_kv, D) = CONTEXT_SHAPE, float32, causal; each against gathering
#: k and v on every rank (CONTEXT_BASELINE), at q bytes per rank CONTEXT_SIZES_MIB (attention costs S^2).
CONTEXT_SHAPE = (8, 2, 64)
CONTEXT_BASELINE = "all-gather KV"
CONTEXT_SIZES_MIB = (0.125, 0.5)


def context_rows(nbytes: int) -> int:
    """Rows per rank (S/W, even) of the context cases at q bytes `nbytes` per rank."""
    heads, _, head_dim = CONTEXT_SHAPE
    return max(2, nbytes // (4 * heads * head_dim) // 2 * 2)


def context_wire(kind: str, world_size: int, nbytes: int) -> dict[str, int]:
    """Bytes all ranks send to other ranks in one forward + backward of `kind` ("ring", "usp" on (W/2) x 2,
    "ulysses") and of its all-gather-KV baseline: gathering sends each rank's k, v to W - 1 ranks and
    reduce-scatters their gradients back; the ring sends k, v W - 1 times forward, k, v, dk, dv W - 1 times and
    dk, dv once backward."""
    W, rows = world_size, context_rows(nbytes)
    heads, kv_heads, head_dim = CONTEXT_SHAPE
    kv = rows * kv_heads * head_dim * 2 * 4  # one rank's k and v, float32
    baseline = W * 2 * (W - 1) * kv
    if kind == "ring":
        return {"commlib ring": W * (3 * W - 2) * kv, CONTEXT_BASELINE: baseline}
    if kind == "usp":
        ring, U = W // 2, 2
        ulysses = (rows * (heads + 2 * kv_heads) + rows * heads) * head_dim * 4 // U  # q, k, v out; output back
        return {"commlib usp": W * (2 * ulysses + (3 * ring - 2) * kv), CONTEXT_BASELINE: baseline}
    split = attention.head_split(heads, kv_heads, W)
    sent = sum(
        rows * (split.q_sizes[j] + 2 * split.kv_sizes[j] + split.q_sizes[r]) * head_dim * 4
        for r in range(W)
        for j in range(W)
        if j != r
    )
    return {"commlib ulysses": 2 * sent, CONTEXT_BASELINE: baseline}


def wire_bytes(plan: Plan, itemsize: int = 4) -> int:
    """Bytes all ranks together send to other ranks in one call of `plan` (`commlib.uneven.sent_elements`)."""
    return itemsize * sum(uneven.sent_elements(plan, rank) for rank in range(plan.world_size))


def _run_framework(
    framework: str, out: Path, options: list[str], timeout: float, runner: str = "bench_runner"
) -> tuple[list[dict], dict, str]:
    """(records, versions, error text or "") of one runner subprocess (``commlib_<framework>.tools.<runner>``)."""
    command = [sys.executable, "-m", f"commlib_{framework}.tools.{runner}", str(out), *options]
    env = dict(os.environ)
    if framework == "jax":  # one XLA thread per device: fewer threads contending for the cores, less noise
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        ).strip()
    try:
        done = progress.run(command, phase=f"{framework} {runner.replace('_runner', '')}", timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [], {}, f"timed out after {timeout:.0f} s"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-6:]
        return [], {}, f"exit {done.returncode}: " + " | ".join(tail)
    result = json.loads(out.read_text())
    return result["records"], result["versions"], ""


def case_names(framework: str, runner: str = "bench_runner", timeout: float = 300.0) -> list[str]:
    """The case names ``--cases`` accepts for `framework`'s `runner`, as the runner lists them
    (``--list-cases``); raises `RuntimeError` with the end of its output when it fails."""
    command = [sys.executable, "-m", f"commlib_{framework}.tools.{runner}", os.devnull, "--list-cases"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{framework} {runner} exit {done.returncode}: {tail}")
    return done.stdout.splitlines()


def run(
    world_sizes: Sequence[int] = (2, 4),
    sizes_mib: Sequence[float] = (1, 4, 16, 64),
    repeats: int = 7,
    warmup: int = 1,
    frameworks: Sequence[str] = FRAMEWORKS,
    quick: bool = False,
    cases: list[str] | None = None,
    timeout: float = 3600.0,
) -> tuple[list[Row], dict]:
    """Run the benches; (rows, facts about the run: versions, machine, load, seconds, failures, and the
    runners' records with every round's seconds)."""
    options = [
        "--world-sizes",
        *map(str, world_sizes),
        "--sizes-mib",
        *map(str, sizes_mib),
        "--repeats",
        str(repeats),
        "--warmup",
        str(warmup),
        *(["--quick"] if quick else []),
    ]
    facts: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "load_before": _load(),
        "versions": {"python": sys.version.split()[0]},
        "failures": {},
        "records": [],
    }
    start, result = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="commlib-bench-") as tmp:
        for framework in frameworks:
            extra = ["--cases", *cases] if cases else []
            records, versions, error = _run_framework(
                framework, Path(tmp) / f"{framework}.json", options + extra, timeout
            )
            facts["versions"].update(versions)
            if error:
                facts["failures"][framework] = error
            facts["records"] += records
            result += rows(records)
    facts.update(load_after=_load(), seconds=round(time.perf_counter() - start, 1))
    return result, facts


def _machine() -> str:
    return f"{platform.machine()} {platform.system()} {os.cpu_count()} cpus ({platform.processor() or 'cpu'})"


def _load() -> list[float] | None:
    return [round(value, 2) for value in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: list[Row]) -> str:
    """The rows as a GitHub markdown table."""
    from tabulate import tabulate

    body = []
    for row in result:
        verdict = "" if row.target is None else f"<= {row.target:.2f} {'met' if row.met else 'MISSED'}"
        spread = "-" if row.spread is None else f"{100 * row.spread:.0f}%"
        wire = (
            "-" if row.subject_wire_mib is None else (f"{row.subject_wire_mib:.2f} / {_number(row.baseline_wire_mib)}")
        )
        body.append(
            [
                row.framework,
                row.case,
                row.world_size,
                f"{row.size_mib:g}",
                _number(row.subject_ms, 1),
                row.baseline,
                _number(row.baseline_ms, 1),
                _number(row.ratio),
                spread,
                _number(row.cpu_ratio),
                wire,
                verdict,
            ]
        )
    headers = [
        "framework",
        "case",
        "W",
        "MiB/rank",
        "commlib ms",
        "baseline",
        "baseline ms",
        "ratio",
        "spread",
        "cpu ratio",
        "wire MiB (commlib / baseline)",
        "target",
    ]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


#: The op families `plot` gives a panel each: a case belongs to the first whose prefix its name starts with.
FAMILIES = {
    "all_reduce": ("all_reduce",),
    "all_gather": ("all_gather",),
    "reduce_scatter": ("reduce_scatter",),
    "all_to_all": ("all_to_all",),
    "attention layers": ("ring", "usp", "ulysses"),
    "train step": ("train",),
}


def family(case: str) -> str:
    """The `FAMILIES` panel of a case name ("other" for none)."""
    return next((name for name, prefixes in FAMILIES.items() if case.startswith(prefixes)), "other")


def _series(result: list[Row]) -> dict[tuple[str, str], dict[tuple[str, int], list[Row]]]:
    """(family, framework) -> (case, world size) -> its rows against the case's main (first) baseline."""
    main: dict[tuple[str, str], str] = {}
    for row in result:
        main.setdefault((row.framework, row.case), row.baseline)
    panels: dict[tuple[str, str], dict[tuple[str, int], list[Row]]] = {}
    for row in result:
        if row.ratio is not None and row.baseline == main[(row.framework, row.case)]:
            panel = panels.setdefault((family(row.case), row.framework), {})
            panel.setdefault((row.case, row.world_size), []).append(row)
    order = [*FAMILIES, "other"]
    return dict(sorted(panels.items(), key=lambda item: (order.index(item[0][0]), item[0][1] != "torch")))


def _panel(
    axis: Any, legend: Any, series: dict[tuple[str, int], list[Row]], markers: dict[int, str], title: str
) -> None:
    """One panel: a colour per case, a marker per world size; its legend (one entry a case) in `legend`."""
    from matplotlib.lines import Line2D

    cases = sorted({case for case, _ in series})
    colours = {case: f"C{index % 10}" for index, case in enumerate(cases)}
    styles: dict[str, Any] = {case: ("-", "--", ":")[index // 10 % 3] for index, case in enumerate(cases)}
    for (case, world_size), points in sorted(series.items()):
        points.sort(key=lambda row: row.size_mib)
        axis.plot(
            [p.size_mib for p in points],
            [p.ratio for p in points],
            color=colours[case],
            linestyle=styles[case],
            marker=markers[world_size],
        )
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set(xscale="log", xlabel="MiB per rank", ylabel="commlib / baseline", title=title)
    baselines = {case: rows[0].baseline for (case, _), rows in series.items()}
    handles = [Line2D([], [], color=colours[c], linestyle=styles[c]) for c in cases]
    handles += [Line2D([], [], color="black", marker=m, linestyle="") for m in markers.values()]
    labels = [f"{case} / {baselines[case]}" for case in cases] + [f"world size {w}" for w in markers]
    legend.legend(handles, labels, loc="center left", fontsize=7, frameon=False)
    legend.axis("off")


def plot(result: list[Row], path: str | Path) -> bool:
    """Ratio (commlib / the case's main baseline, median times) against size: a row of panels per op family
    (`FAMILIES`), one panel per framework, a colour per case, a marker per world size, each panel's legend
    beside it; False without matplotlib (``pip install commlib[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = _series(result)
    families = list(dict.fromkeys(name for name, _ in panels))
    frameworks = [name for name in ("torch", "jax") if any(f == name for _, f in panels)]
    markers = dict(zip(sorted({row.world_size for row in result}), "osD^v", strict=False))
    figure, axes = plt.subplots(
        max(1, len(families)),
        2 * max(1, len(frameworks)),
        squeeze=False,
        figsize=(8.5 * max(1, len(frameworks)), 3.4 * max(1, len(families))),
        gridspec_kw={"width_ratios": [3, 2] * max(1, len(frameworks))},
    )
    for axis in axes.flat:
        axis.set_visible(False)
    for (name, framework), series in panels.items():
        row, column = families.index(name), 2 * frameworks.index(framework)
        axes[row, column].set_visible(True)
        axes[row, column + 1].set_visible(True)
        _panel(axes[row, column], axes[row, column + 1], series, markers, f"{name}, {framework}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
