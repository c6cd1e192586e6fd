"""The exact layout of uneven sizes (`commlib.uneven`) on torch tensors: `Blocks` passes around one
``all_to_all_single`` with their split sizes (an all_gather's pack, which repeats the input for every rank,
sent as it is, pairwise, in eager mode), and two helpers the even walk (`commlib_torch._walk`) shares:
the half-precision scale applied before a collective and the zeros a compiled rank makes from an empty
receive buffer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from commlib import Plan
from commlib.layout import Blocks
from commlib.steps import AllGather
from commlib_torch._c10d import Started
from commlib_torch._groups import ResolvedGroup, global_rank, group_rank

__all__ = ["run_exact", "scaled_first", "zeros_after"]


def scaled_first(send: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """`send` times `scale` before the collective (`Plan.scale_first`): in place when the pack pass made a fresh
    buffer, else a scaled copy (the pack was a view of the caller's `x`)."""
    if send.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return send * scale
    return send.mul_(scale)


@torch.library.custom_op("commlib::zeros_after", mutates_args=())
def zeros_after(received: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Zeros of `shape` that the compiler sees as computed from `received`: an op it cannot look into, so no
    graph pass folds them into a constant (a ``cat`` with the empty buffer would be, and the collective behind
    them would leave this rank's data path)."""
    return received.new_zeros(shape)


@zeros_after.register_fake
def _(received: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return received.new_empty(shape)


def _pack_blocks(
    x: torch.Tensor, step: Blocks, dtype: torch.dtype, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The exact layout's pack: the blocks of `x` one after another in one flat buffer (one pass), or a view; a
    buffer of `shape` (of the same size) where given: the output of a local step whose unpack is identity."""
    if step.is_identity and dtype == x.dtype and x.is_contiguous():
        return x.reshape(-1)
    if torch.compiler.is_compiling() and not step.pieces():  # sends nothing: still read from x (module docstring)
        return x.narrow(step.dim, 0, 0).reshape(-1).to(dtype)
    buffer = torch.empty(shape or (step.numel,), dtype=dtype, device=x.device)
    out = buffer.view(-1) if shape else buffer
    for start, rows, offset, count, piece in step.pieces():
        out[offset : offset + count].view(piece).copy_(x.narrow(step.dim, start, rows))
    return buffer


def _unpack_blocks(buffer: torch.Tensor, step: Blocks, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The exact layout's unpack into `dtype` (one pass, or a view): each block at its rows and zeros where none
    lands, or (reduce) the sum of the blocks times `scale`."""
    if step.reduce:
        out = buffer.view(len(step.sizes), *step.shape).sum(0)
        return (out if scale == 1.0 else out.mul_(scale)).to(dtype)
    if step.is_identity:  # (received into a buffer of step.shape: `run_exact`)
        return (buffer if buffer.shape == step.shape else buffer.view(step.shape)).to(dtype)
    if torch.compiler.is_compiling() and not step.pieces():  # receives nothing: zeros made from the buffer
        return zeros_after(buffer, list(step.shape)).to(dtype)
    out = (torch.empty if step.covers else torch.zeros)(step.shape, dtype=dtype, device=buffer.device)
    for start, rows, offset, count, shape in step.pieces():
        out.narrow(step.dim, start, rows).copy_(buffer[offset : offset + count].view(shape))
    return out


def _gather_pairwise(unpack: Blocks, send: torch.Tensor, recv: torch.Tensor, group: ResolvedGroup, rank: int) -> list:
    """The exchange of a pack that repeats the input (all_gather): `send` itself goes to every other rank and
    each rank's block lands in the flat receive buffer `recv`, pairwise -- no W-fold send buffer. Returns the
    c10d works, begun, not waited."""
    flat, ops, offset = send.reshape(-1), [], 0
    for peer, count in enumerate(unpack.counts):
        part = recv[offset : offset + count]
        offset += count
        if peer == rank:
            part.copy_(flat)
            continue
        if flat.numel():
            ops.append(dist.P2POp(dist.isend, flat, global_rank(group, peer), group))
        if count:
            ops.append(dist.P2POp(dist.irecv, part, global_rank(group, peer), group))
    return dist.batch_isend_irecv(ops) if ops else []


def run_exact(plan: Plan, x: torch.Tensor, group: ResolvedGroup, asynchronous: bool = False) -> Any:
    """Uneven sizes held exactly: the `Blocks` pack, one all_to_all_single with their split sizes (none for a
    local step), the `Blocks` unpack. `asynchronous`: the collective begun, a `commlib_torch._c10d.Started`
    returned whose wait runs the unpack."""
    pack, unpack, arithmetic = plan.layout.pack, plan.layout.unpack, plan.arithmetic
    assert isinstance(pack, Blocks) and isinstance(unpack, Blocks), plan
    scale = arithmetic.scale
    buffer_dtype = x.dtype if arithmetic.accum_dtype is None else getattr(torch, arithmetic.accum_dtype)
    # where the unpack is identity the buffer has the output's shape and is the output (the Function's output is
    # then no view of a tensor made inside it, and can be modified in place); the collective receives it flat
    shaped = unpack.is_identity and not unpack.reduce
    if plan.step.is_local:
        return _unpack_blocks(
            _pack_blocks(x, pack, buffer_dtype, unpack.shape if shaped else None), unpack, x.dtype, scale
        )
    rank, first = group_rank(group), arithmetic.scale_first and scale != 1.0
    recv = torch.empty(unpack.shape if shaped else (unpack.numel,), dtype=buffer_dtype, device=x.device)
    flat = recv.view(-1) if shaped else recv
    if isinstance(plan.step, AllGather) and not torch.compiler.is_compiling():  # x itself to every rank
        # x itself when it already is; `to` keeps a view of the same dtype whose strides are uniform (x[:, ::2]
        # flattens to a stride-2 view), which c10d's send rejects: contiguous() copies exactly that case
        send = x.to(buffer_dtype, memory_format=torch.contiguous_format).contiguous()
        send = scaled_first(send, x, scale) if first else send
        works = _gather_pairwise(unpack, send, flat, group, rank)
    else:
        send = _pack_blocks(x, pack, buffer_dtype)
        send = scaled_first(send, x, scale) if first else send
        work = dist.all_to_all_single(
            flat, send, list(unpack.counts), list(pack.counts), group=group, async_op=asynchronous
        )
        works = [] if work is None else [work]  # (None: done, synchronous)
    if asynchronous:
        return Started(works, _unpacked, plan, recv, x, send)
    for work in works:
        work.wait()
    del send
    return _unpacked(plan, recv, x)


def _unpacked(plan: Plan, recv: torch.Tensor, x: torch.Tensor, send: torch.Tensor | None = None) -> torch.Tensor:
    """The exact walk's output from its received buffer: the scale (where not applied first), the unpack."""
    unpack, arithmetic = plan.layout.unpack, plan.arithmetic
    assert isinstance(unpack, Blocks), plan
    scale, first = arithmetic.scale, arithmetic.scale_first and arithmetic.scale != 1.0
    if scale != 1.0 and not first and not unpack.reduce:
        recv.mul_(scale)
    return _unpack_blocks(recv, unpack, x.dtype, 1.0 if first else scale)
