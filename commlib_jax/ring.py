"""Ring attention and USP over `jax.lax` (inside ``shard_map`` / ``pmap``): context parallelism past the head
count.

The spec (`commlib.ring`) validates the call, owns the schedule and walks it, forward and backward
(`commlib.ring.forward` / `backward`); this module gives that walk its JAX backend (`_AxisBackend`) inside one
`jax.custom_vjp`: the forward passes k/v around the ring with `permute` and merges each step's partial attention
into (out, lse), the backward passes dk/dv the same way, recomputing the probabilities of each step from the
saved LSE. What it saves for backward is q, k, v, out and the LSE: O(S/W) per rank.

The walk is unrolled (W steps in the program); the `permute` of a step reads the block the step computes with,
never its result, so XLA may overlap them. The plan is the same on every rank; where ranks differ in the case
of a step, ``plan.case_table[t, rank]`` is indexed with the traced ``lax.axis_index`` and dispatched by
``lax.switch`` over the plan's static cases (a skipped case is a branch that returns its accumulators
unchanged). The step math is `commlib.blockwise`'s over jax.numpy, in `RingPlan.compute_dtype`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from commlib import blockwise
from commlib import ring as spec
from commlib.blockwise import SegmentedMask
from commlib.layer_call import ring_call
from commlib.masks import MaskRule
from commlib.sequence import SequenceLayout
from commlib_jax import _kernels
from commlib_jax._checked import LayerFrontend
from commlib_jax._op import axis_size
from commlib_jax._vma import axes_of, axis_arg, rank, to_varying, varying_axes
from commlib_jax.functional import Array, AxisName, all_gather, all_reduce, all_to_all, all_to_all_4d, permute

__all__ = ["ring_attention", "usp_attention"]


def _given(joint: tuple[Array | None, Array | None, Array | None]) -> tuple[Array, Array, Array] | None:
    """The joint q, k, v when all three are given (the spec refuses some without the others), else None."""
    joint_q, joint_k, joint_v = joint
    if joint_q is None or joint_k is None or joint_v is None:
        return None
    return joint_q, joint_k, joint_v


MATH = _kernels.MATH


def _ring_on_axes(
    plan: spec.RingPlan,
    axes: tuple,
    block_size: int,
    q: Array,
    k: Array,
    v: Array,
    segments: jax.Array | None = None,
    joint: tuple[Array, Array, Array] | None = None,
) -> Any:
    """Rank's output ``[B, rows, H, D_v]`` (q's dtype) of the ring over `axes` (a tuple of mesh axis names):
    q ``[B, rows, H, D]``, k ``[B, rows, H_kv, D]``, v ``[B, rows, H_kv, D_v]`` this rank's ring block (and its
    segment ids ``[B, rows]``); with `joint` (the joint tensors' heads the ring walks): ``(out, joint_out)``."""
    arrays = [x for x in (q, k, v, segments, *(joint or ())) if x is not None]
    varying = tuple(sorted(set(axes).union(*(varying_axes(x) for x in arrays)), key=str))
    q, k, v = (to_varying(x, varying) for x in (q, k, v))
    if joint is not None:  # typed varying as q: JAX sums the shares of a joint tensor given once (its transpose)
        joint_q, joint_k, joint_v = (to_varying(jnp.asarray(x), varying) for x in joint)
        return _joint_ring(plan, axes, block_size, q, k, v, joint_q, joint_k, joint_v)
    if segments is not None:  # every ring block's ids [W, B, rows], gathered once (integers, no gradient)
        segments = all_gather(to_varying(segments, varying)[None], axes, 0)
        segments = to_varying(segments, varying)
    return _ring(plan, axes, block_size, q, k, v, segments)


def _parts(mask: Any) -> tuple[Any, tuple[Any, ...]]:
    """A piece's mask and its q rows' and keys' segment ids (``()`` without), from the walk's `SegmentedMask`."""
    if isinstance(mask, SegmentedMask):
        return mask.mask, (mask.q_ids, mask.k_ids)
    return mask, ()


class _AxisBackend:
    """`commlib.ring.RingBackend` on this device's arrays: functional row updates, a ring step one `permute`
    per array, the case of a step switched on the traced rank; a piece is `commlib_jax._kernels`' (the keys
    `block_size` at a time, or cuDNN's fused kernel where it serves)."""

    math = MATH
    blocked_masks = True

    def __init__(self, plan: spec.RingPlan, axes: tuple, block_size: int) -> None:
        self.plan, self.axes, self.block_size = plan, axes, block_size

    def compute(self, x: jax.Array) -> jax.Array:
        return x.astype(self.plan.compute_dtype)

    def restore(self, x: jax.Array, like: jax.Array) -> jax.Array:
        return x.astype(like.dtype)

    def zeros(self, like: jax.Array) -> jax.Array:
        """Zeros typed varying as `like` (the branches of ``lax.switch`` must agree on it)."""
        return to_varying(jnp.zeros(like.shape, self.plan.compute_dtype), tuple(varying_axes(like)))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: str | jax.Array) -> tuple[jax.Array, jax.Array]:
        return _kernels.attend_piece(q, k, v, self.plan.scale, mask, self.block_size, self.plan.dtype)

    def attend_vjp(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        out: jax.Array,
        d_out: jax.Array,
        lse: jax.Array,
        delta: jax.Array,
        mask: str | jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        mask, ids = _parts(mask)
        return blockwise.attend_blocks_vjp(
            MATH, q, k, v, d_out, lse, delta, self.plan.scale, mask, self.block_size, *ids
        )

    def set_rows(self, x: jax.Array, rows: slice, value: jax.Array) -> jax.Array:
        return x.at[:, rows].set(value)

    def add_rows(self, x: jax.Array, rows: slice, value: jax.Array) -> jax.Array:
        return x.at[:, rows].add(value)

    def start(self, arrays: list) -> list:
        """One `permute` per array, traced where the walk starts it (before the step's pieces: it reads none
        of their results, and XLA may run it during them)."""
        return [permute(x, axis_arg(self.axes), self.plan.perm) for x in arrays]

    def wait(self, pending: list) -> list:
        return pending

    def key_mask(self, step: int) -> jax.Array:
        """This rank's mask of `step`, from the positions of its block and of the block it holds (the plan's
        ``[W, rows]`` table indexed by the traced rank)."""
        held, mine = jnp.asarray(self.plan.block_positions), rank(self.axes)
        return self.plan.position_mask(held[mine], held[(mine - step) % self.plan.ring_size])

    def real_rows(self, x: jax.Array) -> jax.Array:
        real = jnp.asarray(self.plan.valid_rows())[rank(self.axes)]
        return jnp.where(real[None, :, None, None], x, jnp.zeros((), x.dtype))

    def switch(self, step: int, function: Callable[..., Any], *operands: jax.Array) -> Any:
        case = jnp.asarray(self.plan.case_table[step])[rank(self.axes)]
        branches = [functools.partial(function, pieces) for pieces in self.plan.cases]
        return jax.lax.switch(case, branches, *operands)

    def block_ids(self, segments: jax.Array, step: int) -> tuple[jax.Array, jax.Array]:
        """This rank's ids and those of the kv block it holds at `step` (``(rank - step) % W``), indexed in
        every block's ``[W, B, rows]`` with the traced axis index (read from the gathered ids, not sent)."""
        here = rank(self.axes)
        held = (here - step) % self.plan.ring_size
        return jnp.take(segments, here, axis=0), jnp.take(segments, held, axis=0)

    def gather_ring(self, x: jax.Array) -> jax.Array:
        return to_varying(all_gather(x[None], self.axes, 0), tuple(varying_axes(x)))

    def sum_ring(self, x: jax.Array) -> jax.Array:
        return to_varying(all_reduce(x, self.axes, "sum"), tuple(varying_axes(x)))

    def when_visible(
        self, step: int, index: int, mask: jax.Array, function: Callable[..., Any], *operands: jax.Array
    ) -> Any:
        """``lax.cond`` on `commlib.ring.visible_pieces`' rule (some query of the piece sees some key, decided
        on device, over the keys a block at a time: `commlib.blockwise.any_visible`): a skipped piece is the
        branch that returns its accumulators unchanged."""
        seen = blockwise.any_visible(MATH, mask, self.block_size) if isinstance(mask, SegmentedMask) else jnp.any(mask)
        return jax.lax.cond(seen, function, lambda *unchanged: unchanged, *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(
    plan: spec.RingPlan,
    axes: tuple,
    block_size: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None = None,
) -> jax.Array:
    return spec.forward(plan, _AxisBackend(plan, axes, block_size), q, k, v, segments)[0]


def _ring_forward(
    plan: spec.RingPlan,
    axes: tuple,
    block_size: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None = None,
) -> tuple[jax.Array, tuple]:
    out, lse = spec.forward(plan, _AxisBackend(plan, axes, block_size), q, k, v, segments)
    return out, (q, k, v, out, lse, segments)


def _ring_backward(plan: spec.RingPlan, axes: tuple, block_size: int, residuals: tuple, cotangent: jax.Array) -> tuple:
    q, k, v, out, lse, segments = residuals
    grads = spec.backward(plan, _AxisBackend(plan, axes, block_size), q, k, v, out, lse, cotangent, segments)
    no_gradient = None if segments is None else np.zeros(segments.shape, dtype=jax.dtypes.float0)  # integers
    return (*grads, no_gradient)


_ring.defvjp(_ring_forward, _ring_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _joint_ring(plan: spec.RingPlan, axes: tuple, block_size: int, *arrays: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(out, joint_out)`` of the ring walk with joint tensors: `arrays` q, k, v, joint_q, joint_k, joint_v."""
    return _joint_ring_forward(plan, axes, block_size, *arrays)[0]


def _joint_ring_forward(plan: spec.RingPlan, axes: tuple, block_size: int, *arrays: jax.Array) -> tuple:
    q, k, v, joint_q, joint_k, joint_v = arrays
    backend = _AxisBackend(plan, axes, block_size)
    out, lse, joint_out, joint_lse = spec.forward(plan, backend, q, k, v, joint=(joint_q, joint_k, joint_v))
    return (out, joint_out), (*arrays, out, lse, joint_out, joint_lse)


def _joint_ring_backward(
    plan: spec.RingPlan, axes: tuple, block_size: int, residuals: tuple, cotangents: tuple
) -> tuple[jax.Array, ...]:
    q, k, v, joint_q, joint_k, joint_v, out, lse, joint_out, joint_lse = residuals
    d_out, d_joint_out = cotangents
    joint = (joint_q, joint_k, joint_v, joint_out, joint_lse, d_joint_out)
    return spec.backward(plan, _AxisBackend(plan, axes, block_size), q, k, v, out, lse, d_out, joint=joint)


_joint_ring.defvjp(_joint_ring_forward, _joint_ring_backward)


def ring_attention(
    q: Array,
    k: Array,
    v: Array,
    axis_name: AxisName,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str | SequenceLayout = "contiguous",
    segment_ids: Array | None = None,
    block_size: int | None = None,
    mask: MaskRule | None = None,
    joint_q: Array | None = None,
    joint_k: Array | None = None,
    joint_v: Array | None = None,
    joint_position: str = "front",
) -> Any:
    """Attention over the whole sequence for sequence-sharded inputs, k and v passed around the ring of
    `axis_name`: q ``[B, S/W, H, D]``, k ``[B, S/W, H_kv, D]``, v ``[B, S/W, H_kv, D_v]`` -> ``[B, S/W, H, D_v]``,
    q's dtype; equal to `attention` on the whole sequence, cut back the same way. With `joint_q`, `joint_k`,
    `joint_v`: ``(out, joint_out)``.

    Args:
        q, k, v: this rank's shard of the sequence: the global positions ``commlib.shard_positions(S, W,
            layout)[rank]`` (`commlib.shard_sequence` cuts a whole array so). ``H % H_kv == 0`` (MHA, GQA, MQA).
        axis_name: a mesh axis name of the enclosing ``shard_map`` / ``pmap``, or a tuple of them (ranks
            row-major in the order given); W ranks.
        causal: a query sees the keys at global positions <= its own. Pairs of blocks the mask hides entirely
            are skipped.
        scale: the softmax scale (default ``1 / sqrt(D)``).
        layout: "contiguous" (rank r holds positions ``[r S/W, (r+1) S/W)``) or "zigzag" (the sequence cut into
            2W chunks, rank r holds chunk r then chunk 2W-1-r: the same causal work on every rank); or a
            `commlib.SequenceLayout` (``ring_size == W``) for any length: every rank holds ``layout.max_size``
            rows, rank r's ``layout.sizes[r]`` first (``layout.shard(x, 1, padded=True)[r]``); what the rows
            past them hold is ignored (gradient exactly 0) and the output there is 0.
        segment_ids: integers ``[B, S/W]`` laid out as q (``commlib.segment_ids`` builds a row): a query sees a
            key only when their ids are equal (and, with causal, its position is not after the query's); a
            negative id is padding, seeing and seen by nothing (output 0, gradient 0). Every ring block's ids are
            all-gathered once (``[W, B, S/W]``; nothing of them travels with k and v), and a (q, kv) piece none
            of whose queries sees any of its keys is skipped (`commlib.ring.visible_pieces`' rule, on device:
            ``lax.cond``). No gradient.
        block_size: keys per block of a piece (None: `commlib.blockwise.BLOCK_SIZE`): each piece is computed
            over its keys that many at a time with the online softmax, and recomputed so in the backward from
            the saved LSE, so a piece holds ``[B, H, S/W, block_size]`` scores, never ``[B, H, S/W, S/W]``
            (`commlib.blockwise.attend_blocks`); on a GPU, a piece cuDNN's fused kernel serves runs on it
            (`commlib_jax._kernels.fused_serves`). The values do not depend on it beyond rounding.
        mask: a rule on global positions (`commlib.masks.BlockCausal`: frame-causal with a block size;
            `commlib.masks.SlidingWindow`: a causal window, transformers' ``sliding_window``), ANDed with
            `causal` and `segment_ids`. The plan classifies every pair of position runs of a (q block, kv block)
            pair when it is built (`commlib.ring.ring_plan`, static): the pairs it masks entirely are not in
            the program, those it leaves whole run unmasked, the rest are masked by the rule's mask of the
            pair's positions.
        joint_q, joint_k, joint_v: joint attention (MMDiT: SD3, Flux; `commlib.joint`): ``[B, S_j, H, D]``,
            ``[B, S_j, H_kv, D]``, ``[B, S_j, H_kv, D_v]`` (q, k, v's heads, head dims and dtype), the same on every
            rank (the text tokens), all three or none. The joint tokens attend and are attended as if
            concatenated with the full sequence at `joint_position`; the call returns ``(out, joint_out)``,
            ``joint_out`` ``[B, S_j, H, D_v]`` bit for bit the same on every rank. Each rank attends its q rows to
            the joint k/v locally (one more piece of the online softmax, nothing sent), and the joint q to its own
            k/v block and to the joint k/v; the joint q's partials ``(out, lse)`` are all-gathered over the axis
            and merged in rank order, the same on every rank (`commlib.ring.forward`). Gradient
            (``convention="sum"``, rank r's loss its own): the cotangents of every rank's joint_out are summed
            (one psum) for the joint q's attention to the k/v blocks; rank r's d joint_q, d joint_k, d joint_v are
            its part (its q rows' attention to the joint k/v, and the joint q's attention to the joint k/v with
            its own cotangent): summed over the ranks, the full gradient (a joint tensor given once,
            ``in_specs=P()``, is summed by JAX itself). Not with `segment_ids`, `mask` or an uneven
            `commlib.SequenceLayout`.
        joint_position: "front" (``[joint | sequence]``, text first as SD3 and Flux) or "rear"
            (``[sequence | joint]``); with `causal` the mask follows the concatenation's positions.

    W-1 `permute` steps of k and v (H_kv heads, never repeated), online softmax with the log-sum-exp merge in
    float32 (float64 stays float64). Gradient: exact (``convention="sum"``: rank r's loss is its own), by a
    hand-written backward that passes dk and dv around the ring (W hops) and recomputes each step's scores from
    the saved LSE; what a rank saves for it is q, k, v, the output and the LSE ``[B, S/W, H]``: O(S/W). Reverse
    mode only (a ``jax.custom_vjp``): ``jax.jvp`` does not trace through it.

    Four devices in a ring, each given its zigzag shard of the whole sequence (``commlib.shard_positions``),
    give the rows of attention on the whole sequence:

    >>> import jax, numpy as np, commlib
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from commlib_jax.attention import attention, ring_attention
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("ring",))
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))  # whole sequence
    >>> rows = commlib.shard_positions(16, 4, "zigzag").reshape(-1)  # rank 0's rows, then rank 1's, ...
    >>> ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "ring", causal=True, layout="zigzag"),
    ...                      mesh=mesh, in_specs=P(None, "ring"), out_specs=P(None, "ring"))
    >>> out = ring(q[:, rows], k[:, rows], v[:, rows])
    >>> bool(np.allclose(out, attention(q, k, v, causal=True)[:, rows], atol=1e-5))
    True

    Any length through a `commlib.SequenceLayout`: S = 15 on 4 ranks, shards of 4, 4, 4 and 3 rows held
    padded to 4:

    >>> layout = commlib.SequenceLayout(15, ring_size=4, layout="zigzag")
    >>> q, k, v = (x[:, :15] for x in (q, k, v))
    >>> ring = jax.shard_map(lambda q, k, v: ring_attention(q[0], k[0], v[0], "ring", causal=True,
    ...                                                     layout=layout)[None],
    ...                      mesh=mesh, in_specs=P("ring"), out_specs=P("ring"))
    >>> out = ring(*(np.stack(layout.shard(np.asarray(x), 1, padded=True)) for x in (q, k, v)))
    >>> bool(np.allclose(layout.unshard(list(out), 1, padded=True), attention(q, k, v, causal=True), atol=1e-5))
    True

    Raises:
        CommError: ndim != 4, q/k/v batch, seq or head_dim that disagree, H not divisible by H_kv, S not divisible
            by W (contiguous) or 2W (zigzag), an unknown layout, a `SequenceLayout` whose ring_size is not W or
            whose max_size is not the seq held, unequal dtypes, segment_ids not ``[B, S/W]``; `axis_name` not
            bound; a mask rule's block_size or window below 1; joint tensors given without the others, whose
            batch, heads or head_dim differ from q, k, v's or whose seq differ, whose dtype is not q's, with
            segment_ids, mask or an uneven layout, a `joint_position` not "front" or "rear".
        TypeError: wrong kinds (causal not a bool, scale not a number, segment_ids not integers, axis names,
            mask not a `commlib.masks.MaskRule`, joint tensors not arrays, joint_position not a str).
    """
    axes = axes_of(axis_name)
    size = axis_size(spec.RING_OP, axes)
    joint = (joint_q, joint_k, joint_v)
    plan = ring_call(
        LayerFrontend(),
        q,
        k,
        v,
        segment_ids,
        ring_size=size,
        causal=causal,
        scale=scale,
        layout=layout,
        mask=mask,
        joint_qkv=joint,
        joint_position=joint_position,
    )
    block_size = blockwise.check_block_size(spec.RING_OP, block_size)
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
    given = None if plan.joint is None else _given(joint)
    return _ring_on_axes(plan, axes, block_size, q, k, v, segment_ids, given)


def _heads_out(plan: spec.RingPlan, q: Array, k: Array, v: Array, ulysses_axis: AxisName) -> tuple[Array, ...]:
    """The plan's Ulysses all-to-alls (`commlib.ring.RingPlan.ulysses_exchanges`) of q, k, v: ``[B, S_r, H, D] ->
    [B, U * S_r, H / U, D]`` (ring block r, Ulysses rank u's heads); several inputs in one all-to-all have their
    heads stacked per destination (one concatenate)."""
    inputs = {"q": q, "k": k, "v": v}
    heads = {"q": plan.heads, "k": plan.kv_heads, "v": plan.kv_heads}
    for names in plan.ulysses_exchanges:
        if len(names) == 1:
            inputs[names[0]] = all_to_all_4d(inputs[names[0]], ulysses_axis, 2, 1)
            continue
        per_destination = [
            jnp.moveaxis(inputs[name].reshape(*q.shape[:2], plan.ulysses_size, heads[name], -1), 2, 0) for name in names
        ]
        received = all_to_all(jnp.concatenate(per_destination, axis=3), ulysses_axis, 0, 2)  # [1, B, U S_r, N, D]
        splits = np.cumsum([heads[name] for name in names])[:-1].tolist()
        inputs.update(zip(names, jnp.split(received[0], splits, axis=2), strict=True))
    return inputs["q"], inputs["k"], inputs["v"]


def usp_attention(
    q: Array,
    k: Array,
    v: Array,
    ulysses_axis: AxisName,
    ring_axis: AxisName,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str | SequenceLayout = "contiguous",
    segment_ids: Array | None = None,
    block_size: int | None = None,
    mask: MaskRule | None = None,
    joint_q: Array | None = None,
    joint_k: Array | None = None,
    joint_v: Array | None = None,
    joint_position: str = "front",
) -> Any:
    """USP (Ulysses inside a group, ring across groups, as yunchang's LongContextAttention): q ``[B, S/(R U), H,
    D]``, k ``[B, S/(R U), H_kv, D]``, v ``[B, S/(R U), H_kv, D_v]`` -> ``[B, S/(R U), H, D_v]``, q's dtype; equal
    to `attention` on the whole sequence, cut back the same way.

    Args:
        q, k, v: this rank's shard: at Ulysses index u and ring index r, shard ``r U + u``, the global positions
            ``commlib.shard_positions(S, R, layout, ulysses_size=U)[r * U + u]``. H and H_kv divisible by U.
        ulysses_axis: the mesh axis (or tuple of axes) of the U ranks of one Ulysses group.
        ring_axis: the mesh axis (or tuple of axes) of the R ranks of one ring.
        causal, scale, layout, mask: as in `ring_attention` (the layout of the ring blocks); a `commlib.SequenceLayout`
            (``ring_size == R``, ``ulysses_size == U``) for any length, every shard padded to ``layout.max_size``.
        segment_ids: integers ``[B, S/(R U)]`` laid out as q, as in `ring_attention`: all-gathered over
            `ulysses_axis` into ring block r's ids, then every ring block's over `ring_axis` (once).
        block_size: as in `ring_attention`.
        joint_q, joint_k, joint_v, joint_position: as in `ring_attention` (``(out, joint_out)``): after the
            all-to-all Ulysses rank u takes the same heads of the replicated joint tensors (``[u H/U, (u+1) H/U)``
            and their kv heads: no communication), the ring runs with them over `ring_axis`, and the joint
            output's heads are all-gathered over `ulysses_axis` (rank order; its VJP the reduce-scatter).
            Gradient (``convention="sum"``): rank (u, r)'s d joint_* is its part, 0 outside its heads; summed over
            every rank, the full gradient.

    ``all_to_all_4d`` of q, k, v over `ulysses_axis` (``[B, S/(R U), H, D] -> [B, S/R, H/U, D]``: ring block r,
    H/U heads), `ring_attention` over `ring_axis`, the inverse ``all_to_all_4d``. Gradient: exact, through all
    three.

    A 2 x 2 mesh (ring index r, Ulysses index u: shard ``r * U + u``, the mesh's row-major order):

    >>> import jax, numpy as np, commlib
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from commlib_jax.attention import attention, usp_attention
    >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("ring", "ulysses"))
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 4, 8)) for i in range(3))
    >>> rows = commlib.shard_positions(16, 2, "zigzag", ulysses_size=2).reshape(-1)
    >>> usp = jax.shard_map(lambda q, k, v: usp_attention(q, k, v, "ulysses", "ring", causal=True, layout="zigzag"),
    ...                     mesh=mesh, in_specs=P(None, ("ring", "ulysses")), out_specs=P(None, ("ring", "ulysses")))
    >>> out = usp(q[:, rows], k[:, rows], v[:, rows])
    >>> bool(np.allclose(out, attention(q, k, v, causal=True)[:, rows], atol=1e-5))
    True

    Raises:
        CommError: as `ring_attention` (S divisible by R U, or 2 R U for zigzag; its joint refusals), and U
            larger than H or not dividing H and H_kv.
        TypeError: as `ring_attention`.
    """
    ulysses_axes, ring_axes = axes_of(ulysses_axis), axes_of(ring_axis)
    ulysses_size = axis_size(spec.USP_OP, ulysses_axes)
    plan = ring_call(
        LayerFrontend(),
        q,
        k,
        v,
        segment_ids,
        ring_size=axis_size(spec.USP_OP, ring_axes),
        ulysses_size=ulysses_size,
        causal=causal,
        scale=scale,
        layout=layout,
        mask=mask,
        joint_qkv=(joint_q, joint_k, joint_v),
        joint_position=joint_position,
    )
    block_size = blockwise.check_block_size(spec.USP_OP, block_size)
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
    given = _given((joint_q, joint_k, joint_v))
    if plan.joint is not None and given is not None:
        joint = _joint_heads(plan, given, ulysses_axes)
        local_q, local_k, local_v = _heads_out(plan, q, k, v, ulysses_axis)
        out, joint_out = _ring_on_axes(plan, ring_axes, block_size, local_q, local_k, local_v, None, joint)
        return all_to_all_4d(out, ulysses_axis, 1, 2), all_gather(joint_out, ulysses_axis, 2)
    q, k, v = _heads_out(plan, q, k, v, ulysses_axis)
    if segment_ids is not None and ulysses_size > 1:  # ring block r's ids: the U (padded) shards' in order
        segment_ids = all_gather(segment_ids, ulysses_axis, 1)
    return all_to_all_4d(_ring_on_axes(plan, ring_axes, block_size, q, k, v, segment_ids), ulysses_axis, 1, 2)


def _joint_heads(plan: spec.RingPlan, joint: tuple[Array, Array, Array], ulysses_axes: tuple) -> tuple:
    """This Ulysses rank's heads of the joint tensors (`commlib.ring.RingPlan.joint_head_starts`, indexed with the
    traced axis index), each typed varying over `ulysses_axes` first."""
    starts = jnp.asarray(plan.joint_head_starts)[rank(ulysses_axes)]
    counts = (plan.heads, plan.kv_heads, plan.kv_heads)
    taken = []
    for x, start, count in zip(joint, (starts[0], starts[1], starts[1]), counts, strict=True):
        x = jnp.asarray(x)
        varying = tuple(sorted(set(ulysses_axes) | set(varying_axes(x)), key=str))
        taken.append(jax.lax.dynamic_slice_in_dim(to_varying(x, varying), start, count, axis=2))
    return tuple(taken)
