"""The `commlib` command line: ``commlib parity`` and ``commlib bench``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import commlib
from commlib.tools import (
    bench,
    cases,
    fuzz_parity,
    host_bench,
    mask_parity,
    moe_parity,
    parity,
    sequence_parity,
    train_parity,
)

__all__ = ["main"]

WIDTH = 120  # columns of the printed parity table


def _positive(text: str) -> int:
    """argparse type: an int >= 1 (a world size, a count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _writable(text: str) -> str:
    """argparse type: a file path whose folder exists, checked before any work is done."""
    folder = Path(text).resolve().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist")
    return text


def _format_error(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _mode(mode: str) -> str:
    """The mode as the table shows it: ``shard_map[check_vma=True] -> check_vma=True`` (the other modes as named)."""
    return mode[len("shard_map[") : -1] if mode.startswith("shard_map[") else mode


def _print_table(rows: list[parity.Row]) -> None:
    """The rows at most `WIDTH` columns wide (long case names wrap inside their column), then each failed row's
    detail on a line of its own."""
    import tabulate as tabulate_module
    from tabulate import tabulate

    body = [
        [
            row.case,
            row.framework,
            _mode(row.mode),
            _format_error(row.out_error),
            _format_error(row.grad_error),
            "pass" if row.passed else "FAIL",
        ]
        for row in rows
    ]
    headers = ["case", "framework", "mode", "err out", "err grad", "result"]

    def render(case_width: int) -> str:
        widths = [case_width] + [None] * (len(headers) - 1)
        padding, tabulate_module.MIN_PADDING = tabulate_module.MIN_PADDING, 0  # columns as wide as their text
        try:
            return tabulate(body, headers=headers, tablefmt="simple", maxcolwidths=widths, disable_numparse=True)
        finally:
            tabulate_module.MIN_PADDING = padding

    table = render(WIDTH)
    excess = max(map(len, table.splitlines()), default=0) - WIDTH
    if excess > 0:  # narrow the case column by that much (tabulate wraps its cells)
        longest = max(len(cells[0]) for cells in [headers, *body])
        table = render(max(16, longest - excess))
    print(table)
    for row in rows:
        if row.detail:  # one line each, unwrapped, so an error's text can be searched for
            print(f"{row.case} / {row.framework} / {row.mode}: {row.detail}")


def _parity(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    rows = []
    options = dict(seed=args.seed, frameworks=args.frameworks, timeout=args.timeout)
    if args.workload in ("ops", "all"):
        rows += parity.run(args.world_size, **options)
    if args.workload in ("train", "all"):
        rows += train_parity.run(args.world_size, **options)
    if args.workload in ("sequence", "all"):
        rows += sequence_parity.run(args.world_size, **options)
    if args.workload in ("masks", "all"):
        rows += mask_parity.run(args.world_size, **options)
    if args.workload in ("ops", "moe", "all"):  # the default run includes the MoE rows
        rows += moe_parity.run(args.world_size, **options)
    if args.workload == "fuzz":  # not in "all": its own bounded hunt
        rows += fuzz_parity.run(args.world_size, **options, count=args.cases)
    _print_table(rows)
    failed = sum(not row.passed for row in rows)
    print(
        f"\nworld_size={args.world_size} seed={args.seed} workload={args.workload}: {len(rows) - failed} passed, "
        f"{failed} failed in {time.perf_counter() - start:.1f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    return 0 if rows and not failed else 1


def _host_bench(args: argparse.Namespace) -> int:
    world_size = (args.world_sizes or [4])[0]
    rows, facts = host_bench.run(world_size, calls=args.calls, cases=args.cases, timeout=args.timeout)
    table = host_bench.markdown(rows)
    print(table)
    met = [row.met for row in rows if row.met is not None]
    cost = host_bench.checked_cost(rows)
    print(
        f"\n{len(rows)} comparisons, targets met {sum(met)}/{len(met)}; checked mode adds "
        f"{'-' if cost is None else f'{cost:.1f}'} us per call (median over ops); fake backend, W {world_size}, "
        f"{args.calls} calls per variant; {facts['seconds']} s; load average {facts['load_before']} -> "
        f"{facts['load_after']}; {facts['versions']}"
    )
    for framework, error in facts["failures"].items():
        print(f"{framework} runner FAILED: {error}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "facts": facts,
                    "settings": {"world_size": world_size, "calls": args.calls},
                    "rows": [dataclasses.asdict(row) for row in rows],
                },
                indent=1,
            )
        )
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 1 if facts["failures"] or not rows else 0


def _list_cases(args: argparse.Namespace) -> int:
    """``commlib bench --list-cases``: the names ``--cases`` accepts, per framework (asked of each runner)."""
    runners = [("torch", "host_runner")] if args.host else [(name, "bench_runner") for name in args.frameworks]
    status = 0
    for framework, runner in runners:
        try:
            names = bench.case_names(framework, runner)
        except (RuntimeError, OSError) as error:
            print(f"{framework}: could not list the cases: {error}")
            status = 1
            continue
        print(f"{framework} ({'--host' if args.host else 'bench'}): {len(names)} cases (quote a name with spaces)")
        print("".join(f"  {name}\n" for name in names), end="")
    return status


def _bench(args: argparse.Namespace) -> int:
    if args.list_cases:
        return _list_cases(args)
    if args.host:
        return _host_bench(args)
    settings: dict[str, Any] = {**bench.QUICK} if args.quick else {**bench.FULL}
    settings.update({key: value for key in settings if (value := getattr(args, key)) is not None})
    rows, facts = bench.run(
        **settings, frameworks=args.frameworks, quick=args.quick, cases=args.cases, timeout=args.timeout
    )
    table = bench.markdown(rows)
    print(table)
    met = [row.met for row in rows if row.met is not None]
    verdict = f"targets met {sum(met)}/{len(met)}" if met else "no target applies (they are set at W 4, 16 MiB)"
    print(
        f"\n{len(rows)} comparisons, {verdict}; {facts['seconds']} s; "
        f"load average {facts['load_before']} -> {facts['load_after']}; {facts['versions']}"
    )
    for framework, error in facts["failures"].items():
        print(f"{framework} runner FAILED: {error}")
    if not rows:
        print(f"no comparison ran (cases {args.cases})")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"facts": facts, "settings": settings, "rows": [dataclasses.asdict(row) for row in rows]}, indent=1
            )
        )
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot and not bench.plot(rows, args.plot):
        print("--plot needs matplotlib: pip install 'commlib[bench]'")
    return 1 if facts["failures"] or not rows else 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their line breaks kept), every option's default shown (but None and False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if hidden or "default" in text:
            return text
        default = " ".join(action.default) if isinstance(action.default, list) else "%(default)s"
        return f"{text} (default: {default})"


