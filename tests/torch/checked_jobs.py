"""Job functions for tests/torch/test_checked.py's attention layers in checked mode (module level: the pool's
workers import them by name)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import commlib
import commlib_torch
import commlib_torch.sequence
from commlib import CommError
from commlib_torch import _checked
from commlib_torch._checked import checked
from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from tests.torch.attention_jobs import _counting

_GROUPS: dict = {}


def _usp_groups(ctx, ulysses_size: int) -> tuple:
    """USP's (Ulysses group, ring group) of this rank: global rank ``r * U + u`` at ring index r, Ulysses
    index u (every rank makes every group, in the same order; kept for the pool's later jobs)."""
    ring_size = ctx.world_size // ulysses_size
    if ulysses_size not in _GROUPS:
        ulysses = [dist.new_group([r * ulysses_size + u for u in range(ulysses_size)]) for r in range(ring_size)]
        ring = [dist.new_group([r * ulysses_size + u for r in range(ring_size)]) for u in range(ulysses_size)]
        _GROUPS[ulysses_size] = (ulysses, ring)
    ulysses, ring = _GROUPS[ulysses_size]
    return ulysses[ctx.rank // ulysses_size], ring[ctx.rank % ulysses_size]


def _inputs(ctx, rows: int, heads: int, dtype: str) -> list[torch.Tensor]:
    """This rank's q ``[1, rows, heads, 8]``, k and v ``[1, rows, 2, 8]``, seeded by rank, requiring grad."""
    generator = torch.Generator().manual_seed(ctx.rank)
    shapes = [(1, rows, heads, 8), (1, rows, 2, 8), (1, rows, 2, 8)]
    return [torch.randn(shape, generator=generator, dtype=getattr(torch, dtype)).requires_grad_() for shape in shapes]


def _call(ctx, layer: str, q, k, v, options: dict) -> torch.Tensor:
    if layer == "all_reduce":  # a collective where the other ranks call a layer
        return commlib_torch.all_reduce(q)
    if layer == "usp_attention":
        return usp_attention(q, k, v, *_usp_groups(ctx, options.pop("ulysses_size")), **options)
    return {"ulysses_attention": ulysses_attention, "ring_attention": ring_attention}[layer](q, k, v, **options)


def layer_call(ctx, calls: list, check: bool = True):
    """Rank r calls ``calls[r] = (layer, rows, options)`` (q ``[1, rows, 4, 8]``, k and v ``[1, rows, 2, 8]``,
    float32; options may give ``heads``, ``dtype`` and, for USP, ``ulysses_size``), checked or not, forward
    and backward: ("ok", output, the c10d collectives) or ("error", type name, message, the collectives made
    before the error)."""
    layer, rows, options = calls[ctx.rank]
    options = dict(options)
    layout = options.get("layout")
    if isinstance(layout, tuple):  # a SequenceLayout's fields (pickled as a tuple)
        options["layout"] = commlib.SequenceLayout(*layout)
    if options.get("segment_ids") == "one document":  # a tensor: every row in document 0
        options["segment_ids"] = torch.zeros((1, rows), dtype=torch.int64)
    q, k, v = _inputs(ctx, rows, options.pop("heads", 4), options.pop("dtype", "float32"))
    collectives: list = []
    try:
        with checked(check), _counting(collectives):
            out = _call(ctx, layer, q, k, v, options)
            out.sum().backward()
    except (CommError, TypeError) as error:
        return "error", type(error).__name__, str(error), collectives
    return "ok", out.detach().double().numpy(), collectives


def unchecked_never_exchanges(ctx, calls: list):
    """`layer_call` unchecked with `_checked.exchange_layer` replaced by a function that fails the job: the
    outputs (checked mode off, the layers never build or send a fingerprint)."""
    saved = _checked.exchange_layer

    def refuse(*args, **kwargs):
        raise AssertionError("exchange_layer called with checked mode off")

    modules = [_checked]  # the layers' one call path (`_checked.LayerFrontend`) looks it up there
    for module in modules:
        module.exchange_layer = refuse
    try:
        return layer_call(ctx, calls, check=False)
    finally:
        for module in modules:
            module.exchange_layer = saved


def _parameter(shape) -> torch.Tensor:
    """A parameter of `shape` (or ``(shape, dtype)``) with a gradient of ones."""
    shape, dtype = (
        shape if isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[1], str) else (shape, "float32")
    )
    parameter = torch.zeros(shape, dtype=getattr(torch, dtype), requires_grad=True)
    parameter.grad = torch.ones_like(parameter)
    return parameter


def helper_call(ctx, calls: list):
    """Rank r calls ``calls[r] = (helper, options)`` of `commlib_torch.sequence` in checked mode: gather_sequence
    on x ``[1, layout.sizes[rank], 3]`` (options: ``layout`` as SequenceLayout fields, ``dim``, ``convention``),
    cross_entropy on logits ``[1, 4, 5]`` (options: ``ignore_index``): ("ok", output, collectives) or ("error",
    type name, message, the collectives made before the error)."""
    helper, options = calls[ctx.rank]
    options = dict(options)
    collectives: list = []
    try:
        with checked(), _counting(collectives):
            if helper == "sync_gradients":  # parameters of `shapes` (float32 but where a (shape, dtype) pair)
                parameters = [_parameter(shape) for shape in options.pop("shapes")]
                commlib_torch.sequence.sync_gradients(parameters, **options)
                return "ok", np.concatenate([p.grad.double().numpy().ravel() for p in parameters]), collectives
            if helper == "gather_sequence":
                layout = options["layout"] = commlib.SequenceLayout(*options["layout"])
                x = torch.randn(1, layout.sizes[ctx.rank], 3, requires_grad=True)
                out = commlib_torch.sequence.gather_sequence(x, group=None, **options)
            else:
                logits, labels = torch.randn(1, 4, 5, requires_grad=True), torch.tensor([[1, 2, -100, 3]])
                out = commlib_torch.sequence.cross_entropy(logits, labels, **options)
    except (CommError, TypeError) as error:
        return "error", type(error).__name__, str(error), collectives
    return "ok", out.detach().double().numpy(), collectives
