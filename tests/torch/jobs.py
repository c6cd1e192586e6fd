"""WorkerPool jobs for the torch tests of sub-groups, `DeviceCommunicator`, the worked examples and the
property tests. Module-level functions in an importable module: the pool pickles them by reference.

Sub-groups are created inside the jobs, on every rank in the same order (`dist.new_group` is collective over
the world), and cached per worker process by their member ranks.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import commlib_torch
from commlib.errors import CommError
from commlib.tools import cases
from commlib_torch import DeviceCommunicator, _c10d
from commlib_torch.tools.parity_jobs import _tensor, run_case
from commlib_torch.tools.pool import WorkerContext
from tests.torch.op_calls import every_op

_GROUPS: dict[tuple, dist.ProcessGroup] = {}

#: Communicator method of each public op whose name differs (the seed's and FastVideo's spellings).
METHODS = {"all_to_all_4d": "all_to_all_4D", "shard": "slice"}


def group_of(members, tag: str = "") -> dist.ProcessGroup | None:
    """The process group of `members` (global ranks; None = WORLD), created on first use on every rank;
    another `tag` gives another group over the same ranks."""
    if members is None:
        return dist.group.WORLD
    key = (tag, *sorted(members))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(sorted(members))
    return _GROUPS[key]


def _membership(ctx: WorkerContext, partition) -> tuple[int, int, dist.ProcessGroup] | None:
    """(index of this rank's group in `partition`, local rank, group), or None outside every group.
    Creates every group of `partition` on every rank, in order."""
    groups = [group_of(members) for members in partition]
    for index, (members, group) in enumerate(zip(partition, groups, strict=True)):
        if ctx.rank in members:
            local = sorted(members).index(ctx.rank)
            assert dist.get_rank(group) == local and dist.get_world_size(group) == len(members)
            return index, local, group
    return None


def run_case_in_groups(ctx: WorkerContext, partition, case: cases.Case, arrays_per_group):
    """`run_case` on the sub-group of this rank (group-local rank, that group's arrays, ``group=`` added to
    the op's keywords); ``("idle",)`` on ranks outside every group of `partition`."""
    found = _membership(ctx, partition)
    if found is None:
        return ("idle",)
    index, local, group = found
    return run_case(WorkerContext(local, case.world_size, group), case, arrays_per_group[index], group=group)


# --- DeviceCommunicator -------------------------------------------------------------------------------------


def _communicator(ctx: WorkerContext, members, **kwargs) -> tuple[DeviceCommunicator | None, int]:
    if members is not None and ctx.rank not in members:
        group_of(members)  # still collective: every rank creates it
        return None, -1
    group = group_of(members)
    return DeviceCommunicator(group, **kwargs), dist.get_rank(group)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64 if tensor.is_floating_point() else tensor.dtype).numpy()


def run_method(ctx: WorkerContext, members, case: cases.Case, arrays, positional: bool = False):
    """`run_case`'s reply for the `DeviceCommunicator` method of ``case.op`` on the group of `members`;
    ``("idle",)`` outside it. `positional`: pass the case's keywords positionally, in order (the seed's style)."""
    comm, rank = _communicator(ctx, members)
    if comm is None:
        return ("idle",)
    mine = cases.exact_arrays(case, arrays, rank)  # uneven sizes: this rank's rows
    x = _tensor(mine["x"], case).requires_grad_(case.differentiable)
    try:
        method = getattr(comm, METHODS.get(case.op, case.op))
        out = method(x, *case.params.values()) if positional else method(x, **case.params)
    except (CommError, TypeError) as error:
        return "error", f"{type(error).__name__}: {error}"
    if not case.differentiable:
        return "ok", *cases.padded_result(case, rank, _numpy(out), {})
    (out * _tensor(mine["cotangent"], case)).sum().backward()
    return "ok", *cases.padded_result(case, rank, _numpy(out), {"x": _numpy(x.grad)})


def communicator_attributes(ctx: WorkerContext, members, unique_name: str):
    comm, _ = _communicator(ctx, members, unique_name=unique_name)
    if comm is None:
        return None
    return dict(
        rank=comm.rank,
        world_size=comm.world_size,
        ranks=list(comm.ranks),
        global_rank=comm.global_rank,
        global_world_size=comm.global_world_size,
        rank_in_group=comm.rank_in_group,
        device=str(comm.device),
        device_group_is_cpu_group=comm.device_group is comm.cpu_group,
        unique_name=comm.unique_name,
        destroyed=comm.destroy(),
    )


def communicator_over_device_group(ctx: WorkerContext, members):
    """A communicator whose device_group is a second group over the same ranks: (is it the device_group
    that the all_reduce was handed, the all_reduce's value)."""
    cpu_group, device_group = group_of(members), group_of(members, tag="device")
    if ctx.rank not in members:
        return None
    comm = DeviceCommunicator(cpu_group, device_group=device_group)
    seen, direct = [], _c10d._direct  # every c10d call of a walk asks _direct which process group to call

    def recording(group, tensor):
        seen.append(group)
        return direct(group, tensor)

    _c10d._direct = recording
    try:
        out = comm.all_reduce(torch.tensor([float(ctx.rank)]))
    finally:
        _c10d._direct = direct
    return seen == [device_group] and comm.device_group is device_group, out.item()


def seed_gather(ctx: WorkerContext, members, arrays, dst: int, dim: int):
    """The seed's `gather`: the concatenation on dst, None elsewhere (and not differentiable)."""
    comm, rank = _communicator(ctx, members)
    if comm is None:
        return ("idle",)
    x = torch.from_numpy(arrays[rank]).requires_grad_()
    out = comm.gather(x, dst, dim)
    return None if out is None else (_numpy(out), out.requires_grad)


def seed_all_reduce(ctx: WorkerContext, members, op_name: str | None, torch_op: bool):
    """`all_reduce(input_, op)` called the seed's way: positional op, a torch.distributed.ReduceOp or None."""
    comm, rank = _communicator(ctx, members)
    if comm is None:
        return ("idle",)
    op = None if op_name is None else (getattr(dist.ReduceOp, op_name) if torch_op else op_name)
    x = torch.tensor([rank + 1.0, 2.0 - rank], dtype=torch.float64, requires_grad=True)
    out = comm.all_reduce(x, op)
    out.sum().backward()
    return _numpy(out), _numpy(x.grad)


def send_recv(ctx: WorkerContext, members, explicit: bool, reverse: bool, dtype: str):
    """Every rank sends a tensor naming itself along a ring and receives its neighbour's. Default ranks: next /
    previous (seed semantics); `explicit`: group-local ranks passed; `reverse`: the ring the other way."""
    comm, rank = _communicator(ctx, members)
    if comm is None:
        return ("idle",)
    world_size, step = comm.world_size, -1 if reverse else 1
    sent = (torch.arange(6, dtype=torch.float64).reshape(3, 2) + 100 * ctx.rank).to(getattr(torch, dtype)).t()
    dst, src = ((rank + step) % world_size, (rank - step) % world_size) if explicit else (None, None)
    actions = [lambda: comm.send(sent, dst), lambda: comm.recv(torch.Size([2, 3]), getattr(torch, dtype), src)]
    if rank != 0:  # rank 0 sends first, the others receive first: no cycle of blocked sends
        actions.reverse()
    results = [action() for action in actions]
    received = results[1] if rank == 0 else results[0]
    return _numpy(received), str(received.dtype)


def bad_rank_alone(ctx: WorkerContext, members, method: str, kwargs: dict):
    """Only the group's local rank 0 calls `method` with a bad rank: it must raise before communicating."""
    comm, rank = _communicator(ctx, members)
    if comm is None or rank != 0:
        return None
    x = torch.ones(2 * comm.world_size, 3)
    call = {
        "send": lambda: comm.send(x, **kwargs),
        "recv": lambda: comm.recv(x.shape, x.dtype, **kwargs),
    }.get(method, lambda: getattr(comm, method)(x, **kwargs))
    try:
        call()
    except CommError as error:
        return f"CommError: {error}"
    return "no error"


# --- worked examples ----------------------------------------------------------------------------------------


def scalar_all_reduce(ctx: WorkerContext, values, op: str, convention: str = "sum"):
    """Rank r holds the scalar values[r]; each rank's loss is the sum of its output. (output, grad)."""
    x = torch.tensor(float(values[ctx.rank]), dtype=torch.float64, requires_grad=True)
    out = commlib_torch.all_reduce(x, op, convention=convention)
    out.sum().backward()
    return out.item(), x.grad.item()


def conjugate_pair(ctx: WorkerContext):
    """``all_reduce(sum_grad(x), convention="replicated")``: Megatron's f then g; gradient = sum of cotangents."""
    x = torch.tensor([ctx.rank + 1.0], dtype=torch.float64, requires_grad=True)
    out = commlib_torch.all_reduce(commlib_torch.sum_grad(x), convention="replicated")
    out.sum().backward()
    return out.item(), x.grad.item()


def one_hot_256(rank: int, world_size: int) -> torch.Tensor:
    """[1, ..., 256 at index rank, ..., 1] in bfloat16: the bf16 sum over ranks depends on the order."""
    values = torch.ones(world_size, dtype=torch.bfloat16)
    values[rank] = 256
    return values


def bf16_sum(ctx: WorkerContext, accum_dtype: str | None, op: str = "all_reduce"):
    """all_reduce of `one_hot_256` with the same pattern as cotangent (so the backward sum is order-dependent
    too), or reduce_scatter along 0 of the pattern repeated W times; (output, gradient) as float32."""
    accum = None if accum_dtype is None else getattr(torch, accum_dtype)
    pattern = one_hot_256(ctx.rank, ctx.world_size)
    if op == "all_reduce":
        x = pattern.clone().requires_grad_()
        out = commlib_torch.all_reduce(x, accum_dtype=accum)
    else:
        x = pattern.repeat(ctx.world_size).requires_grad_()
        out = commlib_torch.reduce_scatter(x, 0, accum_dtype=accum)
    (out * pattern).sum().backward()
    return out.detach().float(), x.grad.float()


def integer_forward(ctx: WorkerContext, op: str, dtype: str):
    """Forward on an integer tensor; then the errors torch gives when one asks for its gradient."""
    x = torch.tensor([ctx.rank + 1, -ctx.rank, 2], dtype=getattr(torch, dtype))
    out = commlib_torch.all_reduce(x, op)
    errors = []
    for attempt in (lambda: x.requires_grad_(), lambda: out.sum().backward()):
        try:
            attempt()
            errors.append(None)
        except RuntimeError as error:
            errors.append(str(error))
    return out.tolist(), str(out.dtype), out.requires_grad, errors


def shard_example(ctx: WorkerContext, scale_grad: bool, via_communicator: bool):
    """The one-dim example: every rank holds arange(8), rank r's cotangent is (r+1)*[1, 10]. (output, gradient)."""
    x = torch.arange(8, dtype=torch.float64, requires_grad=True)
    if via_communicator:  # FastVideo's GroupCoordinator.shard -> communicator.slice(input_, dim, scale_grad=...)
        out = DeviceCommunicator(dist.group.WORLD).slice(x, -1, scale_grad=scale_grad)
    else:
        out = commlib_torch.shard(x, scale_grad=scale_grad)
    (out * (ctx.rank + 1) * torch.tensor([1.0, 10.0], dtype=torch.float64)).sum().backward()
    return out.tolist(), x.grad.tolist()


def reduce_example(ctx: WorkerContext, dst: int, op: str):
    """Rank r holds [r+1, 10(r+1)] and cotangent (r+1)*[1, 1]: (output, gradient)."""
    x = torch.tensor([ctx.rank + 1.0, 10.0 * (ctx.rank + 1)], dtype=torch.float64, requires_grad=True)
    out = commlib_torch.reduce(x, dst, op)
    (out * (ctx.rank + 1.0)).sum().backward()
    return out.tolist(), x.grad.tolist()


def all_to_all_single_example(ctx: WorkerContext, dim: int):
    """all_to_all(x, dim, dim) against torch's own all_to_all_single (on `dim` moved to the front), forward and
    backward (the same op on the cotangent): (commlib output, torch's, commlib gradient, torch's)."""
    W = ctx.world_size
    x = (torch.arange(2 * W * 3, dtype=torch.float64).reshape(3, 2 * W) + 100 * ctx.rank).movedim(1, dim)
    cotangent = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(ctx.rank))

    def single(tensor):
        front = tensor.movedim(dim, 0).contiguous()
        out = torch.empty_like(front)
        dist.all_to_all_single(out, front)
        return out.movedim(0, dim)

    leaf = x.clone().requires_grad_()
    out = commlib_torch.all_to_all(leaf, dim, dim)
    (out * cotangent).sum().backward()
    return _numpy(out), _numpy(single(x)), _numpy(leaf.grad), _numpy(single(cotangent))


