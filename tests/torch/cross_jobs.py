"""Job functions for tests/torch/test_cross_attention.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import numpy as np
import torch

from commlib_torch.attention import cross_attention
from tests import cross_cases
from tests.torch.attention_jobs import _counting


def cross_call(ctx, case: cross_cases.CrossCase, arrays: dict):
    """This rank's output, {q, k, v: gradient} (zeros where autograd gives None) and the c10d calls of the
    forward and of the backward."""
    leaves = [torch.tensor(arrays[name][ctx.rank], dtype=torch.float64).requires_grad_() for name in "qkv"]
    ids = {
        keyword: None if arrays[name][ctx.rank] is None else torch.tensor(arrays[name][ctx.rank])
        for keyword, name in (("segment_ids", "q_ids"), ("kv_segment_ids", "kv_ids"))
    }
    forward: list = []
    backward: list = []
    with _counting(forward):
        out = cross_attention(*leaves, **cross_cases.kwargs(case), **ids)
    with _counting(backward):
        (out * torch.tensor(arrays["cotangent"][ctx.rank])).sum().backward()
    grads = {
        name: np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.numpy()
        for name, leaf in zip("qkv", leaves, strict=True)
    }
    return out.detach().numpy(), grads, [name for name, _ in forward], [name for name, _ in backward]


def cross_error(ctx, q_shape, k_shape, options: dict, dtype: str = "float64") -> str:
    """The error text of a bad call on this rank (every rank must raise it before any collective)."""
    q, k = (torch.zeros(shape, dtype=getattr(torch, dtype)) for shape in (q_shape, k_shape))
    try:
        cross_attention(q, k, k, **options)
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
