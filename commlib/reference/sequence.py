"""The float64 references of the whole-model sequence helpers (`commlib.sequence_helpers`' rules): every
rank's tokens, positions and labels, the take and gather of a sequence on W simulated ranks, and the loss over
every rank's tokens with its gradient -- what `commlib_torch.sequence` and `commlib_jax.sequence` are tested
against."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from commlib.sequence import SequenceLayout
from commlib.sequence_helpers import document_labels, document_positions, next_token_labels

__all__ = [
    "shard_tokens_reference",
    "shard_sequence_reference",
    "gather_sequence_reference",
    "cross_entropy_reference",
]


def shard_tokens_reference(
    input_ids: npt.ArrayLike,
    layout: SequenceLayout,
    ignore_index: int = -100,
    *,
    padded: bool = False,
    segment_ids: npt.ArrayLike | None = None,
) -> list[tuple[np.ndarray, ...]]:
    """Every rank's ``(ids, position_ids, labels)``, each ``[B, sizes[r]]`` (padded: ``[B, max_size]`` with id 0,
    position 0 and label `ignore_index` on padding rows): the whole sequence's tokens, positions
    (``arange(S)``) and `next_token_labels` sharded by `layout`. With `segment_ids` ``[B, S]``: ``(ids,
    position_ids, labels, segment_ids)``, the positions `document_positions`, the labels `document_labels` and
    the segment ids sharded too (padding rows: -1).

    >>> [ids.tolist() for ids, _, _ in shard_tokens_reference(np.array([[5, 6, 7]]), SequenceLayout(3, 2))]
    [[[5, 6]], [[7]]]
    >>> shard_tokens_reference(np.array([[5, 6, 7]]), SequenceLayout(3, 2), segment_ids=np.array([[0, 1, 1]]))[1]
    (array([[7]]), array([[1]]), array([[-100]]), array([[1]]))
    """
    ids = np.asarray(input_ids)
    whole: tuple[np.ndarray, ...]
    if segment_ids is None:
        whole = (ids, np.broadcast_to(np.arange(layout.seq_len), ids.shape), next_token_labels(ids, ignore_index))
    else:
        segments = np.asarray(segment_ids)
        whole = (ids, document_positions(segments), document_labels(ids, segments, ignore_index), segments)
    fill = (0, 0, ignore_index, -1)[: len(whole)]
    shards = [layout.shard(array, 1) for array in whole]
    if padded:
        shards = [
            [_pad(shard, layout.max_size, value) for shard in part] for part, value in zip(shards, fill, strict=True)
        ]
    return list(zip(*shards, strict=True))


def _pad(x: np.ndarray, rows: int, value: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, rows - x.shape[1])), constant_values=value)


def shard_sequence_reference(
    x: npt.ArrayLike, cotangents: Sequence[npt.ArrayLike], layout: SequenceLayout, dim: int = 1, *, padded: bool = False
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`shard_sequence` on W simulated ranks, each holding the replicated `x`: every rank's output and every
    rank's gradient of x (the same on every rank: every rank's cotangent placed at its positions)."""
    outputs = layout.shard(x, dim, padded=padded)
    gradient = layout.unshard(cotangents, dim, padded=padded)
    return outputs, [gradient] * layout.world_size


def gather_sequence_reference(
    shards: Sequence[npt.ArrayLike],
    cotangents: Sequence[npt.ArrayLike],
    layout: SequenceLayout,
    dim: int = 1,
    *,
    convention: str = "sum",
    padded: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`gather_sequence` on W simulated ranks: every rank's output (the whole sequence) and every rank's
    gradient of its shard: its rows of the sum of the cotangents ("sum"), or of its own ("replicated")."""
    whole = layout.unshard(shards, dim, padded=padded)
    total = np.sum([np.asarray(cotangent) for cotangent in cotangents], axis=0)
    own = [total] * layout.world_size if convention == "sum" else list(cotangents)
    gradients = [layout.shard(cotangent, dim, padded=padded)[rank] for rank, cotangent in enumerate(own)]
    return [whole] * layout.world_size, gradients


def cross_entropy_reference(
    logits: npt.ArrayLike, labels: npt.ArrayLike, ignore_index: int = -100
) -> tuple[float, np.ndarray]:
    """The mean next-token cross entropy of the whole (unsharded) `logits` ``[*s, V]`` over the non-ignored
    `labels` ``[*s]``, and its gradient ``(softmax - one_hot) / count`` (zero on ignored rows), in float64.

    >>> loss, grad = cross_entropy_reference(np.zeros((1, 2, 4)), np.array([[3, -100]]))
    >>> round(loss, 6), grad[0, 1].tolist()  # log(4); an ignored row's gradient is 0
    (1.386294, [0.0, 0.0, 0.0, 0.0])
    """
    logits, labels = np.asarray(logits, dtype=np.float64), np.asarray(labels)
    valid = labels != ignore_index
    safe = np.where(valid, labels, 0)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    count = valid.sum()
    loss = float(-np.where(valid, picked, 0.0).sum() / count)
    one_hot = np.eye(logits.shape[-1])[safe]
    gradient = np.where(valid[..., None], (np.exp(log_probs) - one_hot) / count, 0.0)
    return loss, gradient
