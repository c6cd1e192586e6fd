"""CI runs exactly the README's test command: the README line marked "as CI runs it" is a line of .ci/run."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "# the test suite, as CI runs it"


def test_ci_runs_the_readme_test_command():
    marked = [line for line in (ROOT / "README.md").read_text().splitlines() if MARK in line]
    assert len(marked) == 1, marked
    command = marked[0].split("#")[0].strip()
    assert command.startswith("HYPOTHESIS_PROFILE=slow python -m pytest"), command
    assert command in [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