PARITY = """Run the seeded case table through the numpy reference (float64, W simulated ranks), torch (W gloo
processes) and JAX (W CPU devices: shard_map with check_vma on and off, pmap, a 2 x 2 mesh at W = 4) and
compare every rank's output and input gradients with the reference. Prints one row per case, framework and
mode, then a summary line; exits 0 only when every row passes. Progress goes to stderr (a bar on a terminal,
a line every few seconds otherwise, with the time left).

examples:
  commlib parity --world-size 4
  commlib parity --world-size 2 --frameworks torch --json parity.json
  commlib parity --workload train
  commlib parity --workload sequence --world-size 4
  commlib parity --workload masks --world-size 4
  commlib parity --workload moe --world-size 4
  commlib parity --workload fuzz --cases 40 --seed 1"""

BENCH = """Time commlib's ops against raw collectives, the seed's code and bare jax.lax on this machine's CPU (gloo,
XLA CPU devices) and print one row per comparison (median ms, ratio to the baseline, wire MiB, the target
where one applies). --host times the host path of one call instead (torch's fake process group). Progress goes
to stderr. The full run takes many minutes; --quick about a minute.

examples:
  commlib bench --quick
  commlib bench --list-cases
  commlib bench --world-sizes 4 --sizes-mib 16 --cases "all_to_all_4d (2, 1) B=1" --json bench.json --plot bench.png
  commlib bench --host"""


