"""Job functions for tests/torch/test_masks.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from commlib import CommError, SequenceLayout
from commlib_torch import ring
from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from commlib_torch.tools.parity_jobs import usp_groups
from tests import mask_cases as masks


@contextlib.contextmanager
def _counting_pieces(counts: list):
    """Count the pieces the ring attends (`commlib_torch.ring._attend` calls) while inside."""
    original = ring._attend

    def counted(*args, **kwargs):
        counts.append(1)
        return original(*args, **kwargs)

    ring._attend = counted
    try:
        yield
    finally:
        ring._attend = original


def _call(op: str, layout: SequenceLayout, name, q, k, v, **kwargs) -> torch.Tensor:
    """`op` on this rank's shard; `name` is the layout the call is given (a string, or the `SequenceLayout`)."""
    if op == "usp_attention":
        return usp_attention(q, k, v, *usp_groups(layout.world_size, layout.ulysses_size), layout=name, **kwargs)
    if op == "ulysses_attention":
        return ulysses_attention(q, k, v, layout=name, **kwargs)
    return ring_attention(q, k, v, layout=name, **kwargs)


def masked_call(
    ctx,
    op: str,
    layout: SequenceLayout,
    name,
    whole: list,
    ids,
    causal: bool,
    dtype: str = "float64",
    segments: bool = True,
    rule=None,
):
    """This rank's output, dq, dk, dv (float64 numpy) of `op` with segment ids on its exact shard (and the mask
    rule `rule`, None: none), and the pieces the ring attended (forward and backward)."""
    shard = [masks.shards(x, layout)[ctx.rank] for x in whole]
    leaves = [torch.tensor(x, dtype=getattr(torch, dtype)).requires_grad_() for x in shard[:3]]
    segment_ids = torch.tensor(masks.shards(ids, layout)[ctx.rank]) if segments and ids is not None else None
    counts: list = []
    with _counting_pieces(counts):
        extra = {} if rule is None else {"mask": rule}
        out = _call(op, layout, name, *leaves, causal=causal, segment_ids=segment_ids, **extra)
        (out * torch.tensor(shard[3], dtype=out.dtype)).sum().backward()
    return [out.detach().double().numpy(), *(leaf.grad.double().numpy() for leaf in leaves)], len(counts)


def rejected_rule(ctx, op: str, rule) -> str:
    """The error text of a call with a bad mask rule on this rank (nothing communicated before it)."""
    q = torch.zeros((1, 3, 2, 4), dtype=torch.float64)
    layout = SequenceLayout(3 * ctx.world_size, ring_size=ctx.world_size // 2, ulysses_size=2)
    try:
        _call(op, layout, "contiguous", q, q, q, mask=rule)
    except (CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def rejected(ctx, op: str, shape: tuple, ids_shape: tuple, ids_dtype: str) -> str:
    """The error text of a call with bad segment ids on this rank (nothing communicated before it)."""
    q = torch.zeros(shape, dtype=torch.float64)
    ids = torch.zeros(ids_shape, dtype=getattr(torch, ids_dtype))
    layout = SequenceLayout(shape[1] * ctx.world_size, ring_size=ctx.world_size // 2, ulysses_size=2)
    try:
        _call(op, layout, "contiguous", q, q, q, segment_ids=ids)
    except (CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def nan_and_blind_rows(ctx, op: str, layout: SequenceLayout, whole: list, dtype: str):
    """Output and dq (numpy) with a NaN in q's row 1 and a query row 2 whose every score is -inf (q = -inf in
    one dim, every key positive there), no segment ids."""
    shard = [np.array(masks.shards(x, layout)[ctx.rank]) for x in whole]
    leaves = [torch.tensor(x, dtype=getattr(torch, dtype)).requires_grad_() for x in shard[:3]]
    out = _call(op, layout, layout.layout, *leaves, causal=True)
    (out * torch.tensor(shard[3], dtype=out.dtype)).sum().backward()
    return out.detach().double().numpy(), leaves[0].grad.double().numpy()


def rejected_kind(ctx, op: str, argument: str, check: bool) -> str:
    """The error text of a layer call given a Python list as `argument` (q or segment_ids) on this rank, in
    checked mode or not (nothing communicated before it)."""
    from commlib_torch import checked

    q = torch.zeros((1, 3, 2, 4), dtype=torch.float64)
    inputs: dict = {"q": q, "segment_ids": torch.zeros((1, 3), dtype=torch.int64)}
    inputs[argument] = [[0, 0, 0]] if argument == "segment_ids" else q.tolist()
    layout = SequenceLayout(3 * ctx.world_size, ring_size=ctx.world_size // 2, ulysses_size=2)
    try:
        with checked(check):
            _call(op, layout, "contiguous", inputs["q"], q, q, segment_ids=inputs["segment_ids"])
    except (CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def nan_in_k_rows(ctx, op: str, layout: SequenceLayout):
    """This rank's ``[out, dq, dk, dv]`` (float64 numpy) for every row of `masks.NAN_K_CASES`
    (NaNs in k; `masks.nan_in_k`) of `op` on `layout`, in the table's order (padding rows skipped at S = 1)."""
    replies = []
    for where, causal, segmented, value_dim in masks.NAN_K_CASES:
        if where == "padding" and layout.seq_len < 4:
            continue
        whole, ids = masks.nan_in_k(layout.seq_len, where, segmented, value_dim)
        replies.append(masked_call(ctx, op, layout, layout, whole, ids, causal, segments=segmented)[0])
    return replies


def rule_sweep(ctx, op: str, layout: SequenceLayout, name, whole: list, rules: list, ids=None) -> list:
    """This rank's ``[out, dq, dk, dv]`` and the pieces the ring attended, for each rule of `rules` with causal
    False then True (`masked_call` with ``mask=``), in that order."""
    return [
        masked_call(ctx, op, layout, name, whole, ids, causal, segments=ids is not None, rule=rule)
        for rule in rules
        for causal in (False, True)
    ]
