"""The sequence helpers of a whole sequence-parallel model: what each rank holds of the tokens, the positions and
the labels of a `SequenceLayout`, the index tables the frontends walk and their validation. The float64 numpy
references (values and gradients) that `commlib_torch.sequence` and `commlib_jax.sequence` are tested against
are `commlib.reference.sequence`.

A model's silent wrong answers live here: RoPE fed local positions, labels shifted per shard, a loss averaged
per shard. The rules, for a layout of S tokens over W shards (shard i holds ``layout.positions(i)``):

- the position of a row is its global position; the label of the row at position p is token p + 1, and
  ``ignore_index`` at p = S - 1 (shifted over the whole sequence, not per shard);
- the loss is the mean over every rank's non-ignored tokens; rank r's tokens' share of it is
  ``sum of rank r's token losses / global count``, so the shares sum to the loss;
- torch holds shard i exactly (``sizes[i]`` rows); JAX padded to ``max_size`` rows: padding rows hold id 0,
  position 0 and label ``ignore_index``;
- packed documents (``segment_ids`` ``[B, S]``, as `commlib.segment_ids` makes): the position of a token counts
  from its document's first token (a document is a run of equal ids), a document's last token and padding
  (negative ids) get ``ignore_index`` as label and padding position 0; JAX padding rows get segment id -1.

>>> layout = SequenceLayout(5, ring_size=2, layout="zigzag")  # chunks (2, 1, 1, 1): blocks [0, 1, 4] and [2, 3]
>>> position_table(layout).tolist(), label_table(layout).tolist()  # -1: padding / ignore_index
([[0, 1, 4], [2, 3, -1]], [[1, 2, -1], [3, 4, -1]])
"""

from __future__ import annotations

import functools
import operator
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from commlib.errors import CommError, comm_error, kind_error
from commlib.plans import CONVENTIONS
from commlib.reduce_op import ReduceOp, is_floating, parse_reduce_op
from commlib.sequence import SequenceLayout
from commlib.validators import check_int, iterable

__all__ = [
    "check_layout",
    "check_tokens",
    "check_sequence",
    "check_cross_entropy",
    "check_share_axes",
    "check_sync_op",
    "describe_parameters",
    "no_parameters_error",
    "sparse_gradient_error",
    "check_token_segments",
    "position_table",
    "label_table",
    "labels_out_of_range_error",
    "shard_order",
    "gather_order",
    "gather_sizes",
    "next_token_labels",
    "DocumentMath",
    "document_tables",
    "document_positions",
    "document_labels",
]

INTEGER_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


# ---------------------------------------------------------------------------------------------------------
# Validation (both frontends raise these, before any communication)
# ---------------------------------------------------------------------------------------------------------


def check_layout(op_name: str, layout: object, world_size: int) -> SequenceLayout:
    """`layout` itself: a `SequenceLayout` whose world size is the group's (`world_size`).

    >>> check_layout("shard_tokens", SequenceLayout(8, ring_size=4), 2)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: shard_tokens: layout.world_size (4) must be the group's world_size (2). Received: ...
    """
    if not isinstance(layout, SequenceLayout):
        raise kind_error(
            op_name, f"layout must be a commlib.SequenceLayout, not {type(layout).__name__}", type=type(layout).__name__
        )
    if layout.world_size != world_size:
        raise comm_error(
            op_name,
            f"layout.world_size ({layout.world_size}) must be the group's world_size ({world_size})",
            layout=layout,
            world_size=world_size,
        )
    return layout


def _dims(op_name: str, shape: object, received: dict) -> tuple[int, ...]:
    try:
        return tuple(operator.index(size) for size in iterable(shape))
    except TypeError:
        raise kind_error(op_name, "shape must be a sequence of ints", **received) from None


