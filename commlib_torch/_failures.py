"""Failed collectives at commlib's boundary (torch): a backend error that means a timeout or a lost rank
becomes `commlib.CommTimeout` / `commlib.CommFailure` naming the op and the group (`commlib.failures` reads
the backend's text); other errors pass unchanged."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlib import failures
from commlib.errors import CommFailure
from commlib_torch._dtypes import dtype_name

__all__ = ["translate"]


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def translate(error: RuntimeError, op_name: str, tensor: torch.Tensor, group, phase: str) -> RuntimeError:
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
