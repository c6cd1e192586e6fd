"""The sequence helpers on real gloo groups (W = 1-4, every layout of `tests.sequence_cases`): every rank's
outputs and input gradients against the spec's float64 references, a tiny model trained the commlib way against
the same model unsharded, sync_gradients' average over two dtypes, and the spec's errors on every rank."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from commlib import CommError, SequenceLayout
from commlib import sequence_helpers as spec
from commlib.reference import sequence as reference
from commlib_torch import sequence
from tests.sequence_cases import IGNORE, data, documents, layouts, model_parameters

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# Each job returns, per layout, this rank's largest errors (0.0 where the helper must be exact).


def _error(got: torch.Tensor, expected) -> float:
    expected = np.asarray(expected)
    assert tuple(got.shape) == expected.shape, (tuple(got.shape), expected.shape)
    return float(np.abs(got.detach().numpy() - expected).max(initial=0.0))


def _tokens(layout: SequenceLayout, case: dict, rank: int) -> list[float]:
    got = sequence.shard_tokens(torch.from_numpy(case["ids"]), layout, ignore_index=IGNORE)
    expected = reference.shard_tokens_reference(case["ids"], layout, IGNORE)[rank]
    return [_error(part, want) for part, want in zip(got, expected, strict=True)] + [
        _error(sequence.position_ids(layout), layout.positions(rank))
    ]


def packed_tokens(ctx, seed: int = 0) -> dict[str, list[float]]:
    """shard_tokens of packed documents (`tests.sequence_cases.documents`, int32 segment ids; without and with
    holes of padding inside the documents) on every layout: {layout (and "holes"): errors of ids, positions,
    labels and segment ids against the reference}, plus the dtypes kept."""
    results = {}
    for layout, holes in itertools.product(layouts(ctx.world_size), (False, True)):
        ids, segments = data(layout, seed)["ids"], documents(layout, seed, holes=holes).astype(np.int32)
        got = sequence.shard_tokens(
            torch.from_numpy(ids), layout, ignore_index=IGNORE, segment_ids=torch.from_numpy(segments)
        )
        expected = reference.shard_tokens_reference(ids, layout, IGNORE, segment_ids=segments)[ctx.rank]
        dtypes = [str(part.dtype) for part in got]
        name = repr(layout) + (" holes" if holes else "")
        results[name] = [_error(part, want) for part, want in zip(got, expected, strict=True)] + [
            float(dtypes != ["torch.int64", "torch.int64", "torch.int64", "torch.int32"])
        ]
    return results


def wrong_segments(ctx) -> list[str]:
    """Segment ids of another shape than input_ids, and of a floating dtype: the spec's texts."""
    messages = []
    ids = torch.zeros(2, 8, dtype=torch.int64)
    for segments in (torch.zeros(2, 7, dtype=torch.int64), torch.zeros(2, 8)):
        try:
            sequence.shard_tokens(ids, SequenceLayout(8, ctx.world_size), segment_ids=segments)
        except (CommError, TypeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def _shard(layout: SequenceLayout, case: dict, rank: int) -> list[float]:
    x = torch.from_numpy(case["x"]).requires_grad_()
    out = sequence.shard_sequence(x, layout)
    (out * torch.from_numpy(case["shard_cotangents"][rank])).sum().backward()
    outputs, grads = reference.shard_sequence_reference(case["x"], case["shard_cotangents"], layout)
    return [_error(out, outputs[rank]), _error(x.grad, grads[rank])]


def _gather(layout: SequenceLayout, case: dict, rank: int, convention: str) -> list[float]:
    shards = layout.shard(case["x"], 1)
    x = torch.from_numpy(shards[rank]).requires_grad_()
    out = sequence.gather_sequence(x, layout, convention=convention)
    (out * torch.from_numpy(case["gather_cotangents"][rank])).sum().backward()
    outputs, grads = reference.gather_sequence_reference(
        shards, case["gather_cotangents"], layout, convention=convention
    )
    return [_error(out, outputs[rank]), _error(x.grad, grads[rank])]


def _cross_entropy(layout: SequenceLayout, case: dict, rank: int) -> list[float]:
    loss, grad = reference.cross_entropy_reference(case["logits"], case["labels"], IGNORE)
    logits = torch.from_numpy(layout.shard(case["logits"], 1)[rank]).requires_grad_()
    got = sequence.cross_entropy(logits, torch.from_numpy(layout.shard(case["labels"], 1)[rank]), ignore_index=IGNORE)
    got.backward()
    return [abs(got.item() - loss) / abs(loss), _error(logits.grad, layout.shard(grad, 1)[rank])]


def helpers(ctx, seed: int = 0) -> dict[str, list[float]]:
    """Every helper on every layout of the table: {layout: [errors...]} (exact ones first, then cross_entropy's
    relative loss error and gradient error)."""
    results = {}
    for layout in layouts(ctx.world_size):
        case = data(layout, seed)
        errors = _tokens(layout, case, ctx.rank) + _shard(layout, case, ctx.rank)
        errors += _gather(layout, case, ctx.rank, "sum") + _gather(layout, case, ctx.rank, "replicated")
        results[repr(layout)] = errors + _cross_entropy(layout, case, ctx.rank)
    return results


def _model_loss(params: dict, ids, positions, labels, mix) -> torch.Tensor:
    hidden = params["embed"][ids] + params["position"][positions]
    hidden = mix(hidden)
    return hidden @ params["head"], labels


def model(ctx, seed: int = 0) -> dict[str, float]:
    """A tiny causal model (embeddings, a prefix sum over the sequence, a head) trained one step the commlib
    way on every layout: {layout: largest relative error of the loss and of every parameter's gradient} against
    the same model unsharded (float64). The prefix sum runs on the whole sequence: gather_sequence
    (convention="replicated"), torch.cumsum, shard_sequence back (Megatron's g and split)."""
    results = {}
    for layout in layouts(ctx.world_size):
        ids = data(layout, seed)["ids"]
        initial = model_parameters(layout.seq_len)
        full = {name: torch.from_numpy(value).requires_grad_() for name, value in initial.items()}
        logits, labels = _model_loss(
            full,
            torch.from_numpy(ids),
            torch.arange(layout.seq_len),
            torch.from_numpy(spec.next_token_labels(ids, IGNORE)),
            lambda h: torch.cumsum(h, 1),
        )
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        expected.backward()

        params = {name: torch.from_numpy(value).requires_grad_() for name, value in initial.items()}
        tokens, positions, labels = sequence.shard_tokens(torch.from_numpy(ids), layout)

        def mix(h, layout=layout):
            whole = sequence.gather_sequence(h, layout, convention="replicated")
            return sequence.shard_sequence(torch.cumsum(whole, 1), layout)

        logits, labels = _model_loss(params, tokens, positions, labels, mix)
        loss = sequence.cross_entropy(logits, labels)
        loss.backward()
        sequence.sync_gradients(params.values())
        errors = [abs(loss.item() - expected.item()) / abs(expected.item())]
        errors += [
            float((params[name].grad - full[name].grad).abs().max() / full[name].grad.abs().max()) for name in params
        ]
        results[repr(layout)] = max(errors)
    return results


def sync_average(ctx) -> list[float]:
    """sync_gradients over two dtypes, op="avg", a parameter without a gradient: rank r's gradients are r + 1."""
    weights = [
        torch.zeros(3, requires_grad=True),
        torch.zeros(2, 2, dtype=torch.float32, requires_grad=True),
        torch.zeros(4, dtype=torch.float64, requires_grad=True),
        torch.zeros(1, requires_grad=True),
    ]
    for weight in weights[:3]:
        weight.grad = torch.full_like(weight, ctx.rank + 1.0)
    sequence.sync_gradients(weights, op="avg")
    assert weights[3].grad is None
    return [float(weight.grad.flatten()[0]) for weight in weights[:3]]


def sync_skipped(ctx) -> dict:
    """Ranks that skip different parameters of the same size (a newcomer's fuzz case): even ranks have a
    gradient on `a` only, odd ranks on `b` only (rank r's is r + 1), nobody on `c`; `d` everywhere; `e`
    frozen (requires_grad False) with a gradient of its own. What each parameter's gradient is after
    sync_gradients (None where it has none)."""
    a, b, c, d = (torch.zeros(3, requires_grad=True) for _ in range(4))
    e = torch.zeros(3)
    (a if ctx.rank % 2 == 0 else b).grad = torch.full((3,), ctx.rank + 1.0)
    d.grad, e.grad = torch.full((3,), 10.0 * (ctx.rank + 1)), torch.full((3,), -1.0 - ctx.rank)
    sequence.sync_gradients([a, b, c, d, e])
    named = zip("abcde", (a, b, c, d, e), strict=True)
    return {name: None if p.grad is None else p.grad.tolist() for name, p in named}


def sync_nothing(ctx, check: bool) -> str:
    """Every rank passes a consumed generator (``model.parameters()`` iterated before), checked or not: the
    error text ("no error" where it returned)."""
    from commlib_torch import checked

    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    parameters = model.parameters()
    list(parameters)  # consumed
    try:
        with checked(check):
            sequence.sync_gradients(parameters)
    except CommError as error:
        return str(error)
    return "no error"


def wrong_layout(ctx) -> list[str]:
    """A layout whose world size is not the group's, and a sequence of the wrong length: the spec's texts."""
    messages = []
    calls = [
        lambda: sequence.shard_tokens(torch.zeros(2, 8, dtype=torch.int64), SequenceLayout(8, ctx.world_size + 1)),
        lambda: sequence.shard_sequence(torch.zeros(2, 7, 3), SequenceLayout(8, ctx.world_size)),
        lambda: sequence.cross_entropy(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.int64)),
    ]
    for call in calls:
        try:
            call()
        except CommError as error:
            messages.append(str(error))
    return messages


