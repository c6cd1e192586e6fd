"""commlib's sequence-parallel attention as a transformers attention implementation (transformers 5.x, read on
5.24): after `register`, a model built with ``attn_implementation="commlib"`` runs, in each attention layer,
the layer of the innermost `commlib_torch.sequence.parallel` context on this rank's shard of the sequence.

transformers is an optional extra (``pip install commlib[transformers]``), imported by `register` only.
"""

from __future__ import annotations

import torch

from commlib import parallel as spec
from commlib_torch import _parallel

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


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' mask function for ``attn_implementation="commlib"``: None (the causal mask, which the layer
    applies from global positions) when the model's 2-D padding mask is absent or keeps every token; else that
    mask, which `attention_forward` refuses (commlib owns no padding mask). transformers' own causal or packed
    mask function (`mask_function`) is not used: the layer masks by the context layout's global positions, and
    `attention_forward` checks the model's ``position_ids`` against them.

    Example:
        >>> padding_mask(2, 4, 4, attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
        True
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def attention_forward(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention call (``sdpa_attention_forward``'s signature) run by the innermost
    `commlib_torch.sequence.parallel` context's layer: query ``[B, H, S_r, D]``, key and value ``[B, H_kv, S_r,
    D]`` (this rank's rows; GQA by head counts, ``H % H_kv == 0``) -> ``([B, S_r, H, D], None)``, query's dtype.

    Causal from `is_causal`, else the module's ``is_causal`` (default True); `scaling` the softmax scale. The
    model's ``position_ids`` (transformers passes them to the attention) must be the global positions of this
    rank's shard, ``layout.positions(shard)``: RoPE fed local positions is silently wrong. Gradient: exact, the
    layer's.

    Raises:
        CommError: outside a `parallel` context; a padding or custom attention mask, dropout > 0, a sliding
            window, softcapping, attention sinks, a position bias; query rows not ``layout.sizes[shard]``;
            ``position_ids`` not the shard's global positions (the first differing ones shown); the layer's own
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
    state.refuse_together(lambda: _check(state, query, attention_mask, dropout, kwargs), query.device)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = state.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=bool(causal),
                       scale=scaling)
    return out, None


def _check(state: _parallel.Parallel, query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
           kwargs: dict) -> None:
    """What `attention_forward` refuses: the spec's call checks, and ``position_ids`` other than the shard's."""
    refused = any(kwargs.get(name) is not None for name in ("s_aux", "sinks", "position_bias"))
    spec.check_call(state.plan, shard=state.shard, rows=query.shape[2], mask=attention_mask is not None,
                    bias=refused, dropout=dropout, sliding_window=kwargs.get("sliding_window"),
                    softcap=kwargs.get("softcap"))
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        expected = state.positions(position_ids.device)
        if position_ids.shape[-1] != expected.shape[-1] or not bool((position_ids == expected).all()):
            raise spec.positions_error(state.plan, state.shard, position_ids.cpu().numpy())