def check_tokens(op_name: str, shape: object, dtype: str, layout: SequenceLayout, ignore_index: object) -> int:
    """Full token ids ``[B, S]`` of an integer dtype with ``S == layout.seq_len``; returns `ignore_index` as an int.

    >>> check_tokens("shard_tokens", (2, 6), "int64", SequenceLayout(5), -100)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: shard_tokens: input_ids.shape[1] (6) must be layout.seq_len (5). Received: ...
    """
    received = dict(shape=shape, dtype=dtype, seq_len=layout.seq_len)
    dims = _dims(op_name, shape, received)
    ignore = check_int(op_name, "ignore_index", ignore_index, dict(received, ignore_index=ignore_index))
    if dtype not in INTEGER_DTYPES:
        raise kind_error(op_name, f"input_ids must have an integer dtype, not {dtype}", **received)
    if len(dims) != 2:
        raise comm_error(op_name, f"input_ids ndim ({len(dims)}) must be 2 ([batch, seq])", **received)
    if dims[1] != layout.seq_len:
        raise comm_error(
            op_name, f"input_ids.shape[1] ({dims[1]}) must be layout.seq_len ({layout.seq_len})", **received
        )
    return ignore


def check_token_segments(op_name: str, shape: object, dtype: str, ids_shape: tuple[int, ...]) -> None:
    """`segment_ids` of `shard_tokens`: input_ids' shape ``[B, S]`` and an integer dtype.

    >>> check_token_segments("shard_tokens", (2, 5), "float32", (2, 5))
    Traceback (most recent call last):
    ...
    TypeError: shard_tokens: segment_ids must have an integer dtype, not float32. Received: ...
    """
    received = dict(segment_ids_shape=shape, segment_ids_dtype=dtype, input_ids_shape=tuple(ids_shape))
    dims = _dims(op_name, shape, received)
    if dtype not in INTEGER_DTYPES:
        raise kind_error(op_name, f"segment_ids must have an integer dtype, not {dtype}", **received)
    if dims != tuple(ids_shape):
        raise comm_error(
            op_name, f"segment_ids.shape ({dims}) must be input_ids.shape ({tuple(ids_shape)})", **received
        )


def check_sequence(op_name: str, shape: object, dim: object, rows: int, what: str, *, convention: object = None) -> int:
    """`dim` normalised, after checking that ``shape[dim] == rows`` (`what` names the expected count) and, for a
    gather, that `convention` is all_gather's ("sum" or "replicated"; None: no gather).

    >>> check_sequence("gather_sequence", (2, 3, 4), 1, 2, "layout.sizes[1]")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: gather_sequence: x.shape[1] (3) must be layout.sizes[1] (2). Received: ...
    >>> check_sequence("gather_latents", (2, 3, 4), 1, 3, "layout.sizes[0]", convention="mean")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: gather_latents: convention ('mean') must be one of sum, replicated. Received: ...
    """
    received = dict(shape=shape, dim=dim)
    if convention is not None and convention not in CONVENTIONS:
        message = f"convention ({convention!r}) must be one of {', '.join(CONVENTIONS)}"
        raise comm_error(op_name, message, **received, convention=convention)
    dims = _dims(op_name, shape, received)
    value = check_int(op_name, "dim", dim, received)
    if not -len(dims) <= value < len(dims):
        raise comm_error(
            op_name, f"dim ({value}) must be in [{-len(dims)}, {len(dims)}) for ndim {len(dims)}", **received
        )
    value %= len(dims)
    if dims[value] != rows:
        raise comm_error(op_name, f"x.shape[{value}] ({dims[value]}) must be {what} ({rows})", **received)
    return value


def check_cross_entropy(
    shape: object, labels_shape: object, dtype: str, labels_dtype: str, ignore_index: object
) -> int:
    """logits ``[*s, V]`` floating, labels ``[*s]`` integer; returns `ignore_index` as an int.

    >>> check_cross_entropy((2, 3, 8), (2, 4), "float32", "int64", -100)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: cross_entropy: labels.shape ((2, 4)) must be logits.shape[:-1] ((2, 3)). Received: ...
    """
    op_name = "cross_entropy"
    received = dict(shape=shape, labels_shape=labels_shape, dtype=dtype, labels_dtype=labels_dtype)
    dims, label_dims = _dims(op_name, shape, received), _dims(op_name, labels_shape, received)
    ignore = check_int(op_name, "ignore_index", ignore_index, dict(received, ignore_index=ignore_index))
    if not is_floating(dtype):
        raise kind_error(op_name, f"logits must have a floating dtype, not {dtype}", **received)
    if labels_dtype not in INTEGER_DTYPES:
        raise kind_error(op_name, f"labels must have an integer dtype, not {labels_dtype}", **received)
    if not dims:
        raise comm_error(op_name, "logits ndim (0) must be >= 1 ([..., vocab])", **received)
    if label_dims != dims[:-1]:
        raise comm_error(op_name, f"labels.shape ({label_dims}) must be logits.shape[:-1] ({dims[:-1]})", **received)
    return ignore


