"""Sequence-parallel attention over `jax.lax` (inside ``shard_map`` / ``pmap``): Ulysses, ring and USP.

Ulysses (any sequence length, any head count, GQA/MQA): the spec checks and plans the call
(`commlib.layer_call.ulysses_call`, the padded layout: every rank runs the same program, so rank-dependent head
counts are padded to the largest rank's) and walks its head groups (`commlib.ulysses.walk`); this module is the
walk's backend (`_Backend`): one gather for the send buffer, `jax.lax` all-to-alls traced where the walk starts
them (no group's all-to-all reads another group's attention, so XLA may overlap them), the attention
`commlib_jax._kernels.local_attention` (the keys a block at a time, a hand-written backward from the saved LSE;
cuDNN's fused kernel on a GPU where it serves) unless the caller gives an `attn_fn`.

Ring and USP: `commlib_jax.ring` (the spec's walk of `commlib.ring`: k/v around the ring with `permute`, a
hand-written backward).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from commlib import attention as spec
from commlib import blockwise
from commlib.layer_call import ulysses_call
from commlib.masks import MaskRule, rule_mask, segment_mask
from commlib.sequence import SequenceLayout
from commlib.ulysses import Finished, walk
from commlib_jax import _kernels
from commlib_jax._checked import LayerFrontend
from commlib_jax._op import axis_size
from commlib_jax._vma import axes_of, rank
from commlib_jax.cross_attention import cross_attention
from commlib_jax.functional import Array, AxisName, all_gather, all_to_all, all_to_all_4d
from commlib_jax.ring import ring_attention, usp_attention

__all__ = ["attention", "ulysses_attention", "ring_attention", "usp_attention", "cross_attention"]

AttentionFn = Callable[..., jax.Array]


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    segment_ids: Array | None = None,
    mask: MaskRule | None = None,
) -> jax.Array:
    """GQA attention on ``[B, S, H, D]`` (``jax.nn.dot_product_attention``'s layout and grouping): q ``[B, S, H, D]``,
    k ``[B, S, H_kv, D]``, v ``[B, S, H_kv, D_v]`` -> ``[B, S, H, D_v]``, q head i using kv head ``i // (H //
    H_kv)``; `causal`: position i sees positions <= i; `scale` defaults to ``1 / sqrt(D)``; `segment_ids`
    (integers ``[B, S]``): position i sees position j only when their ids are equal, a negative id (padding)
    seeing and seen by nothing; `mask` (a `commlib.masks.MaskRule`: `commlib.masks.BlockCausal`, `SlidingWindow`)
    masks by the positions ``0 .. S - 1`` as well (ANDed). The math of `ulysses_attention`'s default attention
    (which computes it over the keys a block at a time, `commlib_jax._kernels.local_attention`: linear memory in
    S), here in one block of ``[B, H, S, S]`` scores, differentiated by JAX.

    The spec's rules, which ``jax.nn.dot_product_attention`` does not keep (jax 0.10): a row that sees no key, or
    whose every score is -inf, outputs 0 with gradient 0 (it fills masked scores with a large finite negative, so
    such a row averaged the masked keys); a NaN gives NaN rows; float64 stays float64 (it takes the softmax in
    float32); v may have its own head dim. So this is the same math in plain XLA (`_grouped_attention`).

    Example:
        >>> import jax.numpy as jnp
        >>> q, k, v = jnp.ones((1, 4, 8, 16)), jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 2, 32))  # 4 q heads per kv
        >>> attention(q, k, v, causal=True).shape
        (1, 4, 8, 32)
        >>> attention(q, k, v, segment_ids=jnp.array([[0, 0, 1, -1]]))[0, :, 0, 0].tolist()  # padding: 0
        [1.0, 1.0, 1.0, 0.0]
    """
    return _grouped_attention(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids, mask=mask)


def _grouped_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool,
    scale: float | None,
    segment_ids: Array | None = None,
    mask: MaskRule | None = None,
) -> jax.Array:
    """GQA attention in plain XLA: q head i of ``[B, T, H, D]`` with kv head ``i // (H // H_kv)``; logits and
    softmax in float32 or wider (as ``jax.nn.dot_product_attention``), float64 stays float64. Masked scores are
    -inf and a row with no finite score gets weights 0 (`commlib.blockwise`'s rule)."""
    batch, length, heads, head_dim = q.shape
    logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
    grouped = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)  # [B, T, K, G, D]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    logits = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=logits_dtype) * scale
    visible = jnp.tril(jnp.ones((length, k.shape[1]), dtype=bool)) if causal else None
    if mask is not None:
        visible = rule_mask(jnp.arange(length), jnp.arange(k.shape[1]), causal, mask)
    if segment_ids is not None:
        same = segment_mask(segment_ids, segment_ids)[:, None, None]  # [B, 1, 1, T, S]
        visible = same if visible is None else same & visible
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))  # no keys: -inf
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = (weights / jnp.where(total == 0, 1.0, total)).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, length, heads, v.shape[-1])


