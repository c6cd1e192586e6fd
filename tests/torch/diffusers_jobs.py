"""Job functions for tests/torch/test_diffusers.py (module-level: the pool's workers import them by name): the tiny
Wan and Flux of examples/diffusers_dit.py through `commlib_torch.integrations.diffusers`."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commlib
from commlib_torch.integrations import diffusers as integration
from commlib_torch.sequence import parallel, sync_gradients

_PATH = Path(__file__).resolve().parents[2] / "examples" / "diffusers_dit.py"
_SPEC = importlib.util.spec_from_file_location("diffusers_dit_example", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)


def _error(call) -> str:
    try:
        call()
    except (commlib.CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _layout(attention: str, tokens: int, world: int, layout: str = "zigzag") -> commlib.SequenceLayout:
    if attention == "ulysses":
        return commlib.SequenceLayout(tokens, ulysses_size=world)
    return commlib.SequenceLayout(tokens, ring_size=world, layout=layout)


def model_step(ctx, model: str, attention: str) -> dict[str, float]:
    """One step of the tiny `model` (wan | flux) over WORLD (`attention`: ulysses | ring) against the same model
    unsharded on this rank: the relative errors of the output and of every parameter's summed gradient."""
    torch.manual_seed(0)
    reference, inputs, tokens, target = (example.wan if model == "wan" else example.flux)(2)
    reference = reference.to(torch.float64)
    sharded = integration.parallelize(copy.deepcopy(reference))
    # Flux's joint attention on the ring takes even shards only: its 15 image tokens as 3 contiguous blocks of 5.
    layout = _layout(attention, tokens, ctx.world_size, "contiguous" if model == "flux" else "zigzag")
    with parallel(layout, attention=attention), example.float64_kept():
        (out,) = sharded(**inputs)
        F.mse_loss(out, target).backward()
        sync_gradients(sharded.parameters())
        (want,) = reference(**inputs)
        F.mse_loss(want, target).backward()
    pairs = zip(sharded.parameters(), reference.parameters(), strict=True)
    gradients = [example.relative(p.grad, q.grad) for p, q in pairs]
    return {"output": example.relative(out.detach(), want.detach()), "gradients": max(gradients)}


def refusals(ctx) -> dict[str, str]:
    """The error text of every call the route refuses, on this rank (W ranks)."""
    torch.manual_seed(0)
    wan, inputs, tokens, _ = example.wan(1)
    wan = integration.parallelize(wan.to(torch.float64))
    flux, flux_inputs, flux_tokens, _ = example.flux(1)
    flux = integration.parallelize(flux.to(torch.float64))
    layout = _layout("ulysses", tokens, ctx.world_size)
    rows = layout.sizes[ctx.rank]
    q = torch.ones(1, rows, 4, 8, dtype=torch.float64)

    def call(**kwargs):
        token = integration._CALL.set(("WanAttnProcessor", kwargs.pop("route", "self")))
        try:
            with parallel(layout):
                integration.attention(kwargs.pop("query", q), q, q, **kwargs)
        finally:
            integration._CALL.reset(token)

    def run(model, arguments, within):
        with within:
            model(**arguments)

    class Unknown:  # an attention processor the route does not know
        _attention_backend = None

    def unknown_processor():
        other = copy.deepcopy(wan)
        other.blocks[0].attn1.processor = Unknown()
        integration.parallelize(other)

    def own_parallelism():
        other, *_ = example.wan(1)
        other.blocks[1].attn2.processor._parallel_config = object()
        integration.parallelize(other)

    ring = parallel(_layout("ring", flux_tokens, ctx.world_size), attention="ring")
    return {
        "outside": _error(lambda: integration.attention(q, q, q)),
        "no module": _error(lambda: _in(parallel(layout), lambda: integration.attention(q, q, q))),
        "mask": _error(lambda: call(attn_mask=torch.ones(1, 1, rows, rows, dtype=torch.bool))),
        "dropout": _error(lambda: call(dropout_p=0.1)),
        "lse": _error(lambda: call(return_lse=True)),
        "causal cross": _error(lambda: call(route="cross", is_causal=True)),
        "rows": _error(lambda: call(query=torch.ones(1, rows + 1, 4, 8, dtype=torch.float64))),
        "tokens": _error(lambda: run(wan, inputs, parallel(_layout("ulysses", tokens + 1, ctx.world_size)))),
        "joint uneven ring": _error(lambda: run(flux, flux_inputs, ring)),
        "unknown processor": _error(unknown_processor),
        "no plan": _error(lambda: integration.parallelize(torch.nn.Linear(2, 2))),
        "own parallelism": _error(own_parallelism),
    }


def _in(context, call) -> None:
    with context:
        call()


def world(ctx) -> int:
    return dist.get_world_size()
