"""Every private or version-gated torch API the torch frontend uses, in one place.

Each binding says what it is for, the torch releases it was read on (2.11-2.13 unless a line says otherwise)
and what it falls back to where a release lacks it. Everything here is bound once, at import: the per-call
host path reads the bound names and asks no version question per call. A new torch release is checked by
reading this file against it (the tests run every binding through the public ops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "COPY_COMPILED_OUTPUT",
    "FLASH_CPU",
    "FLASH_CPU_BACKWARD",
    "FLASH_CUDA",
    "FLASH_CUDA_BACKWARD",
    "EFFICIENT_CUDA",
    "EFFICIENT_CUDA_BACKWARD",
    "RELEASE",
    "all_gather_single",
    "c_apply",
    "default_group",
    "functorch_transforms_active",
    "host_copy",
    "has_torch_function_unary",
    "process_group_all_gather",
    "process_group_all_to_all",
    "process_group_reduce_scatter",
    "reduce_scatter_single",
    "unwrap_if_dead",
]

#: This torch's (major, minor) release, e.g. (2, 13): the version gates below compare it.
RELEASE: tuple[int, int] = (int(torch.__version__.split(".")[0]), int(torch.__version__.split(".")[1]))

# ---- autograd (commlib_torch._op) ----------------------------------------------------------------------------

#: Whether a torch.func transform (grad, vjp, vmap, ...) is active: the test `Function.apply` itself makes.
#: Private (torch._C), read on 2.11-2.13; no fallback (every release since functorch moved into torch has it).
functorch_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
#: A dead functorch wrapper's inner tensor (a tensor as it is otherwise): what `Function.apply` does to each
#: argument before the C apply. Private (torch._C._functorch), read on 2.11-2.13; no fallback.
unwrap_if_dead: Callable[[torch.Tensor], torch.Tensor] = torch._C._functorch.unwrap_if_dead


def host_copy(x: torch.Tensor) -> Any:
    """A numpy copy of `x`'s value, also under torch.func.grad / vjp / jvp, whose wrappers have no storage of their
    own: the plain tensor under them, read with functorch off. What `commlib_torch.testing_trace` records. Private
    (``torch._C._DisableFuncTorch``, ``torch._C._functorch.is_functorch_wrapped_tensor`` / ``get_unwrapped``),
    read on 2.13; no fallback."""
    with torch._C._DisableFuncTorch():
        while torch._C._functorch.is_functorch_wrapped_tensor(x):
            x = torch._C._functorch.get_unwrapped(x)
        x = x.detach()
        return (x.float() if x.dtype == torch.bfloat16 else x).cpu().numpy().copy()


def c_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """`function.apply` without `Function.apply`'s Python layer (~1.1 us per call): in eager mode with no
    torch.func transform active, that layer checks for `setup_context`, unwraps dead functorch wrappers
    (`unwrap_if_dead`) and calls the C apply of ``torch._C._FunctionBase``, which this returns bound to
    `function`. The caller must do the unwrapping and take `function.apply` itself under Dynamo or a
    transform. Read on torch 2.11 and 2.13; from 2.14 on, ``function.apply`` until it is read again."""
    if RELEASE < (2, 14):
        return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    return function.apply


# ---- the compiled walk (commlib_torch._walk) ---------------------------------------------------------------

#: torch 2.11's Dynamo drops the gradient of an autograd.Function output that a traced in-place collective
#: wrote (the backward graph reduces zeros): before 2.13 the compiled walk returns a copy of its output. (A view
#: would carry the gradient too, but a view made inside a Function cannot be modified in place.) 2.13 traces it
#: right.
COPY_COMPILED_OUTPUT: bool = RELEASE < (2, 13)

# ---- c10d (commlib_torch._c10d, _groups) ---------------------------------------------------------------------

#: Whether a tensor has ``__torch_function__`` to honour (a subclass, an active mode): the test the
#: torch.distributed wrappers make. Private (torch._C), read on 2.11-2.13; no fallback.
has_torch_function_unary: Callable[[torch.Tensor], bool] = torch._C._has_torch_function_unary

# torch 2.13 renamed the dim-0 collectives (the old names warn); 2.11 has only the old ones.
#: torch.distributed's dim-0 all_gather, by its name in this torch (2.13: all_gather_single; before:
#: all_gather_into_tensor).
all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: torch.distributed's dim-0 reduce_scatter (2.13: reduce_scatter_single; before: reduce_scatter_tensor).
reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The process group's own methods, ``(process_group, recv, send, [recv_splits, send_splits,] options) -> Work``
# (the stubs type each release's name differently, so they are typed by what the walks pass).
#: 2.13: ``ProcessGroup.all_to_all_single``; before: ``alltoall_base``.
process_group_all_to_all: Callable[..., dist.Work] = (
    getattr(dist.ProcessGroup, "all_to_all_single", None) or dist.ProcessGroup.alltoall_base
)
#: 2.13: ``ProcessGroup.all_gather_single``; before: the private ``_allgather_base``.
process_group_all_gather: Callable[..., dist.Work] = (
    getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
)
#: 2.13: ``ProcessGroup.reduce_scatter_single``; before: the private ``_reduce_scatter_base``.
process_group_reduce_scatter: Callable[..., dist.Work] = (
    getattr(dist.ProcessGroup, "reduce_scatter_single", None) or dist.ProcessGroup._reduce_scatter_base
)

# c10d's record of the default group (private ``distributed_c10d._world._default_pg``, read on 2.11-2.13):
# `dist.GroupMember.WORLD` reads it through two Python properties per call. Another torch: the public way.
_C10D_WORLD = getattr(dist.distributed_c10d, "_world", None)
if not hasattr(_C10D_WORLD, "_default_pg"):
    _C10D_WORLD = None


def default_group() -> dist.ProcessGroup | None:
    """`dist.GroupMember.WORLD` (None before `init_process_group`), read directly."""
    return dist.GroupMember.WORLD if _C10D_WORLD is None else _C10D_WORLD._default_pg


# ---- attention kernels (commlib_torch.ring) ------------------------------------------------------------------

#: torch's fused CPU flash-attention forward, ``(q, k, v, dropout, causal, scale=) -> (out, lse)`` on
#: ``[B, H, S, D]`` (private aten op, read on 2.11-2.13). None where absent: the ring uses the spec's einsum rules.
FLASH_CPU: Callable[..., Any] | None = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: Its backward, ``(d_out, q, k, v, out, lse, dropout, causal, scale=) -> (dq, dk, dv)``, recomputing P from the
#: LSE it is given (private aten op, read on 2.11-2.13). None where absent: the spec's einsum rules.
FLASH_CPU_BACKWARD: Callable[..., Any] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)
#: torch's CUDA flash-attention forward (float16 / bfloat16), ``(q, k, v, dropout, causal, return_debug_mask,
#: scale=) -> (out, lse [B, H, S] float32, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug)`` on
#: ``[B, H, S, D]`` (private aten op, read on 2.11-2.13; `commlib_torch._kernels` calls it). None where absent.
FLASH_CUDA: Callable[..., Any] | None = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
#: Its backward, ``(d_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout, causal, philox_seed,
#: philox_offset, scale=) -> (dq, dk, dv)`` (private aten op, read on 2.11-2.13). None where absent.
FLASH_CUDA_BACKWARD: Callable[..., Any] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None
)
#: torch's memory-efficient attention forward (CUDA: float16 / bfloat16 / float32, an additive ``attn_bias``),
#: ``(q, k, v, attn_bias, compute_log_sumexp, dropout, causal, scale=) -> (out, lse [B, H, ceil(S / 32) * 32]
#: float32, philox_seed, philox_offset)`` (private aten op, read on 2.11-2.13). None where absent.
EFFICIENT_CUDA: Callable[..., Any] | None = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
#: Its backward, ``(d_out, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout, grad_input_mask[4],
#: causal, scale=) -> (dq, dk, dv, d_bias)`` (private aten op, read on 2.11-2.13). None where absent.
EFFICIENT_CUDA_BACKWARD: Callable[..., Any] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", None
)
