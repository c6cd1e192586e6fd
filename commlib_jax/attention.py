"""Sequence-parallel attention over `jax.lax` (inside ``shard_map`` / ``pmap``): Ulysses, ring and USP.

Ulysses (any sequence length, any head count, GQA/MQA): the spec (`commlib.attention.ulysses_plan`, padded
layout) validates the call and decides the heads each rank attends with, the kv heads it receives and the sizes
of the collectives; this module walks that plan: one all-to-all for q, k and v together, the attention over the
full sequence, one all-to-all back. Every rank runs the same program, so rank-dependent head counts are padded
to the largest rank's.

Ring and USP: `commlib_jax.ring` (the spec's walk of `commlib.ring`: k/v around the ring with `permute`, a
hand-written backward).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from commlib import attention as spec
from commlib.check import attention_call
from commlib.sequence import ulysses_seq_sizes
from commlib_jax._checked import exchange_layer, is_checked
from commlib_jax._op import axis_size
from commlib_jax._vma import axes_of
from commlib_jax._walk import dtype_name, rank
from commlib_jax.functional import all_to_all, all_to_all_4d
from commlib_jax.ring import ring_attention, usp_attention

__all__ = ["attention", "ulysses_attention", "ring_attention", "usp_attention"]

AttentionFn = Callable[..., jax.Array]


def attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``jax.nn.dot_product_attention`` on ``[B, S, H, D]``: q ``[B, S, H, D]``, k ``[B, S, H_kv, D]``, v
    ``[B, S, H_kv, D_v]`` -> ``[B, S, H, D_v]``, q head i using kv head ``i // (H // H_kv)`` (its GQA);
    `causal`: position i sees positions <= i; `scale` defaults to ``1 / sqrt(D)``. The default `attn_fn` of
    `ulysses_attention`.

    float64, and a v whose head dim differs from k's, run the same math here (`_grouped_attention`):
    ``jax.nn.dot_product_attention`` takes the softmax in float32 whatever the dtype (jax 0.10-0.11), which
    would cap a float64 layer at float32 accuracy, and it needs v shaped as k.

    Example:
        >>> import jax.numpy as jnp
        >>> q, k, v = jnp.ones((1, 4, 8, 16)), jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 2, 32))  # 4 q heads per kv
        >>> attention(q, k, v, causal=True).shape
        (1, 4, 8, 32)
    """
    if q.dtype != jnp.float64 and v.shape == k.shape:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)
    return _grouped_attention(q, k, v, causal=causal, scale=scale)


def _grouped_attention(q, k, v, *, causal: bool, scale: float | None):
    """GQA attention in plain XLA: q head i of ``[B, T, H, D]`` with kv head ``i // (H // H_kv)``; logits and
    softmax in float32 or wider (as ``jax.nn.dot_product_attention``), float64 stays float64."""
    batch, length, heads, head_dim = q.shape
    logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
    grouped = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)  # [B, T, K, G, D]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    logits = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=logits_dtype) * scale
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((length, k.shape[1]), dtype=bool)), logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, length, heads, v.shape[-1])


def _sizes(scatter_sizes, gather_sizes) -> dict:
    """The uneven keywords of a collective (left out where the spec says even)."""
    sizes = dict(scatter_sizes=scatter_sizes, gather_sizes=gather_sizes)
    return {key: value for key, value in sizes.items() if value is not None}


def _exchange(exchange: spec.Exchange, inputs: dict, axis_name) -> dict:
    """One all-to-all of the exchange's inputs: ``{name: [n, B, S, D]}`` (heads first, padded to the largest
    rank's count) on this rank. The send buffer is one gather (zeros where a destination has fewer heads)."""
    stacked = jnp.concatenate([jnp.moveaxis(inputs[name], 2, 0) for name in exchange.inputs], axis=0)
    send = jnp.take(stacked, np.asarray(exchange.send_index, dtype=np.int32), axis=0, mode="fill", fill_value=0)
    recv = all_to_all(send, axis_name, 0, 2, **_sizes(exchange.scatter_sizes, exchange.gather_sizes))
    return {name: recv[start:stop] for name, start, stop in exchange.receive}


