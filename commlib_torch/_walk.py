"""Walk a `commlib.Plan` on torch tensors: one pack pass, the dim-0 c10d collective, one unpack pass.

A pass whose permutation keeps memory order is a view (no copy); a pass that must copy writes straight
into the buffer the collective needs, casting to the accumulation dtype in the same pass. Rooted ops
(broadcast, reduce, gather, scatter) and permute give zeros on the ranks that receive nothing. The local
steps of gradient plans (identity, slice, pad) move no data between ranks.

Uneven sizes are held exactly (`commlib.uneven`): the plan's pack and unpack are `Blocks` and every collective
is one ``all_to_all_single`` with the split sizes they give -- no padding on the wire, one pass each side at
most. An all_gather's pack repeats the input for every rank; in eager mode it is sent as it is, pairwise
(``batch_isend_irecv``: measured faster than the W-fold buffer, and than gloo's padded all_gather).

Under torch.compile the rooted ops take calls Dynamo traces (it cannot trace c10d's broadcast, reduce, gather
and scatter): the functional broadcast, and one all_to_all_single with the spec's `rooted_splits` for the
others -- the same bytes on the wire. There every rank runs the same program, only the split sizes differ: a
rank that sends nothing still packs its input and sends none of it, a rank that receives nothing computes its
zeros from its (empty) receive buffer (the exact layout's `Blocks` passes too, for uneven gather and scatter).
Each collective then depends on its op's input and feeds its output on every rank, so AOTAutograd's
partitioner keeps it in the same graph (forward or backward) on every rank. Left alone, the partitioner drops
a collective whose result a rank ignores and moves into the forward a backward one that does not read the
cotangent, and the other ranks wait for it forever.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commlib import Collective, Plan, Rearrange, ReduceOp
from commlib.layout import Blocks, permute_splits, rooted_splits
from commlib_torch import _pack

__all__ = ["all_gather_single", "dtype_name", "global_rank", "rearrange", "run", "torch_dtype"]

_C10D_REDUCE = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # gloo has no AVG: the plan's scale divides by W
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

# torch 2.13 renamed the dim-0 collectives (the old names warn); 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: A reduce's local reduction of the blocks it received (dim 0), under torch.compile (avg: the plan's scale).
_LOCAL_REDUCE = {
    ReduceOp.SUM: lambda blocks: blocks.sum(0),
    ReduceOp.AVG: lambda blocks: blocks.sum(0),
    ReduceOp.MAX: lambda blocks: blocks.amax(0),
    ReduceOp.MIN: lambda blocks: blocks.amin(0),
    ReduceOp.PRODUCT: lambda blocks: blocks.prod(0),
}

Group = dist.ProcessGroup | None
Empty = Callable[[tuple[int, ...]], torch.Tensor]


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16 -> "bfloat16"`` (names pass through): the spelling the spec uses."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def torch_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    return default if name is None else getattr(torch, name)


def global_rank(group: Group, rank: int) -> int:
    """The global rank of group-local `rank`."""
    return rank if group is None else dist.get_global_rank(group, rank)


def rearrange(x: torch.Tensor, step: Rearrange, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One local pass of `step` into a contiguous tensor of `shape`; a view when nothing moves."""
    if step.is_identity and dtype == x.dtype and x.is_contiguous():
        return x.reshape(step.view).permute(step.perm).reshape(shape)
    out = torch.empty(step.out_shape, dtype=dtype, device=x.device)
    if not (x.is_cuda and _pack.copy_into(out, x, step)):  # CUDA: a Triton kernel or a wide-word copy
        out.copy_(x.reshape(step.view).permute(step.perm))
    return out.view(shape)


def _receives_only(plan: Plan, rank: int) -> bool:
    """Ranks whose input the collective never reads: no pack pass for them (eagerly; under torch.compile every
    rank packs, see the module docstring)."""
    receives_only = plan.collective in (Collective.BROADCAST, Collective.SCATTER) and rank != plan.root
    return receives_only and not torch.compiler.is_compiling()


def _permute(plan: Plan, send: torch.Tensor, group: Group, rank: int, empty: Empty) -> torch.Tensor | None:
    """ppermute as one all_to_all_single with uneven splits (the spec's `permute_splits`): one call for every
    pattern, and traceable by torch.compile."""
    send_splits, recv_splits = permute_splits(plan.pairs, plan.world_size, rank, send.numel())
    recv = empty((sum(recv_splits),))
    flat = send.reshape(-1)[: sum(send_splits)]
    dist.all_to_all_single(recv, flat, recv_splits, send_splits, group=group)
    return recv.view(plan.recv_shape) if sum(recv_splits) else _nothing_received(recv, plan)


