"""The spec of the sequence helpers (`commlib.sequence_helpers`): the index tables against their definitions
(`SequenceLayout.positions`, the next token over the whole sequence), the exact and padded shard orders and their
inverse, the references' identities (gather after shard is the identity; the ranks' cross-entropy shares sum to
the loss; the reference gradient is the finite-difference one) and every error message."""

from __future__ import annotations

import numpy as np
import pytest

from commlib import CommError, SequenceLayout
from commlib import sequence_helpers as spec
from commlib.reference import sequence as reference
from tests.sequence_cases import IGNORE, V, data, documents, layouts

ALL = [layout for world_size in (1, 2, 3, 4) for layout in layouts(world_size)]


@pytest.mark.parametrize("layout", ALL, ids=repr)
def test_tables_follow_the_layout(layout):
    positions, labels = spec.position_table(layout), spec.label_table(layout)
    for index, size in enumerate(layout.sizes):
        assert positions[index, :size].tolist() == layout.positions(index).tolist()
        assert (positions[index, size:] == -1).all() and (labels[index, size:] == -1).all()
        own = layout.positions(index)
        assert labels[index, :size].tolist() == [p + 1 if p + 1 < layout.seq_len else -1 for p in own]


@pytest.mark.parametrize("layout", ALL, ids=repr)
def test_shard_orders_and_their_inverse(layout):
    x = np.arange(layout.seq_len)
    exact = spec.shard_order(layout, False)
    in_shard_order = x if exact is None else x[exact]
    assert in_shard_order.tolist() == np.concatenate(layout.shard(x, 0)).tolist()
    inverse = spec.gather_order(layout)
    assert (in_shard_order if inverse is None else in_shard_order[inverse]).tolist() == x.tolist()
    padded = spec.shard_order(layout, True)
    rows = x if padded is None else np.where(padded < 0, -1, np.append(x, -1)[np.where(padded < 0, -1, padded)])
    assert rows.reshape(layout.world_size, -1).tolist() == spec.position_table(layout).tolist()
    assert spec.gather_sizes(layout) == (None if layout.is_even else layout.sizes)


@pytest.mark.parametrize("layout", ALL, ids=repr)
def test_references(layout):
    case = data(layout)
    tokens = reference.shard_tokens_reference(case["ids"], layout, IGNORE)
    assert (
        np.concatenate([labels for _, _, labels in tokens], 1)[
            :, np.argsort(np.concatenate([layout.positions(i) for i in range(layout.world_size)]))
        ].tolist()
        == spec.next_token_labels(case["ids"], IGNORE).tolist()
    )
    outputs, _ = reference.shard_sequence_reference(case["x"], case["shard_cotangents"], layout)
    whole, _ = reference.gather_sequence_reference(outputs, case["gather_cotangents"], layout)
    assert all(np.array_equal(out, case["x"]) for out in whole)
    loss, _ = reference.cross_entropy_reference(case["logits"], case["labels"], IGNORE)
    count = (case["labels"] != IGNORE).sum()
    shares = [
        reference.cross_entropy_reference(logits, labels, IGNORE)[0] * (labels != IGNORE).sum() / count
        for logits, labels in zip(layout.shard(case["logits"], 1), layout.shard(case["labels"], 1), strict=True)
        if (labels != IGNORE).any()
    ]
    np.testing.assert_allclose(sum(shares), loss, rtol=1e-13)


