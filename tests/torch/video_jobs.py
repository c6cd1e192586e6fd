"""Pool jobs for tests/torch/test_video.py: the video helpers on this rank against the spec's float64 references
(`commlib.reference.video`) for every layout of `tests.video_cases` at the pool's world size, and bad input's
texts. Each job returns, per layout, this rank's largest errors (0.0 where the helper must be exact)."""

from __future__ import annotations

import numpy as np
import torch

from commlib import CommError, SequenceLayout
from commlib.reference import video as reference
from commlib_torch import video
from tests.video_cases import data, layouts


def _error(got: torch.Tensor, expected) -> float:
    expected = np.asarray(expected)
    assert tuple(got.shape) == expected.shape, (tuple(got.shape), expected.shape)
    assert got.dtype in (torch.float64, torch.int64), got.dtype
    return float(np.abs(got.detach().numpy() - expected).max(initial=0.0))


def _shard(layout: SequenceLayout, case: dict, rank: int) -> list[float]:
    x = torch.from_numpy(case["x"]).requires_grad_()
    out = video.shard_latents(x, layout)
    (out * torch.from_numpy(case["shard_cotangents"][rank])).sum().backward()
    outputs, grads = reference.shard_latents_reference(case["x"], case["shard_cotangents"], layout)
    assert grads is not None
    return [_error(out, outputs[rank]), _error(x.grad, grads[rank])]


def _gather(layout: SequenceLayout, case: dict, rank: int, convention: str) -> list[float]:
    shards, _ = reference.shard_latents_reference(case["x"], None, layout)
    tokens = torch.from_numpy(shards[rank]).requires_grad_()
    out = video.gather_latents(tokens, layout, convention=convention)
    (out * torch.from_numpy(case["gather_cotangents"][rank])).sum().backward()
    outputs, grads = reference.gather_latents_reference(
        shards, case["gather_cotangents"], layout, convention=convention
    )
    return [_error(out, outputs[rank]), _error(tokens.grad, grads[rank])]


def helpers(ctx, seed: int = 0) -> dict[str, list[float]]:
    """grid_position_ids, shard_latents (output, x's gradient), gather_latents "sum" and "replicated" (output,
    the tokens' gradient) on every layout: {layout: [7 errors]}."""
    results = {}
    for layout in layouts(ctx.world_size):
        case = data(layout, seed)
        errors = [_error(video.grid_position_ids(layout), layout.grid_positions(ctx.rank))]
        errors += _shard(layout, case, ctx.rank)
        errors += _gather(layout, case, ctx.rank, "sum") + _gather(layout, case, ctx.rank, "replicated")
        results[repr(layout)] = errors
    return results


def bad_input(ctx) -> list[str]:
    """Each bad call's error, ``"<type>: <text>"`` (or "no error"), on this rank."""
    W = ctx.world_size
    layout = SequenceLayout(12, ring_size=W, grid=(2, 2, 3))
    own = layout.sizes[ctx.rank]
    calls = [
        lambda: video.shard_latents(torch.zeros(1, 4, 2, 3, 2), layout),
        lambda: video.shard_latents(torch.zeros(1, 4, 12), SequenceLayout(12, ring_size=W)),
        lambda: video.shard_latents(np.zeros((1, 4, 2, 2, 3)), layout),
        lambda: video.shard_latents(torch.zeros(1, 4, 2, 2, 3), SequenceLayout(12, ring_size=W + 1, grid=(2, 2, 3))),
        lambda: video.gather_latents(torch.zeros(1, own + 1, 4), layout),
        lambda: video.gather_latents(torch.zeros(1, own, 4), layout, convention="mean"),
        lambda: video.grid_position_ids(SequenceLayout(12, ring_size=W)),
        lambda: video.grid_position_ids("layout"),
    ]
    messages = []
    for call in calls:
        try:
            call()
        except (CommError, TypeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append("no error")
    return messages
