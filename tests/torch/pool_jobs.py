"""Job functions for tests/torch/test_pool.py; module-level so worker processes can import them by name."""

import os
import signal
import time

import torch
import torch.distributed as dist


class JobError(ValueError):
    """A picklable exception raised on purpose by a job."""


class UnpicklableError(Exception):
    """Pickles, but cannot be rebuilt: its __init__ needs two arguments."""

    def __init__(self, first, second):
        super().__init__(f"{first} and {second}")


def identify(ctx, offset=0):
    return (ctx.rank + offset, ctx.world_size)


def all_reduce_rank(ctx):
    tensor = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(tensor, group=ctx.group)
    return tensor


def raise_on(ctx, rank):
    if ctx.rank == rank:
        raise JobError(f"boom on rank {rank}")
    return ctx.rank


def raise_unpicklable_on(ctx, rank):
    if ctx.rank == rank:
        raise UnpicklableError("left", "right")
    return ctx.rank


def raise_before_all_reduce(ctx, rank):
    if ctx.rank == rank:
        raise JobError(f"rank {rank} skips the collective")
    return all_reduce_rank(ctx)


def exit_on(ctx, rank, code):
    if ctx.rank == rank:
        os._exit(code)
    return ctx.rank


def kill_on(ctx, rank):
    if ctx.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return ctx.rank


def sleep_on(ctx, rank, seconds):
    if ctx.rank == rank:
        time.sleep(seconds)
    return ctx.rank


def process_id(ctx):
    return os.getpid()


def return_unpicklable(ctx):
    return lambda: ctx.rank