def labels_out_of_range_error(
    counts: Sequence[int], vocab: int, ignore_index: int, first_labels: Sequence[int | None] | None = None
) -> CommError:
    """The error every rank of `cross_entropy` raises when some rank's labels hold values outside ``[0, vocab)``
    other than `ignore_index`; `counts` is every rank's number of them (all_reduced with the loss, so the
    message is the same on every rank); `first_labels` (optional, JAX's checked mode) every rank's first such
    label (None on a rank without one), named in the message.

    >>> labels_out_of_range_error([0, 2], 5, -100)
    CommError('cross_entropy: labels must be in [0, 5) or ignore_index (-100); 2 are not, on rank 1. Received: ...')
    >>> str(labels_out_of_range_error([1, 0], 5, -100, [-5, None])).split(". Received")[0]
    'cross_entropy: labels must be in [0, 5) or ignore_index (-100); 1 are not, on rank 0 (label -5)'
    """
    ranks = [rank for rank, count in enumerate(counts) if count]
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    received: dict[str, object] = dict(counts_per_rank=tuple(counts), vocab=vocab, ignore_index=ignore_index)
    if first_labels is not None:
        named = [int(label) for rank, label in enumerate(first_labels) if rank in ranks and label is not None]
        where += f" (label {named[0]})" if len(named) == 1 else f" (labels {named}, each rank's first)"
        received["first_labels"] = tuple(first_labels)
    return comm_error(
        "cross_entropy",
        f"labels must be in [0, {vocab}) or ignore_index ({ignore_index}); {sum(counts)} are not, on {where}",
        **received,
    )


def check_share_axes(axes: tuple, summed: tuple | None) -> bool:
    """Whether JAX's `cross_entropy` over `axes` returns this rank's share of the mean: inside
    ``commlib_jax.training.value_and_grad`` over the axes `summed` (None: outside it), which sums the ranks'
    losses and gradients over them; `axes` must be among them there.

    >>> check_share_axes(("sp",), ("dp", "sp")), check_share_axes(("sp",), None)
    (True, False)
    >>> check_share_axes(("sp",), ("dp",))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: cross_entropy: axis_name (('sp',)) must be among the axes value_and_grad sums ...
    """
    if summed is None:
        return False
    if not set(axes) <= set(summed):
        raise comm_error(
            "cross_entropy",
            f"axis_name ({tuple(axes)}) must be among the axes value_and_grad sums over "
            f"({tuple(summed)}): the other ranks' shares of the loss and of the gradients would not be "
            "summed",
            axis_name=tuple(axes),
            value_and_grad_axes=tuple(summed),
        )
    return True


def sparse_gradient_error(shape: tuple[int, ...]) -> TypeError:
    """`sync_gradients`' error for a sparse gradient (it flattens dense gradients).

    >>> sparse_gradient_error((4, 2))
    TypeError('sync_gradients: gradients must be dense, not sparse. Received: shape=(4, 2)')
    """
    return kind_error("sync_gradients", "gradients must be dense, not sparse", shape=tuple(shape))


def check_sync_op(op: object) -> ReduceOp:
    """`sync_gradients`' op: "sum" or "avg" (a string, `ReduceOp` or its torch twin).

    >>> check_sync_op("max")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: sync_gradients: op ('max') must be one of sum, avg. Received: op='max'
    """
    parsed = parse_reduce_op(op, op_name="sync_gradients")
    if parsed not in (ReduceOp.SUM, ReduceOp.AVG):
        raise comm_error("sync_gradients", f"op ({parsed.value!r}) must be one of sum, avg", op=parsed.value)
    return parsed


class _Described(str):
    """A text that stands in a message as it is (not quoted)."""

    def __repr__(self) -> str:
        return str(self)


_LISTED = 8  # parameters listed one by one in sync_gradients' checked-mode text (a count and a hash beyond)


