"""`cross_attention` over `jax.lax` (inside ``shard_map`` / ``pmap``): sequence-sharded queries attending
replicated or sharded keys and values. The spec (`commlib.cross_attention`) validates, plans and walks; this module
is the walk's backend: commlib's differentiable ``all_gather`` for a sharded kv, the attention in plain XLA.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from commlib import cross_attention as spec
from commlib_jax._dtypes import dtype_name
from commlib_jax._op import axis_size
from commlib_jax._types import ARRAY_NAME, ARRAY_TYPES, Array, AxisName
from commlib_jax._vma import axes_of
from commlib_jax.functional import all_gather

__all__ = ["cross_attention"]


def _attend(q: Array, k: Array, v: Array, scale: float, q_ids: Array | None, kv_ids: Array | None) -> jax.Array:
    """GQA attention of q ``[B, Sq, H, D]`` over k, v ``[B, S_kv, H_kv, D]`` with `spec.visible`'s mask: padding
    keys zeroed first (gradient 0); logits in float32 or wider (float64 stays float64); masked scores -inf and a
    row with no finite score weights 0 (output 0, gradient 0)."""
    if kv_ids is not None:
        keep = (kv_ids >= 0)[:, :, None, None]
        k, v = jnp.where(keep, k, 0), jnp.where(keep, v, 0)
    batch, length, heads, head_dim = q.shape
    grouped = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)  # [B, T, K, G, D]
    logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=logits_dtype) * scale
    mask = spec.visible(q_ids, kv_ids)
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))  # no keys: -inf
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = (weights / jnp.where(total == 0, 1.0, total)).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(batch, length, heads, v.shape[-1])


class _Backend:
    """`commlib.cross_attention.CrossBackend` over mesh axes."""

    def __init__(self, axis_name: AxisName) -> None:
        self.axis_name = axis_name

    def gather(self, x: jax.Array, sizes: tuple[int, ...] | None) -> jax.Array:
        return all_gather(x, self.axis_name, 1, sizes=sizes)

    def concat(self, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.concatenate([k, v], axis=-1)

    def split(self, kv: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
        return kv[..., :head_dim], kv[..., head_dim:]

    def attend(
        self, q: Array, k: Array, v: Array, scale: float, q_ids: Array | None, kv_ids: Array | None
    ) -> jax.Array:
        return _attend(q, k, v, scale, q_ids, kv_ids)


def _ids(ids: Array | None) -> tuple[tuple[int, ...], str] | None:
    return None if ids is None else (tuple(ids.shape), dtype_name(ids.dtype))


def cross_attention(
    q: Array,
    k: Array,
    v: Array,
    axis_name: AxisName,
    *,
    kv: str = "replicated",
    scale: float | None = None,
    kv_sizes: Sequence[int] | None = None,
    segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
) -> jax.Array:
    """Cross-attention of this rank's sequence-sharded queries to keys and values from elsewhere (a DiT's text
    encoder states): q ``[B, Sq_r, H, D]``, k ``[B, S_kv(_r), H_kv, D]``, v ``[B, S_kv(_r), H_kv, D_v]`` ->
    ``[B, Sq_r, H, D_v]``, q's dtype; every query row attends the FULL kv, so the result is `attention` of this
    rank's rows to the whole kv (no positions, no causal mask).

    Args:
        q: this rank's query rows, as the layers' q. ``H % H_kv == 0``. Padding rows: mark them in `segment_ids`.
        k, v: ``kv="replicated"``: the whole kv, the same on every rank. ``kv="sharded"``: this rank's rows of it,
            in rank order; with `kv_sizes` every rank holds ``max(kv_sizes)`` rows and rank r's rows past
            ``kv_sizes[r]`` are ignored (gradient exactly 0; a shard may be empty).
        axis_name: a mesh axis name of the enclosing ``shard_map`` / ``pmap``, or a tuple of them; W its size.
        kv: "replicated": local attention, NO communication. "sharded": ``[k | v]`` (concatenated along the head
            dim) all-gathered once with commlib's ``all_gather(..., sizes=kv_sizes)`` along seq, and the kv
            segment ids (integers, no gradient) in a second gather; then local attention.
        scale: the softmax scale (default ``1 / sqrt(D)``).
        kv_sizes: ``kv="sharded"``: W ints, every rank's valid kv rows; None: all of every rank's rows.
        segment_ids: integers ``[B, Sq_r]`` (q's): a negative id is a padding query (output 0, gradient 0).
        kv_segment_ids: integers ``[B, S_kv]`` (replicated) or ``[B, max(kv_sizes)]`` (sharded, laid out as k): a
            negative id is a padding key (padded text): seen by nothing, its dk, dv exactly 0. With both ids a query
            sees a key only when they are equal; a side left out matches every non-negative id of the other.

    A row that sees no key outputs 0 with gradient 0. Gradient (``convention="sum"``: rank r's loss is its own,
    in every mode): dq exact; "sharded": dk, dv of this rank's rows are the sum over ranks of those rows'
    cotangents (the all_gather's VJP, a reduce-scatter); "replicated": dk, dv are this rank's share (summed over
    the ranks, the full gradient).

    Raises:
        CommError: q, k, v not 4-D, batch / head counts / head dims that disagree (H not divisible by H_kv), k and
            v rows unequal, `kv` not "replicated" or "sharded", kv_sizes with ``kv="replicated"``, bad kv_sizes
            (length, negative, k rows not ``max(kv_sizes)``), segment ids of the wrong shape, unequal or
            non-floating dtypes, non-finite scale. At trace time, before any communication.
        TypeError: q, k, v or ids not arrays, ids not integers, kv not a str, scale not a number.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> q, k, v = (jax.random.normal(key, (2, 8, 4, 16)) for key in jax.random.split(jax.random.key(0), 3))
        >>> tk, tv = k[:, :6, :2], v[:, :6, :2]  # 6 text tokens, 2 kv heads
        >>> f = jax.shard_map(lambda q, k, v: cross_attention(q, k, v, "x", kv="sharded"), mesh=mesh,
        ...                   in_specs=(P(None, "x"), P(None, None), P(None, None)), out_specs=P(None, "x"))
        >>> f(q, tk, tv).shape  # k, v replicated in, so every rank gathers 4 copies: 24 keys
        (2, 8, 4, 16)
        >>> g = jax.shard_map(lambda q, k, v: cross_attention(q, k, v, "x"), mesh=mesh,
        ...                   in_specs=(P(None, "x"), P(None, None), P(None, None)), out_specs=P(None, "x"))
        >>> bool(jnp.allclose(g(q, tk, tv), f(q, tk, tv), atol=1e-5))  # 4 copies of every key: the same softmax
        True
    """
    spec.check_inputs(q, k, v, {"segment_ids": segment_ids, "kv_segment_ids": kv_segment_ids}, ARRAY_TYPES, ARRAY_NAME)
    plan = spec.cross_attention_plan(
        q.shape,
        k.shape,
        v.shape,
        axis_size(spec.OP_NAME, axes_of(axis_name)),
        kv=kv,
        scale=scale,
        kv_sizes=kv_sizes,
        rank=None,
        dtypes=[dtype_name(x.dtype) for x in (q, k, v)],
        segment_ids=_ids(segment_ids),
        kv_segment_ids=_ids(kv_segment_ids),
    )
    q_ids, kv_ids = (None if ids is None else jnp.asarray(ids) for ids in (segment_ids, kv_segment_ids))
    return spec.walk(_Backend(axis_name), plan, q, k, v, q_ids, kv_ids)
