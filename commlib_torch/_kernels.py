"""The attention kernel of a piece, chosen in one place for the torch layers (DESIGN "Long sequences"), and the
calls of torch's fused kernels that return the log-sum-exp, on heads-major tensors (``[B, H, S, D]``).

`choose(device_type, dtype, head_dim, value_dim, mask)` is the whole rule (a pure function of the piece's
description; the tests walk its table):

- CPU, any dtype the ring computes in, ``D == D_v``, any mask: "flash-cpu"
  (``_scaled_dot_product_flash_attention_for_cpu``; an array mask as an additive one);
- CUDA, float16 / bfloat16, ``D == D_v`` a multiple of 8 up to 256, mask "full" or "causal": "flash"
  (``_scaled_dot_product_flash_attention``);
- CUDA, float16 / bfloat16 / float32, ``D == D_v`` a multiple of 8, any mask (an array as ``attn_bias``):
  "efficient" (``_scaled_dot_product_efficient_attention``);
- everything else (``D != D_v``, float64 on CUDA, another device): "einsum", the spec's rules
  (`commlib.blockwise`).

Every fused kernel returns the LSE ``[B, H, S_q]`` in float32 (the CPU kernel: the compute dtype), natural log
(the efficient kernel pads it to a multiple of 32 rows: `forward` cuts it, `backward` pads it back), and its
backward recomputes P from the LSE it is given -- the ring's final one. A row an array mask hides entirely
outputs 0 with LSE -inf (the spec's rule): on CUDA its bias row is made finite for the forward (the row then
sees every key, harmlessly) and its output and LSE are set after; the backward keeps the true bias (P = 0 there).

The aten ops are private; their signatures were read on torch 2.11-2.13 (`commlib_torch._compat` binds them).
The CUDA calls are checked on CPU against the ops' meta registrations (shapes, argument order); their values
only by ``benchmarks/device_check.sh`` on a GPU.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from commlib_torch import _compat

__all__ = [
    "FUSED",
    "Kernel",
    "MaskKind",
    "choose",
    "forward",
    "backward",
    "mask_kind",
    "bias",
    "block_rows",
    "block_seen",
    "segment_attention",
]

Kernel = Literal["flash-cpu", "flash", "efficient", "einsum"]
MaskKind = Literal["full", "causal", "array"]
#: The kernels of torch (not the spec's einsum rules).
FUSED: tuple[Kernel, ...] = ("flash-cpu", "flash", "efficient")

_HALF = ("float16", "bfloat16")
_ALIGN_LSE = 32  # the efficient kernel's LSE rows, padded (torch's meta registration: ceil(S / 32) * 32)
_ALIGN_BIAS = 16  # the efficient kernel reads attn_bias rows with strides a multiple of 16 elements


def choose(device_type: str, dtype: str, head_dim: int, value_dim: int, mask: MaskKind) -> Kernel:
    """The kernel that computes a piece (the module's table): `dtype` the inputs' dtype name (the fused CUDA
    kernels run in it; the CPU kernel in the ring's compute dtype), `mask` its kind."""
    if head_dim != value_dim:
        return "einsum"
    if device_type == "cpu":
        return "flash-cpu" if _compat.FLASH_CPU is not None and _compat.FLASH_CPU_BACKWARD is not None else "einsum"
    if device_type != "cuda" or dtype not in (*_HALF, "float32") or head_dim % 8 or head_dim == 0:
        return "einsum"
    if dtype in _HALF and mask != "array" and head_dim <= 256 and _compat.FLASH_CUDA is not None:
        return "flash"
    return "efficient" if _compat.EFFICIENT_CUDA is not None else "einsum"


def mask_kind(mask: str | torch.Tensor) -> MaskKind:
    """A ring piece's mask ("full", "causal-diagonal" or a bool array) as `choose` takes it."""
    if isinstance(mask, str):
        return "causal" if mask == "causal-diagonal" else "full"
    return "array"


def bias(seen: torch.Tensor, dtype: torch.dtype, kernel: Kernel) -> torch.Tensor:
    """A bool mask ``[B or 1, Sq, Sk]`` as the kernel's additive one: 0 where seen, -inf elsewhere, ``[B or 1, 1,
    Sq, Sk]`` (the kernels broadcast it; for the efficient kernel a view of rows padded to a multiple of 16
    elements, its alignment, that `forward` / `backward` expand to ``[B, H, Sq, Sk]``)."""
    seen = seen.reshape(-1, 1, *seen.shape[-2:])
    if kernel != "efficient":
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, float("-inf"))
    keys = seen.shape[-1]
    padded = torch.zeros((*seen.shape[:-1], -(-keys // _ALIGN_BIAS) * _ALIGN_BIAS), dtype=dtype, device=seen.device)
    padded[..., :keys].masked_fill_(~seen, float("-inf"))
    return padded[..., :keys]


def _expanded(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The efficient kernel's bias as it reads it: ``[B, H, Sq, Sk]`` (a view, stride 0 where broadcast)."""
    return None if bias is None else bias.expand(q.shape[0], q.shape[1], *bias.shape[-2:])


def _philox(kernel: Kernel, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernels' dropout seed and offset, shaped as their forwards return them (flash: its ``rng_state``
    ``[2]`` and an unused ``[]``; efficient: two ``[]``): never read at dropout 0, passed as the schemas require."""
    seed = torch.zeros(2 if kernel == "flash" else (), dtype=torch.int64, device=device)
    return seed, torch.zeros((), dtype=torch.int64, device=device)


def forward(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, Sq, D_v], lse [B, H, Sq])`` of a fused kernel on ``[B, H, S, D]`` (k, v repeated to H heads),
    the LSE natural-log (`bias`: `bias`'s additive mask, or None)."""
    if kernel == "flash-cpu":
        assert _compat.FLASH_CPU is not None
        return _compat.FLASH_CPU(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    if kernel == "flash":
        assert _compat.FLASH_CUDA is not None and bias is None
        out, lse, *_ = _compat.FLASH_CUDA(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    assert kernel == "efficient" and _compat.EFFICIENT_CUDA is not None
    out, lse, *_ = _compat.EFFICIENT_CUDA(q, k, v, _expanded(bias, q), True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]


def backward(
    kernel: Kernel,
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of a fused kernel's backward from `out` and `lse` (``[B, H, Sq]``, finite: a row that saw
    no key passes 0, its P is 0 through the bias), heads-major as `forward`'s."""
    if kernel == "flash-cpu":
        assert _compat.FLASH_CPU_BACKWARD is not None
        return _compat.FLASH_CPU_BACKWARD(d_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    seed, offset = _philox(kernel, q.device)
    if kernel == "flash":
        assert _compat.FLASH_CUDA_BACKWARD is not None and bias is None
        rows, keys = q.shape[2], k.shape[2]
        lse = lse.contiguous()
        dq, dk, dv = _compat.FLASH_CUDA_BACKWARD(
            d_out, q, k, v, out, lse, None, None, rows, keys, 0.0, causal, seed, offset, scale=scale
        )
        return dq, dk, dv
    assert kernel == "efficient" and _compat.EFFICIENT_CUDA_BACKWARD is not None
    padding = -(-q.shape[2] // _ALIGN_LSE) * _ALIGN_LSE - q.shape[2]
    lse = torch.nn.functional.pad(lse, (0, padding)).contiguous()
    dq, dk, dv, _ = _compat.EFFICIENT_CUDA_BACKWARD(
        d_out, q, k, v, _expanded(bias, q), out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


# ---- Ulysses' attention with segment ids on a fused kernel: query blocks, never a [S, S] mask ---------------------

#: Elements of one query block's additive mask (``B * rows * S``): the block's rows are as many as fit.
BIAS_ELEMENTS = 2**27


def block_rows(batch: int, seq: int) -> int:
    """Query rows per block of `segment_attention`: ``BIAS_ELEMENTS // (B * S)``, at least 64 (all, if fewer)."""
    return min(seq, max(64, BIAS_ELEMENTS // max(batch * seq, 1)))


def block_seen(ids: torch.Tensor, rows: slice, causal: bool) -> torch.Tensor:
    """bool ``[B, rows, S]``: what the query rows `rows` see of every key (equal ids, not padding; with causal,
    not after the query)."""
    query = ids[:, rows, None]
    seen = (query == ids[:, None, :]) & (query >= 0)
    if causal:
        positions = torch.arange(ids.shape[1], device=ids.device)
        seen &= positions[rows, None] >= positions[None, :]
    return seen


class _Segmented(torch.autograd.Function):
    """Attention on heads-major q, k, v (``[B, H, S, D]``, k and v repeated to H heads) with segment ids, one
    query block at a time on a fused kernel: each block's additive mask is ``[B, rows, S]`` and its LSE final
    (it sees every key), so no merge; the backward runs the kernel's backward per block from the saved output
    and LSE, dk and dv summed over the blocks in float32 (float64 stays float64)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ids: torch.Tensor,
        causal: bool,
        scale: float,
        kernel: Kernel,
        rows: int,
    ) -> torch.Tensor:
        outs, lses = [], []
        for start in range(0, q.shape[2], rows):
            block = slice(start, start + rows)
            seen = block_seen(ids, block, causal)
            sees = seen.any(-1)  # [B, rows]: a row that sees nothing sees every key here, then is set
            out, lse = forward(
                kernel, q[:, :, block], k, v, False, bias(seen | ~sees[..., None], q.dtype, kernel), scale
            )
            outs.append(out.masked_fill(~sees[:, None, :, None], 0.0))
            lses.append(lse.masked_fill(~sees[:, None], float("-inf")))
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, ids, out, lse)
        ctx.options = causal, scale, kernel, rows
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, ids, out, lse = ctx.saved_tensors
        causal, scale, kernel, rows = ctx.options
        accumulate = torch.promote_types(q.dtype, torch.float32)
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros(x.shape, dtype=accumulate, device=x.device) for x in (k, v))
        finite = lse.masked_fill(~lse.isfinite(), 0.0)  # a row that saw no key: P = exp(-inf - 0) = 0 there
        for start in range(0, q.shape[2], rows):
            block = slice(start, start + rows)
            additive = bias(block_seen(ids, block, causal), q.dtype, kernel)
            parts = (d_out[:, :, block].contiguous(), q[:, :, block], k, v, out[:, :, block], finite[:, :, block])
            dq_block, dk_block, dv_block = backward(kernel, *parts, False, additive, scale)
            dq[:, :, block] = dq_block
            dk += dk_block
            dv += dv_block
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    kernel: Kernel,
    rows: int | None = None,
) -> torch.Tensor:
    """`commlib_torch.attention.attention` with `segment_ids` on ``[B, S, H, D]`` (k, v ``[B, S, H_kv, D]``) on
    a fused kernel, query block by query block (`block_rows`, or `rows`): what it holds is one block's mask
    ``[B, rows, S]``, never ``[B, S, S]``. A row that sees nothing outputs 0 with gradient 0. No NaN handling
    (the caller's: `commlib_torch.ring.nan_free` / `nan_rows` per block)."""
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    heads = [x.repeat_interleave(group, dim=2) if group > 1 else x for x in (k, v)]
    query, key, value = (x.transpose(1, 2) for x in (q, *heads))
    rows = block_rows(q.shape[0], q.shape[1]) if rows is None else rows
    out = _Segmented.apply(query, key, value, segment_ids, causal, scale, kernel, max(rows, 1))
    return out.transpose(1, 2)
