"""Walk a `commlib.Plan` on torch tensors: one pack pass, the dim-0 c10d collective, one unpack pass.

A pass whose permutation keeps memory order is a view (no copy); a pass that must copy writes straight
into the buffer the collective needs, casting to the accumulation dtype in the same pass. Rooted ops
(broadcast, reduce, gather, scatter) and permute give zeros on the ranks that receive nothing. The local
steps of gradient plans (identity, slice, pad) move no data between ranks. A dtype the backend lacks travels
as the plan's same-size `carrier` (a bit view) or its wider `accum_dtype` (a cast).

Uneven sizes are held exactly (`commlib.uneven`): the plan's pack and unpack are `Blocks` and every collective
is one ``all_to_all_single`` with the split sizes they give -- no padding on the wire, one pass each side at
most. An all_gather's pack repeats the input for every rank; in eager mode it is sent as it is, pairwise
(``batch_isend_irecv``: measured faster than the W-fold buffer, and than gloo's padded all_gather). That walk
is `commlib_torch._exact`.

Under torch.compile the rooted ops take calls Dynamo traces (it cannot trace c10d's broadcast, reduce, gather
and scatter): the functional broadcast, and one all_to_all_single with the spec's `rooted_splits` for the
others -- the same bytes on the wire. There every rank runs the same program, only the split sizes differ: a
rank that sends nothing still packs its input and sends none of it, a rank that receives nothing computes its
zeros from its (empty) receive buffer (the exact layout's `Blocks` passes too, for uneven gather and scatter).
Each collective then depends on its op's input and feeds its output on every rank, so AOTAutograd's
partitioner keeps it in the same graph (forward or backward) on every rank. Left alone, the partitioner drops
a collective whose result a rank ignores and moves into the forward a backward one that does not read the
cotangent, and the other ranks wait for it forever.

Host work per call is what the plan leaves: every decision is read from it (built once, `commlib.plan_cache`),
and the unrooted collectives -- the small calls of hot paths -- are walked inline in `run`. Nothing reads a
tensor's values on the host and no allocation depends on them, so a walk can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commlib import Collective, Plan, Rearrange, ReduceOp
from commlib.layout import permute_splits, rooted_splits
from commlib_torch import _pack
from commlib_torch._exact import run_exact, scaled_first, zeros_after
from commlib_torch._groups import global_rank, group_rank, group_size

__all__ = ["DTYPE_NAMES", "all_gather_single", "dtype_name", "global_rank", "group_rank", "group_size", "rearrange",
           "run", "torch_dtype"]

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
_CONTIGUOUS = torch.contiguous_format
_permute_splits = functools.lru_cache(maxsize=1024)(permute_splits)  # the lists are only read
# Per-call tests read these (an enum member read through its class costs ~0.15 us):
_ALL_REDUCE, _ALL_GATHER, _ALL_TO_ALL = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.ALL_TO_ALL
_INLINE = frozenset({_ALL_REDUCE, _ALL_GATHER, Collective.REDUCE_SCATTER, _ALL_TO_ALL})  # walked inline in `run`
_RECEIVE_ONLY = frozenset({Collective.BROADCAST, Collective.SCATTER})  # non-roots' input is not read
_DIM_0 = (0,)


#: Every torch dtype -> the spelling the spec uses (``torch.bfloat16 -> "bfloat16"``).
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: str(dtype).removeprefix("torch.") for dtype in vars(torch).values()
                                       if isinstance(dtype, torch.dtype)}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16 -> "bfloat16"`` (names pass through): the spelling the spec uses."""
    name = DTYPE_NAMES.get(dtype)  # type: ignore[call-overload]
    if name is not None:
        return name
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def torch_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    return default if name is None else getattr(torch, name)


