"""Failed collectives at commlib's boundary (torch): a backend error that means a timeout or a lost rank
becomes `commlib.CommTimeout` / `commlib.CommFailure` naming the op and the group (`commlib.failures` reads
the backend's text); other errors pass unchanged."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlib import failures
from commlib.errors import CommFailure
from commlib_torch._dtypes import dtype_name

__all__ = ["all_reduce", "translate"]


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def translate(
    error: RuntimeError, op_name: str, tensor: torch.Tensor, group: dist.ProcessGroup | None, phase: str
) -> RuntimeError:
    """The `CommTimeout` / `CommFailure` for a backend error raised by a collective of `op_name`, or `error`."""
    if isinstance(error, CommFailure):
        return error
    received: dict[str, object] = {"shape": tuple(tensor.shape), "dtype": dtype_name(tensor.dtype)}
    try:
        rank, ranks = dist.get_rank(group), _group_ranks(group)
    except Exception:  # the group itself is gone: report what is known
        rank, ranks = -1, []
    translated = failures.failure(op_name, str(error), rank=rank, group_ranks=ranks, phase=phase, received=received)
    return error if translated is None else translated


def all_reduce(flag: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None, op_name: str) -> None:
    """``dist.all_reduce(flag, op, group)`` in place (a small flag of an integration's decision or checked mode's
    refusal), a backend error that means a timeout or a lost rank raised as `op_name`'s CommTimeout /
    CommFailure (`translate`), not as gloo's or NCCL's raw RuntimeError."""
    try:
        dist.all_reduce(flag, op=op, group=group)
    except RuntimeError as error:
        translated = translate(error, op_name, flag, group, "forward")
        if translated is error:
            raise
        raise translated from error