@torch.library.custom_op("commlib::zeros_after", mutates_args=())
def _zeros_after(received: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Zeros of `shape` that the compiler sees as computed from `received`: an op it cannot look into, so no
    graph pass folds them into a constant (a ``cat`` with the empty buffer would be, and the collective behind
    them would leave this rank's data path)."""
    return received.new_zeros(shape)


@_zeros_after.register_fake
def _(received: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return received.new_empty(shape)


def _nothing_received(recv: torch.Tensor, plan: Plan) -> torch.Tensor | None:
    """None (the caller returns zeros) on a rank that receives nothing; under torch.compile, zeros of
    `plan.recv_shape` computed from the empty `recv`, so the collective stays on this rank's data path."""
    return _zeros_after(recv, list(plan.recv_shape)) if torch.compiler.is_compiling() else None


def _rooted_traceable(plan: Plan, send: torch.Tensor, group: Group, rank: int, empty: Empty) -> torch.Tensor | None:
    """A rooted collective in calls Dynamo traces, the same on every rank: broadcast as the functional
    collective, gather / reduce / scatter as one all_to_all_single with the spec's `rooted_splits`."""
    kind, root = plan.collective, global_rank(group, plan.root)
    if kind is Collective.BROADCAST:
        return funcol.broadcast(send, root, dist.group.WORLD if group is None else group)
    block = math.prod(plan.recv_shape if kind is Collective.SCATTER else plan.send_shape)
    send_splits, recv_splits = rooted_splits(kind, plan.root, plan.world_size, rank, block)
    recv = empty((sum(recv_splits),))
    dist.all_to_all_single(recv, send.reshape(-1)[: sum(send_splits)], recv_splits, send_splits, group=group)
    if kind is Collective.SCATTER:
        return recv.view(plan.recv_shape)
    if rank != plan.root:
        return _nothing_received(recv, plan)
    blocks = recv.view(plan.world_size, *plan.send_shape)
    return blocks.view(plan.recv_shape) if kind is Collective.GATHER else _LOCAL_REDUCE[plan.reduce_op](blocks)


def _collective(plan: Plan, send, group: Group, rank: int, empty: Empty) -> torch.Tensor | None:
    """Run the dim-0 collective; the received buffer, or None where this rank receives nothing."""
    if plan.collective.is_rooted and torch.compiler.is_compiling():
        return _rooted_traceable(plan, send, group, rank, empty)
    kind, is_root = plan.collective, rank == plan.root
    root = None if plan.root is None else global_rank(group, plan.root)
    reduce_op = None if plan.reduce_op is None else _C10D_REDUCE[plan.reduce_op]
    if kind is Collective.ALL_REDUCE:
        dist.all_reduce(send, op=reduce_op, group=group)
        return send
    if kind is Collective.REDUCE:
        dist.reduce(send, dst=root, op=reduce_op, group=group)
        return send if is_root else None
    if kind is Collective.BROADCAST:
        buffer = send if is_root else empty(plan.recv_shape)
        dist.broadcast(buffer, src=root, group=group)
        return buffer
    if kind is Collective.PERMUTE:
        return _permute(plan, send, group, rank, empty)
    recv = empty(plan.recv_shape) if kind is not Collective.GATHER or is_root else None
    if kind is Collective.ALL_TO_ALL:
        dist.all_to_all_single(recv, send, group=group)
    elif kind is Collective.ALL_GATHER:  # c10d concatenates along dim 0: hand it flat buffers
        all_gather_single(recv.view(-1), send.view(-1), group=group)
    elif kind is Collective.REDUCE_SCATTER:
        _reduce_scatter_single(recv.view(-1), send.view(-1), op=reduce_op, group=group)
    elif kind is Collective.GATHER:
        dist.gather(send, list(recv.unbind(0)) if is_root else None, dst=root, group=group)
    elif kind is Collective.SCATTER:
        dist.scatter(recv, list(send.unbind(0)) if is_root else None, src=root, group=group)
    else:
        raise NotImplementedError(kind)
    return recv


def _local(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    """identity (times the scale), slice (this rank's block) or pad (this rank's block of zeros)."""
    kind = plan.collective
    if kind is Collective.IDENTITY:
        return x if plan.scale == 1.0 else x * plan.scale
    (dim,) = plan.dims
    rank, block = dist.get_rank(group), plan.recv_shape[dim] if kind is Collective.SLICE else x.shape[dim]
    if kind is Collective.SLICE:  # a copy, not a view: the output may be modified in place, and a gradient
        out = x.narrow(dim, rank * block, block).clone(memory_format=torch.contiguous_format)  # frees the rest
    else:
        out = x.new_zeros(plan.out_shape)
        out.narrow(dim, rank * block, block).copy_(x)
    return out if plan.scale == 1.0 else out * plan.scale


def _pack_blocks(x: torch.Tensor, step: Blocks, dtype: torch.dtype) -> torch.Tensor:
    """The exact layout's pack: the blocks of `x` one after another in one flat buffer (one pass), or a view."""
    if step.is_identity and dtype == x.dtype and x.is_contiguous():
        return x.reshape(-1)
    if torch.compiler.is_compiling() and not step.pieces():  # sends nothing: still read from x (module docstring)
        return x.narrow(step.dim, 0, 0).reshape(-1).to(dtype)
    out = torch.empty(step.numel, dtype=dtype, device=x.device)
    for start, rows, offset, count, shape in step.pieces():
        out[offset:offset + count].view(shape).copy_(x.narrow(step.dim, start, rows))
    return out


def _unpack_blocks(buffer: torch.Tensor, step: Blocks, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The exact layout's unpack into `dtype` (one pass, or a view): each block at its rows and zeros where none
    lands, or (reduce) the sum of the blocks times `scale`."""
    if step.reduce:
        out = buffer.view(len(step.sizes), *step.shape).sum(0)
        return (out if scale == 1.0 else out.mul_(scale)).to(dtype)
    if step.is_identity:
        return buffer.view(step.shape).to(dtype)
    if torch.compiler.is_compiling() and not step.pieces():  # receives nothing: zeros made from the buffer
        return _zeros_after(buffer, list(step.shape)).to(dtype)
    out = (torch.empty if step.covers else torch.zeros)(step.shape, dtype=dtype, device=buffer.device)
    for start, rows, offset, count, shape in step.pieces():
        out.narrow(step.dim, start, rows).copy_(buffer[offset:offset + count].view(shape))
    return out


def _gather_pairwise(unpack: Blocks, send: torch.Tensor, group: Group, rank: int) -> torch.Tensor:
    """The exchange of a pack that repeats the input (all_gather): `send` itself goes to every other rank and
    each rank's block lands in the receive buffer, pairwise -- no W-fold send buffer."""
    recv = torch.empty(unpack.numel, dtype=send.dtype, device=send.device)
    flat, ops, offset = send.reshape(-1), [], 0
    for peer, count in enumerate(unpack.counts):
        part = recv[offset:offset + count]
        offset += count
        if peer == rank:
            part.copy_(flat)
            continue
        if flat.numel():
            ops.append(dist.P2POp(dist.isend, flat, global_rank(group, peer), group))
        if count:
            ops.append(dist.P2POp(dist.irecv, part, global_rank(group, peer), group))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return recv


def _run_exact(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    """Uneven sizes held exactly: the `Blocks` pack, one all_to_all_single with their split sizes (none for a
    local step), the `Blocks` unpack."""
    pack, unpack = plan.pack, plan.unpack
    assert isinstance(pack, Blocks) and isinstance(unpack, Blocks), plan
    buffer_dtype = torch_dtype(plan.accum_dtype, x.dtype)
    if plan.collective.is_local:
        return _unpack_blocks(_pack_blocks(x, pack, buffer_dtype), unpack, x.dtype, plan.scale)
    rank, first = dist.get_rank(group), plan.scale_first and plan.scale != 1.0
    if plan.collective is Collective.ALL_GATHER and not torch.compiler.is_compiling():  # x itself to every rank
        send = x.to(buffer_dtype, memory_format=torch.contiguous_format)  # x itself when it already is
        recv = _gather_pairwise(unpack, _scaled(send, x, plan.scale) if first else send, group, rank)
    else:
        send = _pack_blocks(x, pack, buffer_dtype)
        send = _scaled(send, x, plan.scale) if first else send
        recv = torch.empty(unpack.numel, dtype=buffer_dtype, device=x.device)
        dist.all_to_all_single(recv, send, list(unpack.counts), list(pack.counts), group=group)
    del send
    if plan.scale != 1.0 and not first and not unpack.reduce:
        recv.mul_(plan.scale)
    return _unpack_blocks(recv, unpack, x.dtype, 1.0 if first else plan.scale)


def _scaled(send: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """`send` times `scale` before the collective (`Plan.scale_first`): in place when the pack pass made a fresh
    buffer, else a scaled copy (the pack was a view of the caller's `x`)."""
    if send.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return send * scale
    return send.mul_(scale)


def run(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    """Output of `plan` on this rank for input `x` (any strides), in x's dtype. A dtype the backend lacks
    travels as the plan's same-size `carrier` (a bit view) or its wider `accum_dtype` (a cast)."""
    if plan.carrier is not None:
        return _run(plan, x.view(getattr(torch, plan.carrier)), group).view(x.dtype)
    return _run(plan, x, group)


def _run(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    if plan.is_exact:
        return _run_exact(plan, x, group)
    if plan.collective.is_local:
        return _local(plan, x, group)
    rank = dist.get_rank(group)
    buffer_dtype = torch_dtype(plan.accum_dtype, x.dtype)
    empty = lambda shape: torch.empty(shape, dtype=buffer_dtype, device=x.device)  # noqa: E731
    send = None if _receives_only(plan, rank) else rearrange(x, plan.pack, plan.send_shape, buffer_dtype)
    if send is not None and plan.scale_first and plan.scale != 1.0:
        send = _scaled(send, x, plan.scale)
    recv = _collective(plan, send, group, rank, empty)
    del send  # dead once sent: the unpack's output can take its memory (peak = send + recv, not + output)
    if recv is None:
        return torch.zeros(plan.out_shape, dtype=x.dtype, device=x.device)
    if plan.scale != 1.0 and not plan.scale_first:
        recv.mul_(plan.scale)
    return rearrange(recv, plan.unpack, plan.out_shape, x.dtype)
