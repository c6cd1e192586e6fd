"""Numbers the docs quote, made from stored results: ``python -m commlib.tools.quotes [--write]``.

A quoted number sits in README.md or docs/*.md between two markers, ``<!-- quote NAME -->TEXT<!-- /quote -->``
(invisible once rendered; TEXT may be a code span, the markers outside its backticks). `QUOTES` makes each
NAME's TEXT from a stored result in the repository (a command's output or JSON under ``docs/results/`` or
``benchmarks/results/``). Without ``--write`` it exits 1 and names each quote whose text differs from what its
result gives (``tests/tools/test_docs_numbers.py`` checks the same); ``--write`` puts the results' text into the
docs. To refresh a number: rerun the command named beside it in the docs into its result file, then
``--write``. A number that is no quote is stated as an example, with the command that gives it. Reads the
docs of a clone (the repository around this package).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DOCUMENTS", "QUOTES", "ROOT", "check", "memory_table", "quoted", "write"]

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/*.md")
RESULTS = "docs/results"  # the results this module reads that are not benchmarks (commands' output)
# A quote's text may sit in a code span: <!-- quote NAME -->`TEXT`<!-- /quote --> (markers outside the backticks,
# where markdown hides them).
_MARKED = re.compile(r"<!-- quote (?P<name>[\w.-]+) -->(?P<tick>`?)(?P<text>.*?)(?P=tick)<!-- /quote -->", re.DOTALL)


def _text(name: str) -> str:
    return (ROOT / RESULTS / name).read_text(encoding="utf-8")


def _line(name: str, start: str) -> str:
    """The last line of the stored output `name` that starts with `start`."""
    return [line for line in _text(name).splitlines() if line.startswith(start)][-1].strip()


def _json(path: str) -> Any:
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


def _seconds(path: str) -> str:
    """A bench run's own time (its facts: the runners'), in seconds."""
    return f"{_json(path)['facts']['seconds']:.1f} s"


def _largest_error(path: str) -> str:
    """The largest error over every row of a stored ``commlib parity --json`` (both columns)."""
    errors = [row[key] for row in _json(path) for key in ("out_error", "grad_error") if row[key] is not None]
    return f"{max(errors):.2e}"


def _bench_table(path: str) -> str:
    """The table ``commlib bench`` prints for a stored run, from its rows."""
    from commlib.tools import bench

    return "\n" + bench.markdown([bench.Row(**row) for row in _json(path)["rows"]]) + "\n"


def _dead_rank(path: str) -> str:
    """How long the survivors of a SIGKILLed rank took to raise (``benchmarks/dead_rank.py``'s stored output)."""
    result = _json(path)
    runs, timeout = result["runs"], result["args"]["timeout"]
    times = [survivor["seconds"] for run in runs for survivor in run["survivors"].values()]
    quick = [seconds for seconds in times if seconds < timeout - 1]
    slow = sum(any(s["seconds"] >= timeout - 1 for s in run["survivors"].values()) for run in runs)
    return (
        f"{len(quick)} of {len(times)} survivors raised `CommFailure` within {max(quick):.1f} s; in {slow} of "
        f"{len(runs)} runs at least one waited the full timeout ({timeout:g} s) and raised `CommTimeout`"
    )


def _ring_masks(path: str) -> str:
    """``benchmarks/ring_masks.py``'s stored rows as a markdown table."""
    lines = [
        "| layout | segment ids | pieces computed / scheduled | median s | min s | bytes one rank sends per "
        "forward step |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['layout']} | {'yes' if row['segment_ids'] else 'no'} | {row['pieces_computed']} / "
        f"{row['pieces_scheduled']} | {row['median_s']:.2f} | {row['min_s']:.2f} | "
        f"{row['bytes_sent_per_forward_step']} |"
        for row in _json(path)["rows"]
    ]
    return "\n" + "\n".join(lines) + "\n"


def _all_ones_mask(path: str) -> str:
    """``benchmarks/all_ones_mask.py``'s stored rows as a markdown table."""
    lines = [
        "| variant | median s | min s | decisions (all_reduces) per forward | logits vs no mask |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['variant']} | {row['median_s']:.2f} | {row['min_s']:.2f} | {row['decisions_per_forward']} | "
        f"{row['logits_max_difference_to_no_mask']:.1e} |"
        for row in _json(path)["rows"]
    ]
    return "\n" + "\n".join(lines) + "\n"


def _moe_bench(path: str) -> str:
    """``benchmarks/moe.py``'s stored run as a markdown table: per dtype and variant, the median and spread of
    the step, commlib exact's median over it, the row exchanges per step and the rows per exchange over the
    valid rows; then the run's facts (load, repeats)."""
    result = _json(path)
    facts = result["facts"]
    lines = [
        "| dtype | variant | median s | min-max s | commlib exact / this | row exchanges per step | rows on the wire "
        "/ valid rows | largest difference (vs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in result["results"]:
        for name, row in run["variants"].items():
            lines.append(
                f"| {run['dtype']} | {name} | {row['median_s']:.3f} | {row['min_s']:.3f}-{row['max_s']:.3f} | "
                f"{row['commlib_exact_over_this']:.2f} | {row['wire']['row_exchanges_per_step']} | "
                f"{row['rows_per_exchange_over_valid']:.3f} | {row['largest_difference']:.1e} "
                f"({row['compared_with']}) |"
            )
    load = f"{facts['load_before'][0]:.1f} -> {facts['load_after'][0]:.1f}"
    lines.append("")
    lines.append(
        f"W = {facts['world_size']} gloo ranks, T = {facts['tokens']}, H = {facts['hidden']}, E = {facts['experts']}, "
        f"K = {facts['top_k']}, cf {facts['capacity_factor']:g}; {facts['repeats']} timed steps per variant after "
        f"{facts['warmup']} warmup, {facts['threads_per_rank']} thread per rank; load average {load} on 2 cores; "
        f"torch {facts['versions']['torch']}, deepspeed {facts['versions']['deepspeed']}; `{facts['command']}`"
    )
    return "\n" + "\n".join(lines) + "\n"


def memory_table(rows: list[dict]) -> str:
    """``benchmarks/memory.py``'s rows as a markdown table (the bench prints it too)."""
    lines = ["| framework | layer | S | block | temp MiB | peak RSS MiB | RSS before MiB | s (fwd+bwd) |"]
    lines.append("|---" * 8 + "|")
    for row in rows:
        cells = [row["framework"], row["layer"], f"{row['seq']:,}", str(row.get("block_size") or "default")]
        cells += [f"{row[key]:,.0f}" if key in row else "-" for key in ("temp_mib", "peak_rss_mib", "rss_before_mib")]
        cells.append(f"{row['seconds']:.2f}" if "seconds" in row else row.get("error", "-"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _memory(path: str, key: str = "rows") -> str:
    return "\n" + memory_table(_json(path)[key]) + "\n"


def _memory_files(*paths: str) -> str:
    """The rows of several stored ``benchmarks/memory.py`` runs as one table, in order."""
    return "\n" + memory_table([row for path in paths for row in _json(path)["rows"]]) + "\n"


def _memory_speed(path: str) -> str:
    """The speed ratios a stored ``benchmarks/memory.py --baseline-path`` run gives, one per layer."""
    parts = []
    for entry in _json(path)["speed"]:
        this, baseline = entry["this"]["seconds"], entry["baseline"]["seconds"]
        parts.append(f"{entry['layer']} {entry['ratio']:.2f}x ({this:.2f} s / {baseline:.2f} s)")
    return ", ".join(parts)


_TARGET = "benchmarks/results/cpu-2026-11-30/target-0138.json"
_MASKS = "benchmarks/results/cpu-2026-12-01-masks"
_FULL = "benchmarks/results/cpu-2026-11-30/full.json"
_MEMORY = "benchmarks/results/cpu-2026-12-07-memory"

#: NAME -> the text its stored result gives.
QUOTES: dict[str, Callable[[], str]] = {
    "parity-ops": lambda: _line("parity-ops.txt", "world_size="),
    "train-example-torch": lambda: _line("train-torch.txt", "PASS"),
    "train-example-jax": lambda: _line("train-jax.txt", "PASS"),
    "parity-train": lambda: _line("parity-train.txt", "world_size="),
    "parity-train-largest": lambda: _largest_error(f"{RESULTS}/parity-train.json"),
    "bench-quick": lambda: _line("bench-quick.txt", f"{len(_json(f'{RESULTS}/bench-quick.json')['rows'])} comparisons"),
    "bench-quick-table": lambda: _bench_table(f"{RESULTS}/bench-quick.json"),
    "bench-host": lambda: _line("bench-host.txt", f"{len(_json(f'{RESULTS}/bench-host.json')['rows'])} comparisons"),
    "bench-target-seconds": lambda: _seconds(_TARGET),
    "bench-target-table": lambda: _bench_table(_TARGET),
    "bench-host-stored-seconds": lambda: _seconds("benchmarks/results/cpu-2026-12-01-host/host.json"),
    "bench-full-seconds": lambda: _seconds(_FULL),
    "bench-full-comparisons": lambda: str(len(_json(_FULL)["rows"])),
    "dead-rank": lambda: _dead_rank("benchmarks/results/cpu-2026-12-01-dead-rank/dead_rank.json"),
    "port-check": lambda: _line("port-check.txt", "port with bug none:"),
    "port-check-bug": lambda: _line("port-check.txt", "port with bug local-positions:"),
    "parity-sequence": lambda: _line("parity-sequence.txt", "world_size="),
    "parity-sequence-largest": lambda: _largest_error(f"{RESULTS}/parity-sequence.json"),
    "model-step": lambda: _line("../../benchmarks/results/cpu-2026-12-01-model-step/model_step.txt", "ratio"),
    "glue-lines": lambda: _line("glue-lines.txt", "hand-written"),
    "parity-masks": lambda: _line("parity-masks.txt", "world_size="),
    "parity-masks-largest": lambda: _largest_error(f"{RESULTS}/parity-masks.json"),
    "ring-masks": lambda: _ring_masks(f"{_MASKS}/ring_masks.json"),
    "ring-masks-one-document": lambda: _ring_masks(f"{_MASKS}/ring_masks_one_document.json"),
    "ring-masks-one-document-2": lambda: _ring_masks(f"{_MASKS}/ring_masks_one_document-2.json"),
    "all-ones-mask": lambda: _all_ones_mask(f"{_MASKS}/all_ones_mask.json"),
    "moe-bench": lambda: _moe_bench("benchmarks/results/cpu-2026-12-07-moe/moe.json"),
    "moe-bench-small": lambda: _moe_bench("benchmarks/results/cpu-2026-12-07-moe/moe-small.json"),
    "memory-table": lambda: _memory(f"{_MEMORY}/memory.json"),
    "memory-baseline": lambda: _memory(f"{_MEMORY}/baseline.json", "baseline_rows"),
    "memory-speed": lambda: _memory_speed(f"{_MEMORY}/baseline.json"),
    "memory-speed-ulysses": lambda: _memory_speed(f"{_MEMORY}/baseline_ulysses_4096.json"),
    "memory-block-size": lambda: _memory(f"{_MEMORY}/block_size.json"),
    "memory-torch": lambda: _memory_files(f"{_MEMORY}/torch_ulysses.json", f"{_MEMORY}/torch_ring_usp.json"),
    "memory-65536": lambda: _memory_files(f"{_MEMORY}/torch_65536_ring.json", f"{_MEMORY}/torch_65536_usp.json"),
}


def _documents() -> list[Path]:
    return sorted(path for pattern in DOCUMENTS for path in ROOT.glob(pattern))


def quoted() -> dict[Path, list[tuple[str, str]]]:
    """Every document's quotes, (NAME, TEXT) in order."""
    return {
        path: [(m["name"], m["text"]) for m in _MARKED.finditer(path.read_text(encoding="utf-8"))]
        for path in _documents()
    }


def check() -> list[str]:
    """What is wrong: a quote whose text is not its result's, an unknown NAME, a NAME no document quotes."""
    problems, used = [], set()
    for path, quotes in quoted().items():
        for name, text in quotes:
            used.add(name)
            if name not in QUOTES:
                problems.append(f"{path.relative_to(ROOT)}: unknown quote {name!r}")
            elif text != (want := QUOTES[name]()):
                problems.append(f"{path.relative_to(ROOT)}: quote {name!r} says {text!r}, its result gives {want!r}")
    problems += [f"no document quotes {name!r}" for name in QUOTES if name not in used]
    return problems


def _filled(marked: re.Match) -> str:
    """A quote with its result's text (an unknown NAME as it was: `check` names it)."""
    name = marked["name"]
    tick = marked["tick"]
    return f"<!-- quote {name} -->{tick}{QUOTES[name]()}{tick}<!-- /quote -->" if name in QUOTES else marked[0]


def write() -> list[Path]:
    """Put each result's text between its markers; the documents changed."""
    changed = []
    for path in _documents():
        text = path.read_text(encoding="utf-8")
        new = _MARKED.sub(_filled, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.tools.quotes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="update the docs from the stored results")
    args = parser.parse_args(argv)
    if args.write:
        for path in write():
            print(f"updated {path.relative_to(ROOT)}")
    problems = check()
    print("\n".join(problems) or f"every quoted number matches its stored result ({len(QUOTES)} quotes)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
