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
