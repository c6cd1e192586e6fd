"""commlib's sequence-parallel attention as a transformers attention implementation (transformers 5.x, read on
5.24): after `register`, a model built with ``attn_implementation="commlib"`` runs, in each attention layer,
the layer of the innermost `commlib_torch.sequence.parallel` context on this rank's shard of the sequence.

transformers is an optional extra (``pip install commlib[transformers]``), imported by `register` only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from commlib import parallel as spec
from commlib.errors import comm_error
from commlib_torch import _failures, _parallel

__all__ = ["attention_forward", "padding_mask", "register"]


def register(name: str = "commlib") -> None:
    """Register `attention_forward` as transformers' attention implementation `name` (``AttentionInterface``),
    and `padding_mask` as its mask function (``AttentionMaskInterface``), so that a padding mask reaches the
    attention and is refused there instead of being dropped. Idempotent.

    Raises:
        ImportError: transformers is not installed.

    Example:
        >>> import transformers
        >>> register()
        >>> "commlib" in transformers.AttentionInterface._global_mapping
        True
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask function for ``attn_implementation="commlib"``: None (the causal mask, which the layer
    applies from global positions) when the model is given no padding mask; else that 2-D mask ``[B, S_r]``
    (this rank's tokens), which `attention_forward` turns into segment ids (padding: -1), unless every rank's mask
    keeps every token (a tokenizer's all-ones mask): decided by the ranks together, once per forward (one int
    all_reduce in the first attention layer), since the ranks of a layer must all pass segment ids or none.
    transformers' own causal or packed mask function (`mask_function`) is not used: the layer masks by the
    context layout's global positions, and `attention_forward` reads packed documents from ``position_ids``
    (``parallel(..., packed=True)``).

    Example:
        >>> padding_mask(2, 4, 4) is None, padding_mask(2, 4, 4, attention_mask=torch.ones(2, 4)).shape
        (True, torch.Size([2, 4]))
    """
    return attention_mask


def attention_forward(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call (``sdpa_attention_forward``'s signature) run by the innermost
    `commlib_torch.sequence.parallel` context's layer: query ``[B, H, S_r, D]``, key and value ``[B, H_kv, S_r,
    D]`` (this rank's rows; GQA by head counts, ``H % H_kv == 0``) -> ``([B, S_r, H, D], None)``, query's dtype.

    Causal from `is_causal`, else the module's ``is_causal`` (default True); `scaling` the softmax scale; a
    layer's ``sliding_window`` (Mistral, Qwen2, Gemma's sliding layers: transformers passes it to the attention)
    becomes the layer's ``mask=commlib.masks.SlidingWindow(sliding_window)``, transformers' own rule (key k seen
    by query q iff ``q - sliding_window < k <= q``) on global positions, so the ring skips what it hides. The
    model's ``position_ids`` (transformers passes them to the attention) must be the global positions of this
    rank's shard, ``layout.positions(shard)`` (RoPE fed local positions is silently wrong); in a
    ``parallel(..., packed=True)`` context, positions of packed documents (``shard_tokens(..., segment_ids=)``'
    second output; `DataCollatorWithFlattening`'s form): they restart at 0 at each document's first token and
    count up by one (across a padding hole of the mask too: a hole is padding inside one document), a token at
    global position g with position p belonging to the document that starts at
    g - p, which becomes its segment id (a document may cross shards). A 2-D padding mask (`padding_mask`) makes
    its zeros padding (segment id -1: output 0, gradient 0); a mask that keeps every token on every rank is
    dropped (the ranks decide together: one int all_reduce per forward), so the layer runs unmasked, as without
    it.
    Both go to the layer as ``segment_ids=``; neither costs anything when absent. Gradient: exact, the layer's.

    Raises:
        CommError: outside a `parallel` context; a custom (not 2-D padding) attention mask, dropout > 0, a sliding
            window not an int >= 1, softcapping, attention sinks, a position bias; query rows not
            ``layout.sizes[shard]``;
            ``position_ids`` not the shard's global positions, or (packed) not packed documents' (negative,
            past the global position, a step other than +1 or a restart at 0, or the local positions 0..n-1
            transformers makes when given none): the first differing ones shown; a padding mask not ``[B, S_r]``;
            the layer's own
            errors. Each rank decides these from its own shard: in checked mode (``COMMLIB_CHECK=1``) the ranks
            of the layer exchange whether any refused (one small all_reduce), and every rank raises -- the others
            "another rank of the layer refused this call" -- where otherwise a rank whose shard passes enters the
            layer's collective alone and waits for the timeout.

    Example (one rank: WORLD of size 1):
        >>> import commlib
        >>> from commlib_torch.sequence import parallel
        >>> q, k = torch.randn(1, 8, 6, 16), torch.randn(1, 2, 6, 16)  # GQA: 8 query heads, 2 kv heads
        >>> with parallel(commlib.SequenceLayout(6)):
        ...     out, weights = attention_forward(None, q, k, k, None, position_ids=torch.arange(6)[None])
        >>> out.shape, weights
        (torch.Size([1, 6, 8, 16]), None)
    """
    state = _parallel.current(spec.CALL_OP)
    segments: list[torch.Tensor | None] = []
    state.refuse_together(lambda: segments.append(_check(state, query, attention_mask, dropout, kwargs)), query.device)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    segment_ids = segments[0]
    if (
        segment_ids is not None
        and attention_mask is not None
        and not state.packed
        and _keeps_every_token(state, module, attention_mask)
    ):
        segment_ids = None  # every rank's mask keeps every token: the same attention, unmasked
    out = state.attend(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=bool(causal),
        scale=scaling,
        segment_ids=segment_ids,
        mask=spec.window_rule(kwargs.get("sliding_window")),  # checked by `_check`
    )
    return out, None


class _Decision(NamedTuple):
    """`_keeps_every_token`'s last answer: for which mask (weakly held) at which version, in which context."""

    mask: weakref.ref
    version: int
    state: weakref.ref
    kept: bool


_LAST: list[_Decision] = []


def _keeps_every_token(state: _parallel.Parallel, module: torch.nn.Module | None, attention_mask: torch.Tensor) -> bool:
    """Whether the 2-D padding mask of every rank of the layer keeps every token (then the layer needs no segment
    ids: one document a row is the unmasked attention). Decided by one int64 all_reduce (MIN) over each of the
    layer's groups in the first attention layer of a forward (``module.layer_idx == 0``) and wherever a layer is
    handed a mask (or an in-place changed version of it) not decided in this context; the other layers of the
    forward reuse the answer. Every rank runs the same layers in the same order and transformers hands every
    layer of a forward the same mask, so the ranks all reduce in the same calls and agree on the answer."""
    last = _LAST[0] if _LAST else None
    if (
        last is not None
        and getattr(module, "layer_idx", 0) != 0
        and last.mask() is attention_mask
        and last.version == attention_mask._version
        and last.state() is state
    ):
        return last.kept
    flag = attention_mask.all().to(torch.int64).reshape(1)
    for group in state.groups():
        _failures.all_reduce(flag, dist.ReduceOp.MIN, group, spec.CALL_OP)
    kept = bool(flag.item())
    _LAST[:] = [_Decision(weakref.ref(attention_mask), attention_mask._version, weakref.ref(state), kept)]
    return kept


def _check(
    state: _parallel.Parallel, query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict
) -> torch.Tensor | None:
    """What `attention_forward` refuses: the spec's call checks, and ``position_ids`` neither the shard's nor
    packed documents'. Returns the segment ids ``[B, S_r]`` of packed documents and padding (None: neither)."""
    refused = any(kwargs.get(name) is not None for name in ("s_aux", "sinks", "position_bias"))
    padding = attention_mask is not None and attention_mask.dim() == 2
    spec.check_call(
        state.plan,
        shard=state.shard,
        rows=query.shape[2],
        mask=attention_mask is not None and not padding,
        bias=refused,
        dropout=dropout,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
    )
    kept = None
    if padding:
        assert attention_mask is not None
        if tuple(attention_mask.shape) != tuple(query.shape[:1]) + tuple(query.shape[2:3]):
            raise comm_error(
                spec.CALL_OP,
                f"a padding attention_mask {tuple(attention_mask.shape)} must be "
                f"[batch, this rank's rows] {(query.shape[0], query.shape[2])}",
                attention=state.plan.attention,
                layout=state.plan.layout,
            )
        kept = attention_mask.to(torch.bool)
    segments = None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        expected = state.positions(position_ids.device)
        if position_ids.shape[-1] != expected.shape[-1] or not (state.packed or bool((position_ids == expected).all())):
            raise spec.positions_error(state.plan, state.shard, position_ids.cpu().numpy())
        if state.packed:
            segments = _documents(state, position_ids, expected, kept)
    if kept is not None:
        segments = torch.where(kept, 0 if segments is None else segments, -1)
    return None if segments is None else segments.expand(query.shape[0], -1).contiguous()


def _documents(
    state: _parallel.Parallel, position_ids: torch.Tensor, expected: torch.Tensor, kept: torch.Tensor | None
) -> torch.Tensor:
    """Segment ids ``[*, S_r]`` of packed documents' positions: g - p, each document named by the global position
    of its first token; the spec's positions error where the positions cannot be a packing. A padding token
    (`kept` False) is a hole: its own position is not read, and the token after it may go on counting (its
    document continues across the hole, as `shard_tokens(..., segment_ids=)` and transformers count it) or
    restart at 0."""
    steps = expected[:, 1:] == expected[:, :-1] + 1  # consecutive global positions within the shard
    after = position_ids[..., 1:]
    counts = (after == position_ids[..., :-1] + 1) | (after == 0)
    bounds = (position_ids < 0) | (position_ids > expected)
    if kept is not None:  # a step into or out of padding, and padding's own position, are not checked
        counts, bounds = counts | ~(kept[..., 1:] & kept[..., :-1]), bounds & kept
    local = torch.arange(expected.shape[-1], device=expected.device)
    if bool(bounds.any() | (steps & ~counts).any()) or (
        bool((position_ids == local).all()) and not bool((expected == local).all())
    ):
        raise spec.positions_error(state.plan, state.shard, position_ids.cpu().numpy())
    return (expected - position_ids).to(torch.int64)
