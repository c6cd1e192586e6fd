"""`commlib.tools.progress`: a runner subprocess reports, the driver shows a bar (terminal) or lines (logs)."""

import io
import subprocess
import sys

import pytest

from commlib.tools import progress

RUNNER = """
import time
from commlib.tools import progress
progress.expect(4)
for index in range(4):
    time.sleep(0.25)
    progress.done(f"case {index}")
    progress.done(f"case {index}")  # a second mode of the same case counts once
print("the result")
"""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_off_a_terminal_with_the_time_left(monkeypatch):
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    stream = io.StringIO()
    done = progress.run([sys.executable, "-c", RUNNER], phase="torch parity", timeout=60, total=99, stream=stream)
    assert (done.returncode, done.stdout) == (0, "the result\n")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "torch parity: started, 99 to run"
    assert any(line.startswith("torch parity: 1/4, 0:0") and "left (last: case 0)" in line for line in lines)
    assert lines[-1].startswith("torch parity: finished, 4/4 in 0:0")


def test_a_bar_on_a_terminal():
    stream = Terminal()
    progress.run([sys.executable, "-c", RUNNER], phase="jax bench", timeout=60, stream=stream)
    frames = stream.getvalue().split("\r")
    assert any("jax bench [##########..........] 2/4 0:0" in frame and "left  case 1" in frame for frame in frames)
    assert "\njax bench: finished, 4/4 in 0:0" in frames[-1]


def test_a_failed_and_a_slow_runner():
    stream = io.StringIO()
    done = progress.run([sys.executable, "-c", "import sys; sys.exit('broken')"], phase="x", timeout=60, stream=stream)
    assert (done.returncode, done.stderr) == (1, "broken\n")
    assert stream.getvalue().splitlines()[-1].startswith("x: failed (exit 1), 0 done in 0:0")
    with pytest.raises(subprocess.TimeoutExpired):
        progress.run([sys.executable, "-c", "import time; time.sleep(30)"], phase="y", timeout=0.5, stream=stream)
    assert stream.getvalue().splitlines()[-1].startswith("y: timed out")


def test_outside_a_driver_reports_do_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv(progress.ENV, raising=False)
    progress.done("nothing")  # no file, no error
    monkeypatch.setenv(progress.ENV, str(tmp_path / "progress"))
    progress.expect(2)
    progress.done("a\nb")
    assert (tmp_path / "progress").read_text() == "total 2\ndone a b\n"


def test_runner_timeout_grows_with_the_rows_and_says_how_to_raise_it(monkeypatch, tmp_path):
    """The default limit of a runner grows with the rows it reports (the case table at W = 4 took 585 s of a
    fixed 600 s on a loaded 2-core machine); a runner past its limit is a failed row naming the runner, the
    workload and the option that raises it."""
    from commlib.tools import cli, parity

    assert parity.runner_timeout(None) == 600.0 and parity.runner_timeout(10) == 600.0
    assert parity.runner_timeout(len(parity.cases.parity_table(4))) > 1000.0
    seen = {}

    def slow(command, *, phase, timeout, total):
        seen.update(phase=phase, timeout=timeout, total=total)
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(progress, "run", slow)
    row = parity.run_runner("jax", tmp_path, tmp_path, 4, None, ("--workload", "moe"), total=100)
    assert seen == {"phase": "jax parity (moe)", "timeout": 60.0 + 12.0 * 100, "total": 100}
    assert row is not None and not row.passed and row.case == "(runner)"
    assert row.detail == (
        "timed out after 1260 s (the jax parity (moe) runner, workload moe, world size 4, 100 rows): on a slow or "
        "loaded machine raise the limit with --timeout SECONDS (commlib parity --timeout 2520 ...)"
    )
    assert parity.run_runner("torch", tmp_path, tmp_path, 2, 5.0).detail.startswith(  # type: ignore[union-attr]
        "timed out after 5 s (the torch parity runner, workload ops, world size 2): "
    )
    assert cli._parser().parse_args(["parity"]).timeout is None  # the default: per runner, by its rows