def _sizes(scatter_sizes: tuple[int, ...] | None, gather_sizes: tuple[int, ...] | None) -> dict:
    """The uneven keywords of a collective (left out where the spec says even)."""
    sizes = dict(scatter_sizes=scatter_sizes, gather_sizes=gather_sizes)
    return {key: value for key, value in sizes.items() if value is not None}


class _Backend(LayerFrontend):
    """`commlib.ulysses.UlyssesBackend` over mesh axes (and the call path's `LayerFrontend`): every collective is
    traced where the walk starts it (`Finished`) and XLA schedules."""

    def __init__(self, axis_name: AxisName, attn_fn: AttentionFn | None, block_size: int) -> None:
        self.axis_name, self.axes, self.attn_fn, self.block_size = axis_name, axes_of(axis_name), attn_fn, block_size

    def start_exchange(self, exchange: spec.Exchange, inputs: Mapping[str, Array], overlap: bool) -> Finished:
        """One all-to-all of the exchange's inputs, heads first, padded to the largest rank's count; the send
        buffer is one gather (zeros where a destination has fewer heads)."""
        stacked = jnp.concatenate([jnp.moveaxis(inputs[name], 2, 0) for name in exchange.inputs], axis=0)
        send = jnp.take(stacked, np.asarray(exchange.send_index, dtype=np.int32), axis=0, mode="fill", fill_value=0)
        sizes = _sizes(exchange.scatter_sizes, exchange.gather_sizes)
        return Finished(all_to_all(send, self.axis_name, 0, 2, **sizes))

    def gather_segments(self, segment_ids: jax.Array, sizes: tuple[int, ...] | None) -> jax.Array:
        return all_gather(segment_ids, self.axis_name, 1, sizes=sizes)

    def attend(
        self, plan: spec.UlyssesPlan, group: spec.HeadGroup, local: Mapping[str, jax.Array], masks: Mapping
    ) -> jax.Array:
        """``[B, S, h, D_v]``, h padded to the largest rank's."""
        keys, values = local["k"], local["v"]
        if group.kv_index is not None:  # some rank's q heads do not group evenly over its kv heads
            index = jnp.asarray(np.asarray(group.kv_index, dtype=np.int32))[rank(self.axes)]
            keys, values = jnp.take(keys, index, axis=0), jnp.take(values, index, axis=0)
        bshd = [jnp.transpose(x, (1, 2, 0, 3)) for x in (local["q"], keys, values)]
        if self.attn_fn is not None:
            return self.attn_fn(*bshd, causal=plan.causal, scale=plan.scale, **masks)
        return _kernels.local_attention(
            *bshd, causal=plan.causal, scale=plan.scale, block_size=self.block_size, **masks
        )

    def start_output(
        self, out: jax.Array, scatter_sizes: tuple[int, ...] | None, gather_sizes: tuple[int, ...] | None, overlap: bool
    ) -> Finished:
        return Finished(all_to_all_4d(out, self.axis_name, 1, 2, **_sizes(scatter_sizes, gather_sizes)))

    def concat_heads(self, outputs: list[jax.Array]) -> jax.Array:
        return jnp.concatenate(outputs, axis=2)

    def joint_heads(self, x: Array, heads: tuple[tuple[int, ...], ...]) -> jax.Array:
        """This rank's row of the padded table (an index past the last head: zeros)."""
        index = jnp.asarray(np.asarray(heads, dtype=np.int32))[rank(self.axes)]
        return jnp.take(jnp.moveaxis(jnp.asarray(x), 2, 0), index, axis=0, mode="fill", fill_value=0)

    def concat_seq(self, parts: list[jax.Array]) -> jax.Array:
        return jnp.concatenate(parts, axis=2)

    def gather_heads(self, x: jax.Array, sizes: tuple[int, ...] | None) -> jax.Array:
        return all_gather(x, self.axis_name, 2, sizes=sizes)