def _documents_by_token(ids: np.ndarray, segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The definition, token by token: position = tokens since the document's first (a run of equal ids, padding
    inside it a hole, counted), the label the next token while it is in the same document, padding position 0 and
    label ignored."""
    positions, labels = np.zeros_like(ids), np.full_like(ids, IGNORE)
    for row, column in np.ndindex(*ids.shape):
        if segments[row, column] < 0:
            continue
        start = back = column
        while back > 0 and (segments[row, back - 1] < 0 or segments[row, back - 1] == segments[row, column]):
            back -= 1
            start = back if segments[row, back] == segments[row, column] else start
        positions[row, column] = column - start
        if column + 1 < ids.shape[1] and segments[row, column + 1] == segments[row, column]:
            labels[row, column] = ids[row, column + 1]
    return positions, labels


@pytest.mark.parametrize("layout", ALL, ids=repr)
@pytest.mark.parametrize("padded", [False, True])
def test_document_references(layout, padded):
    ids, segments = data(layout)["ids"], documents(layout)
    positions, labels = _documents_by_token(ids, segments)
    got = reference.shard_tokens_reference(ids, layout, IGNORE, padded=padded, segment_ids=segments)
    for rank, shards in enumerate(got):
        size = layout.sizes[rank]
        for part, whole, fill in zip(shards, (ids, positions, labels, segments), (0, 0, IGNORE, -1), strict=True):
            assert part.shape == (ids.shape[0], layout.max_size if padded else size)
            assert part[:, :size].tolist() == whole[:, layout.positions(rank)].tolist()
            assert (part[:, size:] == fill).all()


@pytest.mark.parametrize("layout", ALL[::3], ids=repr)
def test_documents_with_holes(layout):
    """Padding inside a document (a padding mask with zeros in the middle, made segment ids) is a hole: the
    positions count it, as transformers' do, and the labels stop before it (issue 34 item 8: the positions
    restarted after the hole, so the helpers and the transformers route split one row into two documents)."""
    ids, segments = data(layout)["ids"], documents(layout).copy()
    rng = np.random.default_rng(layout.seq_len)
    segments[rng.random(segments.shape) < 0.2] = -1
    positions, labels = _documents_by_token(ids, segments)
    assert spec.document_positions(segments).tolist() == positions.tolist()
    assert spec.document_labels(ids, segments, IGNORE).tolist() == labels.tolist()


def test_a_hole_counts_as_transformers_counts_it():
    """A tokenizer's mask ``[1, 1, 0, 1, 1]`` (``where(mask, 0, -1)``) is one document: positions 0..4 where the
    mask keeps a token (transformers' own ``arange``), 0 at the hole; left padding then a hole: the positions start
    at the text and count the hole; a hole between two documents ends neither more than their ids do."""
    assert spec.document_positions(np.array([[0, 0, -1, 0, 0]])).tolist() == [[0, 1, 0, 3, 4]]
    assert spec.document_positions(np.array([[-1, -1, 0, -1, 0, 0]])).tolist() == [[0, 0, 0, 0, 2, 3]]
    assert spec.document_positions(np.array([[0, -1, 1, 1, -1, 1]])).tolist() == [[0, 0, 0, 1, 0, 3]]
    ids = np.array([[10, 11, 12, 13, 14]])
    labels = spec.document_labels(ids, np.array([[0, 0, -1, 0, 0]]), IGNORE)
    assert labels.tolist() == [[11, IGNORE, IGNORE, 14, IGNORE]]


def test_documents_in_a_handed_row():
    ids, segments = np.array([[10, 11, 12, 13, 14, 15, 16]]), np.array([[0, 0, 1, 1, 1, -1, -1]])
    assert spec.document_positions(segments).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert spec.document_labels(ids, segments, IGNORE).tolist() == [[11, IGNORE, 13, 14, IGNORE, IGNORE, IGNORE]]
    # the same id in two runs is two documents for the positions and labels
    assert spec.document_positions(np.array([[0, 0, 1, 0]])).tolist() == [[0, 1, 0, 0]]


def test_cross_entropy_gradient_is_the_finite_difference():
    rng = np.random.default_rng(0)
    logits, labels = rng.standard_normal((2, 3, V)), np.array([[1, IGNORE, 4], [0, 2, IGNORE]])
    _, grad = reference.cross_entropy_reference(logits, labels, IGNORE)
    step, numeric = 1e-6, np.zeros_like(logits)
    for index in np.ndindex(*logits.shape):
        bumped = [logits.copy(), logits.copy()]
        bumped[0][index] += step
        bumped[1][index] -= step
        numeric[index] = (
            reference.cross_entropy_reference(bumped[0], labels, IGNORE)[0]
            - reference.cross_entropy_reference(bumped[1], labels, IGNORE)[0]
        ) / (2 * step)
    np.testing.assert_allclose(grad, numeric, atol=1e-8)
    assert not grad[0, 1].any() and not grad[1, 2].any()


def test_sync_gradients_parameters_are_described_in_full():
    """Checked mode compares these texts: past 8 parameters a hash of the whole list keeps a change at any place
    visible."""
    few = [((3,), "float32"), ((2, 2), "bfloat16 frozen")]
    assert spec.describe_parameters(few) == "2 tensors: (3,) float32, (2, 2) bfloat16 frozen"
    assert repr(spec.describe_parameters(few[:1])) == "1 tensor: (3,) float32"  # (shown unquoted in messages)
    many = [((index + 1,), "float32") for index in range(10)]
    text = spec.describe_parameters(many)
    assert text.startswith("10 tensors (55 elements, hash ") and text.endswith("(7,) float32, (8,) float32, ...")
    changed = spec.describe_parameters([*many[:9], ((10,), "float64")])
    assert changed != text and changed.split(": ")[1] == text.split(": ")[1]
    assert spec.describe_parameters([]) == "none (an empty iterable: a consumed generator?)"
    assert str(spec.no_parameters_error()).endswith("the same on every rank. Received: parameters=()")


@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        (
            lambda: spec.check_layout("shard_tokens", "contiguous", 2),
            TypeError,
            "shard_tokens: layout must be a commlib.SequenceLayout, not str. Received: type='str'",
        ),
        (
            lambda: spec.check_layout("cross_entropy", SequenceLayout(8, 2, 2), 2),
            CommError,
            "cross_entropy: layout.world_size (4) must be the group's world_size (2). Received: layout=SequenceLayout("
            "seq_len=8, ring_size=2, ulysses_size=2, layout='contiguous'), world_size=2",
        ),
        (
            lambda: spec.check_tokens("shard_tokens", (2, 8), "float32", SequenceLayout(8), -100),
            TypeError,
            "shard_tokens: input_ids must have an integer dtype, not float32. Received: shape=(2, 8), dtype='float32', "
            "seq_len=8",
        ),
        (
            lambda: spec.check_tokens("shard_tokens", (8,), "int64", SequenceLayout(8), -100),
            CommError,
            "shard_tokens: input_ids ndim (1) must be 2 ([batch, seq]). Received: shape=(8,), dtype='int64', seq_len=8",
        ),
        (
            lambda: spec.check_tokens("shard_tokens", (2, 8), "int64", SequenceLayout(8), 1.5),
            TypeError,
            "shard_tokens: ignore_index must be an int, not float. Received: shape=(2, 8), dtype='int64', seq_len=8, "
            "ignore_index=1.5",
        ),
        (
            lambda: spec.check_token_segments("shard_tokens", (2, 8), "float32", (2, 8)),
            TypeError,
            "shard_tokens: segment_ids must have an integer dtype, not float32. Received: segment_ids_shape=(2, 8), "
            "segment_ids_dtype='float32', input_ids_shape=(2, 8)",
        ),
        (
            lambda: spec.check_token_segments("shard_tokens", (2, 7), "int32", (2, 8)),
            CommError,
            "shard_tokens: segment_ids.shape ((2, 7)) must be input_ids.shape ((2, 8)). Received: "
            "segment_ids_shape=(2, 7), "
            "segment_ids_dtype='int32', input_ids_shape=(2, 8)",
        ),
        (
            lambda: spec.check_sequence("shard_sequence", (2, 8), 2, 8, "layout.seq_len"),
            CommError,
            "shard_sequence: dim (2) must be in [-2, 2) for ndim 2. Received: shape=(2, 8), dim=2",
        ),
        (
            lambda: spec.check_cross_entropy((2, 3, 5), (2, 3), "int64", "int64", -100),
            TypeError,
            "cross_entropy: logits must have a floating dtype, not int64. Received: shape=(2, 3, "
            "5), labels_shape=(2, 3), "
            "dtype='int64', labels_dtype='int64'",
        ),
        (
            lambda: spec.check_cross_entropy((2, 3, 5), (2, 3), "float32", "float32", -100),
            TypeError,
            "cross_entropy: labels must have an integer dtype, not float32. Received: shape=(2, 3, "
            "5), labels_shape=(2, 3), "
            "dtype='float32', labels_dtype='float32'",
        ),
        (
            lambda: spec.check_sync_op("product"),
            CommError,
            "sync_gradients: op ('product') must be one of sum, avg. Received: op='product'",
        ),
    ],
)
def test_errors(call, kind, message):
    with pytest.raises(kind) as raised:
        call()
    assert str(raised.value) == message
