"""Job functions for tests/torch/test_attention.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from commlib import CommError
from commlib.tools import cases
from commlib_torch import _c10d
from commlib_torch.attention import ulysses_attention

#: The c10d calls a commlib collective can make (torch.distributed's and the names _c10d bound at import).
_COLLECTIVES = (
    "all_to_all_single",
    "all_reduce",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "batch_isend_irecv",
)
_BOUND = ("all_gather_single", "reduce_scatter_single")


@contextlib.contextmanager
def _counting(calls: list):
    """Record ``(name, received bytes)`` of every c10d collective while inside."""
    saved = {}

    def wrap(owner, name):
        original = getattr(owner, name)
        saved[owner, name] = original

        def counted(*args, **kwargs):
            output = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if name == "batch_isend_irecv":  # what its irecvs receive
                received = [op.tensor.reshape(-1) for op in args[0] if op.op is dist.irecv]
                output = torch.cat(received) if received else None  # a rank that receives nothing (an empty shard)
            calls.append((name, 0 if output is None else output.numel() * output.element_size()))
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for name in _COLLECTIVES:
        wrap(dist, name)
    for name in _BOUND:
        wrap(_c10d, name)
    saved[_c10d, "_direct"] = _c10d._direct
    _c10d._direct = lambda group, tensor: None  # every call through torch.distributed's functions, counted there
    try:
        yield
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)


def _inputs(ctx, case: cases.Case, arrays, transposed: bool = False) -> list[torch.Tensor]:
    """This rank's q, k, v as float leaves; `transposed`: non-contiguous views of a [B, H, S, D] layout."""
    dtype = getattr(torch, case.dtype)
    mine = cases.exact_arrays(case, arrays, ctx.rank)  # this rank's rows (torch's exact layout)
    leaves = []
    for name in case.inputs:
        array = mine[name]
        if transposed:
            leaf = torch.tensor(np.swapaxes(array, 1, 2), dtype=dtype).transpose(1, 2)
        else:
            leaf = torch.tensor(array, dtype=dtype)
        leaves.append(leaf.requires_grad_())
    return leaves


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().double().numpy()


def _cotangent(ctx, case: cases.Case, arrays) -> torch.Tensor:
    return torch.tensor(cases.exact_arrays(case, arrays, ctx.rank)["cotangent"], dtype=getattr(torch, case.dtype))


def _result(ctx, case: cases.Case, out: torch.Tensor, leaves) -> tuple[np.ndarray, dict]:
    """This rank's output and gradients in the case's (padded) layout, as `commlib.tools.parity.check` takes."""
    gradients = {name: _numpy(x.grad) for name, x in zip("qkv", leaves, strict=True)}
    return cases.padded_result(case, ctx.rank, _numpy(out), gradients)


def counted_call(ctx, case: cases.Case, arrays, transposed: bool = False):
    """Output, input gradients and the collectives of the forward and of the backward, on this rank."""
    q, k, v = _inputs(ctx, case, arrays, transposed)
    forward, backward = [], []
    with _counting(forward):
        out = ulysses_attention(q, k, v, **cases.attention_kwargs(case))
    with _counting(backward):
        (out * _cotangent(ctx, case, arrays)).sum().backward()
    return *_result(ctx, case, out, (q, k, v)), forward, backward


def _einsum_attention(record: list):
    """A plain-einsum GQA attention (not SDPA) as `attn_fn`, recording what it is called with."""

    def attend(q, k, v, *, causal, scale):
        record.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), causal, scale))
        group = q.shape[2] // k.shape[2]
        keys, values = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), values)

    return attend


def custom_attention(ctx, case: cases.Case, arrays):
    """`attn_fn` = `_einsum_attention`: output, gradients and the calls it received."""
    q, k, v = _inputs(ctx, case, arrays)
    record: list = []
    out = ulysses_attention(q, k, v, attn_fn=_einsum_attention(record), **cases.attention_kwargs(case))
    (out * _cotangent(ctx, case, arrays)).sum().backward()
    return *_result(ctx, case, out, (q, k, v)), record


def forward_only(ctx, case: cases.Case, arrays, mode: str):
    """Output under ``torch.no_grad()`` ("no_grad") or for inputs that don't require grad ("constant"), and
    whether it carries autograd state."""
    q, k, v = (x.detach() for x in _inputs(ctx, case, arrays))
    with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
        out = ulysses_attention(q, k, v, **cases.attention_kwargs(case))
    return cases.padded_result(case, ctx.rank, _numpy(out), {})[0], out.requires_grad or out.grad_fn is not None


def rejected(ctx, shapes: dict, kwargs: dict, dtype: str = "float64"):
    """The error text of a bad call on this rank (shapes by rank or shared) and the collectives it made."""
    tensors = [
        torch.zeros(
            shapes[name][ctx.rank] if isinstance(shapes[name], list) else shapes[name], dtype=getattr(torch, dtype)
        )
        for name in "qkv"
    ]
    calls: list = []
    try:
        with _counting(calls):
            ulysses_attention(*tensors, **kwargs)
    except (CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}", calls
    return None, calls


def checked_case(ctx, case: cases.Case, arrays) -> tuple:
    """`commlib_torch.tools.parity_jobs.run_case` in checked mode (every collective compared first)."""
    from commlib_torch import checked
    from commlib_torch.tools.parity_jobs import run_case

    with checked():
        return run_case(ctx, case, arrays)
