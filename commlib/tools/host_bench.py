"""``commlib bench --host``: host time per call of the torch ops, on torch's ``fake`` process group.

On a GPU a small collective takes 10-20 us on the device, so the Python around it decides the step time of
tensor-parallel layers and decode steps. The fake backend makes every collective a no-op, so what the
runner (``python -m commlib_torch.tools.host_runner``, one process, rank 0 of W) times is that host work
alone: commlib against `torch.distributed.nn.functional` where it has the op, against the raw c10d call with
its buffers in one autograd Function ("by hand"), the Ulysses all_to_all_4d against the hand-written
DeepSpeed-style layout, and checked mode against plain commlib. The driver takes each variant's median over
thousands of calls and the ratio commlib / baseline; a missed target is reported, not raised.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from commlib.tools import bench

__all__ = ["BY_HAND_OPS", "TARGETS", "markdown", "run"]

#: The ops whose target is against the raw call by hand (the runner's case names).
BY_HAND_OPS = (
    "all_gather (dim 0)",
    "reduce_scatter (dim 0)",
    "all_to_all (= all_to_all_single)",
    "broadcast",
    "gather (dim 0)",
    "scatter (dim 0)",
    "permute (ring)",
    "sum_grad",
    "shard (dim 0)",
    "reduce",
)
_HOST: dict[str, Any] = dict(world_size=4, size_mib=0.0)
#: The issue's targets (fake backend, world size 4, small tensors), ratios of medians from one run.
TARGETS = (
    bench.Target("torch", "all_reduce", "torch.distributed.nn", 1.3, **_HOST),
    bench.Target("torch", "all_to_all_4d*", "hand-written (torch.distributed.nn)", 1.1, **_HOST),
    *(bench.Target("torch", name, "by hand", 1.3, **_HOST) for name in BY_HAND_OPS),
)


def run(
    world_size: int = 4, calls: int = 3000, cases: list[str] | None = None, timeout: float = 3600.0
) -> tuple[list[bench.Row], dict[str, Any]]:
    """Run the torch host-time runner; (rows, facts about the run, the runner's records included)."""
    options = ["--world-size", str(world_size), "--calls", str(calls), *(["--cases", *cases] if cases else [])]
    facts: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": bench._machine(),
        "load_before": bench._load(),
        "versions": {"python": sys.version.split()[0]},
        "failures": {},
        "records": [],
    }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="commlib-host-") as tmp:
        records, versions, error = bench._run_framework(
            "torch", Path(tmp) / "torch.json", options, timeout, runner="host_runner"
        )
    facts["versions"].update(versions)
    if error:
        facts["failures"]["torch"] = error
    facts.update(records=records, load_after=bench._load(), seconds=round(time.perf_counter() - start, 1))
    return bench.rows(records, TARGETS), facts


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def markdown(rows: list[bench.Row]) -> str:
    """The rows as a GitHub markdown table, in microseconds per call (medians)."""
    from tabulate import tabulate

    body = []
    for row in rows:
        verdict = "" if row.target is None else f"<= {row.target:.2f} {'met' if row.met else 'MISSED'}"
        added = None if row.subject_ms is None or row.baseline_ms is None else row.subject_ms - row.baseline_ms
        body.append(
            [
                row.case,
                row.subject,
                _us(row.subject_ms),
                row.baseline,
                _us(row.baseline_ms),
                bench._number(row.ratio),
                "-" if added is None else f"{1e3 * added:+.1f}",
                "-" if row.spread is None else f"{100 * row.spread:.0f}%",
                verdict,
            ]
        )
    headers = [
        "case",
        "subject",
        "us/call",
        "baseline",
        "baseline us/call",
        "ratio",
        "difference us",
        "spread",
        "target",
    ]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def checked_cost(rows: list[bench.Row]) -> float | None:
    """Median over ops of the host time checked mode adds per call (us), from the ``checked`` rows."""
    added = [
        1e3 * (row.subject_ms - row.baseline_ms)
        for row in rows
        if row.subject == "commlib checked" and row.subject_ms is not None and row.baseline_ms is not None
    ]
    return statistics.median(added) if added else None
