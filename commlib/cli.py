"""The `commlib` command line: ``commlib parity`` (and ``commlib bench``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from commlib import parity

__all__ = ["main"]


def _format_error(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _print_table(rows: list[parity.Row]) -> None:
    from tabulate import tabulate

    body = [
        [row.case, row.framework, row.mode, _format_error(row.out_error), _format_error(row.grad_error),
         "pass" if row.passed else "FAIL", row.detail]
        for row in rows
    ]
    headers = ["case", "framework", "mode", "max err out", "max err grad", "result", "detail"]
    print(tabulate(body, headers=headers, tablefmt="github"))


def _parity(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    rows = parity.run(args.world_size, seed=args.seed, frameworks=args.frameworks, timeout=args.timeout)
    _print_table(rows)
    failed = sum(not row.passed for row in rows)
    print(f"\nworld_size={args.world_size} seed={args.seed}: {len(rows) - failed} passed, {failed} failed "
          f"in {time.perf_counter() - start:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    return 0 if rows and not failed else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commlib", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("parity", help="run the case table through numpy, torch and JAX and compare")
    check.add_argument("--world-size", type=int, default=4, help="ranks (torch processes, JAX CPU devices)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    check.add_argument("--frameworks", nargs="+", choices=parity.FRAMEWORKS, default=list(parity.FRAMEWORKS))
    check.add_argument("--timeout", type=float, default=600.0, help="seconds per framework runner")
    check.set_defaults(handler=_parity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
