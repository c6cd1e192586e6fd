"""A FastVideo-style subclass of `DeviceCommunicator` on real gloo ranks (world and a sub-group): the methods
it overrides run its own path wherever it calls them, and the methods it inherits (Ulysses all-to-alls, slice,
reduce, ...) keep commlib's values and exact gradients without routing through the overrides (which, as in
FastVideo, are not differentiable)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from commlib.errors import CommError
from commlib.tools import cases, parity
from commlib_torch import DeviceCommunicator
from commlib_torch.tools.parity_jobs import _tensor, merge
from commlib_torch.tools.pool import WorkerContext
from tests.torch.jobs import METHODS, group_of

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# `CpuStyleCommunicator` follows FastVideo's CpuCommunicator: all_reduce in place through a `dist_module`,
# its own forward-only `gather` and concat-style `all_gather`. `CudaStyleCommunicator` follows its
# CudaCommunicator: all_reduce on a copy (the no-pynccl fallback), `send` / `recv` through its own path,
# `destroy` releasing what it built. Each override records its call in `calls`, so the tests can tell which
# path ran.


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


# --- the tests ----------------------------------------------------------------------------------------------


GROUPS = {"world": None, "123": (1, 2, 3)}
STYLES = list(SUBCLASSES)


def _members(members):
    return list(range(4)) if members is None else sorted(members)


def _inherited_cases(style: str, world_size: int) -> list[cases.Case]:
    """A few of the parity table's valid cases per method the subclass inherits (`cases.per_op`: every keyword
    each forwards; the table's arithmetic is tests/torch/test_ops.py's), the seed's gather aside."""
    overridden = SUBCLASSES[style].OVERRIDDEN
    table = cases.per_op(cases.case_table(world_size))
    return [
        case
        for case in table
        if case.op not in (cases.ATTENTION, "gather", *overridden) and cases.error_text(case) is None
    ]


@pytest.mark.parametrize("members", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("style", STYLES)
def test_inherited_methods_keep_commlib_values_and_gradients(pool, style, members):
    inside = _members(members)
    table = [(case, cases.make_arrays(case, 0)) for case in _inherited_cases(style, len(inside))]
    assert {case.op for case, _ in table} >= {"shard", "reduce", "all_to_all_4d", "all_to_all", "reduce_scatter"}
    replies = pool(4).run(inherited_methods, style, members, table)
    assert all(replies[rank] is None for rank in range(4) if rank not in inside)
    members_replies = [replies[rank] for rank in inside]
    assert [calls for _, calls in members_replies] == [[]] * len(inside)  # no override ran
    failed = []
    for index, (case, arrays) in enumerate(table):
        row = parity.check(case, arrays, *merge(case, [per_case[index] for per_case, _ in members_replies]))
        failed += [] if row.passed else [f"{case.name}: out {row.out_error} grad {row.grad_error} {row.detail}"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("members", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("style", STYLES)
def test_overrides_run_their_own_path(pool, style, members):
    inside = _members(members)
    W = len(inside)
    replies = [pool(4).run(overridden_methods, style, members)[rank] for rank in inside]
    xs = [np.arange(6.0).reshape(2, 3) + 10 * rank for rank in range(W)]
    for rank, (results, calls) in enumerate(replies):
        np.testing.assert_array_equal(results["all_reduce"], sum(xs))
        if style == "cpu":
            np.testing.assert_array_equal(results["all_gather"], np.concatenate(xs, axis=1))
            want = np.concatenate(xs, axis=0) if rank == W - 1 else None
            assert (results["gather"] is None) == (want is None)
            if want is not None:
                np.testing.assert_array_equal(results["gather"], want)
            assert calls == [
                "all_reduce",
                "dist_module.all_reduce",
                "all_gather",
                "dist_module.all_gather_into_tensor",
                "gather",
                "dist_module.gather",
            ]
        else:
            np.testing.assert_array_equal(results["recv"], xs[(rank - 1) % W])
            assert results["released"]
            assert calls == ["all_reduce", *(["send", "recv"] if rank == 0 else ["recv", "send"]), "destroy"]
