"""Segment masks (``segment_ids=``) in `ulysses_attention`, `ring_attention` and `usp_attention` on real gloo
ranks: the handed case within 1e-10 of the unsharded masked reference on every rank (outputs and
dq/dk/dv), padding rows exactly 0 with gradient exactly 0; documents of random lengths at any length, W = 1-4;
the pieces the ring skips; bad segment ids refused by name on every rank; and a NaN in q gives
NaN rows and a query whose every score is -inf gives 0 (gradient 0), through SDPA and the ring's flash kernels."""

import numpy as np
import pytest

from commlib import SequenceLayout
from commlib.ring import pieces_computed, ring_plan
from tests import mask_cases as masks
from tests.torch import mask_jobs as jobs


def _run(pool, op, layout, name, whole, ids, causal):
    replies = pool(layout.world_size).run(jobs.masked_call, op, layout, name, whole, ids, causal)
    per_rank = [reply[0] for reply in replies]
    return [list(values) for values in zip(*per_rank, strict=True)], sum(reply[1] for reply in replies)


@pytest.mark.parametrize(("op", "layout", "name"), masks.HANDED, ids=lambda x: str(getattr(x, "layout", x)))
def test_handed_case(pool, op, layout, name):
    """W = 4, B = 2, S = 40, H = 8, H_kv = 2, D = 16, float64, causal; row 0 documents of 3, 17, 9, 11, row 1
    25 tokens then 15 of padding: within 1e-10 on every rank; padding rows' output, dq, dk, dv exactly 0."""
    whole, ids = masks.whole_inputs(*masks.HANDED_SHAPE), masks.handed_ids()
    got, _ = _run(pool, op, layout, name, whole, ids, True)
    masks.check_handed(got, ids, layout, f"{op} {name}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_documents_at_any_length(pool, world_size):
    """S = 37 (uneven shards), documents of random lengths (some shorter than a shard, some crossing shards,
    a padding tail), causal and not: ring (both layouts) and Ulysses at W, USP 2 x 2 at W = 4."""
    ids, whole, settings = masks.random_documents(world_size)
    failed = []
    for (op, layout), causal in [(setting, causal) for setting in settings for causal in (False, True)]:
        got, _ = _run(pool, op, layout, layout, whole, ids, causal)
        error = masks.worst_error(got, masks.expected(whole, ids, causal), layout)
        failed += [f"{op} {layout} causal={causal}: {error:.2e}"] if error > masks.TOLERANCE else []
    assert not failed, "\n".join(failed)


def test_ring_skips_pieces(pool):
    """W = 4, S = 64, causal contiguous, documents of 8 tokens (1/8 of the sequence): the ranks' forwards attend
    4 pieces in all (`commlib.ring.pieces_computed`), against the schedule's 10 without segment ids; the values
    stay within 1e-10."""
    layout = SequenceLayout(64, ring_size=4)
    ids = np.repeat(np.arange(8), 8)[None].repeat(2, axis=0)
    whole = masks.whole_inputs(2, 64, 4, 2, 8)
    got, attended = _run(pool, "ring_attention", layout, "contiguous", whole, ids, True)
    plan = ring_plan((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8), 4, causal=True, segment_ids=((2, 16), "int64"))
    assert attended == pieces_computed(plan, np.stack(masks.shards(ids, layout)))[0] == 4
    assert masks.worst_error(got, masks.expected(whole, ids, True), layout) < masks.TOLERANCE
    replies = pool(4).run(jobs.masked_call, "ring_attention", layout, "contiguous", whole, ids, True, "float64", False)
    assert sum(reply[1] for reply in replies) == 10


@pytest.mark.parametrize("op", ["ulysses_attention", "ring_attention", "usp_attention"])
@pytest.mark.parametrize(
    ("ids_shape", "ids_dtype", "text"),
    [
        ((1, 3), "float32", "TypeError: {op}: segment_ids dtype (float32) must be an integer dtype"),
        ((1, 4), "int64", "CommError: {op}: segment_ids shape (1, 4) must be q's [batch, seq] (1, 3)"),
        ((3,), "int32", "CommError: {op}: segment_ids shape (3,) must be q's [batch, seq] (1, 3)"),
    ],
)
def test_bad_segment_ids(pool, op, ids_shape, ids_dtype, text):
    """The same text on every rank, naming the layer and the argument, raised before communicating (a rank
    that communicated would wait for the others: the pool would time out)."""
    texts = set(pool(4).run(jobs.rejected, op, (1, 3, 2, 4), ids_shape, ids_dtype))
    assert len(texts) == 1
    message = texts.pop()
    assert message.startswith(text.format(op=op) + ". Received: "), message


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("argument", ["q", "segment_ids"])
@pytest.mark.parametrize("op", ["ulysses_attention", "ring_attention", "usp_attention"])
def test_list_inputs_are_refused(pool, op, argument, check):
    """A Python list as q or segment_ids: the spec's TypeError (`commlib.attention.check_layer_inputs`, the JAX
    text with torch's type) on every rank before any communication, checked mode included."""
    texts = set(pool(4).run(jobs.rejected_kind, op, argument, check, timeout=30.0))
    assert texts == {f"TypeError: {op}: {argument} must be a torch.Tensor, not list. Received: type='list'"}, texts


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("op", "layout"), masks.NAN_LAYOUTS)
@pytest.mark.parametrize("row", ["nan", "blind"])
@pytest.mark.parametrize("value_dim", [4, 3])
def test_nan_rows_and_rows_that_see_no_finite_score(pool, op, layout, dtype, row, value_dim):
    """Causal: a NaN in q's row 3 gives a NaN output row (SDPA's and the ring's CPU flash kernels
    gave 0), as the reference; row 9, whose every score is -inf ("blind"), gives exactly 0 and dq exactly 0; the
    other rows equal the reference. ``D_v != D`` takes the ring's einsum rules and JAX's route in Ulysses."""
    whole = masks.nan_or_blind(row, value_dim)
    replies = pool(2).run(jobs.nan_and_blind_rows, op, layout, whole, dtype)
    out = layout.unshard([reply[0] for reply in replies], 1)
    dq = layout.unshard([reply[1] for reply in replies], 1)
    masks.check_nan_or_blind(out, dq, whole, row, dtype == "float64")


@pytest.mark.parametrize(("op", "layout"), masks.NAN_K_SETTINGS, ids=masks.setting_id)
def test_nan_in_k_reaches_the_rows_that_see_it_and_no_other(pool, op, layout):
    """Every row of `masks.NAN_K_CASES` (causal and not, segment ids with padding or none, the
    flash kernels and the einsum rules): a NaN key makes exactly the rows that see it NaN, as the float64
    reference (torch gave S = 1's row, causal row 0 whose only key is NaN and a non-causal ring of one row per
    rank finite); a NaN at a padding key changes nothing (torch made real rows NaN, and the ring's padding
    row, which must be 0), gradients included."""
    replies = pool(layout.world_size).run(jobs.nan_in_k_rows, op, layout)
    rows = [case for case in masks.NAN_K_CASES if case[0] != "padding" or layout.seq_len >= 4]
    failed = []
    for index, (where, causal, segmented, value_dim) in enumerate(rows):
        whole, ids = masks.nan_in_k(layout.seq_len, where, segmented, value_dim)
        got = [list(values) for values in zip(*(reply[index] for reply in replies), strict=True)]
        try:
            masks.check_nan_in_k(got, whole, ids, causal, where, layout)
        except AssertionError as error:
            failed.append(f"{where} causal={causal} segmented={segmented} D_v={value_dim}: {str(error)[:300]}")
    assert not failed, "\n".join(failed)
