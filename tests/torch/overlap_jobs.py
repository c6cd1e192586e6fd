"""Job functions for tests/torch/test_overlap.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import contextlib
import functools

import torch

from commlib import SequenceLayout
from commlib_torch import ring
from tests import mask_cases as masks
from tests.torch.mask_jobs import _call


@contextlib.contextmanager
def sequential():
    """The ring walked in the sequential order while inside: each step's send completed before its pieces."""
    forward, backward = ring._forward, ring._backward
    ring._forward = functools.partial(forward, overlap=False)
    ring._backward = functools.partial(backward, overlap=False)
    try:
        yield
    finally:
        ring._forward, ring._backward = forward, backward


def _once(op: str, layout: SequenceLayout, name, shard: list, ids, causal: bool, dtype: str) -> list:
    leaves = [torch.tensor(x, dtype=getattr(torch, dtype)).requires_grad_() for x in shard[:3]]
    out = _call(op, layout, name, *leaves, causal=causal, segment_ids=None if ids is None else torch.tensor(ids))
    (out * torch.tensor(shard[3], dtype=out.dtype)).sum().backward()
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def overlapped_and_sequential(
    ctx, op: str, layout: SequenceLayout, name, whole: list, ids, causal: bool, dtype: str
) -> tuple[list, list, int]:
    """This rank's ``[out, dq, dk, dv]`` overlapped and sequential (float64 numpy of the tensors, bit for bit),
    and how many ring steps the overlapped call began asynchronously (``batch_isend_irecv`` calls)."""
    shard = [masks.shards(x, layout)[ctx.rank] for x in whole]
    mine = None if ids is None else masks.shards(ids, layout)[ctx.rank]
    started = []
    original = torch.distributed.batch_isend_irecv

    def counted(ops):
        started.append(len(ops))
        return original(ops)

    torch.distributed.batch_isend_irecv = counted
    try:
        overlapped = _once(op, layout, name, shard, mine, causal, dtype)
    finally:
        torch.distributed.batch_isend_irecv = original
    with sequential():
        walked = _once(op, layout, name, shard, mine, causal, dtype)
    return ([x.double().numpy() for x in overlapped], [x.double().numpy() for x in walked], len(started))