def describe_parameters(parameters: Sequence[tuple[Sequence[int], str]]) -> str:
    """How checked mode compares and shows the parameters a rank passes `sync_gradients`: each (shape, dtype)
    in order (past 8 of them: the count, the elements and a hash of the whole list, then the first 8).

    >>> print(describe_parameters([((3,), "float32"), ((2, 2), "bfloat16")]))
    2 tensors: (3,) float32, (2, 2) bfloat16
    >>> print(describe_parameters([]))
    none (an empty iterable: a consumed generator?)
    """
    if not parameters:
        return _Described("none (an empty iterable: a consumed generator?)")
    shown = [f"{tuple(int(size) for size in shape)} {dtype}" for shape, dtype in parameters]
    count = f"{len(shown)} tensor{'s' if len(shown) > 1 else ''}"
    if len(shown) <= _LISTED:
        return _Described(f"{count}: {', '.join(shown)}")
    elements = sum(functools.reduce(operator.mul, shape, 1) for shape, _ in parameters)
    digest = zlib.crc32("; ".join(shown).encode())
    return _Described(f"{count} ({elements} elements, hash {digest:08x}): {', '.join(shown[:_LISTED])}, ...")


def no_parameters_error() -> CommError:
    """`sync_gradients`' error for an empty iterable of parameters (on every rank in checked mode, where the
    ranks compare their lists first; unchecked, on the rank that passed it, before communicating).

    >>> str(no_parameters_error()).split(" (")[0]
    'sync_gradients: parameters is empty: nothing to sync'
    """
    return comm_error(
        "sync_gradients",
        "parameters is empty: nothing to sync (a consumed generator, such as model.parameters() iterated "
        "before?); pass the replicated parameters, the same on every rank",
        parameters=(),
    )


# ---------------------------------------------------------------------------------------------------------
# Index tables (built once per layout; the frontends walk them)
# ---------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def position_table(layout: SequenceLayout) -> np.ndarray:
    """int64 ``[W, max_size]``: row i holds shard i's global positions, then -1 for each padding row."""
    table = np.full((layout.world_size, layout.max_size), -1, dtype=np.int64)
    for index in range(layout.world_size):
        table[index, : layout.sizes[index]] = layout.positions(index)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=256)
def label_table(layout: SequenceLayout) -> np.ndarray:
    """int64 ``[W, max_size]``: the position whose token is each row's label (p + 1), -1 where the label is
    ``ignore_index`` (the last position and padding rows)."""
    positions = position_table(layout)
    table = np.where((positions >= 0) & (positions + 1 < layout.seq_len), positions + 1, -1)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=256)
def shard_order(layout: SequenceLayout, padded: bool) -> np.ndarray | None:
    """The rows of the whole sequence in shard order: every shard's positions concatenated (exact: S rows), or
    each shard padded to `max_size` with -1 (padded: ``W * max_size`` rows). None where that is the identity
    (contiguous and even, or contiguous and exact)."""
    order = (
        position_table(layout).reshape(-1)
        if padded
        else np.concatenate([layout.positions(index) for index in range(layout.world_size)])
    )
    if order.shape[0] == layout.seq_len and np.array_equal(order, np.arange(layout.seq_len)):
        return None
    order.flags.writeable = False
    return order


@functools.lru_cache(maxsize=256)
def gather_order(layout: SequenceLayout) -> np.ndarray | None:
    """The inverse of the exact `shard_order`: row p of the whole sequence is row ``gather_order[p]`` of the
    shards concatenated (what `all_gather` with `gather_sizes` returns). None where that is the identity."""
    order = shard_order(layout, False)
    if order is None:
        return None
    inverse = np.argsort(order, kind="stable")
    inverse.flags.writeable = False
    return inverse


def gather_sizes(layout: SequenceLayout) -> tuple[int, ...] | None:
    """The ``sizes=`` of the all_gather of a sequence (None: even)."""
    return None if layout.is_even else layout.sizes


# ---------------------------------------------------------------------------------------------------------
# float64 numpy references (W simulated ranks)
# ---------------------------------------------------------------------------------------------------------


def next_token_labels(input_ids: npt.ArrayLike, ignore_index: int = -100) -> np.ndarray:
    """``[B, S]`` labels of the whole sequence: token p + 1 at position p, `ignore_index` at S - 1.

    >>> next_token_labels(np.array([[5, 6, 7]])).tolist()
    [[6, 7, -100]]
    """
    ids = np.asarray(input_ids)
    return np.concatenate([ids[:, 1:], np.full((ids.shape[0], 1), ignore_index, dtype=ids.dtype)], axis=1)