def ulysses_attention(
    q: Array,
    k: Array,
    v: Array,
    axis_name: AxisName,
    *,
    causal: bool = False,
    scale: float | None = None,
    seq_sizes: Sequence[int] | None = None,
    attn_fn: AttentionFn | None = None,
    layout: str | SequenceLayout = "contiguous",
    segment_ids: Array | None = None,
    chunks: int = 1,
    block_size: int | None = None,
    joint_q: Array | None = None,
    joint_k: Array | None = None,
    joint_v: Array | None = None,
    joint_position: str = "front",
    mask: MaskRule | None = None,
) -> Any:
    """Attention over the full sequence for sequence-sharded inputs (Ulysses): q ``[B, S_r, H, D]``, k ``[B, S_r,
    H_kv, D]``, v ``[B, S_r, H_kv, D_v]`` -> ``[B, S_r, H, D_v]``, q's dtype; equal to `attention` on the inputs
    concatenated along seq, cut back the same way. With `joint_q`, `joint_k`, `joint_v`: ``(out, joint_out)``.

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
            using kv head ``i // (h // h_kv)``); default: `attention`'s math over the keys `block_size` at a time
            (`commlib_jax._kernels.local_attention`; cuDNN's fused kernel on a GPU where it serves).
        layout: "contiguous" (rank order, `seq_sizes` as given), or a `commlib.SequenceLayout` of W shards
            holding the sequence in rank order (``ring_size == 1`` or contiguous): ``seq_sizes=layout.sizes``,
            every shard padded to ``layout.max_size``.
        segment_ids: integers ``[B, S_r]`` laid out as q (``commlib.segment_ids`` builds a row; rows past
            ``seq_sizes[r]`` are ignored): a query sees a key only when their ids are equal; a negative id is
            padding (sees and is seen by nothing: output 0, gradient 0). All-gathered over the axis (integers,
            no gradient) and given to `attn_fn` as ``segment_ids=`` (``[B, S]``), which must then accept it.
        chunks: head groups (DESIGN "Overlap"): an int from 1 to ``ceil(H / W)`` (the most q heads a rank
            attends with). Group c holds piece c of ``commlib.split_sizes(h_r, chunks)`` of rank r's ``h_r`` q
            heads (padded to the largest rank's count of the group) and exactly the kv heads those use; it has
            its own all-to-all in (``[B, S_r, *, D]`` heads -> ``[B, S, h_c + 2 kv_c, D]``), attention and
            all-to-all out (``[B, S, h_c, D_v] -> [B, S_r, sum_r h_rc, D_v]``). No group's all-to-all reads
            another group's attention, so XLA may run group c + 1's communication during group c's attention.
            Where no kv head serves q heads of two groups (MHA; GQA whose groups keep a kv head's q heads
            together) a group's attention is the same arithmetic per head and the output, dq, dk and dv equal
            ``chunks=1``'s bit for bit; elsewhere a group attends with fewer q heads per kv head, XLA may round
            its dots otherwise, and they equal it to rounding. With MQA / GQA a kv head is sent once per group
            that uses it.
        block_size: keys per block of the default attention (None: `commlib.blockwise.BLOCK_SIZE`): the
            online softmax over blocks of keys forward, the blocks recomputed from the saved LSE backward, so a
            rank holds ``[B, h, S, block_size]`` scores, never ``[B, h, S, S]``. Not used with `attn_fn`.
        joint_q, joint_k, joint_v: joint attention (MMDiT: SD3, Flux; `commlib.joint`): ``[B, S_j, H, D]``,
            ``[B, S_j, H_kv, D]``, ``[B, S_j, H_kv, D_v]`` (the main tensors' heads and head dims), the same on
            every rank (the text tokens), all three or none. The joint tokens attend and are attended as if
            concatenated with the full sequence at `joint_position`; the call returns ``(out, joint_out)``,
            ``joint_out`` ``[B, S_j, H, D_v]`` bit for bit the same on every rank. Each rank takes its q heads of
            them (and the kv heads those use; padded to the largest rank's count with zero heads) after the
            all-to-all, attends over the concatenation and all-gathers the joint rows of its heads
            (``commlib.split_sizes(H, W)``, rank order). Gradient (``convention="sum"``, rank r's loss its own):
            the cotangents of every rank's joint_out are summed; rank r's d joint_q is the gradient in the q
            heads rank r attends with (0 in the others), its d joint_k, d joint_v what those heads give their kv
            heads: summed over the ranks, the full gradient (a joint tensor given once, ``in_specs=P()``, is
            summed by JAX itself). Not with `segment_ids` or `mask`.
        joint_position: "front" (``[joint | sequence]``, text first as SD3 and Flux) or "rear"
            (``[sequence | joint]``); with `causal` the mask follows the concatenation's positions.
        mask: a rule on global positions (`commlib.masks.BlockCausal`: frame-causal; `SlidingWindow`: a causal
            window, transformers' ``sliding_window``), ANDed with `causal` and `segment_ids`; the gathered
            sequence holds the positions ``0 .. S - 1``, the default attention builds the rule's mask a key
            block at a time, and `attn_fn` is given it as ``mask=``. Nothing of it is sent.

    Rank r attends with the q heads ``commlib.split_sizes(H, W)`` gives it (padded to the largest count) and
    receives the kv heads those use (padded likewise). q, k and v travel in one all-to-all (two when v's head
    dim differs from q's), the output in one (per head group). Gradient: exact, through both all-to-alls, in every mode
    (``convention="sum"``: rank r's loss is its own). Reverse mode only (``jax.grad``, ``jax.vjp``): the
    collectives and the default attention are ``jax.custom_vjp`` functions, so ``jax.jvp`` / ``jax.jacfwd`` do not
    trace through the layer, with or without `attn_fn` (as before the blockwise attention: every commlib
    collective is a ``custom_vjp``).

    Raises:
        CommError: ndim != 4, q/k/v batch, seq or head_dim that disagree, H not divisible by H_kv, bad
            `seq_sizes` (length, negative, seq not ``max(seq_sizes)``), a `layout` of another world size,
            "zigzag" or not in rank order, or whose sizes are not `seq_sizes`, unequal dtypes, segment_ids not
            ``[B, S_r]``, `chunks` below 1 or above the most q heads a rank attends with (the message gives the
            head counts), a mask rule's block_size or window below 1; joint tensors given without the others,
            whose batch, heads or head_dim differ from q, k, v's or whose seq differ, whose dtype is not q's,
            with segment_ids or mask, a `joint_position` not "front" or "rear".
        TypeError: wrong kinds (causal not a bool, scale not a number, segment_ids not integers, chunks not an
            int, mask not a `commlib.masks.MaskRule`, joint tensors not arrays, joint_position not a str).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> q, k, v = (jax.random.normal(key, (1, 8, 4, 16)) for key in jax.random.split(jax.random.key(0), 3))
        >>> f = jax.shard_map(lambda q, k, v: ulysses_attention(q, k, v, "x", causal=True), mesh=mesh,
        ...                   in_specs=P(None, "x"), out_specs=P(None, "x"))  # rank r holds rows [2r, 2r + 2)
        >>> bool(jnp.allclose(f(q, k, v), attention(q, k, v, causal=True), atol=1e-5))
        True
        >>> pair = Mesh(jax.devices()[:2], ("x",))  # W = 2: two q heads a rank, so up to 2 groups
        >>> chunked = lambda chunks: jax.shard_map(lambda q, k, v: ulysses_attention(q, k, v, "x", chunks=chunks),
        ...                                        mesh=pair, in_specs=P(None, "x"), out_specs=P(None, "x"))
        >>> bool(jnp.array_equal(chunked(2)(q, k, v), chunked(1)(q, k, v)))  # heads 0 and 2, then 1 and 3
        True
        >>> text = q[:, :3], k[:, :3], v[:, :3]  # 3 text tokens, the same on every rank
        >>> def joint(q, k, v, *text):  # every rank's joint_out returned (stacked), to compare them
        ...     out, joint_out = ulysses_attention(q, k, v, "x", joint_q=text[0], joint_k=text[1],
        ...                                        joint_v=text[2], joint_position="rear")
        ...     return out, joint_out[None]
        >>> g = jax.shard_map(joint, mesh=mesh, in_specs=(P(None, "x"),) * 3 + (P(),) * 3,
        ...                   out_specs=(P(None, "x"), P("x")))
        >>> out, joint_outs = g(q, k, v, *text)
        >>> whole = attention(*(jnp.concatenate([x, t], axis=1) for x, t in zip((q, k, v), text)))  # text last
        >>> bool(jnp.allclose(out, whole[:, :8], atol=1e-5)), bool(jnp.allclose(joint_outs[0], whole[:, 8:], atol=1e-5))
        (True, True)
        >>> all(bool(jnp.array_equal(joint_outs[r], joint_outs[0])) for r in range(4))  # the same on every rank
        True
    """
    backend = _Backend(axis_name, attn_fn, blockwise.check_block_size(spec.OP_NAME, block_size))
    plan = ulysses_call(
        backend,
        q,
        k,
        v,
        segment_ids,
        world_size=axis_size(spec.OP_NAME, backend.axes),
        rank=None,
        causal=causal,
        scale=scale,
        seq_sizes=seq_sizes,
        attn_fn=attn_fn,
        layout=layout,
        chunks=chunks,
        joint_qkv=(joint_q, joint_k, joint_v),
        joint_position=joint_position,
        mask=mask,
    )
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
    inputs: dict[str, Array | None] = {"q": q, "k": k, "v": v}
    if plan.joint is not None:
        inputs |= {"joint_q": joint_q, "joint_k": joint_k, "joint_v": joint_v}
    return walk(backend, plan, inputs, segment_ids)
