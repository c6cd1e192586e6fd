"""commlib's sequence-parallel attention as a diffusers attention backend (diffusers 0.42, read on 0.42.1): after
`parallelize(model)`, a diffusers transformer run inside `commlib_torch.sequence.parallel(layout, ...)` shards its
tokens at the model's input edge by the layout (any token count: shard i holds ``layout.sizes[i]`` rows), runs
each attention call on this rank's shard with commlib's layers and gathers the output at its output edge, so the
model's output is the whole one on every rank.

What each attention call becomes is decided by its processor (diffusers' processors call `dispatch_attention_fn`,
which calls the backend with ``[B, S, H, D]`` query, key and value and nothing about the call):

- Wan (`WanAttnProcessor`): self-attention over the video tokens -> the context's layer (Ulysses, ring, USP);
  cross-attention to the text (and image) states -> `commlib_torch.attention.cross_attention(..., kv="replicated")`
  (local, no communication).
- Flux (`FluxAttnProcessor`): the text tokens stay replicated, the image tokens are sharded; the joint attention
  over ``[text | image]`` (double- and single-stream blocks) -> the context's layer (Ulysses, ring or USP) with
  ``joint_q=, joint_k=, joint_v=, joint_position="front"`` (ring and USP refuse joint tensors over uneven shards).

diffusers is an optional extra (``pip install commlib[diffusers]``), imported by `register` and `parallelize` only.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
from typing import Any

import torch

from commlib.errors import CommError, comm_error
from commlib_torch import _parallel
from commlib_torch.cross_attention import cross_attention
from commlib_torch.sequence import gather_sequence

__all__ = ["attention", "parallelize", "register"]

OP_NAME = "commlib_torch.integrations.diffusers"  # the integration, as its errors name it
BACKEND = "commlib"  # the diffusers attention backend's name


@dataclasses.dataclass(frozen=True)
class _Take:
    """An input edge: this rank's rows of a replicated tensor along `dim` (diffusers' ``ContextParallelInput``:
    of the module's output with `output`; skipped where `ndim` is given and the tensor has another)."""

    dim: int
    ndim: int | None = None
    output: bool = False


@dataclasses.dataclass(frozen=True)
class _Gather:
    """The output edge: every rank's rows gathered along `dim` (diffusers' ``ContextParallelOutput``)."""

    dim: int


#: Each model's edges: module name ("" the model) -> {argument name or output index: _Take}, or a _Gather of its
#: output. Wan's is its own ``_cp_plan``; Flux's keeps the text (``encoder_hidden_states``, ``txt_ids``)
#: replicated, where diffusers' shards it: the text joins the attention as commlib's joint tensors.
_EDGES: dict[str, dict[str, Any]] = {
    "WanTransformer3DModel": {
        "rope": {0: _Take(1, 4, output=True), 1: _Take(1, 4, output=True)},
        "blocks.0": {"hidden_states": _Take(1, 3)},
        "": {"timestep": _Take(1, 2)},
        "proj_out": _Gather(1),
    },
    "FluxTransformer2DModel": {
        "": {"hidden_states": _Take(1, 3), "img_ids": _Take(0)},
        "proj_out": _Gather(1),
    },
}

#: What each known processor's attention calls are: "self" (the video tokens, sharded) or "cross" (to replicated
#: kv) by whether the module was called with ``encoder_hidden_states``; "joint": ``[text | sharded tokens]``.
_ROUTES = {"WanAttnProcessor": ("self", "cross"), "FluxAttnProcessor": ("joint", "joint")}

#: The attention call in flight: (processor's name, "self" | "cross" | "joint"), set by each attention module's
#: forward pre-hook, cleared after it.
_CALL: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("commlib_diffusers_call", default=None)


def register() -> None:
    """Register `attention` as diffusers' attention backend ``"commlib"`` (``AttentionBackendName("commlib")``,
    ``model.set_attention_backend("commlib")``). Idempotent; `parallelize` calls it.

    Raises:
        ImportError: diffusers is not installed.

    Example:
        >>> from diffusers.models.attention_dispatch import AttentionBackendName
        >>> register()
        >>> AttentionBackendName("commlib").value
        'commlib'
    """
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    names = AttentionBackendName
    if BACKEND not in names._value2member_map_:  # diffusers' names are a closed Enum: add one member to it
        member = str.__new__(names, BACKEND)
        member._name_, member._value_ = BACKEND.upper(), BACKEND
        names._member_map_[member._name_] = member
        names._value2member_map_[BACKEND] = member
        names._member_names_.append(member._name_)
    _AttentionBackendRegistry.register(names(BACKEND))(attention)


