"""Persistent torch.distributed worker processes for tests, CLIs and `commlib_torch.testing.run` (its ranks).

`WorkerPool(W)` starts W processes that each join one process group, then serve jobs: `pool.run(fn, *args)` calls
`fn(WorkerContext, *args)` on every rank and returns the results in rank order. Workers come from a forkserver
(preloaded with torch), so a parent that already imported torch or jax or started threads is safe, and a fresh
set of gloo workers starts in a fraction of a second once the server runs. `fn` is pickled by reference: define it
at module level in an importable module. As with "spawn", a script's `__main__` is re-imported in every worker:
guard it.

Every failure raises `WorkerError`; only `close()` makes the pool unusable. The pool keeps its workers when every
rank answered (some with an exception) and a barrier still passes. Otherwise it kills all workers and starts
fresh ones on the next `run`: when a rank died, did not answer within the timeout, was still busy
`STRAGGLER_GRACE` seconds after another rank failed (typically blocked in a collective the failed rank never
entered), or failed the barrier (a gloo collective that timed out breaks the process group for good), and when
`run` itself is interrupted (KeyboardInterrupt, a test timeout). Not thread-safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["STRAGGLER_GRACE", "WorkerContext", "WorkerError", "WorkerPool"]

STRAGGLER_GRACE = 2.0  # seconds ranks may still answer after another rank failed; also the barrier's limit
_HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """What a job function learns about the worker it runs on."""

    rank: int  # this worker's rank in the process group
    world_size: int  # number of ranks in the process group
    group: dist.ProcessGroup | None = None  # the default (WORLD) process group


class WorkerError(RuntimeError):
    """One or more ranks raised, died or hung.

    `ranks` lists the ranks that raised or died (ascending), then those that hung; `rank` is the first of them.
    `cause` is that rank's original exception if it raised one that pickles back (else None); `exit_codes` maps
    each dead rank to its exit code (negative: killed by that signal).
    """

    def __init__(self, message: str, ranks: list[int], cause: BaseException | None, exit_codes: dict[int, int | None]):
        super().__init__(message)
        self.ranks, self.rank, self.cause, self.exit_codes = tuple(ranks), ranks[0], cause, exit_codes


class WorkerPool:
    """`world_size` persistent worker processes sharing one `torch.distributed` process group.

    Args:
        world_size: number of worker processes (ranks).
        backend: process-group backend, "gloo" (CPU) or "nccl" (rank r uses cuda:r).
        timeout: default seconds `run` (and start-up) waits for every rank to answer.
        pg_timeout: seconds a collective may block inside the process group (None: the torch default).
    """

    def __init__(
        self, world_size: int, *, backend: str = "gloo", timeout: float = 120.0, pg_timeout: float | None = None
    ):
        if world_size < 1:
            raise ValueError(f"WorkerPool needs world_size >= 1. Received: world_size={world_size}")
        self.world_size, self.backend, self.timeout, self.pg_timeout = world_size, backend, timeout, pg_timeout
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["torch", "torch.distributed", __name__])  # ignored if already running
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._connections: list[multiprocessing.connection.Connection] = []
        self._lifeline: multiprocessing.connection.Connection | None = None
        self._store: dist.TCPStore | None = None  # rendezvous server; lives as long as the workers
        self._closed = False
        self._start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run `fn(ctx, *args, **kwargs)` on every rank; return the results in rank order.

        Waits at most `timeout` seconds (default: the pool's) plus about a second to kill workers. Raises
        `WorkerError` if any rank raises, dies or hangs; see the module docstring for what happens next.
        """
        if self._closed:
            raise RuntimeError(f"WorkerPool(world_size={self.world_size}) is closed; create a new one.")
        payload = pickle.dumps((fn, args, kwargs))  # fails here, before any rank starts, if unpicklable
        if not self._processes:
            self._start()
        try:
            self._send(payload)
            results, errors, exit_codes = self._collect(self.timeout if timeout is None else timeout)
            if errors and self._processes:  # every rank answered: keep them only if the group still works
                self._send(_BARRIER)
                if self._collect(STRAGGLER_GRACE)[1]:
                    self._stop(grace=0.0)
        except BaseException:  # e.g. KeyboardInterrupt or a test timeout: replies may still be on their way
            self._stop(grace=0.0)
            raise
        if errors:
            raise self._error(errors, exit_codes)
        return results

    def close(self) -> None:
        """Ask every worker to leave the process group and exit; kill those that take over 5 seconds."""
        if not self._closed:
            self._closed = True
            self._send(b"")  # empty message: shut down
            self._stop(grace=5.0)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)  # port 0: the OS picks one
        lifeline_reader, self._lifeline = self._context.Pipe(duplex=False)
        for rank in range(self.world_size):
            parent_end, child_end = self._context.Pipe()
            settings = (rank, self.world_size, self.backend, store.port, self.timeout, self.pg_timeout)
            process = self._context.Process(
                target=_worker_main,
                args=(settings, child_end, lifeline_reader),
                name=f"commlib-worker-{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()  # so the parent sees EOF when the worker dies
            self._processes.append(process)
            self._connections.append(parent_end)
        lifeline_reader.close()
        self._store = store
        try:
            _, errors, exit_codes = self._collect(self.timeout)
            if errors:
                raise self._error(errors, exit_codes)
        except BaseException:
            self._stop(grace=0.0)
            raise

    def _send(self, payload: bytes) -> None:
        for connection in self._connections:
            with contextlib.suppress(OSError):  # the worker is gone; _collect reports it
                connection.send_bytes(payload)

    def _collect(self, timeout: float) -> tuple[list, dict[int, tuple[str, Any]], dict[int, int | None]]:
        """Gather one reply per rank within `timeout` seconds; kill all workers if any died or hung.

        Returns results in rank order, {rank: (description, exception or None)} for failed ranks (raised or
        died, then hung), and {rank: exit code} for dead ones.
        """
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, Any]] = {}
        exit_codes: dict[int, int | None] = {}
        first_error = math.inf  # time.monotonic() of the first failure
        while pending:
            limit = min(deadline, first_error + STRAGGLER_GRACE)
            waitables: dict[Any, int] = {self._connections[r]: r for r in pending}  # connections and sentinels
            waitables.update({self._processes[r].sentinel: r for r in pending})
            ready = multiprocessing.connection.wait(list(waitables), max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for rank in sorted({waitables[item] for item in ready}):
                pending.discard(rank)
                try:
                    reply = pickle.loads(self._connections[rank].recv_bytes())
                except (EOFError, OSError):
                    self._processes[rank].join(1.0)
                    exit_codes[rank] = self._processes[rank].exitcode
                    reply = ("error", f"rank {rank} died with exit code {exit_codes[rank]}", None)
                if reply[0] == "ok":
                    results[rank] = reply[1]
                else:
                    errors[rank] = (reply[1], _unpickle_or_none(reply[2]))
                    first_error = min(first_error, time.monotonic())
        errors = {rank: errors[rank] for rank in sorted(errors)}
        grace_ended = first_error + STRAGGLER_GRACE < deadline  # the wait ended before the timeout
        waited = f"{STRAGGLER_GRACE} s after another rank failed" if grace_ended else f"{timeout} s"
        for rank in sorted(pending):
            errors[rank] = (f"rank {rank} did not answer within {waited}; killed", None)
        if exit_codes or pending:
            self._stop(grace=0.0)
        return [results.get(rank) for rank in range(self.world_size)], errors, exit_codes

    def _error(self, errors: dict[int, tuple[str, Any]], exit_codes: dict[int, int | None]) -> WorkerError:
        ranks = list(errors)
        message = f"WorkerPool(world_size={self.world_size}): {len(ranks)} rank(s) failed"
        message += ": " if self._processes else " (all workers killed; fresh ones start on the next run): "
        message += "\n".join(description for description, _ in errors.values())
        return WorkerError(message, ranks, errors[ranks[0]][1], exit_codes)

    def _stop(self, grace: float) -> None:
        """Let workers exit for `grace` seconds, then kill the rest; the next `run` starts fresh ones."""
        deadline = time.monotonic() + grace
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for connection in [*self._connections, self._lifeline]:
            if connection is not None:
                connection.close()
        self._processes, self._connections, self._lifeline, self._store = [], [], None, None


def _unpickle_or_none(pickled: bytes | None) -> Any:
    try:
        return None if pickled is None else pickle.loads(pickled)
    except Exception:  # e.g. an exception whose __init__ takes other arguments than its args
        return None


def _error_reply(rank: int, error: BaseException) -> bytes:
    try:
        pickled = pickle.dumps(error)
    except Exception:
        pickled = None
    formatted = "".join(traceback.format_exception(error))
    return pickle.dumps(("error", f"rank {rank} raised {type(error).__qualname__}: {error}\n{formatted}", pickled))


def _barrier(context: WorkerContext) -> None:
    dist.barrier(group=context.group)


_BARRIER = pickle.dumps((_barrier, (), {}))


def _exit_with_parent(lifeline: multiprocessing.connection.Connection) -> None:
    lifeline.poll(None)  # the parent never writes: this returns at EOF, when the parent has gone
    os._exit(1)


def _worker_main(
    settings: tuple, connection: multiprocessing.connection.Connection, lifeline: multiprocessing.connection.Connection
) -> None:
    """Worker process: join the process group, then serve jobs until an empty message or EOF."""
    rank, world_size, backend, port, timeout, pg_timeout = settings
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which closes the pool
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        timeout = None if pg_timeout is None else datetime.timedelta(seconds=pg_timeout)  # None: c10d's default
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException as error:
        connection.send_bytes(_error_reply(rank, error))
        return
    connection.send_bytes(pickle.dumps(("ok", None)))
    context = WorkerContext(rank, world_size, dist.group.WORLD)
    while True:
        try:
            payload = connection.recv_bytes()
        except EOFError:  # the parent is gone
            break
        if not payload:  # the parent closed the pool
            break
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = pickle.dumps(("ok", fn(context, *args, **kwargs)))
        except BaseException as error:
            reply = _error_reply(rank, error)
        connection.send_bytes(reply)
    dist.destroy_process_group()