class DocumentMath:
    """The array operations `document_tables` uses, over an array module `xp` (numpy here; `commlib_torch.sequence`
    and `commlib_jax.sequence` bind torch's and jax.numpy's), each along the sequence (axis 1) of ``[B, S]``."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return self.xp.where(condition, x, y)

    def cummax(self, x: Any) -> Any:
        """The running maximum along the sequence."""
        return np.maximum.accumulate(x, axis=1)

    def take(self, x: Any, index: Any) -> Any:
        """``x[b, index[b, s]]``."""
        return np.take_along_axis(x, index, axis=1)

    def shift(self, x: Any, fill: int, step: int) -> Any:
        """``x`` moved one column right (`step` 1: column s holds column s - 1's, column 0 `fill`) or left (-1)."""
        edge = np.full_like(x[:, :1], fill)
        return np.concatenate([edge, x[:, :-1]] if step > 0 else [x[:, 1:], edge], axis=1)

    def columns(self, x: Any) -> Any:
        """``[B, S]``: the column index of each element of `x`."""
        return np.broadcast_to(np.arange(x.shape[1]), x.shape)


NUMPY_DOCUMENTS = DocumentMath(np)


def document_tables(segment_ids: Any, math: DocumentMath = NUMPY_DOCUMENTS) -> tuple[Any, Any]:
    """``(positions, continues)``, both ``[B, S]``, of packed documents' integer segment ids ``[B, S]``: the rule,
    once, for the numpy reference (`document_positions`, `document_labels`) and both frontends' `shard_tokens`.

    A document is a run of tokens of one id (a negative id is padding); padding between two tokens of the same
    id is a hole in the document, not its end (a padding mask with a zero in the middle, made segment ids as
    docs/integrations.md says, stays one document, as transformers attends across the hole). positions: tokens
    since the document's first token, holes counted (transformers' positions count them too); 0 on padding.
    continues: the next token is of the same document and not padding (the token's label is the next token).

    >>> [t.tolist() for t in document_tables(np.array([[0, 0, -1, 0, 1, 1, -1]]))]
    [[[0, 1, 0, 3, 0, 1, 0]], [[True, False, False, False, True, False, False]]]
    """
    segments = segment_ids
    kept = segments >= 0
    index = math.columns(segments)
    before = math.shift(math.cummax(math.where(kept, index, -1)), -1, 1)  # the last token before s not padding
    previous = math.take(segments, math.where(before < 0, 0, before))
    starts = kept & ((before < 0) | (previous != segments))
    positions = math.where(kept, index - math.cummax(math.where(starts, index, 0)), 0)
    joined = kept & (math.shift(segments, -1, 1) == segments)  # token s continues token s - 1
    return positions, math.shift(joined, False, -1)


def document_positions(segment_ids: npt.ArrayLike) -> np.ndarray:
    """int64 ``[B, S]``: each token's position in its document (`document_tables`: a run of equal ids, holes of
    padding inside it counted), 0 on padding (id < 0).

    >>> document_positions(np.array([[0, 0, 0, 1, 1, -1]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    >>> document_positions(np.array([[0, 0, -1, 0, 0]])).tolist()  # one document with a hole
    [[0, 1, 0, 3, 4]]
    """
    return document_tables(np.asarray(segment_ids))[0].astype(np.int64)


def document_labels(input_ids: npt.ArrayLike, segment_ids: npt.ArrayLike, ignore_index: int = -100) -> np.ndarray:
    """``[B, S]`` labels of packed documents: token p + 1 where it is in p's document, `ignore_index` at a
    document's last token, before a hole and on padding (id < 0).

    >>> document_labels(np.array([[5, 6, 7, 8, 9]]), np.array([[0, 0, 1, 1, -1]])).tolist()
    [[6, -100, 8, -100, -100]]
    """
    ids = np.asarray(input_ids)
    labels = next_token_labels(ids, ignore_index)
    return np.where(document_tables(np.asarray(segment_ids))[1], labels, ignore_index).astype(labels.dtype)
