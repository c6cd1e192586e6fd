"""The call path of the attention layers, once: what ``ulysses_attention``, ``ring_attention`` and
``usp_attention`` do, in both frontends, between the user's arguments and the walk.

1. the kinds of q, k, v and `segment_ids` (`commlib.attention.check_layer_inputs`: the spec's `TypeError`);
2. checked mode: the ranks compare the call as the user made it (`commlib.layer_check.attention_call`) before any
   collective, so a rank that disagrees raises one `CommError` on every rank instead of hanging;
3. the plan (`commlib.attention.ulysses_plan` or `commlib.ring.ring_plan`), which validates every shape and
   option and raises the spec's errors naming the layer.

A frontend gives what only it knows through a `LayerFrontend` (its array types, dtype names, whether checked
mode is on and how its ranks exchange a call); the group is resolved and the world size, rank and shard index
are read before this path starts. The walks are elsewhere: Ulysses' in `commlib.ulysses`, the ring's in
`commlib.ring`.

>>> import numpy as np
>>> class Numpy:  # a frontend of numpy arrays, never in checked mode
...     array_types, array_name = (np.ndarray,), "numpy.ndarray"
...     def dtype_name(self, x): return str(x.dtype)
...     def checked(self): return False
...     def exchange_layer(self, call): raise AssertionError("not checked")
>>> q = np.zeros((1, 4, 2, 8))
>>> ulysses_call(Numpy(), q, q, q, None, world_size=2, rank=0, seq_sizes=(4, 3)).seq_sizes
(4, 3)
>>> ulysses_call(Numpy(), q, [0], q, None, world_size=2, rank=0)
Traceback (most recent call last):
...
TypeError: ulysses_attention: k must be a numpy.ndarray, not list. Received: type='list'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from commlib import attention, joint, ring
from commlib.errors import comm_error
from commlib.layer_check import LayerCall, attention_call
from commlib.sequence import SequenceLayout, ulysses_seq_sizes

__all__ = ["LayerFrontend", "check_call", "ulysses_call", "ring_call"]

SegmentType = tuple[tuple[int, ...], str] | None


class LayerFrontend(Protocol):
    """What the call path needs of a frontend."""

    array_types: tuple[type, ...]  # the arrays q, k, v and segment_ids may be
    array_name: str  # their name in a `TypeError` ("torch.Tensor")

    def dtype_name(self, x: Any) -> str:
        """The numpy name of `x`'s dtype ("float32", "bfloat16")."""

    def checked(self) -> bool:
        """True when the ranks compare this call first (checked mode on, and not inside a compiler's trace)."""

    def exchange_layer(self, call: LayerCall) -> None:
        """Compare `call` across the layer's ranks: return when every rank's is the same, else raise the spec's
        `CommError` on every rank (`commlib.layer_check.compare_layers`)."""


def check_call(
    frontend: LayerFrontend, layer: str, q: Any, k: Any, v: Any, segment_ids: Any, options: dict[str, object]
) -> tuple[list[str], SegmentType]:
    """Steps 1 and 2 of the path for `layer`: the kinds, then checked mode's comparison of the call (`options`
    in the order the layer's record shows them, `segment_ids` among them). Gives q, k and v's dtype names and
    the segment ids' ``(shape, dtype name)`` (None without them), what the plans take."""
    attention.check_layer_inputs(layer, q, k, v, segment_ids, frontend.array_types, frontend.array_name)
    if frontend.checked():
        frontend.exchange_layer(attention_call(layer, (q.shape, k.shape, v.shape), frontend.dtype_name(q), **options))
    segment_type = None if segment_ids is None else (tuple(segment_ids.shape), frontend.dtype_name(segment_ids))
    return [frontend.dtype_name(x) for x in (q, k, v)], segment_type


