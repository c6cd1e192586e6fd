"""Skipped collectives and dead ranks on real gloo groups (process-group timeout 5 s): the other ranks raise
`commlib.CommTimeout` / `commlib.CommFailure` naming the op and the group in bounded time, the pool reports
which rank failed and leaves no process behind, and a parity run turns it into a failed row naming the rank.

Each test has a hard timeout (pytest-timeout); the pool kills every worker of a broken group itself.
"""

from __future__ import annotations

import os
import re
import time

import pytest

import commlib_torch._pool as pool_module
from commlib import CommFailure, CommTimeout
from commlib.tools import cases, parity
from commlib.tools.parity import Results
from commlib_torch.tools.parity_jobs import run_table
from commlib_torch.tools.pool import WorkerError, WorkerPool
from tests.torch import failure_jobs, pool_jobs

PG_TIMEOUT = 5.0
GROUP = "of the group with global ranks [0, 1, 2]"
#: What the others are told (`commlib.failures`): a rank that did not join may have raised and stayed alive.
MAY_HAVE_RAISED = (
    "a rank did not join this collective (it may have raised an error and stayed alive: see that rank's output), "
    "or it is stuck or dead"
)
STOPPED_ANSWERING = (
    "lost its connection to another rank, which closed it: that rank stopped answering (it may have raised an error "
    "and gone on to another collective, which failed or timed out: see that rank's output), or it died or left the "
    "group"
)
BACKEND_TIMEOUT = r"backend_error='Timed out waiting 5000ms for (send|recv) operation to complete'$"


@pytest.fixture
def pool_5s(monkeypatch):
    """Three gloo workers with a 5 s process-group timeout; the pool waits up to 15 s for ranks still busy
    after another failed (instead of killing them after 2 s), so the survivors' own errors are seen."""
    monkeypatch.setattr(pool_module, "STRAGGLER_GRACE", 15.0)
    with WorkerPool(3, timeout=60.0, pg_timeout=PG_TIMEOUT) as pool:
        yield pool


def _gone(process_ids) -> bool:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and _running(pid) for pid in process_ids):
            return True
        time.sleep(0.1)
    return False


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run_failing(pool, job, *args, **kwargs) -> tuple[WorkerError, float]:
    before = pool.run(pool_jobs.process_id)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(job, *args, **kwargs)
    elapsed = time.monotonic() - start
    assert _gone(before), "workers of the broken group are still running"
    assert pool.run(pool_jobs.identify) == [(rank, 3) for rank in range(3)]  # fresh workers, working group
    return info.value, elapsed


def _rank_errors(error: WorkerError) -> dict[int, str]:
    """{rank: "raised Type: message" or "died with exit code N"} from the pool's report (no tracebacks)."""
    return {int(rank): text for rank, text in re.findall(r"\brank (\d+) ((?:raised|died with)[^\n]*)", str(error))}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize(
    ("op", "phase"), [("all_reduce", "forward"), ("all_gather", "backward"), ("all_to_all_4d", "forward")]
)
def test_rank_skipping_a_collective_makes_the_others_raise_comm_timeout(pool_5s, op, phase, check):
    error, elapsed = _run_failing(pool_5s, failure_jobs.skip_collective, 2, op, phase, check)
    assert elapsed < PG_TIMEOUT + 5.0
    assert error.ranks == (0, 1) and isinstance(error.cause, CommTimeout)
    name = op if phase == "forward" else f"{op} backward"
    for rank, text in _rank_errors(error).items():
        assert text.startswith(
            f"raised CommTimeout: {name}: timed out on group rank {rank} {GROUP} waiting for "
            f"the other ranks: {MAY_HAVE_RAISED}. Received: shape="
        ), text
        assert re.search(BACKEND_TIMEOUT, text), text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("op", "phase"), [("all_reduce", "forward"), ("all_to_all_4d", "forward"), ("all_gather", "backward")]
)
def test_rank_killed_mid_collective_makes_the_survivors_raise(pool_5s, op, phase):
    error, elapsed = _run_failing(pool_5s, failure_jobs.die_in_collective, 1, op, phase)
    assert elapsed < 0.5 + 10.0
    assert error.ranks == (0, 1, 2) and error.exit_codes == {1: -9}
    assert isinstance(error.cause, CommFailure)  # rank 0's error: lost peer, or a timeout waiting for rank 2
    reports = _rank_errors(error)
    assert reports[1] == "died with exit code -9"
    name = op if phase == "forward" else f"{op} backward"
    for rank in (0, 2):
        assert re.match(rf"raised Comm(Failure|Timeout): {name}: ", reports[rank]), reports[rank]
        assert f"group rank {rank} {GROUP}" in reports[rank]


