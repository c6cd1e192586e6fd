"""One call of every public op (and of each all_reduce reduction and convention) on an ``x`` of shape [2W, 3]:
the one catalogue the pool jobs use that ask every op the same question (`jobs.autograd_state`,
`failure_jobs.autograd_state`)."""

from collections.abc import Callable

import torch

import commlib_torch


def every_op(W: int, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """{name: a call of no arguments} for `x` of shape [2W, 3] on a group of W ranks."""
    ops = {
        f"all_reduce_{op}": (lambda op=op: commlib_torch.all_reduce(x, op))
        for op in ("sum", "avg", "max", "min", "product")
    }
    return ops | {
        "all_reduce_replicated": lambda: commlib_torch.all_reduce(x, convention="replicated"),
        "all_gather": lambda: commlib_torch.all_gather(x, 0),
        "reduce_scatter": lambda: commlib_torch.reduce_scatter(x, 0),
        "reduce_scatter_avg": lambda: commlib_torch.reduce_scatter(x, 0, "avg"),
        "all_to_all": lambda: commlib_torch.all_to_all(x, 0, 1),
        "all_to_all_4d": lambda: commlib_torch.all_to_all_4d(x.reshape(1, 2 * W, 3, 1), 1, 2),
        "broadcast": lambda: commlib_torch.broadcast(x, W - 1),
        "gather": lambda: commlib_torch.gather(x, W - 1, 0),
        "scatter": lambda: commlib_torch.scatter(x, W - 1, 0),
        "permute": lambda: commlib_torch.permute(x, [(r, (r + 1) % W) for r in range(W)]),
        "sum_grad": lambda: commlib_torch.sum_grad(x),
        "all_to_all_single": lambda: commlib_torch.all_to_all(x, 0, 0),
        "shard": lambda: commlib_torch.shard(x, 0, scale_grad=True),
        "reduce": lambda: commlib_torch.reduce(x, W - 1, "avg"),
    }
