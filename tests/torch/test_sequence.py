"""The sequence helpers on real gloo groups (W = 1-4, every layout of `tests.sequence_cases`): every rank's
outputs and input gradients against the spec's float64 references, a tiny model trained the commlib way against
the same model unsharded, sync_gradients' average over two dtypes, and the spec's errors on every rank."""

from __future__ import annotations

import pytest

from commlib import CommError, SequenceLayout
from commlib import sequence_helpers as spec
from tests.torch import sequence_jobs

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_helper_against_the_reference(pool, world_size):
    for rank, results in enumerate(pool(world_size).run(sequence_jobs.helpers)):
        for layout, errors in results.items():
            # tokens, positions, shard_sequence, gather_sequence: exact (the "sum" gradient adds W cotangents)
            assert errors[:7] + errors[8:10] == [0.0] * 9 and errors[7] < 1e-14, (rank, layout, errors)
            assert errors[10] < 1e-13 and errors[11] < 1e-15, (rank, layout, errors)  # the loss and its gradient


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_tokens_of_packed_documents_is_the_reference(pool, world_size):
    results = pool(world_size).run(sequence_jobs.packed_tokens)
    assert len(results) == world_size and all(results)
    for rank, per_layout in enumerate(results):
        for layout, errors in per_layout.items():
            assert errors == [0.0] * 5, (rank, layout, errors)  # exact, and the dtypes kept


def test_bad_segment_ids_raise_the_spec_text_on_every_rank(pool):
    expected = []
    for call in (
        lambda: spec.check_token_segments("shard_tokens", (2, 7), "int64", (2, 8)),
        lambda: spec.check_token_segments("shard_tokens", (2, 8), "float32", (2, 8)),
    ):
        with pytest.raises((CommError, TypeError)) as info:
            call()
        expected.append(f"{info.type.__name__}: {info.value}")
    assert pool(2).run(sequence_jobs.wrong_segments) == [expected] * 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_model_trained_the_commlib_way_is_the_unsharded_model(pool, world_size):
    for rank, results in enumerate(pool(world_size).run(sequence_jobs.model)):
        assert all(error < 1e-12 for error in results.values()), (rank, results)


def test_sync_gradients_averages_per_dtype(pool):
    assert pool(3).run(sequence_jobs.sync_average) == [[2.0, 2.0, 2.0]] * 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_gradients_of_parameters_some_ranks_skip(pool, world_size):
    """As DDP with find_unused_parameters: every parameter in the ranks' (same) list takes part, zeros where a
    rank has no gradient, so no gradient lands on another parameter; a parameter no rank has a gradient for
    keeps None, one some rank has gets the sum on every rank; a frozen one is left out (its own gradient)."""
    a = float(sum(rank + 1 for rank in range(0, world_size, 2)))
    b = float(sum(rank + 1 for rank in range(1, world_size, 2)))
    d = float(sum(10 * (rank + 1) for rank in range(world_size)))
    expected = [
        {"a": [a] * 3, "b": [b] * 3, "c": None, "d": [d] * 3, "e": [-1.0 - rank] * 3} for rank in range(world_size)
    ]
    assert pool(world_size).run(sequence_jobs.sync_skipped) == expected


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
def test_sync_gradients_of_nothing_is_refused(pool, check):
    expected = (
        "sync_gradients: parameters is empty: nothing to sync (a consumed generator, such as model.parameters() "
        "iterated before?); pass the replicated parameters, the same on every rank. Received: parameters=()"
    )
    assert pool(2).run(sequence_jobs.sync_nothing, check) == [expected] * 2


def test_bad_input_raises_the_spec_text_on_every_rank(pool):
    expected = []
    for call in (
        lambda: spec.check_layout("shard_tokens", SequenceLayout(8, 3), 2),
        lambda: spec.check_sequence("shard_sequence", (2, 7, 3), 1, 8, "layout.seq_len"),
        lambda: spec.check_cross_entropy((2, 4, 5), (2, 3), "float32", "int64", -100),
    ):
        with pytest.raises(CommError) as info:
            call()
        expected.append(str(info.value))
    assert pool(2).run(sequence_jobs.wrong_layout) == [expected] * 2


@pytest.mark.parametrize("values", [(5,), (-5,), (9, 7)], ids=["V", "negative", "two"])
def test_labels_outside_the_vocabulary_raise_the_same_error_on_every_rank(pool, values):
    expected = (
        f"cross_entropy: labels must be in [0, 5) or ignore_index (-100); {len(values)} are not, on rank 1. "
        f"Received: counts_per_rank=(0, {len(values)}), vocab=5, ignore_index=-100"
    )
    assert pool(2).run(sequence_jobs.bad_labels, values) == [expected] * 2


def test_cross_entropy_and_sync_gradients_take_the_parallel_contexts_group(pool):
    for result in pool(4).run(sequence_jobs.context_group_loss):
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, result