def parallelize(model: torch.nn.Module) -> torch.nn.Module:
    """Prepare a diffusers transformer for `commlib_torch.sequence.parallel`: `register` the backend, set it on
    every attention processor, and hook the model's edges (its input tokens taken by the context's layout, its
    output gathered). Returns `model`. Idempotent. Outside a context the hooked model refuses to run.

    Inside ``parallel(layout, ...)`` the layout's ``seq_len`` is the model's number of sharded tokens (Wan: the
    video tokens after patchify, ``F/p_t * H/p_h * W/p_w``; Flux: the image tokens). The output is the whole one
    on every rank; its backward takes this rank's rows of the cotangent (``gather_sequence(...,
    convention="replicated")``: every rank computes the same loss from it), and the input edge's backward puts
    this rank's rows' cotangent in place (zeros elsewhere, no communication), so each rank's parameter gradients
    are its tokens' part: `commlib_torch.sequence.sync_gradients` sums them into the unsharded model's.

    Raises:
        CommError: a model with no edge plan here (known: Wan, Flux), an attention processor the route does not
            know, or diffusers' own context parallelism enabled on the model.

    Example:
        >>> from diffusers import WanTransformer3DModel
        >>> config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=8)
        >>> model = parallelize(WanTransformer3DModel(**config, freq_dim=8, ffn_dim=16, num_layers=1))
        >>> model.blocks[0].attn1.processor._attention_backend.value
        'commlib'
    """
    register()
    name = type(model).__name__
    if name not in _EDGES:
        raise comm_error(
            OP_NAME,
            f"{name} has no edge plan (which inputs are sharded, which output gathered); known: {', '.join(_EDGES)}",
            model=name,
        )
    for module_name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(module, "set_processor"):
            continue
        kind = type(processor).__name__
        if kind not in _ROUTES:
            raise comm_error(
                OP_NAME,
                f"the attention processor {kind} of {module_name!r} is not one the route knows "
                f"({', '.join(_ROUTES)}): its calls could not be told apart (self, cross or joint attention)",
                model=name,
            )
        if getattr(processor, "_parallel_config", None) is not None:
            raise _own_parallelism(name)
        if not getattr(module, "_commlib_hooked", False):
            module.register_forward_pre_hook(_calling(kind), with_kwargs=True)
            module.register_forward_hook(_called, always_call=True)
            setattr(module, "_commlib_hooked", True)  # noqa: B010 (a module attribute mypy cannot type)
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    # this model's processors; diffusers also makes it every model's default, and other models keep theirs:
    set_attention_backend: Any = model.set_attention_backend  # ModelMixin's (mypy: Tensor)
    set_attention_backend(BACKEND)
    _AttentionBackendRegistry.set_active_backend(active)
    if not getattr(model, "_commlib_edges", False):
        modules = dict(model.named_modules())
        for module_name, edge in _EDGES[name].items():
            _hook_edge(modules[module_name], edge, module_name)
        setattr(model, "_commlib_edges", True)  # noqa: B010
    return model


def _own_parallelism(model: str) -> CommError:
    return comm_error(
        OP_NAME,
        "diffusers' own context parallelism is enabled on this model (a parallel_config): commlib's parallel(...) "
        "shards the tokens itself; use one of the two",
        model=model,
    )


def _calling(kind: str) -> Any:
    """The forward pre-hook of an attention module whose processor is `kind`: the call in flight."""
    self_route, cross_route = _ROUTES[kind]

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        cross = bound.get("encoder_hidden_states") is not None
        setattr(module, "_commlib_token", _CALL.set((kind, cross_route if cross else self_route)))  # noqa: B010

    return hook


def _called(module: torch.nn.Module, args: tuple, output: Any) -> None:
    token = getattr(module, "_commlib_token", None)
    if token is not None:
        _CALL.reset(token)
        setattr(module, "_commlib_token", None)  # noqa: B010


def _take(x: Any, take: _Take, name: str) -> Any:
    """This rank's rows of `x` along ``take.dim`` (the context's layout's positions of its shard)."""
    if not torch.is_tensor(x) or (take.ndim is not None and x.dim() != take.ndim):
        return x
    state = _parallel.current(OP_NAME)
    dim = take.dim % x.dim()
    if x.shape[dim] != state.plan.layout.seq_len:
        raise comm_error(
            OP_NAME,
            f"{name}.shape[{dim}] ({x.shape[dim]}) must be the layout's seq_len ({state.plan.layout.seq_len}): "
            "the model's tokens are what the parallel(...) context shards",
            shape=tuple(x.shape),
            layout=state.plan.layout,
        )
    return x.index_select(dim, state.positions(x.device)[0])


