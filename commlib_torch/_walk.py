"""Walk a `commlib.Plan` on torch tensors: one pack pass, the dim-0 c10d collective, one unpack pass.

A pass whose permutation keeps memory order is a view (no copy); a pass that must copy writes straight
into the buffer the collective needs, casting to the accumulation dtype in the same pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlib import Plan, Rearrange

__all__ = ["dtype_name", "run", "torch_dtype"]

_C10D_REDUCE = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo has no AVG: the plan's scale divides by W
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


# torch 2.13 renamed the dim-0 collectives (the old names warn); 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16 -> "bfloat16"`` (names pass through): the spelling the spec uses."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def torch_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    return default if name is None else getattr(torch, name)


def rearrange(x: torch.Tensor, step: Rearrange, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One local pass of `step` into a contiguous tensor of `shape`; a view when nothing moves."""
    source = x.reshape(step.view).permute(step.perm)
    if step.is_identity and dtype == x.dtype and x.is_contiguous():
        return source.reshape(shape)
    out = torch.empty(step.out_shape, dtype=dtype, device=x.device)
    out.copy_(source)
    return out.view(shape)


def _collective(plan: Plan, send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    kind = plan.collective
    if kind == "all_reduce":
        dist.all_reduce(send, op=_C10D_REDUCE[plan.reduce_op], group=group)
        return send
    recv = torch.empty(plan.recv_shape, dtype=send.dtype, device=send.device)
    if kind == "all_to_all":
        dist.all_to_all_single(recv, send, group=group)
    elif kind == "all_gather":  # c10d concatenates along dim 0: hand it flat buffers
        _all_gather_single(recv.view(-1), send.view(-1), group=group)
    elif kind == "reduce_scatter":
        _reduce_scatter_single(recv.view(-1), send.view(-1), op=_C10D_REDUCE[plan.reduce_op], group=group)
    else:
        raise NotImplementedError(kind)
    return recv


def run(plan: Plan, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Output of `plan` on this rank for input `x` (any strides); in x's dtype."""
    buffer_dtype = torch_dtype(plan.accum_dtype, x.dtype)
    send = rearrange(x, plan.pack, plan.send_shape, buffer_dtype)
    recv = _collective(plan, send, group)
    if plan.scale != 1.0:
        recv.mul_(plan.scale)
    return rearrange(recv, plan.unpack, plan.out_shape, x.dtype)
