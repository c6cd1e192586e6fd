"""The sequence helpers of a whole sequence-parallel model over `jax.lax` (inside ``shard_map`` / ``pmap``): this
rank's tokens, global positions and globally shifted labels (`shard_tokens`, `position_ids`), the differentiable
take and gather of a sequence (`shard_sequence`, `gather_sequence`) and the loss over every rank's tokens
(`cross_entropy`); `commlib_jax.training.value_and_grad` takes the gradient.

Each takes a `commlib.SequenceLayout` whose world size is the size of `axis_name`. Inside a `parallel` context
`layout` and `axis_name` may be left out (None): they are the context's layout and its sequence axes (USP: the
ring axis, then the Ulysses axis: shard ``r * U + u``); given, they must be those (a `CommError` naming the helper,
the argument, the context's value and the given one), so the tokens, positions and sequences the helpers shard
are the ones the attention layer attends. Outside every context both are required. Every device holds one shape:
shard r padded to ``layout.max_size`` rows, its own ``layout.sizes[r]`` first (padding rows: id 0, position 0,
label `ignore_index`, zeros in `shard_sequence`'s output; ignored by `gather_sequence`, gradient exactly 0).
The spec (`commlib.sequence_helpers`) validates every call at trace time and owns the index tables; the float64
references there are what the tests compare with.

And the `parallel` context that names the attention layer (Ulysses, ring, USP), its mesh axes and the
`commlib.SequenceLayout`, and `dot_product_attention`, the drop-in for ``jax.nn.dot_product_attention`` that
runs that layer (a Flax model swaps it in for its attention call). JAX holds every shard padded to
``layout.max_size`` rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from commlib import SequenceLayout, frontend_errors
from commlib import parallel as parallel_spec
from commlib import sequence_helpers as spec
from commlib_jax import _parallel
from commlib_jax._checked import checks_data
from commlib_jax._dtypes import dtype_name
from commlib_jax._op import axis_size
from commlib_jax._types import ARRAY_NAME, ARRAY_TYPES, Array
from commlib_jax._vma import axes_of, axis_arg, rank, shared_axes, to_varying
from commlib_jax.functional import AxisName, all_gather, all_reduce, shard
from commlib_jax.training import summed_axes

__all__ = [
    "shard_tokens",
    "shard_sequence",
    "gather_sequence",
    "position_ids",
    "cross_entropy",
    "dot_product_attention",
    "parallel",
]


def _layout(op_name: str, layout: object, axis_name: AxisName | None) -> tuple[SequenceLayout, tuple[str, ...]]:
    """The layout and axes a helper runs on: the given ones, or inside a `parallel` context its layout and
    sequence axes where None (given ones must be the context's: the spec refuses others); the layout's world
    size checked against the axes'."""
    state = _parallel.CONTEXTS.innermost()
    layout = parallel_spec.helper_layout(op_name, None if state is None else state.plan, layout)
    axes = parallel_spec.helper_axes(
        op_name, None if state is None else state.sequence_axes(), () if axis_name is None else axes_of(axis_name)
    )
    return spec.check_layout(op_name, layout, axis_size(op_name, axes)), axes


def _rows(table: np.ndarray, layout: SequenceLayout, axes: tuple[str, ...]) -> jax.Array:
    """This rank's row of a ``[W, max_size]`` table, -1 (padding) replaced by ``seq_len`` (out of bounds: a
    take with ``mode="fill"`` gives the fill value there)."""
    return jnp.asarray(np.where(table < 0, layout.seq_len, table).astype(np.int32))[rank(axes)]


def _check_array(op_name: str, x: object, name: str = "x") -> Array:
    """`x` itself if it is an array; else the spec's TypeError naming the argument and the type received."""
    if not isinstance(x, (*ARRAY_TYPES, np.generic)):
        raise frontend_errors.wrong_type(op_name, name, x, ARRAY_NAME)
    return cast(Array, x)  # ARRAY_TYPES are Array's kinds (a numpy scalar taken as a 0-d array)


def position_ids(layout: SequenceLayout | None = None, axis_name: AxisName | None = None) -> jax.Array:
    """This rank's global positions: int32 ``[layout.max_size]`` (``layout.positions(rank)``, then 0 on padding
    rows), for RoPE and position embeddings (local positions 0..n-1 are the silent mistake this replaces).

    Raises:
        CommError: ``layout.world_size`` is not the size of `axis_name`, an unbound axis name; a layout or axes
            not the `parallel` context's (see the module).
        TypeError: `layout` not a `SequenceLayout`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib import SequenceLayout
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> layout = SequenceLayout(8, ring_size=4, layout="zigzag")
        >>> f = jax.shard_map(lambda: position_ids(layout, "x")[None], mesh=mesh, in_specs=(), out_specs=P("x"))
        >>> f().tolist()  # row r: rank r's positions (chunks r and 7 - r)
        [[0, 7], [1, 6], [2, 5], [3, 4]]
    """
    layout, axes = _layout("position_ids", layout, axis_name)
    return jnp.asarray(np.maximum(spec.position_table(layout), 0).astype(np.int32))[rank(axes)]


def shard_tokens(
    input_ids: Array,
    layout: SequenceLayout | None = None,
    axis_name: AxisName | None = None,
    *,
    ignore_index: int = -100,
    segment_ids: Array | None = None,
) -> tuple[jax.Array, ...]:
    """This rank's part of the full tokens ``[B, S]`` every rank holds: ``(ids, position_ids, labels)``, each
    ``[B, layout.max_size]`` (ids and labels in input_ids' dtype, positions int32).

    ids: the tokens at this rank's positions; position_ids: those global positions; labels: the next token of
    each position over the whole sequence (the label of position p is token p + 1; position S - 1 and padding
    rows get `ignore_index`), not shifted per shard. Padding rows: id 0, position 0. No communication.

    `segment_ids` (integers ``[B, S]`` like input_ids, e.g. rows of `commlib.segment_ids`: packed documents, a
    negative id padding): returns ``(ids, position_ids, labels, segment_ids)``; the positions restart at each
    document (a run of equal ids; padding 0; padding between two tokens of one id is a hole in that document,
    counted by the positions after it, as transformers counts a padding mask's zero in the middle:
    `commlib.sequence_helpers.document_tables`), a document's last token, the token before a hole and padding get
    `ignore_index` as label,
    and the fourth output is this rank's segment ids (their dtype; padding rows -1), for the attention layers'
    ``segment_ids=``.

    Raises:
        CommError: input_ids not 2-D, ``S != layout.seq_len``, ``layout.world_size`` not the axis size; a
            layout or axes not the `parallel` context's (see the module); segment_ids not input_ids' shape.
        TypeError: input_ids or segment_ids not an integer array, `layout` not a `SequenceLayout`,
            `ignore_index` not an int.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib import SequenceLayout
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4; S = 5: rank 0 holds two rows, the others one
        >>> f = jax.shard_map(lambda ids: shard_tokens(ids, SequenceLayout(5, 4), "x")[2], mesh=mesh,
        ...                   in_specs=P(), out_specs=P(None, "x"))
        >>> f(jnp.array([[10, 11, 12, 13, 14]])).tolist()  # labels, [1, 2] per rank: token p + 1, then padding
        [[11, 12, 13, -100, 14, -100, -100, -100]]
        >>> g = jax.shard_map(lambda ids, segments: shard_tokens(ids, SequenceLayout(5, 4), "x",
        ...                   segment_ids=segments)[1:], mesh=mesh, in_specs=P(), out_specs=P(None, "x"))
        >>> [part.tolist() for part in g(jnp.array([[10, 11, 12, 13, 14]]), jnp.array([[0, 0, 0, 1, -1]]))]
        [[[0, 1, 2, 0, 0, 0, 0, 0]], [[11, 12, -100, -100, -100, -100, -100, -100]], [[0, 0, 0, -1, 1, -1, -1, -1]]]
    """
    input_ids = _check_array("shard_tokens", input_ids, "input_ids")
    layout, axes = _layout("shard_tokens", layout, axis_name)
    ignore = spec.check_tokens("shard_tokens", input_ids.shape, dtype_name(input_ids.dtype), layout, ignore_index)
    rows = _rows(spec.position_table(layout), layout, axes)
    if segment_ids is not None:
        return _shard_documents(input_ids, _check_array("shard_tokens", segment_ids, "segment_ids"), rows, ignore)
    ids = jnp.take(input_ids, rows, axis=1, mode="fill", fill_value=0)
    labels = jnp.take(input_ids, _rows(spec.label_table(layout), layout, axes), axis=1, mode="fill", fill_value=ignore)
    positions = jnp.broadcast_to(position_ids(layout, axes), ids.shape)
    return ids, positions, labels


class _JaxDocuments(spec.DocumentMath):
    """`commlib.sequence_helpers.DocumentMath` on jax arrays ``[B, S]`` (along axis 1; traceable)."""

    def __init__(self) -> None:
        super().__init__(jnp)

    def cummax(self, x: jax.Array) -> jax.Array:
        return jax.lax.cummax(x, axis=1)

    def take(self, x: jax.Array, index: jax.Array) -> jax.Array:
        return jnp.take_along_axis(x, index, axis=1)

    def shift(self, x: jax.Array, fill: int, step: int) -> jax.Array:
        edge = jnp.full_like(x[:, :1], fill)
        return jnp.concatenate([edge, x[:, :-1]] if step > 0 else [x[:, 1:], edge], axis=1)

    def columns(self, x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)


_JAX_DOCUMENTS = _JaxDocuments()


def _shard_documents(input_ids: Array, segment_ids: Array, rows: jax.Array, ignore: int) -> tuple[jax.Array, ...]:
    """`shard_tokens` of packed documents (`spec.document_tables`: a run of one id, padding inside it a hole) at
    `rows` (``seq_len``: a padding row)."""
    spec.check_token_segments("shard_tokens", segment_ids.shape, dtype_name(segment_ids.dtype), input_ids.shape)
    input_ids, segments = jnp.asarray(input_ids), jnp.asarray(segment_ids)
    positions, continues = spec.document_tables(segments, _JAX_DOCUMENTS)
    labels = jnp.where(continues, jnp.roll(input_ids, -1, 1), ignore).astype(input_ids.dtype)
    return tuple(
        jnp.take(whole, rows, axis=1, mode="fill", fill_value=fill)
        for whole, fill in ((input_ids, 0), (positions, 0), (labels, ignore), (segments, -1))
    )


def shard_sequence(
    x: Array, layout: SequenceLayout | None = None, axis_name: AxisName | None = None, *, dim: int = 1
) -> jax.Array:
    """Differentiable take of this rank's positions of a replicated `x`: ``[.., S, ..] -> [.., max_size, ..]``
    along `dim` (``S == layout.seq_len``; rows past ``sizes[rank]`` are zeros), x's dtype; no communication
    forward.

    Gradient: every rank's cotangent all-gathered into place (as `commlib_jax.shard`): each rank gets the
    gradient of the one replicated x (padding rows' cotangents dropped). An x typed invariant under
    ``shard_map(check_vma=True)`` is one shared value: the take is then a plain local take, whose gradient JAX
    itself sums over the ranks (the same gradient).

    Raises:
        CommError: `dim` out of range, ``x.shape[dim] != layout.seq_len``, ``layout.world_size`` not the axis
            size; a layout or axes not the `parallel` context's (see the module). TypeError: `layout` not a
            `SequenceLayout`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib import SequenceLayout
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> layout = SequenceLayout(8, ring_size=4, layout="zigzag")
        >>> f = jax.shard_map(lambda x: shard_sequence(x, layout, "x", dim=0), mesh=mesh, in_specs=P(),
        ...                   out_specs=P("x"), check_vma=False)
        >>> f(jnp.arange(8.0))  # rank r: positions r and 7 - r
        Array([0., 7., 1., 6., 2., 5., 3., 4.], dtype=float32)
    """
    return _shard_sequence("shard_sequence", x, layout, axis_name, dim)


def _shard_sequence(
    op_name: str, x: Array, layout: SequenceLayout | None, axis_name: AxisName | None, dim: int
) -> jax.Array:
    """`shard_sequence` as helper `op_name` (its errors name it)."""
    x = _check_array(op_name, x)
    layout, axes = _layout(op_name, layout, axis_name)
    dim = spec.check_sequence(op_name, x.shape, dim, layout.seq_len, "layout.seq_len")
    if shared_axes(x, axes):  # one shared value: JAX's transpose of the sharing sums the gradient
        return jnp.take(x, _rows(spec.position_table(layout), layout, axes), axis=dim, mode="fill", fill_value=0)
    order = spec.shard_order(layout, padded=True)
    if order is not None:
        index = np.where(order < 0, layout.seq_len, order).astype(np.int32)
        x = jnp.take(x, jnp.asarray(index), axis=dim, mode="fill", fill_value=0)
    return shard(x, axes, dim)


def gather_sequence(
    x: Array,
    layout: SequenceLayout | None = None,
    axis_name: AxisName | None = None,
    *,
    dim: int = 1,
    convention: str = "sum",
) -> jax.Array:
    """The inverse of `shard_sequence`: every rank's shard ``[.., max_size, ..]`` (its first ``sizes[r]`` rows
    valid) gathered into the whole sequence ``[.., S, ..]`` in natural position order along `dim`, on every
    rank; x's dtype.

    One `all_gather` (``sizes=layout.sizes`` when uneven) and one local permutation (none for a contiguous
    layout). Gradient as all_gather's: "sum" -> this rank's positions of the sum of every rank's cotangent;
    "replicated" -> of its own cotangent; padding rows get exactly 0.

    Raises:
        CommError: `dim` out of range, ``x.shape[dim] != layout.max_size``, unknown convention,
            ``layout.world_size`` not the axis size; a layout or axes not the `parallel` context's (see the
            module). TypeError: `layout` not a `SequenceLayout`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib import SequenceLayout
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> layout = SequenceLayout(8, ring_size=4, layout="zigzag")
        >>> f = jax.shard_map(lambda x: gather_sequence(x, layout, "x", dim=0), mesh=mesh, in_specs=P("x"),
        ...                   out_specs=P("x"))
        >>> f(jnp.array([0.0, 7, 1, 6, 2, 5, 3, 4]))[:8]  # rank 0's output: natural order
        Array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
    """
    return _gather_sequence("gather_sequence", x, layout, axis_name, dim, convention)


def _gather_sequence(
    op_name: str, x: Array, layout: SequenceLayout | None, axis_name: AxisName | None, dim: int, convention: str
) -> jax.Array:
    """`gather_sequence` as helper `op_name` (its errors name it)."""
    x = _check_array(op_name, x)
    layout, axes = _layout(op_name, layout, axis_name)
    dim = spec.check_sequence(op_name, x.shape, dim, layout.max_size, "layout.max_size", convention=convention)
    whole = all_gather(x, axes, dim, convention=convention, sizes=spec.gather_sizes(layout))
    order = spec.gather_order(layout)
    return whole if order is None else jnp.take(whole, jnp.asarray(order.astype(np.int32)), axis=dim)


def cross_entropy(logits: Array, labels: Array, axis_name: AxisName, *, ignore_index: int = -100) -> jax.Array:
    """The mean cross entropy over EVERY rank's non-ignored tokens, the same value on every rank of `axis_name`:
    logits ``[*s, V]`` (this rank's tokens, padding rows included), labels ``[*s]`` -> a scalar in
    ``promote(logits.dtype, float32)``.

    The token losses of this rank are summed, the sums and the counts of non-ignored labels all_reduced, and
    loss = global sum / global count. Gradient (``all_reduce(..., convention="replicated")``): each rank's
    logits get their tokens' share of the global mean, ``(softmax - one_hot) / global count``, exactly 0 on
    ignored and padding rows. No non-ignored token anywhere: NaN.

    Inside `commlib_jax.training.value_and_grad` over axes that include `axis_name` it returns this rank's
    share (its tokens' loss sum / global count) instead: that helper sums the ranks' losses, so its loss is the
    global mean (not W times it) and its gradients the unsharded ones, in every mode.

    Labels outside ``[0, V)`` other than `ignore_index` on any rank (a traced program cannot raise): the loss
    and every gradient are NaN on every rank, never a finite gradient and never another label in their place
    (torch's `cross_entropy` raises a CommError instead). In checked mode (``COMMLIB_CHECK=1``, any number of
    processes: `commlib_jax._checked.checks_data`) the ranks' counts and first such labels are all-gathered
    and, when the step runs, every device raises the spec's CommError naming cross_entropy, V, the ranks and
    their labels, inside ``jax.errors.JaxRuntimeError`` (one all_gather of 2 ints and a host callback per call).

    Raises:
        CommError: ``labels.shape != logits.shape[:-1]``, logits 0-d, `axis_name` not within value_and_grad's
            axes (inside it). TypeError: logits not floating, labels not integer, `ignore_index` not an int.
        jax.errors.JaxRuntimeError: (when run, checked mode only) labels outside ``[0, V)`` on some rank.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4, one token each, the last one ignored
        >>> f = jax.shard_map(lambda z, y: cross_entropy(z, y, "x")[None], mesh=mesh, in_specs=P("x"),
        ...                   out_specs=P("x"))
        >>> f(jnp.zeros((4, 3)), jnp.array([0, 1, 2, -100])).round(6)  # log(3) on every rank
        Array([1.098612, 1.098612, 1.098612, 1.098612], dtype=float32)
    """
    logits, labels = _check_array("cross_entropy", logits, "logits"), _check_array("cross_entropy", labels, "labels")
    axes = axes_of(axis_name)
    axis_size("cross_entropy", axes)
    ignore = spec.check_cross_entropy(
        logits.shape, labels.shape, dtype_name(logits.dtype), dtype_name(labels.dtype), ignore_index
    )
    share = spec.check_share_axes(axes, summed_axes())
    accumulate = jnp.promote_types(logits.dtype, jnp.float32)
    bad = (labels != ignore) & ((labels < 0) | (labels >= logits.shape[-1]))  # counted, never indexed
    valid = (labels != ignore) & ~bad
    log_probs = jax.nn.log_softmax(logits.astype(accumulate), axis=-1)
    picked = jnp.take_along_axis(log_probs, jnp.where(valid, labels, 0)[..., None].astype(jnp.int32), axis=-1)
    local = -jnp.sum(jnp.where(valid, picked[..., 0], 0))
    counts = jnp.stack([jnp.sum(valid), jnp.sum(bad)]).astype(accumulate)
    if checks_data():
        _refuse_labels(labels, bad, axes, logits.shape[-1], ignore)
    if share:  # value_and_grad sums the ranks' losses: each rank contributes its share
        total_counts = jax.lax.stop_gradient(all_reduce(counts, axis_name))
        return local / total_counts[0] * _poisoned(total_counts[1])
    total = all_reduce(jnp.concatenate([local[None], counts]), axis_name, convention="replicated")
    return total[0] / jax.lax.stop_gradient(total[1]) * _poisoned(jax.lax.stop_gradient(total[2]))


def _refuse_labels(labels: Array, bad: jax.Array, axes: tuple[str, ...], vocab: int, ignore: int) -> None:
    """Checked mode: every rank's count of labels outside ``[0, V)`` and its first one, all-gathered over
    `axes`; a host callback on every device raises the spec's error where any rank has one."""
    flat, flat_bad = jnp.ravel(jnp.asarray(labels)), jnp.ravel(bad)
    first = flat[jnp.argmax(flat_bad)] if flat.size else jnp.zeros((), flat.dtype)
    mine = to_varying(jnp.stack([jnp.sum(flat_bad).astype(flat.dtype), first]), axes)
    everyone = jax.lax.all_gather(mine, axis_arg(axes))  # [W, 2]: count, first bad label (any value if none)
    io_callback(functools.partial(_raise_labels, vocab, ignore), None, everyone, ordered=False)


def _raise_labels(vocab: int, ignore: int, everyone: Any) -> None:
    """Host side of `_refuse_labels`: the same error on every device (`spec.labels_out_of_range_error`)."""
    rows = np.asarray(everyone).tolist()
    counts = [int(count) for count, _ in rows]
    if any(counts):
        firsts = [int(label) if count else None for count, label in rows]
        raise spec.labels_out_of_range_error(counts, vocab, ignore, firsts)


def _poisoned(bad_count: jax.Array) -> jax.Array:
    """NaN where any rank had a label outside ``[0, V)`` (a traced program cannot raise): the loss and, through
    the product, every gradient NaN on every rank; else 1."""
    return jnp.where(bad_count > 0, jnp.nan, 1.0).astype(bad_count.dtype)


# ---- the parallel context and the attention drop-in ------------------------------------------------------------


@contextlib.contextmanager
def parallel(
    layout: SequenceLayout,
    axis_name: AxisName | None = None,
    *,
    attention: str = "ulysses",
    ulysses_axis: AxisName | None = None,
    ring_axis: AxisName | None = None,
) -> Iterator[parallel_spec.ParallelPlan]:
    """A context in which `dot_product_attention` runs commlib's `attention` layer on this rank's shard of
    `layout` (enter it around the code that traces the model: the jitted step, or inside the shard_map body).

    Args:
        layout: the `commlib.SequenceLayout` of the sequence (any length; each shard held padded to
            ``layout.max_size`` rows, the valid ones first).
        axis_name: the mesh axis (or tuple of axes) of ``"ulysses"`` and ``"ring"``; required for them.
        attention: ``"ulysses"`` (`commlib_jax.attention.ulysses_attention`: ``layout.ulysses_size`` = the axis
            size, ``ring_size`` 1), ``"ring"`` (`ring_attention`: ``ring_size`` = the axis size) or ``"usp"``
            (`usp_attention` over `ulysses_axis` and `ring_axis`, both required).

    Yields the spec's `commlib.parallel.ParallelPlan`. Contexts nest (the innermost wins; the outer one is back
    on exit) and are per thread (a contextvar). The layout's sizes are checked against the axes' on entry
    inside a shard_map, else when the attention is traced. The context is part of ``jax.jit``'s cache key: a
    function jitted in one context (or outside every one) and called in another is traced again there (on a
    jax without the private API this rests on, `commlib_jax._compat.JitKeyedState`, it keeps the first
    context's layer: jit it inside the context it runs in). Gradients are the layers' (exact, every JAX mode).

    Raises:
        CommError: an unknown `attention`, USP without both axes (Ulysses / ring without `axis_name`, or given
            USP's axes), a layout whose Ulysses or ring size is not its axis size.
        TypeError: `layout` not a SequenceLayout, `attention` not a str.

    Example (4 CPU devices: S = 10 over 4 ranks, held padded to 3 rows):
        >>> import commlib, jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> layout = commlib.SequenceLayout(10, ulysses_size=4)
        >>> x = np.random.default_rng(0).standard_normal((1, 10, 4, 8)).astype(np.float32)
        >>> shards = jnp.asarray(np.concatenate(layout.shard(x, padded=True), axis=1))  # [1, 4 * 3, 4, 8]
        >>> body = lambda q: dot_product_attention(q, q, q, is_causal=True)
        >>> with parallel(layout, "x"):
        ...     out = jax.shard_map(body, mesh=Mesh(jax.devices()[:4], ("x",)), in_specs=P(None, "x"),
        ...                         out_specs=P(None, "x"))(shards)
        >>> whole = layout.unshard(np.split(np.asarray(out), 4, axis=1), padded=True)
        >>> want = jax.nn.dot_product_attention(x, x, x, is_causal=True)
        >>> bool(np.allclose(whole, want, atol=1e-5))
        True
    """
    state = _parallel.enter(layout, axis_name, attention, ulysses_axis, ring_axis)
    with _parallel.CONTEXTS.entered(state), _parallel.JIT_KEY.bound(state.key()):
        yield state.plan


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: object = None,
    mask: object = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    positions: Array | None = None,
    segment_ids: Array | None = None,
) -> jax.Array:
    """``jax.nn.dot_product_attention``'s signature and layout, run by the innermost `parallel` context's layer on
    this rank's shard: query ``[B, T, N, H]``, key and value ``[B, T, K, H]`` (``T = layout.max_size``; GQA by head
    counts, ``N % K == 0``) -> ``[B, T, N, H]``, query's dtype; rows past this shard's own are zeros.

    `is_causal` masks by global positions; `scale` defaults to ``1 / sqrt(H)``. Gradient: exact, the layer's
    (rows past a shard's own get gradient 0).

    `positions` (optional, int ``[..., T]``: the positions the model fed RoPE / its position embeddings,
    ``shard_tokens``' second output): checked against the global positions of this rank's shard (padding rows
    ignored), on every rank -- RoPE fed local positions, or tokens sharded by another layout than the context's
    (e.g. by `shard_tokens` outside the context), is otherwise silently wrong, as the layer sees no positions.
    The check costs one all_gather of the positions (``W * positions.size`` ints) and a host callback per call;
    a mismatch raises, when the step runs, ``jax.errors.JaxRuntimeError`` carrying the spec's `CommError` text
    (the first shard that differs: its expected and received positions) on every rank, so none waits in the
    layer's collectives; JAX reports it again at exit. None (default): not checked, nothing added.

    `segment_ids` (optional, integers ``[B, T]``: packed documents and padding, ``shard_tokens(...,
    segment_ids=)``'s fourth output; padding rows -1): the segment mask of the layers' ``segment_ids=`` -- a
    query attends a key of the same document only (and, with `is_causal`, not after it); a negative id is
    padding, whose rows output 0 with gradient 0. A keyword of its own, as MaxText's decoder segment ids, since
    a dense `mask` ``[B, N, T, S]`` cannot say what other shards hold: a Flax model passes it down to its
    attention modules (e.g. through ``nnx.MultiHeadAttention``'s ``attention_fn`` with ``functools.partial``).

    Raises:
        CommError: outside a `parallel` context (at trace time); a `bias` or a `mask` (commlib owns the causal
            and segment masks only); T not ``layout.max_size``; the layout's sizes not the axes';
            ``positions.shape[-1]`` not ``layout.max_size``; segment_ids not ``[B, T]``; the layer's own errors.
        TypeError: query, key, value or segment_ids not an array (a Python list); segment_ids not of an integer
            dtype.
        jax.errors.JaxRuntimeError: (when run) `positions` not the shards' global positions (see above).

    Example (4 CPU devices, ring attention over a zigzag layout of 16 positions, GQA; the positions checked):
        >>> import commlib, jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> layout = commlib.SequenceLayout(16, ring_size=4, layout="zigzag")
        >>> rng = np.random.default_rng(0)
        >>> q, k = rng.standard_normal((2, 16, 4, 8), np.float32), rng.standard_normal((2, 16, 2, 8), np.float32)
        >>> cut = lambda x: jnp.asarray(np.concatenate(layout.shard(x), axis=1))  # shard r's rows at block r
        >>> body = lambda q, k: dot_product_attention(q, k, k, is_causal=True, positions=position_ids()[None])
        >>> with parallel(layout, "x", attention="ring"):
        ...     out = jax.shard_map(body, mesh=Mesh(jax.devices()[:4], ("x",)), in_specs=P(None, "x"),
        ...                         out_specs=P(None, "x"))(cut(q), cut(k))
        >>> whole = layout.unshard(np.split(np.asarray(out), 4, axis=1))
        >>> bool(np.allclose(whole, jax.nn.dot_product_attention(q, k, k, is_causal=True), atol=1e-5))
        True
    """
    for name, array in (("query", query), ("key", key), ("value", value)):  # kinds first: a list has no shape
        _check_array(parallel_spec.CALL_OP, array, name)
    state = _parallel.current(parallel_spec.CALL_OP)
    parallel_spec.check_call(state.plan, shard=None, rows=query.shape[1], mask=mask is not None, bias=bias is not None)
    parallel_spec.check_sizes(state.plan.layout, state.plan.attention, **state.sizes(parallel_spec.CALL_OP))
    if positions is not None:
        state.check_positions(positions)
    return state.attend(query, key, value, causal=is_causal, scale=scale, segment_ids=segment_ids)