@pytest.mark.timeout(90)
def test_parity_run_reports_the_rank_that_died(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(pool_module, "STRAGGLER_GRACE", 15.0)
    first, last = cases.case_table(2)[:2]
    doomed = cases.Case("kill-rank-1", first.op, 2, first.shape)
    table = [(case, cases.make_arrays(case, 0)) for case in (first, doomed, last)]
    results = Results("torch")
    with WorkerPool(2, timeout=60.0, pg_timeout=PG_TIMEOUT) as pool:
        run_table(pool, table, results, job=failure_jobs.kill_rank_in_case)
    results.save(tmp_path, {})
    rows = parity.compare(table, "torch", tmp_path)
    assert [row.passed for row in rows] == [True, False, True]  # the pool restarted for the third case
    detail = rows[1].detail
    assert detail.startswith("expected None, got ") and "WorkerError: rank 0 raised Comm" in detail, detail
    assert "rank 1 died with exit code -9" in detail and "Traceback" not in detail, detail

    from commlib.tools import cli

    monkeypatch.setattr(parity, "run", lambda *args, **kwargs: rows)
    assert cli.main(["parity", "--world-size", "2", "--frameworks", "torch"]) == 1
    assert "rank 1 died with exit code -9" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_rank_that_raised_and_lived_is_not_called_dead(pool_5s):
    """Rank 1 raises before the layer's all-to-all, stays alive and times out in its next collective (gloo then
    closes its pairs): the ranks waiting in the layer's all-to-all get `CommFailure` saying the peer closed the
    connection, its own collective having failed -- not that a rank died."""
    replies = pool_5s.run(failure_jobs.raise_and_go_on, 1)
    assert replies[1].startswith("CommTimeout: all_gather: timed out on group rank 1"), replies[1]
    for rank in (0, 2):
        assert replies[rank].startswith(
            f"CommFailure: all_to_all: group rank {rank} {GROUP} {STOPPED_ANSWERING}. Received: "
        ), replies[rank]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["return", "collective"])
def test_rank_that_raised_inside_a_layer_is_reported_as_maybe_raised(pool_5s, then):
    """Rank 1's attention function raises a ValueError inside `ulysses_attention` (after its first
    all-to-all); the rank stays alive, idle ("return") or in its next collective ("collective", which times
    out and closes its pairs). The others, waiting in the layer's output all-to-all, are told what is known:
    the peer did not join / stopped answering and may have raised (see its output) -- not that it died."""
    replies = pool_5s.run(failure_jobs.raise_inside_layer, 1, then)
    if then == "return":
        assert replies[1] == "ValueError: a user error inside the layer", replies[1]
    else:
        assert replies[1].startswith(
            f"CommTimeout: all_gather: timed out on group rank 1 {GROUP} waiting for the "
            f"other ranks: {MAY_HAVE_RAISED}. Received: "
        ), replies[1]
    for rank in (0, 2):
        if then == "return":  # the raiser's pairs stay open: the others time out
            want = f"CommTimeout: all_to_all_4d: timed out on group rank {rank} {GROUP} waiting for the other ranks: "
            assert replies[rank].startswith(want + f"{MAY_HAVE_RAISED}. Received: "), replies[rank]
        else:  # its next collective timed out and gloo closed its pairs -- or, where a survivor's own 5 s ran
            # out first (the two timeouts race), it timed out: either text says the peer may have raised
            closed = f"CommFailure: all_to_all_4d: group rank {rank} {GROUP} {STOPPED_ANSWERING}. Received: "
            waited = f"CommTimeout: all_to_all_4d: timed out on group rank {rank} {GROUP} waiting for the other ranks: "
            assert replies[rank].startswith((closed, waited + f"{MAY_HAVE_RAISED}. Received: ")), replies[rank]