def ulysses_attention(q, k, v, axis_name, *, causal: bool = False, scale: float | None = None, seq_sizes=None,
                      attn_fn: AttentionFn | None = None, layout="contiguous"):
    """Attention over the full sequence for sequence-sharded inputs (Ulysses): q ``[B, S_r, H, D]``, k ``[B, S_r,
    H_kv, D]``, v ``[B, S_r, H_kv, D_v]`` -> ``[B, S_r, H, D_v]``, q's dtype; equal to `attention` on the inputs
    concatenated along seq, cut back the same way.

    Args:
        q, k, v: this rank's rows of the sequence. With `seq_sizes`, every rank holds ``max(seq_sizes)`` rows
            and rank r's rows past ``seq_sizes[r]`` are ignored (gradient exactly 0); its output rows there are
            zeros. ``H % H_kv == 0`` (MHA, GQA, MQA); any H, H_kv and world size W.
        axis_name: a mesh axis name of the enclosing ``shard_map`` / ``pmap``, or a tuple of them (ranks
            row-major in the order given).
        causal: a query sees the keys at global positions <= its own.
        scale: the softmax scale (default ``1 / sqrt(D)``).
        seq_sizes: W ints, every rank's valid row count (e.g. ``commlib.split_sizes(S, W)``); None: all equal.
        attn_fn: ``attn_fn(q, k, v, *, causal, scale) -> out`` on ``[B, S, h, D]`` / ``[B, S, h_kv, D]`` (q head i
            using kv head ``i // (h // h_kv)``); default `attention` (``jax.nn.dot_product_attention``).
        layout: "contiguous" (rank order, `seq_sizes` as given), or a `commlib.SequenceLayout` of W shards
            holding the sequence in rank order (``ring_size == 1`` or contiguous): ``seq_sizes=layout.sizes``,
            every shard padded to ``layout.max_size``.

    Rank r attends with the q heads ``commlib.split_sizes(H, W)`` gives it (padded to the largest count) and
    receives the kv heads those use (padded likewise). q, k and v travel in one all-to-all (two when v's head
    dim differs from q's), the output in one. Gradient: exact, through both all-to-alls, in every mode
    (``convention="sum"``: rank r's loss is its own).

    Raises:
        CommError: ndim != 4, q/k/v batch, seq or head_dim that disagree, H not divisible by H_kv, bad
            `seq_sizes` (length, negative, seq not ``max(seq_sizes)``), a `layout` of another world size,
            "zigzag" or not in rank order, or whose sizes are not `seq_sizes`, unequal dtypes.
        TypeError: wrong kinds (causal not a bool, scale not a number).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> q, k, v = (jax.random.normal(key, (1, 8, 4, 16)) for key in jax.random.split(jax.random.key(0), 3))
        >>> f = jax.shard_map(lambda q, k, v: ulysses_attention(q, k, v, "x", causal=True), mesh=mesh,
        ...                   in_specs=P(None, "x"), out_specs=P(None, "x"))  # rank r holds rows [2r, 2r + 2)
        >>> bool(jnp.allclose(f(q, k, v), attention(q, k, v, causal=True), atol=1e-5))
        True
    """
    axes = axes_of(axis_name)
    size = axis_size(spec.OP_NAME, axes)
    if is_checked():  # several processes: they compare the options first (commlib_jax._checked)
        exchange_layer(attention_call(spec.OP_NAME, (q.shape, k.shape, v.shape), dtype_name(q.dtype),
                                      world_size=size, causal=causal, scale=scale, layout=layout, seq_sizes=seq_sizes,
                                      attn_fn=attn_fn))
    seq_sizes = ulysses_seq_sizes(spec.OP_NAME, layout, seq_sizes, size)
    plan = spec.ulysses_plan(q.shape, k.shape, v.shape, size, seq_sizes=seq_sizes,
                             dtypes=[dtype_name(x.dtype) for x in (q, k, v)], causal=causal, scale=scale,
                             layout="padded")
    inputs, local = {"q": q, "k": k, "v": v}, {}
    for exchange in plan.exchanges:
        local.update(_exchange(exchange, inputs, axis_name))
    keys, values = local["k"], local["v"]
    if plan.kv_index is not None:  # some rank's q heads do not group evenly over its kv heads
        index = jnp.asarray(np.asarray(plan.kv_index, dtype=np.int32))[rank(axes)]
        keys, values = jnp.take(keys, index, axis=0), jnp.take(values, index, axis=0)
    bshd = [jnp.transpose(x, (1, 2, 0, 3)) for x in (local["q"], keys, values)]
    out = (attn_fn or attention)(*bshd, causal=plan.causal, scale=plan.scale)
    return all_to_all_4d(out, axis_name, 1, 2, **_sizes(plan.out_scatter_sizes, plan.out_gather_sizes))
