"""Job functions for tests/torch/test_chunks.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from commlib.tools import cases
from commlib_torch import attention as layer
from commlib_torch import handle
from tests import mask_cases as masks
from tests.torch.attention_jobs import _cotangent, _counting, _inputs, _result


def chunked(ctx, case: cases.Case, arrays, chunks: tuple[int, ...]) -> dict:
    """{c: (output, {name: gradient})} of the case on this rank for chunks=1 and every c (the case's layout)."""
    results = {}
    for count in (1, *chunks):
        q, k, v = _inputs(ctx, case, arrays)
        out = layer.ulysses_attention(q, k, v, chunks=count, **cases.attention_kwargs(case))
        (out * _cotangent(ctx, case, arrays)).sum().backward()
        results[count] = _result(ctx, case, out, (q, k, v))
    return results


def pipeline_order(ctx, case: cases.Case, arrays, chunks: int) -> tuple[list, list, list, list]:
    """The forward's and the backward's events in order on this rank: ``("all_to_all_single", bytes)`` for
    each c10d all-to-all and ``("attention", q heads)`` for each head group's attention; then the collectives
    begun asynchronously (`commlib_torch.Handle`: their plans' step names) in the forward and in the backward."""
    forward: list = []
    begun: dict[str, list] = {"forward": [], "backward": []}
    phase = "forward"
    begin = handle._begin

    def counted(plan, x, group):
        begun[phase].append(plan.step.name)
        return begin(plan, x, group)

    def attend(q, k, v, **kwargs):
        forward.append(("attention", q.shape[2]))
        return layer.attention(q, k, v, **kwargs)

    q, k, v = _inputs(ctx, case, arrays)
    handle._begin = counted
    try:
        with _counting(forward):
            out = layer.ulysses_attention(q, k, v, chunks=chunks, attn_fn=attend, **cases.attention_kwargs(case))
        backward: list = []
        phase = "backward"
        with _counting(backward):
            (out * _cotangent(ctx, case, arrays)).sum().backward()
    finally:
        handle._begin = begin
    return forward, backward, begun["forward"], begun["backward"]


def segments(ctx, layout, whole: list, ids, chunks: int) -> dict:
    """{c: [out, dq, dk, dv]} (float64 numpy) on this rank's exact shard with segment ids, causal, for chunks=1
    and `chunks`."""
    shard = [masks.shards(x, layout)[ctx.rank] for x in whole]
    mine = torch.tensor(masks.shards(ids, layout)[ctx.rank])
    results = {}
    for count in (1, chunks):
        leaves = [torch.tensor(x).requires_grad_() for x in shard[:3]]
        out = layer.ulysses_attention(*leaves, causal=True, layout=layout, segment_ids=mine, chunks=count)
        (out * torch.tensor(shard[3])).sum().backward()
        results[count] = [out.detach().numpy(), *(leaf.grad.numpy() for leaf in leaves)]
    return results


def compiled(ctx, chunks: int) -> tuple[int, float, float]:
    """(graph breaks, max |eager - compiled| of the output, of dq, dk, dv) of ``ulysses_attention(...,
    chunks=chunks)`` under torch.compile(fullgraph=True, backend="aot_eager"), GQA, causal; compiled first."""
    generator = torch.Generator().manual_seed(ctx.rank)
    shapes = [(1, 5, 4 * ctx.world_size, 8), (1, 5, 2 * ctx.world_size, 8), (1, 5, 2 * ctx.world_size, 8)]
    inputs = [torch.randn(shape, generator=generator) for shape in shapes]
    cotangent = torch.randn(1, 5, 4 * ctx.world_size, 8, generator=generator)

    def call(q, k, v):
        return layer.ulysses_attention(q, k, v, causal=True, chunks=chunks)

    def value_and_grads(fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        (out * cotangent).sum().backward()
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    torch._dynamo.reset()
    counters.clear()
    got = value_and_grads(torch.compile(call, fullgraph=True, backend="aot_eager"))
    breaks = sum(counters["graph_break"].values())
    want = value_and_grads(call)
    torch._dynamo.reset()
    return (
        breaks,
        float((got[0] - want[0]).abs().max()),
        max(float((a - b).abs().max()) for a, b in zip(got[1:], want[1:], strict=True)),
    )
