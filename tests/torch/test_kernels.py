"""The kernel of a piece, chosen in one place (`commlib_torch._kernels`): the selection table, the LSE convention
of torch's fused kernels against the spec's einsum rules (on the CPU kernel), the CUDA calls against the ops'
meta registrations (their signatures and the LSE shapes), and the ring's choice for a CUDA piece. One process,
no process group; the CUDA kernels' values run only in ``benchmarks/device_check.sh``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from commlib import blockwise
from commlib import ring as spec
from commlib_torch import _compat, _kernels
from commlib_torch.ring import _MATH, piece_kernel

CPU = "flash-cpu" if _compat.FLASH_CPU is not None else "einsum"


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "value_dim", "mask", "kernel"),
    [
        ("cpu", "float32", 64, 64, "full", CPU),
        ("cpu", "float64", 64, 64, "array", CPU),
        ("cpu", "bfloat16", 16, 16, "causal", CPU),
        ("cpu", "float32", 64, 32, "full", "einsum"),  # D_v != D: no kernel
        ("cuda", "bfloat16", 64, 64, "full", "flash"),
        ("cuda", "float16", 128, 128, "causal", "flash"),
        ("cuda", "bfloat16", 256, 256, "causal", "flash"),
        ("cuda", "bfloat16", 64, 64, "array", "efficient"),  # flash takes no mask
        ("cuda", "float16", 512, 512, "full", "efficient"),  # past flash's head dims
        ("cuda", "float32", 64, 64, "full", "efficient"),
        ("cuda", "float32", 64, 64, "causal", "efficient"),
        ("cuda", "float32", 64, 64, "array", "efficient"),
        ("cuda", "float64", 64, 64, "full", "einsum"),
        ("cuda", "bfloat16", 60, 60, "full", "einsum"),  # not a multiple of 8
        ("cuda", "bfloat16", 64, 128, "full", "einsum"),
        ("mps", "float32", 64, 64, "full", "einsum"),
    ],
)
def test_choose(device, dtype, head_dim, value_dim, mask, kernel):
    assert _kernels.choose(device, dtype, head_dim, value_dim, mask) == kernel


def _plan(dtype: str, head_dim: int = 16, value_dim: int = 16, causal: bool = True) -> spec.RingPlan:
    return spec.ring_plan(
        (2, 8, 4, head_dim), (2, 8, 2, head_dim), (2, 8, 2, value_dim), 4, causal=causal, dtypes=(dtype,) * 3
    )


def test_ring_piece_on_cuda():
    """The ring's choice for a CUDA piece (a description: no GPU here) is the CUDA branch, by the inputs' dtype
    (the pieces themselves compute in float32), the head dims and the mask."""
    seen = torch.ones(8, 8, dtype=torch.bool)
    assert piece_kernel("cuda", _plan("bfloat16"), "causal-diagonal") == "flash"
    assert piece_kernel("cuda", _plan("float16"), "full") == "flash"
    assert piece_kernel("cuda", _plan("bfloat16"), seen) == "efficient"
    assert piece_kernel("cuda", _plan("float32"), "full") == "efficient"
    assert piece_kernel("cuda", _plan("float64"), "full") == "einsum"
    assert piece_kernel("cuda", _plan("bfloat16", 16, 8), "full") == "einsum"
    assert piece_kernel("cpu", _plan("bfloat16"), seen) == CPU


def _inputs(dtype=torch.float64, shape=(2, 3, 12, 16)):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(4)]  # q, k, v, d_out


@pytest.mark.skipif(_compat.FLASH_CPU is None, reason="this torch has no CPU flash kernel")
@pytest.mark.parametrize("masked", ["full", "causal", "array"])
def test_cpu_kernel_lse_convention(masked):
    """The fused kernel's LSE is ``[B, H, S_q]``, natural log, the spec's (`commlib.blockwise.attend` on
    ``[B, S, H, D]``); its output and its backward (from that LSE) are the spec's too."""
    q, k, v, d_out = _inputs()
    scale = 1 / math.sqrt(q.shape[-1])
    seen = torch.rand(q.shape[2], q.shape[2], generator=torch.Generator().manual_seed(1)) > 0.3
    seen[:, 0] = True  # every row sees a key
    mask = {"full": "full", "causal": "causal-diagonal", "array": seen[None]}[masked]
    additive = None if masked != "array" else _kernels.bias(seen[None], q.dtype, "flash-cpu")
    out, lse = _kernels.forward("flash-cpu", q, k, v, masked == "causal", additive, scale)
    assert lse.shape == q.shape[:3]
    scores = scale * q @ k.transpose(-1, -2)
    if masked != "full":
        scores = scores.masked_fill(~(seen if masked == "array" else torch.ones_like(seen).tril()), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))  # natural log, not log2
    bshd = [x.transpose(1, 2) for x in (q, k, v, d_out)]
    want_out, want_lse = blockwise.attend(_MATH, *bshd[:3], scale, mask)
    torch.testing.assert_close(out.transpose(1, 2), want_out)
    torch.testing.assert_close(lse.transpose(1, 2), want_lse)
    grads = _kernels.backward("flash-cpu", d_out, q, k, v, out, lse, masked == "causal", additive, scale)
    rowsums = blockwise.delta(_MATH, want_out, bshd[3])
    wants = blockwise.attend_vjp(_MATH, *bshd[:3], bshd[3], want_lse, rowsums, scale, mask)
    for grad, want in zip(grads, wants, strict=True):
        torch.testing.assert_close(grad.transpose(1, 2), want)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_calls_on_meta(kernel, causal):
    """The CUDA calls as torch's meta registrations of the ops see them (their argument order, what they
    return): the LSE comes back ``[B, H, S_q]`` (the efficient kernel's padding to 32 rows cut), the gradients
    q's, k's and v's shapes; the efficient kernel's bias a view of rows padded to 16 elements."""
    shape = (2, 4, 70, 64)
    dtype = torch.bfloat16 if kernel == "flash" else torch.float32
    q, k, v, d_out = (torch.empty(shape, dtype=dtype, device="meta") for _ in range(4))
    additive = None
    if kernel == "efficient" and not causal:
        seen = torch.ones(1, 70, 70, dtype=torch.bool)
        additive = _kernels.bias(seen, dtype, kernel)
        assert additive.shape == (1, 1, 70, 70) and additive.stride(-2) % 16 == 0  # [B or 1, 1, Sq, Sk]
        assert _kernels._expanded(additive, q).stride()[:2] == (0, 0)  # broadcast over batch and heads
        additive = additive.to("meta")
    out, lse = _kernels.forward(kernel, q, k, v, causal, additive, 0.125)
    assert out.shape == shape and lse.shape == shape[:3] and lse.dtype == torch.float32
    grads = _kernels.backward(kernel, d_out, q, k, v, out, lse, causal, additive, 0.125)
    assert [tuple(g.shape) for g in grads] == [shape] * 3