def rearrange(x: torch.Tensor, step: Rearrange, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One local pass of `step` into a contiguous tensor of `shape`: a view (or `x` itself) when nothing moves,
    else one copy into a fresh buffer, cast to `dtype` in the same pass."""
    if step.is_identity and x.dtype == dtype and x.is_contiguous():
        return x if x.shape == shape else x.view(shape)
    if step.keeps_order:  # a fresh buffer (in-place collective), a cast or a non-contiguous source: one copy
        out = x.clone(memory_format=_CONTIGUOUS) if x.dtype == dtype else x.to(dtype, memory_format=_CONTIGUOUS)
    elif x.is_cuda:  # a Triton kernel or a wide-word copy (commlib_torch._pack), else torch's copy_
        out = x.new_empty(step.out_shape, dtype=dtype)
        if not _pack.copy_into(out, x, step):
            out.copy_(x.reshape(step.view).permute(step.perm))
    else:  # (contiguous() of a permuted view copies: it is contiguous only where nothing moves)
        source = x.reshape(step.view).permute(step.perm)
        out = source.contiguous() if x.dtype == dtype else source.to(dtype, memory_format=_CONTIGUOUS)
    return out if out.shape == shape else out.view(shape)


# ---- the rooted collectives and permute: (plan, packed send buffer or None, group, rank, input, buffer dtype)
# -> the received buffer (contiguous, of the plan's recv_shape), None where this rank receives nothing ------

def _receives_only(plan: Plan, rank: int) -> bool:
    """Ranks whose input the collective never reads: no pack pass for them (eagerly; under torch.compile every
    rank packs, see the module docstring)."""
    return plan.collective in _RECEIVE_ONLY and rank != plan.root and not torch.compiler.is_compiling()


def _reduce(plan: Plan, send, group: Group, rank: int, x: torch.Tensor, dtype: torch.dtype):
    dist.reduce(send, dst=global_rank(group, plan.root), op=_C10D_REDUCE[plan.reduce_op], group=group)
    return send if rank == plan.root else None


def _broadcast(plan: Plan, send, group: Group, rank: int, x: torch.Tensor, dtype: torch.dtype):
    buffer = send if rank == plan.root else x.new_empty(plan.recv_shape, dtype=dtype)
    dist.broadcast(buffer, src=global_rank(group, plan.root), group=group)
    return buffer


def _gather(plan: Plan, send, group: Group, rank: int, x: torch.Tensor, dtype: torch.dtype):
    recv = x.new_empty(plan.recv_shape, dtype=dtype) if rank == plan.root else None
    dist.gather(send, None if recv is None else list(recv.unbind(0)), dst=global_rank(group, plan.root), group=group)
    return recv


def _scatter(plan: Plan, send, group: Group, rank: int, x: torch.Tensor, dtype: torch.dtype):
    recv = x.new_empty(plan.recv_shape, dtype=dtype)
    dist.scatter(recv, None if send is None else list(send.unbind(0)), src=global_rank(group, plan.root), group=group)
    return recv


def _permute(plan: Plan, send, group: Group, rank: int, x: torch.Tensor, dtype: torch.dtype):
    """ppermute as one all_to_all_single with uneven splits (the spec's `permute_splits`): one call for every
    pattern, and traceable by torch.compile."""
    numel = send.numel()
    send_splits, recv_splits = _permute_splits(plan.pairs, plan.world_size, rank, numel)
    sent, received = sum(send_splits), sum(recv_splits)
    if not received:
        recv = x.new_empty((0,), dtype=dtype)
        dist.all_to_all_single(recv, send.reshape(-1)[:sent], recv_splits, send_splits, group=group)
        return _nothing_received(recv, plan)
    # received == numel: the buffer has the plan's shape (not a view of a flat one: a Function's output that is
    # a view costs autograd's view bookkeeping), and what is sent is the input itself where it is all sent
    recv = x.new_empty(plan.recv_shape, dtype=dtype)
    flat_send = send.view(-1) if sent == numel else send.reshape(-1)[:sent]
    dist.all_to_all_single(recv.view(-1), flat_send, recv_splits, send_splits, group=group)
    return recv


def _nothing_received(recv: torch.Tensor, plan: Plan) -> torch.Tensor | None:
    """None (the caller returns zeros) on a rank that receives nothing; under torch.compile, zeros of
    `plan.recv_shape` computed from the empty `recv`, so the collective stays on this rank's data path."""
    return zeros_after(recv, list(plan.recv_shape)) if torch.compiler.is_compiling() else None


def _rooted_traceable(plan: Plan, send, group: Group, rank: int, x: torch.Tensor, dtype: torch.dtype):
    """A rooted collective in calls Dynamo traces, the same on every rank: broadcast as the functional
    collective, gather / reduce / scatter as one all_to_all_single with the spec's `rooted_splits`."""
    kind, root = plan.collective, global_rank(group, plan.root)
    if kind is Collective.BROADCAST:
        return funcol.broadcast(send, root, dist.group.WORLD if group is None else group)
    block = math.prod(plan.recv_shape if kind is Collective.SCATTER else plan.send_shape)
    send_splits, recv_splits = rooted_splits(kind, plan.root, plan.world_size, rank, block)
    recv = x.new_empty((sum(recv_splits),), dtype=dtype)
    dist.all_to_all_single(recv, send.reshape(-1)[: sum(send_splits)], recv_splits, send_splits, group=group)
    if kind is Collective.SCATTER:
        return recv.view(plan.recv_shape)
    if rank != plan.root:
        return _nothing_received(recv, plan)
    blocks = recv.view(plan.world_size, *plan.send_shape)
    return blocks.view(plan.recv_shape) if kind is Collective.GATHER else _LOCAL_REDUCE[plan.reduce_op](blocks)


# ---- the local steps of gradient plans: (plan, input, group) -> output --------------------------------------

def _times_scale(plan: Plan, out: torch.Tensor) -> torch.Tensor:
    return out if plan.scale == 1.0 else out * plan.scale


def _identity(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    """identity times the scale."""
    return _times_scale(plan, x)


def _slice(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's block of `dims[0]`."""
    (dim,) = plan.dims
    block = plan.recv_shape[dim]
    # a copy, not a view: the output may be modified in place, and a gradient frees the rest
    out = x.narrow(dim, group_rank(group) * block, block).clone(memory_format=_CONTIGUOUS)
    return _times_scale(plan, out)


def _pad(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's block of zeros along `dims[0]` (the transpose of `_slice`)."""
    (dim,) = plan.dims
    block = x.shape[dim]
    out = x.new_zeros(plan.out_shape)
    out.narrow(dim, group_rank(group) * block, block).copy_(x)
    return _times_scale(plan, out)


_OTHER_STEPS: dict[Collective, Callable[..., torch.Tensor | None]] = {
    Collective.REDUCE: _reduce,
    Collective.BROADCAST: _broadcast,
    Collective.GATHER: _gather,
    Collective.SCATTER: _scatter,
    Collective.PERMUTE: _permute,
}
_LOCAL_STEPS: dict[Collective, Callable[[Plan, torch.Tensor, Group], torch.Tensor]] = {
    Collective.IDENTITY: _identity,
    Collective.SLICE: _slice,
    Collective.PAD: _pad,
}


def _run_other(plan: Plan, x: torch.Tensor, group: Group) -> torch.Tensor:
    """`run` for the local steps, the rooted collectives and permute."""
    local = _LOCAL_STEPS.get(plan.collective)
    if local is not None:
        return local(plan, x, group)
    rank = group_rank(group)
    dtype = x.dtype if plan.accum_dtype is None else getattr(torch, plan.accum_dtype)
    send = None if _receives_only(plan, rank) else rearrange(x, plan.pack, plan.send_shape, dtype)
    if send is not None and plan.scale_first and plan.scale != 1.0:
        send = scaled_first(send, x, plan.scale)
    if plan.collective.is_rooted and torch.compiler.is_compiling():
        recv = _rooted_traceable(plan, send, group, rank, x, dtype)
    else:
        recv = _OTHER_STEPS[plan.collective](plan, send, group, rank, x, dtype)
    del send  # dead once sent: the unpack's output can take its memory (peak = send + recv, not + output)
    if recv is None:
        return x.new_zeros(plan.out_shape)
    if plan.scale != 1.0 and not plan.scale_first:
        recv.mul_(plan.scale)
    if plan.unpack.is_identity and dtype == x.dtype:  # recv is contiguous: the output is a view of it
        return recv if recv.shape == plan.out_shape else recv.view(plan.out_shape)
    return rearrange(recv, plan.unpack, plan.out_shape, x.dtype)


def run(plan: Plan, x: torch.Tensor, group: Group, *, carried: bool = False) -> torch.Tensor:
    """Output of `plan` on this rank for input `x` (any strides), in x's dtype.

    The unrooted collectives run inline, their shape decisions read from the plan: the pack pass is `x`
    itself where the plan says identity and `x` is contiguous (a fresh copy where the collective writes in
    place), the unpack at most one view where the plan says identity; c10d's dim-0 gather and scatter take
    flat buffers.
    """
    if plan.carrier is not None and not carried:  # a dtype the backend lacks: its bits in a same-size dtype
        return run(plan, x.view(getattr(torch, plan.carrier)), group, carried=True).view(x.dtype)
    if plan.is_exact:
        return run_exact(plan, x, group)
    kind = plan.collective
    if kind not in _INLINE:
        return _run_other(plan, x, group)
    cast = plan.accum_dtype is not None
    dtype = getattr(torch, plan.accum_dtype) if cast else x.dtype  # type: ignore[arg-type]
    pack = plan.pack
    packed = cast or not pack.keeps_order  # a pass into a buffer of send_shape, else x's own shape (in_shape)
    if packed:
        send = rearrange(x, pack, plan.send_shape, dtype)
    else:  # a fresh copy for an in-place collective, else x itself where contiguous
        send = x.clone(memory_format=_CONTIGUOUS) if pack.always_copy else x.contiguous()
    if plan.scale_first and plan.scale != 1.0:
        send = scaled_first(send, x, plan.scale)
    if kind is _ALL_REDUCE:  # in place
        dist.all_reduce(send, op=_C10D_REDUCE[plan.reduce_op], group=group)
        recv, shape = send, plan.send_shape
    elif kind is _ALL_TO_ALL:  # the send buffer's dim 0 goes out in W blocks
        recv, shape = x.new_empty(plan.recv_shape, dtype=dtype), plan.recv_shape
        if not packed and plan.in_shape != plan.send_shape:
            send = send.view(plan.send_shape)
        dist.all_to_all_single(recv, send, group=group)
    else:  # c10d gathers and scatters along dim 0: x itself along dim 0 ([n, ...] <-> [W * n, ...]), else flat
        along_0 = not packed and plan.dims == _DIM_0
        if kind is _ALL_GATHER:
            shape = plan.out_shape if along_0 else (send.numel() * plan.world_size,)
            recv = x.new_empty(shape, dtype=dtype)
            all_gather_single(recv, send if along_0 else send.view(-1), group=group)
        else:
            shape = plan.out_shape if along_0 else (send.numel() // plan.world_size,)
            recv = x.new_empty(shape, dtype=dtype)
            _reduce_scatter_single(recv, send if along_0 else send.view(-1), op=_C10D_REDUCE[plan.reduce_op],
                                   group=group)
    del send  # dead once sent: the unpack's output can take its memory (peak = send + recv, not + output)
    if plan.scale != 1.0 and not plan.scale_first:
        recv.mul_(plan.scale)
    if cast or not plan.unpack.is_identity:
        return rearrange(recv, plan.unpack, plan.out_shape, x.dtype)
    return recv if shape == plan.out_shape else recv.view(plan.out_shape)