def _hook_edge(module: torch.nn.Module, edge: Any, name: str) -> None:
    """Hook one module of a model's edge plan: take its inputs (or outputs), or gather its output."""
    if isinstance(edge, _Gather):
        module.register_forward_hook(lambda _m, _a, out: gather_sequence(out, dim=edge.dim, convention="replicated"))
        return
    inputs = {key: take for key, take in edge.items() if not take.output}
    outputs = {key: take for key, take in edge.items() if take.output}
    if inputs:
        signature = inspect.signature(module.forward)

        def pre_hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            bound = signature.bind(*args, **kwargs)
            for key, take in inputs.items():
                if key in bound.arguments:
                    bound.arguments[key] = _take(bound.arguments[key], take, str(key))
            return bound.args, bound.kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if outputs:

        def hook(_module: torch.nn.Module, _args: tuple, out: Any) -> Any:
            taken = (_take(x, outputs[i], f"{name} output {i}") if i in outputs else x for i, x in enumerate(out))
            return type(out)(taken)

        module.register_forward_hook(hook)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> torch.Tensor:
    """diffusers' backend call (``dispatch_attention_fn``'s keywords) run by the innermost
    `commlib_torch.sequence.parallel` context's layer: query ``[B, S_q, H, D]``, key and value ``[B, S_k, H_kv,
    D]`` (GQA by head counts) -> ``[B, S_q, H, D_v]``, query's dtype. What the call is comes from its attention
    module (hooked by `parallelize`): self-attention (``S_q = S_k = layout.sizes[shard]``) -> the context's layer;
    cross-attention (kv the same on every rank) -> ``cross_attention(..., kv="replicated")``; joint (Flux: the
    first ``S_q - layout.sizes[shard]`` rows are the replicated text) -> the context's layer ``(..., joint_q=...,
    joint_position="front")``, returning ``cat([joint_out, out])``. Gradient: exact, the layers' (convention
    "sum": rank r's dk, dv of replicated kv, and its d joint_*, are its part; summed by `sync_gradients`).

    Raises:
        CommError: outside a `parallel` context or a model `parallelize` prepared; an attention mask, dropout > 0,
            ``return_lse``, diffusers' own parallel config, causal cross-attention; query rows not the shard's (plus
            the text's, joint); the layers' own errors (ring and USP: joint tensors over uneven shards).

    Example (one rank: WORLD of size 1; the call a Wan self-attention module makes):
        >>> import commlib
        >>> from commlib_torch.sequence import parallel
        >>> q = torch.randn(1, 6, 4, 8)
        >>> token = _CALL.set(("WanAttnProcessor", "self"))
        >>> with parallel(commlib.SequenceLayout(6)):
        ...     out = attention(q, q, q)
        >>> _CALL.reset(token); out.shape
        torch.Size([1, 6, 4, 8])
    """
    state = _parallel.current(OP_NAME)
    call = _CALL.get()
    if call is None:
        raise comm_error(
            OP_NAME,
            "the 'commlib' backend was called from no attention module of a model prepared by parallelize(model): "
            "call parallelize(model) (it hooks the attention modules and the model's edges)",
            query_shape=tuple(query.shape),
        )
    kind, route = call
    _check(state, kind, route, query, key, attn_mask, dropout_p, is_causal, return_lse, _parallel_config)
    if route == "cross":
        return cross_attention(query, key, value, state.group, kv="replicated", scale=scale)
    rows = state.plan.layout.sizes[state.shard]
    if route == "self":
        return state.attend(query, key, value, causal=bool(is_causal), scale=scale)
    text = query.shape[1] - rows
    if text == 0:
        return state.attend(query, key, value, causal=bool(is_causal), scale=scale)
    joint = (query[:, :text], key[:, :text], value[:, :text])
    out, joint_out = state.attend_joint(
        query[:, text:],
        key[:, text:],
        value[:, text:],
        joint,
        joint_position="front",
        causal=bool(is_causal),
        scale=scale,
    )
    return torch.cat([joint_out, out], dim=1)


def _check(
    state: _parallel.Parallel,
    kind: str,
    route: str,
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    return_lse: bool,
    parallel_config: Any,
) -> None:
    """What `attention` refuses, before any communication."""
    where = dict(processor=kind, attention=state.plan.attention, layout=state.plan.layout)
    refused = [
        (
            attn_mask is not None,
            f"attn_mask is not supported (received a {None if attn_mask is None else tuple(attn_mask.shape)} mask): "
            "a dense mask over this rank's rows cannot describe the keys other ranks hold",
        ),
        (dropout_p != 0.0, f"dropout_p ({dropout_p}) must be 0"),
        (return_lse, "return_lse=True is not supported"),
        (parallel_config is not None, "diffusers' own context parallelism (a parallel_config) is enabled too"),
        (route == "cross" and is_causal, "is_causal=True with cross-attention (kv from elsewhere) has no meaning"),
    ]
    for refuse, message in refused:
        if refuse:
            raise comm_error(OP_NAME, message, query_shape=tuple(query.shape), **where)
    rows = state.plan.layout.sizes[state.shard]
    if route == "self" and query.shape[1] != rows:
        raise comm_error(
            OP_NAME,
            f"query rows ({query.shape[1]}) must be layout.sizes[{state.shard}] ({rows})",
            query_shape=tuple(query.shape),
            **where,
        )
    if route == "joint" and query.shape[1] < rows:
        raise comm_error(
            OP_NAME,
            f"query rows ({query.shape[1]}) must be the text's plus layout.sizes[{state.shard}] ({rows})",
            query_shape=tuple(query.shape),
            **where,
        )
    if route == "joint" and key.shape[1] != query.shape[1]:
        raise comm_error(
            OP_NAME,
            f"key rows ({key.shape[1]}) must be query rows ({query.shape[1]}) in joint attention",
            query_shape=tuple(query.shape),
            key_shape=tuple(key.shape),
            **where,
        )
