"""Pool jobs for test_fastvideo.py: subclasses of `DeviceCommunicator` written the way today's FastVideo writes
its device communicators (each overrides a few methods with its own path and inherits the rest), and the jobs
that drive them. Module level, so the pool pickles them by reference.

`CpuStyleCommunicator` follows FastVideo's CpuCommunicator: all_reduce in place through a `dist_module`,
its own forward-only `gather` and concat-style `all_gather`. `CudaStyleCommunicator` follows its
CudaCommunicator: all_reduce on a copy (the no-pynccl fallback), `send` / `recv` through its own path,
`destroy` releasing what it built. Each override records its call in `calls`, so the tests can tell which
path ran.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from commlib.errors import CommError
from commlib.tools import cases
from commlib_torch import DeviceCommunicator
from commlib_torch.tools.parity_jobs import _tensor
from commlib_torch.tools.pool import WorkerContext
from tests.torch.jobs import METHODS, group_of


class _RecordingDist:
    """Stands in for FastVideo's `dist_module` (torch.distributed or its shared-memory path): records each call."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def all_reduce(self, tensor, group=None, op=dist.ReduceOp.SUM):
        self.calls.append("dist_module.all_reduce")
        dist.all_reduce(tensor, op=op, group=group)

    def all_gather_into_tensor(self, output, tensor, group=None):
        self.calls.append("dist_module.all_gather_into_tensor")
        dist.all_gather_into_tensor(output, tensor, group=group)

    def gather(self, tensor, gather_list, dst, group=None):
        self.calls.append("dist_module.gather")
        dist.gather(tensor, gather_list, dst=dst, group=group)


class CpuStyleCommunicator(DeviceCommunicator):
    """all_reduce, gather and all_gather overridden as FastVideo's CpuCommunicator does (not differentiable)."""

    OVERRIDDEN = ("all_reduce", "gather", "all_gather")

    def __init__(self, cpu_group, device=None, device_group=None, unique_name=""):
        super().__init__(cpu_group, device, device_group, unique_name)
        self.calls: list[str] = []
        self.dist_module = _RecordingDist(self.calls)

    def all_reduce(self, input_, op=dist.ReduceOp.SUM):
        self.calls.append("all_reduce")
        self.dist_module.all_reduce(input_, group=self.device_group, op=op)
        return input_

    def gather(self, input_, dst=0, dim=-1):
        self.calls.append("gather")
        dim %= input_.dim()
        gather_list = [torch.empty_like(input_) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        self.dist_module.gather(input_, gather_list, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(gather_list, dim=dim) if self.rank_in_group == dst else None

    def all_gather(self, input_, dim=-1):
        self.calls.append("all_gather")
        dim %= input_.dim()
        output = torch.empty((input_.shape[0] * self.world_size, *input_.shape[1:]), dtype=input_.dtype)
        self.dist_module.all_gather_into_tensor(output, input_.contiguous(), group=self.device_group)
        output = output.reshape(self.world_size, *input_.shape).movedim(0, dim)
        return output.reshape(*input_.shape[:dim], self.world_size * input_.shape[dim], *input_.shape[dim + 1 :])


class CudaStyleCommunicator(DeviceCommunicator):
    """all_reduce, send, recv and destroy overridden as FastVideo's CudaCommunicator does without pynccl."""

    OVERRIDDEN = ("all_reduce", "send", "recv", "destroy")

    def __init__(self, cpu_group, device=None, device_group=None, unique_name=""):
        super().__init__(cpu_group, device, device_group, unique_name)
        self.calls: list[str] = []
        self.pynccl_comm = object() if self.world_size > 1 else None  # what its constructor builds

    def all_reduce(self, input_, op=None):
        self.calls.append("all_reduce")
        out = input_.clone()
        dist.all_reduce(out, group=self.device_group, op=dist.ReduceOp.SUM if op is None else op)
        return out

    def send(self, tensor, dst=None):
        self.calls.append("send")
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        dist.send(tensor, self.ranks[dst], self.device_group)

    def recv(self, size, dtype, src=None):
        self.calls.append("recv")
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        dist.recv(tensor, self.ranks[src], self.device_group)
        return tensor

    def destroy(self):
        self.calls.append("destroy")
        self.pynccl_comm = None


SUBCLASSES = {"cpu": CpuStyleCommunicator, "cuda": CudaStyleCommunicator}


def _communicator(ctx: WorkerContext, style: str, members):
    group = group_of(members)  # collective: every rank creates it
    if members is not None and ctx.rank not in members:
        return None
    return SUBCLASSES[style](group, unique_name="sp")


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64).numpy()


def inherited_methods(ctx: WorkerContext, style: str, members, table):
    """Each (case, arrays) of `table` through the inherited method of ``case.op`` (FastVideo's spelling),
    forward and backward: a `run_case`-style reply per case, plus the overrides called meanwhile (none
    expected). ``None`` outside the group."""
    comm = _communicator(ctx, style, members)
    if comm is None:
        return None
    rank, replies = comm.rank_in_group, []
    for case, arrays in table:
        mine = cases.exact_arrays(case, arrays, rank)  # uneven sizes: this rank's rows
        x = _tensor(mine["x"], case).requires_grad_()
        try:
            out = getattr(comm, METHODS.get(case.op, case.op))(x, **case.params)
        except (CommError, TypeError) as error:
            replies.append(("error", f"{type(error).__name__}: {error}"))
            continue
        (out * _tensor(mine["cotangent"], case)).sum().backward()
        replies.append(("ok", *cases.padded_result(case, rank, _numpy(out), {"x": _numpy(x.grad)})))
    return replies, list(comm.calls)


def overridden_methods(ctx: WorkerContext, style: str, members):
    """Calls the overridden methods as FastVideo's GroupCoordinator does; their results and the recorded
    calls. ``None`` outside the group."""
    comm = _communicator(ctx, style, members)
    if comm is None:
        return None
    rank, world_size = comm.rank_in_group, comm.world_size
    x = torch.arange(6.0, dtype=torch.float64).reshape(2, 3) + 10 * rank
    results = {"all_reduce": _numpy(comm.all_reduce(x.clone()))}
    if style == "cpu":
        results["all_gather"] = _numpy(comm.all_gather(x, 1))
        gathered = comm.gather(x, world_size - 1, 0)
        results["gather"] = None if gathered is None else _numpy(gathered)
    else:
        if rank == 0:  # a ring: rank 0 sends first, the others receive first
            comm.send(x)
            received = comm.recv(x.shape, x.dtype)
        else:
            received = comm.recv(x.shape, x.dtype)
            comm.send(x)
        results["recv"] = _numpy(received)
        comm.destroy()
        results["released"] = comm.pynccl_comm is None
    return results, list(comm.calls)
