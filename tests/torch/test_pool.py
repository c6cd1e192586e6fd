"""WorkerPool: results in rank order, real gloo collectives, and every failure path ending in WorkerError."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import commlib_torch._pool as pool_module
from commlib_torch.tools.pool import STRAGGLER_GRACE, WorkerError, WorkerPool
from tests.torch import pool_jobs

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_pool():
    """A pool of its own for tests that break workers (the session's shared pools come from conftest `pool`)."""
    with WorkerPool(2, timeout=60.0) as fresh:
        yield fresh


def process_ids(worker_pool):
    return worker_pool.run(pool_jobs.process_id)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(pool, world_size):
    shared = pool(world_size)
    assert shared.run(pool_jobs.identify) == [(rank, world_size) for rank in range(world_size)]
    assert shared.run(pool_jobs.identify, offset=10) == [(rank + 10, world_size) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gloo_all_reduce_sums_over_ranks(pool, world_size):
    expected = torch.full((3,), world_size * (world_size + 1) / 2)
    results = pool(world_size).run(pool_jobs.all_reduce_rank)
    assert len(results) == world_size
    for result in results:
        torch.testing.assert_close(result, expected)


def test_exception_names_the_rank_and_keeps_the_workers():
    with WorkerPool(4, timeout=60.0) as pool:
        before = process_ids(pool)
        with pytest.raises(WorkerError) as info:
            pool.run(pool_jobs.raise_on, 2)
        error = info.value
        assert (error.rank, error.ranks) == (2, (2,))
        assert isinstance(error.cause, pool_jobs.JobError) and str(error.cause) == "boom on rank 2"
        assert "rank 2 raised JobError: boom on rank 2" in str(error)
        assert "Traceback" in str(error) and "raise_on" in str(error)
        assert process_ids(pool) == before  # same workers, still in a working process group
        assert pool.run(pool_jobs.all_reduce_rank)[0].tolist() == [10.0] * 3


def test_exception_that_cannot_be_unpickled_still_reports_its_text(fresh_pool):
    with pytest.raises(WorkerError, match="rank 0 raised UnpicklableError: left and right") as info:
        fresh_pool.run(pool_jobs.raise_unpicklable_on, 0)
    assert info.value.cause is None
    assert fresh_pool.run(pool_jobs.identify) == [(0, 2), (1, 2)]


def test_unpicklable_result_is_reported(fresh_pool):
    with pytest.raises(WorkerError, match="rank 0 raised") as info:
        fresh_pool.run(pool_jobs.return_unpicklable)
    assert info.value.ranks == (0, 1)
    assert fresh_pool.run(pool_jobs.identify) == [(0, 2), (1, 2)]


def test_unpicklable_function_fails_before_any_rank_runs(fresh_pool):
    with pytest.raises(Exception, match="pickle"):
        fresh_pool.run(lambda ctx: ctx.rank)
    assert fresh_pool.run(pool_jobs.identify) == [(0, 2), (1, 2)]


def test_rank_skipping_a_collective_restarts_the_workers(fresh_pool):
    before = process_ids(fresh_pool)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="all workers killed") as info:
        fresh_pool.run(pool_jobs.raise_before_all_reduce, 1)
    assert time.monotonic() - start < STRAGGLER_GRACE + 5.0
    error = info.value
    assert error.ranks == (1, 0)  # rank 1 raised; rank 0 was left waiting in all_reduce
    assert isinstance(error.cause, pool_jobs.JobError)
    assert "rank 0 did not answer" in str(error)
    assert set(process_ids(fresh_pool)).isdisjoint(before)
    assert fresh_pool.run(pool_jobs.all_reduce_rank)[1].tolist() == [3.0] * 3


def test_process_group_broken_by_a_collective_timeout_restarts_the_workers(monkeypatch):
    monkeypatch.setattr(pool_module, "STRAGGLER_GRACE", 30.0)  # let gloo's own timeout fire first
    with WorkerPool(2, timeout=60.0, pg_timeout=1.0) as pool:
        before = process_ids(pool)
        with pytest.raises(WorkerError, match="all workers killed") as info:
            pool.run(pool_jobs.raise_before_all_reduce, 1)
        assert info.value.ranks == (0, 1)  # rank 0's all_reduce timed out and raised: every rank answered
        assert set(process_ids(pool)).isdisjoint(before)
        assert pool.run(pool_jobs.all_reduce_rank)[0].tolist() == [3.0] * 3


@pytest.mark.parametrize(
    ("job", "args", "exit_code"),
    [(pool_jobs.exit_on, (1, 3), 3), (pool_jobs.kill_on, (1,), -signal.SIGKILL)],
    ids=["os._exit(3)", "SIGKILL"],
)
def test_dead_worker_is_reported_with_its_exit_code(fresh_pool, job, args, exit_code):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=f"rank 1 died with exit code {exit_code}") as info:
        fresh_pool.run(job, *args)
    assert time.monotonic() - start < 10.0
    assert (info.value.rank, info.value.exit_codes) == (1, {1: exit_code})
    assert fresh_pool.run(pool_jobs.identify) == [(0, 2), (1, 2)]


def test_hung_worker_is_killed_after_the_timeout(fresh_pool):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 0 did not answer within 2\.0 s") as info:
        fresh_pool.run(pool_jobs.sleep_on, 0, 120.0, timeout=2.0)
    assert time.monotonic() - start < 2.0 + 5.0
    assert info.value.ranks == (0,)
    assert fresh_pool.run(pool_jobs.identify) == [(0, 2), (1, 2)]


def test_closed_pool_refuses_jobs():
    pool = WorkerPool(1)
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(pool_jobs.identify)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see whether a process is alive")
def test_workers_exit_when_the_parent_dies(tmp_path):
    script = textwrap.dedent("""
        import os, threading
        from commlib_torch.tools.pool import WorkerPool
        from tests.torch import pool_jobs
        pool = WorkerPool(2)
        print("workers:", *pool.run(pool_jobs.process_id), flush=True)
        threading.Timer(0.5, os._exit, (0,)).start()  # no close(), no atexit: the workers must notice
        pool.run(pool_jobs.sleep_on, 0, 60.0)  # rank 0 busy in a job, rank 1 idle
    """)
    output = tmp_path / "output.txt"  # a file, not a pipe: workers inherit it, and a pipe would wait for them
    with output.open("w") as stream:
        parent = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=stream, stderr=stream, timeout=120)
    assert parent.returncode == 0, output.read_text()
    (line,) = [line for line in output.read_text().splitlines() if line.startswith("workers:")]
    worker_ids = [int(word) for word in line.split()[1:]]
    deadline = time.monotonic() + 10.0
    while any(map(is_running, worker_ids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(is_running, worker_ids))


def is_running(process_id):
    try:
        status = pathlib.Path(f"/proc/{process_id}/stat").read_text()
    except OSError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"  # an exited process that nobody reaped is a zombie


def test_interrupted_run_leaves_no_stale_replies(fresh_pool):
    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)  # not SIGALRM: pytest-timeout uses that one
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            fresh_pool.run(pool_jobs.sleep_on, 0, 2.0)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert fresh_pool.run(pool_jobs.identify) == [(0, 2), (1, 2)]  # not a late answer to the interrupted job
