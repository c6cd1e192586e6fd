"""Progress of the long commands (`commlib parity`, `commlib bench`): the runners report, the driver shows.

A runner subprocess calls `expect(total)` once and `done(label)` per finished item (a case, a size); each call
appends a line (``total N``, ``done LABEL``) to the file the environment variable ``COMMLIB_PROGRESS`` names
(without it they do nothing). The driver starts the runner through `run`, which sets that variable, reads the
file while the runner works and shows on stderr, with the time left estimated from the time per item so far:

- on a terminal, one bar redrawn in place:
  ``torch parity [########............] 120/460 1:02 elapsed, ~2:56 left  all_reduce[4x6,float32]``
- otherwise (a log file, CI), a line when a phase starts and ends and a line per finished item at most every
  `LINE_SECONDS`: ``torch parity: 120/460, 1:02 elapsed, ~2:56 left (last: all_reduce[4x6,float32])``.

Items are counted by distinct label, so a runner may report one label several times (a case in each mode).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

__all__ = ["ENV", "LINE_SECONDS", "Display", "done", "expect", "run"]

ENV = "COMMLIB_PROGRESS"  # the file the runner appends its progress lines to
LINE_SECONDS = 10.0  # off a terminal: at most one line per this many seconds (and each phase's start and end)
BAR = 20  # characters of the bar
POLL = 0.2  # seconds between two reads of the progress file


# ---- the runner's side ------------------------------------------------------------------------------------


def expect(total: int) -> None:
    """Declare how many items this runner will report (`done`)."""
    _append(f"total {total}")


def done(label: str) -> None:
    """Report one finished item, named `label` (a label reported again counts once)."""
    _append(f"done {label}")


def _append(line: str) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(line.replace("\n", " ") + "\n")


# ---- the driver's side ------------------------------------------------------------------------------------


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


class Display:
    """What the driver shows for one phase (one runner): `update` as items finish, `finish` at the end."""

    def __init__(
        self,
        phase: str,
        total: int | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.phase, self.total, self.stream, self.clock = phase, total, stream or sys.stderr, clock
        self.terminal = self.stream.isatty()
        self.start = self.last_line = clock()
        self.count, self.label = 0, ""
        if not self.terminal:
            self._print(f"{phase}: started" + (f", {total} to run" if total else ""))

    def _times(self) -> str:
        elapsed = self.clock() - self.start
        text = f"{_clock(elapsed)} elapsed"
        if self.total and 0 < self.count < self.total:
            text += f", ~{_clock(elapsed / self.count * (self.total - self.count))} left"
        return text

    def _counted(self) -> str:
        return f"{self.count}/{self.total}" if self.total else f"{self.count} done"

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self) -> None:
        filled = BAR * min(self.count, self.total or 0) // (self.total or 1)
        bar = f"[{'#' * filled}{'.' * (BAR - filled)}] " if self.total else ""
        line = f"{self.phase} {bar}{self._counted()} {self._times()}  {self.label}"
        width = max(40, _columns() - 1)
        self.stream.write("\r" + line[:width].ljust(width))
        self.stream.flush()

    def update(self, count: int, label: str, total: int | None = None) -> None:
        """`count` items finished so far, the last one `label`; `total` when the runner declared one."""
        changed = count != self.count
        self.count, self.label, self.total = count, label, total or self.total
        if self.terminal:
            self._draw()
        elif changed and self.clock() - self.last_line >= LINE_SECONDS:
            self.last_line = self.clock()
            self._print(f"{self.phase}: {self._counted()}, {self._times()} (last: {label})")

    def finish(self, outcome: str) -> None:
        """End the phase: `outcome` is "finished", "failed (exit 1)", "timed out", ..."""
        if self.terminal:
            self._draw()
            self.stream.write("\n")
        self._print(f"{self.phase}: {outcome}, {self._counted()} in {_clock(self.clock() - self.start)}")


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 120


def _read(path: Path) -> tuple[int | None, list[str]]:
    """(declared total or None, distinct labels done, in order) from a progress file."""
    total, labels = None, dict[str, None]()  # an ordered set
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    for line in text.splitlines():
        kind, _, value = line.partition(" ")
        if kind == "total" and value.isdigit():
            total = int(value)
        elif kind == "done":
            labels[value] = None
    return total, list(labels)


def run(
    command: list[str],
    *,
    phase: str,
    timeout: float,
    total: int | None = None,
    env: dict | None = None,
    stream: TextIO | None = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=DEVNULL, env=env)``
    that shows the runner's progress as `phase` meanwhile (`total`: the items expected unless the runner
    declares it). Raises `subprocess.TimeoutExpired` after `timeout` seconds (the runner is killed)."""
    display = Display(phase, total, stream)
    with tempfile.TemporaryDirectory(prefix="commlib-progress-") as tmp:
        folder = Path(tmp)
        progress = folder / "progress"
        environment = {**(os.environ if env is None else env), ENV: str(progress)}
        with open(folder / "stdout", "w+") as out, open(folder / "stderr", "w+") as err:
            process = subprocess.Popen(
                command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True, env=environment
            )
            deadline = time.monotonic() + timeout
            while process.poll() is None:
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    display.finish("timed out")
                    raise subprocess.TimeoutExpired(command, timeout)
                declared, labels = _read(progress)
                display.update(len(labels), labels[-1] if labels else "", declared)
                time.sleep(POLL)
            declared, labels = _read(progress)
            display.update(len(labels), labels[-1] if labels else "", declared)
            display.finish("finished" if process.returncode == 0 else f"failed (exit {process.returncode})")
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())