def _add_bench(commands: argparse._SubParsersAction) -> None:
    timing = commands.add_parser(
        "bench",
        help="time commlib against raw collectives, the seed and bare jax.lax",
        description=BENCH,
        formatter_class=_HelpFormatter,
    )
    timing.add_argument("--quick", action="store_true", help=f"a short run (about a minute): {bench.QUICK}")
    timing.add_argument("--world-sizes", type=_positive, nargs="+", help=f"default {bench.FULL['world_sizes']}")
    timing.add_argument("--sizes-mib", type=float, nargs="+", help=f"MiB per rank, default {bench.FULL['sizes_mib']}")
    timing.add_argument("--repeats", type=int, help=f"timed rounds per variant, default {bench.FULL['repeats']}")
    timing.add_argument("--warmup", type=int, help=f"untimed rounds first, default {bench.FULL['warmup']}")
    timing.add_argument(
        "--frameworks",
        nargs="+",
        choices=bench.FRAMEWORKS,
        default=list(bench.FRAMEWORKS),
        help="which frontends to time (each in a subprocess of its own)",
    )
    timing.add_argument(
        "--cases",
        nargs="+",
        metavar="NAME",
        help="only the cases of these names (each framework runs those it has; see --list-cases)",
    )
    timing.add_argument(
        "--list-cases",
        action="store_true",
        help="print the names --cases accepts, per framework (with --host: the host cases), and stop",
    )
    timing.add_argument("--json", metavar="PATH", type=_writable, help="also write the rows and run facts as JSON")
    timing.add_argument("--markdown", metavar="PATH", type=_writable, help="also write the table as markdown")
    timing.add_argument("--plot", metavar="PATH", type=_writable, help="also plot the ratios as PNG (needs matplotlib)")
    timing.add_argument("--timeout", type=float, default=3600.0, help="seconds per framework runner")
    timing.add_argument(
        "--host",
        action="store_true",
        help="host time per call instead (torch, fake process group, small tensors): commlib vs "
        "torch.distributed.nn, the raw call by hand, the hand-written Ulysses, checked mode",
    )
    timing.add_argument("--calls", type=_positive, default=3000, help="with --host: timed calls per variant")
    timing.set_defaults(handler=_bench)


def _add_parity(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "parity",
        help="run the case table through numpy, torch and JAX and compare",
        description=PARITY,
        formatter_class=_HelpFormatter,
    )
    check.add_argument("--world-size", type=_positive, default=4, help="ranks (torch processes, JAX CPU devices)")
    check.add_argument("--seed", type=int, default=0, help="seed of the case table's inputs")
    check.add_argument("--json", metavar="PATH", type=_writable, help="also write the rows as JSON")
    check.add_argument(
        "--frameworks",
        nargs="+",
        choices=parity.FRAMEWORKS,
        default=list(parity.FRAMEWORKS),
        help="which frontends to compare with the reference (each in a subprocess of its own)",
    )
    check.add_argument(
        "--workload",
        choices=("ops", "train", "sequence", "masks", "moe", "fuzz", "all"),
        default="ops",
        help="ops: the case table and the moe rows; train: the training block on every SP x TP mesh; sequence: the "
        "sequence helpers on every layout and the two model examples (W = 4); masks: the "
        "attention layers with segment ids (padding, packed documents); moe: expert parallelism's route, "
        "dispatch and combine (torch's exact and padded layouts, JAX's padded); fuzz: --cases seeded random calls of "
        "the attention layers (world sizes 1..--world-size, any length, GQA/MQA, layouts, segment ids, chunks, "
        "float64/float32) against the reference and torch against JAX; all: the first five",
    )
    rows = len(cases.parity_table(4))
    check.add_argument(
        "--timeout",
        type=float,
        help=f"seconds per framework runner (default: {parity.TIMEOUT_START:.0f} + {parity.TIMEOUT_PER_ROW:.0f} "
        f"per row of the case table, at least {parity.TIMEOUT_BASE:.0f}: {parity.runner_timeout(rows):.0f} s for "
        f"its {rows} rows at W = 4; {parity.TIMEOUT_BASE:.0f} for the other workloads' runners)",
    )
    check.add_argument(
        "--cases", type=_positive, default=fuzz_parity.CASES, help="with --workload fuzz: how many cases to draw"
    )
    check.set_defaults(handler=_parity)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commlib", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {commlib.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_parity(commands)
    _add_bench(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if importlib.util.find_spec("tabulate") is None:  # the spec does without; its command does not
        print(
            "commlib: the commlib command prints its tables with tabulate: pip install 'commlib[cli]' "
            "(the torch, jax, test and bench extras include it)",
            file=sys.stderr,
        )
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