def autograd_state(ctx: WorkerContext, mode: str):
    """{op: (has grad_fn, requires_grad)} for a leaf input under `mode`: "no_grad" (input requires grad,
    call under torch.no_grad()), "constant" (input does not require grad) or "grad" (the control)."""
    x = torch.ones(2 * ctx.world_size, 3, requires_grad=mode != "constant")
    result = {}
    for name, call in every_op(ctx.world_size, x).items():
        if mode == "no_grad":
            with torch.no_grad():
                out = call()
        else:
            out = call()
        result[name] = (out.grad_fn is not None, out.requires_grad)
    return result


def double_backward(ctx: WorkerContext, case: cases.Case, arrays):
    """Grad of grad: gx = VJP(cotangent) built with create_graph; then d(sum(gx * v))/d(cotangent), the
    transpose of the VJP applied to v. Returns that gradient (float64)."""
    x = _tensor(arrays["x"][ctx.rank], case).requires_grad_()
    cotangent = _tensor(arrays["cotangent"][ctx.rank], case).requires_grad_()
    out = getattr(commlib_torch, case.op)(x, **case.params)
    (gx,) = torch.autograd.grad((out * cotangent).sum(), x, create_graph=True)
    v = _tensor(arrays["v"][ctx.rank], case)
    (second,) = torch.autograd.grad((gx * v).sum(), cotangent)
    return _numpy(second)


def second_order(ctx: WorkerContext, op: str, xs, cotangents, vs, convention: str, cotangent_requires_grad: bool):
    """Hessian-vector style: gx = d(sum(out * cotangent) + sum(x**3) / 3)/dx with create_graph, then the
    gradients of sum(gx * v) with respect to x and (if it requires grad) the cotangent, as a gradient penalty
    takes them. The x**3 term keeps gx in the graph even where the collective's own part would drop out."""
    x = torch.tensor(xs[ctx.rank], dtype=torch.float64, requires_grad=True)
    cotangent = torch.tensor(cotangents[ctx.rank], dtype=torch.float64, requires_grad=cotangent_requires_grad)
    out = commlib_torch.all_reduce(x, op, convention=convention)
    (gx,) = torch.autograd.grad((out * cotangent).sum() + (x**3).sum() / 3, x, create_graph=True)
    (gx * torch.tensor(vs[ctx.rank], dtype=torch.float64)).sum().backward()
    zero = torch.zeros_like(x)
    return _numpy(gx), _numpy(x.grad), _numpy(zero if cotangent.grad is None else cotangent.grad)