def ulysses_call(
    frontend: LayerFrontend,
    q: Any,
    k: Any,
    v: Any,
    segment_ids: Any,
    *,
    world_size: int,
    rank: int | None,
    causal: bool = False,
    scale: float | None = None,
    seq_sizes: Sequence[int] | None = None,
    attn_fn: Callable[..., Any] | None = None,
    layout: str | SequenceLayout = "contiguous",
    chunks: int = 1,
    joint_qkv: Sequence[Any] = (None, None, None),
    joint_position: object = "front",
    mask: object = None,
) -> attention.UlyssesPlan:
    """The validated `UlyssesPlan` of ``ulysses_attention(q, k, v, ...)`` on `world_size` ranks: for `rank`
    (torch, ``layout="exact"``: rank r holds exactly ``seq_sizes[r]`` rows), or None for every rank (JAX,
    ``layout="padded"``: every rank holds ``max(seq_sizes)`` rows). `joint_qkv`: ``(joint_q, joint_k,
    joint_v)`` or three Nones (`commlib.joint`: the plan's ``joint``)."""
    has_joint = joint.check_joint_inputs(
        attention.OP_NAME, joint_qkv, joint_position, frontend.array_types, frontend.array_name
    )
    options = dict(
        world_size=world_size,
        causal=causal,
        scale=scale,
        layout=layout,
        seq_sizes=seq_sizes,
        attn_fn=attn_fn,
        segment_ids=segment_ids,
        chunks=chunks,
        mask=mask,
    )
    if has_joint:  # (a call without them keeps its record, so checked mode's messages stay as they were)
        options |= dict(joint_shapes=tuple(tuple(x.shape) for x in joint_qkv), joint_position=joint_position)
    dtypes, segment_type = check_call(frontend, attention.OP_NAME, q, k, v, segment_ids, options)
    plan = attention.ulysses_plan(
        q.shape,
        k.shape,
        v.shape,
        world_size,
        rank=rank,
        seq_sizes=ulysses_seq_sizes(attention.OP_NAME, layout, seq_sizes, world_size),
        dtypes=dtypes,
        causal=causal,
        scale=scale,
        layout="exact" if rank is not None else "padded",
        segment_ids=segment_type,
        chunks=chunks,
        mask=mask,
    )
    if not has_joint:
        return plan
    if mask is not None:
        raise comm_error(
            attention.OP_NAME,
            "mask cannot be given with joint_q (a rule's positions would be the concatenation's: not supported)",
            mask=mask,
            joint_position=joint_position,
        )
    shapes = [tuple(x.shape) for x in joint_qkv]
    joint_dtypes = dtypes + [frontend.dtype_name(x) for x in joint_qkv]
    checked = joint.joint_plan(
        attention.OP_NAME, q.shape, k.shape, v.shape, shapes, joint_dtypes, joint_position, segment_ids is not None
    )
    return dataclasses.replace(plan, joint=attention.ulysses_joint(checked, plan))


def ring_call(
    frontend: LayerFrontend,
    q: Any,
    k: Any,
    v: Any,
    segment_ids: Any,
    *,
    ring_size: int,
    ulysses_size: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    layout: str | SequenceLayout = "contiguous",
    shard: int | None = None,
    mask: object = None,
    joint_qkv: Sequence[Any] = (None, None, None),
    joint_position: object = "front",
) -> ring.RingPlan:
    """The validated `RingPlan` of ``ring_attention`` on `ring_size` ranks (`ulysses_size` None) or of
    ``usp_attention`` on a `ulysses_size` x `ring_size` grid; `shard`: this rank's shard index in a
    `SequenceLayout` (torch, which holds shards exactly), None where every rank holds the padded size (JAX).
    `joint_qkv`: ``(joint_q, joint_k, joint_v)`` or three Nones (`commlib.joint`: the plan's ``joint``; not with
    `segment_ids`, `mask` or a layout whose shards are uneven)."""
    layer = ring.RING_OP if ulysses_size is None else ring.USP_OP
    has_joint = joint.check_joint_inputs(layer, joint_qkv, joint_position, frontend.array_types, frontend.array_name)
    sizes: dict[str, object] = (
        dict(world_size=ring_size) if ulysses_size is None else dict(ulysses_size=ulysses_size, ring_size=ring_size)
    )
    options = dict(**sizes, causal=causal, scale=scale, layout=layout, segment_ids=segment_ids, mask=mask)
    if has_joint:  # (a call without them keeps its record, so checked mode's messages stay as they were)
        options |= dict(joint_shapes=tuple(tuple(x.shape) for x in joint_qkv), joint_position=joint_position)
    dtypes, segment_type = check_call(frontend, layer, q, k, v, segment_ids, options)
    plan = ring.ring_plan(
        q.shape,
        k.shape,
        v.shape,
        ring_size,
        causal=causal,
        scale=scale,
        layout=layout,
        dtypes=dtypes,
        ulysses_size=1 if ulysses_size is None else ulysses_size,
        op_name=layer,
        shard=shard,
        segment_ids=segment_type,
        mask=mask,
    )
    if not has_joint:
        return plan
    shapes = [tuple(x.shape) for x in joint_qkv]
    joint_dtypes = dtypes + [frontend.dtype_name(x) for x in joint_qkv]
    segmented = segment_ids is not None
    checked = joint.joint_plan(layer, q.shape, k.shape, v.shape, shapes, joint_dtypes, joint_position, segmented)
    return ring.with_joint(plan, checked, mask=mask)