def bad_labels(ctx, values: tuple[int, ...]) -> str:
    """cross_entropy where rank 1's labels hold `values` (outside [0, 5), not ignore_index): every rank's error
    text (before, rank 1 raised a raw IndexError or averaged label -5 as label 0 and the others timed out)."""
    labels = torch.tensor([[0, 1, IGNORE, 4]])
    if ctx.rank == 1:
        labels[0, : len(values)] = torch.tensor(values)
    logits = torch.zeros(1, 4, 5, requires_grad=True)
    try:
        sequence.cross_entropy(logits, labels, ignore_index=IGNORE)
    except CommError as error:
        return str(error)
    return "no error"


def context_group_loss(ctx) -> dict[str, float]:
    """On a DP 2 x SP 2 mesh (rank 2 * d + s), cross_entropy and sync_gradients inside ``parallel(layout,
    (mesh, "sp"))`` with group None: this replica's loss against the unsharded replica's, and the weight's
    gradient error (the context's group, where WORLD averaged both replicas: 3.998690 for 3.977933 and
    4.019447)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    replica = ctx.rank // 2
    generator = np.random.default_rng(replica)
    ids = generator.integers(0, 7, size=(1, 6))
    labels = torch.from_numpy(spec.next_token_labels(ids, IGNORE))
    weight0 = generator.standard_normal((7, 7))
    full = torch.tensor(weight0, requires_grad=True)
    expected = torch.nn.functional.cross_entropy(full[torch.from_numpy(ids)].reshape(-1, 7), labels.reshape(-1))
    expected.backward()
    layout = SequenceLayout(6, ulysses_size=2)
    weight = torch.tensor(weight0, requires_grad=True)
    with sequence.parallel(layout, (mesh, "sp")):
        tokens, _, shard_labels = sequence.shard_tokens(torch.from_numpy(ids))
        loss = sequence.cross_entropy(weight[tokens], shard_labels)
        loss.backward()
        sequence.sync_gradients([weight])
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": float((weight.grad - full.grad).abs().max()),
    }


# --- the tests ----------------------------------------------------------------------------------------------


pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_helper_against_the_reference(pool, world_size):
    for rank, results in enumerate(pool(world_size).run(helpers)):
        for layout, errors in results.items():
            # tokens, positions, shard_sequence, gather_sequence: exact (the "sum" gradient adds W cotangents)
            assert errors[:7] + errors[8:10] == [0.0] * 9 and errors[7] < 1e-14, (rank, layout, errors)
            assert errors[10] < 1e-13 and errors[11] < 1e-15, (rank, layout, errors)  # the loss and its gradient


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_tokens_of_packed_documents_is_the_reference(pool, world_size):
    results = pool(world_size).run(packed_tokens)
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
    assert pool(2).run(wrong_segments) == [expected] * 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_model_trained_the_commlib_way_is_the_unsharded_model(pool, world_size):
    for rank, results in enumerate(pool(world_size).run(model)):
        assert all(error < 1e-12 for error in results.values()), (rank, results)


def test_sync_gradients_averages_per_dtype(pool):
    assert pool(3).run(sync_average) == [[2.0, 2.0, 2.0]] * 3


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
    assert pool(world_size).run(sync_skipped) == expected


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
def test_sync_gradients_of_nothing_is_refused(pool, check):
    expected = (
        "sync_gradients: parameters is empty: nothing to sync (a consumed generator, such as model.parameters() "
        "iterated before?); pass the replicated parameters, the same on every rank. Received: parameters=()"
    )
    assert pool(2).run(sync_nothing, check) == [expected] * 2


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
    assert pool(2).run(wrong_layout) == [expected] * 2


@pytest.mark.parametrize("values", [(5,), (-5,), (9, 7)], ids=["V", "negative", "two"])
def test_labels_outside_the_vocabulary_raise_the_same_error_on_every_rank(pool, values):
    expected = (
        f"cross_entropy: labels must be in [0, 5) or ignore_index (-100); {len(values)} are not, on rank 1. "
        f"Received: counts_per_rank=(0, {len(values)}), vocab=5, ignore_index=-100"
    )
    assert pool(2).run(bad_labels, values) == [expected] * 2


def test_cross_entropy_and_sync_gradients_take_the_parallel_contexts_group(pool):
    for result in pool(4).run(context_group_loss):
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, result