@pytest.mark.skipif(_compat.FLASH_CPU is None, reason="this torch has no CPU flash kernel")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", [5, 13, None])
def test_segmented_route(causal, rows):
    """Ulysses' attention with segment ids query block by query block (the CUDA route, here on the CPU kernel:
    one block's mask at a time) gives `attention`'s dense-mask values and gradients: GQA, batch 2, packed
    documents, padding rows (output 0, gradient 0), a NaN in a padding key (unseen: nothing changes) and in a
    document's query (that row NaN), blocks that do not divide S."""
    from commlib import segment_ids
    from commlib_torch.attention import _segmented, attention

    generator = torch.Generator().manual_seed(2)
    shape, kv_shape = (2, 13, 4, 16), (2, 13, 2, 16)
    q, d_out = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(kv_shape, generator=generator, dtype=torch.float64) for _ in range(2))
    ids = torch.from_numpy(np.stack([segment_ids([5, 6], 13), segment_ids([13], 13)]))
    k[0, 12, 1, 3] = float("nan")  # a padding key
    q[1, 4, 2, 0] = float("nan")  # a query of the one document
    dense = lambda *x: attention(*x, causal=causal, segment_ids=ids)  # noqa: E731
    blocked = lambda *x: _segmented(*x, ids, causal, None, "flash-cpu", rows)  # noqa: E731
    runs = []
    for call in (dense, blocked):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = call(*leaves)
        runs.append((out, torch.autograd.grad(out, leaves, d_out.masked_fill(out.isnan(), 0.0))))
    (want, want_grads), (got, got_grads) = runs
    assert got[1, 4, 2].isnan().all() and (got[0, 11:] == 0).all()
    torch.testing.assert_close(got, want, equal_nan=True)
    for grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, equal_nan=True)


def test_block_rows():
    """A query block's mask is at most `BIAS_ELEMENTS` (64 rows at least, S at most): at S = 131,072, B = 1,
    1,024 rows (a [1, 1024, 131072] mask), not a [S, S] one."""
    assert _kernels.block_rows(1, 131072) == 1024
    assert _kernels.block_rows(1, 100) == 100
    assert _kernels.block_rows(4, 2**22) == 64
