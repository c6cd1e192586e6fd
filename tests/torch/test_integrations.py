"""`commlib_torch.sequence.parallel` and `commlib_torch.integrations.transformers` on real gloo process groups:
the registered attention, called as transformers calls it, against the float64 reference (`commlib.attention`:
unsharded GQA attention at global positions) on every rank, values and dq/dk/dv, for Ulysses (odd lengths, a rank
with fewer rows), ring (zigzag) and USP 2 x 2; every refusal with its message on every rank; nested contexts; a
transformers Llama sharded against the unsharded model, outside a context and with a padding mask. The whole
training loop is examples/transformers_llama.py (tests/test_training_examples.py).
"""

import numpy as np
import pytest

import commlib
from commlib import attention as A
from tests.torch import integration_jobs as jobs

WORLD_SIZES = (1, 2, 3, 4)
TOLERANCE = 1e-10


def _whole(seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """float64 q ``[2, S, 8, 4]``, k and v ``[2, S, 2, 4]`` (GQA) and the output cotangent."""
    rng = np.random.default_rng(seed)
    shapes = [(2, seq_len, 8, 4), (2, seq_len, 2, 4), (2, seq_len, 2, 4), (2, seq_len, 8, 4)]
    return [rng.standard_normal(shape) for shape in shapes]


def _check(pool, layout: commlib.SequenceLayout, attention: str, causal: bool) -> None:
    whole = _whole(layout.seq_len)
    replies = pool(layout.world_size).run(jobs.attention_call, layout, attention, whole, causal)
    want = A.attention(*whole[:3], causal=causal, scale=0.3)
    want_grads = A.attention_vjp(*whole, causal=causal, scale=0.3)
    for rank, (out, grads) in enumerate(replies):
        rows = layout.positions(rank)
        np.testing.assert_allclose(out, want[:, rows], rtol=0, atol=TOLERANCE, err_msg=f"rank {rank} output")
        for name, grad, wanted in zip("qkv", grads, want_grads, strict=True):
            np.testing.assert_allclose(grad, wanted[:, rows], rtol=0, atol=TOLERANCE, err_msg=f"rank {rank} d{name}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("seq_len", [7, 37])
def test_ulysses_any_length(pool, world_size, seq_len):
    """S = 7 at W = 4: three ranks hold 2 rows, one holds 1."""
    _check(pool, commlib.SequenceLayout(seq_len, ulysses_size=world_size), "ulysses", causal=True)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_zigzag(pool, world_size):
    _check(pool, commlib.SequenceLayout(24, ring_size=world_size, layout="zigzag"), "ring", causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_usp_two_by_two(pool, causal):
    _check(pool, commlib.SequenceLayout(16, ring_size=2, ulysses_size=2, layout="zigzag"), "usp", causal=causal)


def test_ring_contiguous_not_causal(pool):
    _check(pool, commlib.SequenceLayout(12, ring_size=3), "ring", causal=False)


def test_refusals(pool):
    """Every refused call raises the spec's message, the same on every rank, before communicating."""
    replies = pool(4).run(jobs.refusals)
    for reply in replies[1:]:
        assert set(reply) == set(replies[0])
    first = replies[0]
    assert first["outside"].startswith(
        "CommError: commlib attention: called outside a commlib_torch.sequence.parallel(...) context"
    )
    assert "a dense attention mask is not supported" in first["mask"]
    assert "a padding attention_mask (1, 3) must be [batch, this rank's rows] (1, 2)" in first["padding shape"]
    assert "dropout (0.1) must be 0" in first["dropout"]
    assert "sliding_window (0) must be an int >= 1" in first["sliding_window"]
    assert "softcap (30.0) is not supported" in first["softcap"]
    assert "an attention bias is not supported" in first["sinks"]
    assert (
        "position_ids must be the global positions of shard 0 of the layout (layout.positions(0); "
        "sequence.shard_tokens and sequence.position_ids give them): from row 0 of batch row 0, expected [0, 1], "
        "received [1, 2]" in first["local positions"]
    )
    assert "query rows (3) must be layout.sizes[0] (2)" in first["rows"]
    assert (
        "parallel: layout.ulysses_size (5) must be 4 (the group's size for attention='ulysses')"
        in first["layout world size"]
    )
    assert "parallel: layout.ulysses_size (1) must be 4" in first["ring layout for ulysses"]
    assert "parallel: attention ('flash') must be one of ulysses, ring, usp" in first["unknown attention"]
    assert "attention='usp' needs both ulysses_group and ring_group" in first["usp without groups"]
    assert first["not a layout"].startswith("TypeError: parallel: layout must be a commlib.SequenceLayout, not int")
    for rank, reply in enumerate(replies):
        assert f"shard {rank}" in reply["local positions"]
        assert all(text != "no error" for text in reply.values()), (rank, reply)


@pytest.mark.parametrize("what", ["positions", "mask"])
def test_checked_mode_refusal_reaches_every_rank(pool, what):
    """In checked mode a refusal decided on some ranks only (local positions: rank 0's equal its global ones; a
    padding mask on the last rank only) makes every rank raise, the refusing ranks their own error and the others
    "another rank ... refused", instead of the passing ranks waiting in the all-to-all for the timeout."""
    replies = pool(4).run(jobs.refusal_on_some_ranks, what)
    refusing = range(1, 4) if what == "positions" else [3]
    for rank, text in enumerate(replies):
        if rank in refusing:
            wanted = (
                f"position_ids must be the global positions of shard {rank}"
                if what == "positions"
                else "a dense attention mask is not supported"
            )
            assert wanted in text, (rank, text)
        else:
            assert text.startswith("CommError: commlib attention: another rank of the layer refused this call"), (
                rank,
                text,
            )


def test_llama_without_position_ids_is_refused_on_every_rank(pool):
    """transformers' default positions are local (0..n-1 on each rank): the integration sees them and refuses,
    and in checked mode rank 0, whose local positions are its global ones, raises too."""
    replies = pool(3).run(jobs.llama_default_positions)
    assert replies[0].startswith("CommError: commlib attention: another rank of the layer refused this call")
    for rank in (1, 2):
        assert f"position_ids must be the global positions of shard {rank} of the layout" in replies[rank]
        assert "expected [3, 4, 5], received [0, 1, 2]" in replies[1]


def test_helpers_take_and_must_match_the_context_layout(pool):
    """Inside a context the helpers' layout None (and group None) are the context's; a zigzag layout under a
    contiguous context is refused by every helper, naming both layouts; outside, a layout is required."""
    contiguous = commlib.SequenceLayout(13, ring_size=3)
    zigzag = commlib.SequenceLayout(13, ring_size=3, layout="zigzag")
    for rank, reply in enumerate(pool(3).run(jobs.helpers_in_context)):
        assert reply["defaults"] == reply["explicit"]
        assert reply["defaults"][1] == [contiguous.positions(rank).tolist()]
        for name, text in zip(
            ("shard_tokens", "position_ids", "shard_sequence", "gather_sequence"), reply["errors"], strict=True
        ):
            assert text.startswith(
                f"CommError: {name}: layout ({zigzag!r}) must be the parallel context's layout ({contiguous!r})"
            ), text
        assert reply["outside"].startswith(
            "CommError: position_ids: layout is required outside a parallel(...) context"
        )


def test_nesting(pool):
    """The innermost context wins; the outer one is back on exit; nothing is left after."""
    for reply in pool(2).run(jobs.nesting):
        assert reply == ["ulysses", "ring", "ulysses", "None"]


def test_llama_through_the_registry(pool):
    """A transformers Llama with attn_implementation="commlib" at S = 7 over 3 ranks: logits within 1e-10 of the
    unsharded SDPA model's on every rank; outside a context, a clear CommError."""
    for outside, error in pool(3).run(jobs.llama, 7, False):
        assert "called outside a commlib_torch.sequence.parallel(...) context" in outside
        assert error <= TOLERANCE


@pytest.mark.parametrize(
    ("world_size", "seq_len", "attention", "what"),
    [(2, 9, "ulysses", "padding"), (3, 13, "ring", "padding"), (2, 9, "ulysses", "packed"), (3, 37, "ring", "packed")],
)
def test_llama_with_masks_is_the_unsharded_model(pool, world_size, seq_len, attention, what):
    """A padding attention_mask (padding at the end of one row, the start of the other) and packed documents
    (position_ids that restart, documents crossing shards) become segment ids: the logits of every rank's
    non-padding tokens equal the unsharded SDPA model's with the same mask or positions."""
    for rank, error in enumerate(pool(world_size).run(jobs.llama_masked, seq_len, attention, what)):
        assert error <= TOLERANCE, (rank, error)


@pytest.mark.parametrize(("world_size", "attention"), [(2, "ulysses"), (4, "ring")])
def test_a_padding_mask_with_holes_is_one_document(pool, world_size, attention):
    """A tokenizer's padding mask with zeros between ones, made segment ids as docs/integrations.md says and run
    with ``packed=True``: one document across each hole, as transformers attends; logits of the kept tokens, the
    loss and every gradient within 1e-10 of the unsharded model with the same 2-D mask (issue 34 item 8: the
    helpers restarted the positions after a hole, so the route split the row in two: logits 0.49, gradients 0.73
    off)."""
    for rank, found in enumerate(pool(world_size).run(jobs.llama_with_a_hole, attention)):
        assert max(found.values()) <= TOLERANCE, (rank, found)


@pytest.mark.parametrize(("world_size", "attention"), [(2, "ulysses"), (3, "ring")])
def test_an_all_ones_mask_is_dropped_once_per_forward(pool, world_size, attention):
    """A tokenizer's all-ones attention_mask costs one all_reduce per forward (the first layer decides for the
    model's two; a second forward decides again) and then runs exactly as without a mask: logits and gradients
    bit for bit. A mask that keeps every token on some ranks only stays segment ids on every rank
    (`test_llama_with_masks_is_the_unsharded_model`: at W = 3 ring, rank 2's shard holds no padding)."""
    for rank, found in enumerate(pool(world_size).run(jobs.llama_all_ones, attention)):
        assert found == {"reduces": [1, 1], "logits": 0.0, "gradients": 0.0}, (rank, found)


@pytest.mark.parametrize("attention", ["ulysses", "ring", "usp"])
def test_an_empty_shard_is_refused_on_every_rank(pool, attention):
    """S = 3 over 4 ranks: every rank's `parallel` raises the spec's CommError on entry, before any communication
    (issue 34 item 10: rank 3's empty shard crashed inside transformers 5.x and another rank got gloo's raw
    RuntimeError from the integration's all_reduce)."""
    for rank, text in enumerate(pool(4).run(jobs.empty_shard, attention)):
        assert text.startswith(
            f"parallel: seq_len (3) must be at least the world size (4) for attention={attention!r}: a rank with no "
            "tokens cannot run the model"
        ), (rank, text)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
def test_a_rank_missing_from_the_integrations_all_reduce_is_a_comm_timeout(checked):
    """The integration's own all_reduces (the all-ones mask decision; checked mode's refusal exchange) go through
    the failure translation: the rank left waiting raises CommTimeout naming "commlib attention" and its group,
    not gloo's raw RuntimeError (issue 34 item 10)."""
    from commlib_torch.tools.pool import WorkerPool

    with WorkerPool(2, timeout=60.0, pg_timeout=5.0) as pool:
        waiting, skipped = pool.run(jobs.skip_the_mask_decision, checked)
    assert skipped == "skipped"
    assert waiting.startswith(
        "CommTimeout: commlib attention: timed out on group rank 0 of the group with global ranks [0, 1] waiting for "
        "the other ranks"
    ), waiting


def test_packing_that_cannot_be_is_refused(pool):
    """In a packed context, position_ids that are no packing (a step of +2 inside the shard, a position past the
    token's global one, a negative one) or transformers' local 0..n-1 stay the spec's positions error; a custom
    4-D mask stays refused (`test_refusals`)."""
    for rank, texts in enumerate(pool(2).run(jobs.not_a_packing)):
        for text in texts:
            assert f"position_ids must be the global positions of shard {rank}" in text, (rank, text)


@pytest.mark.parametrize(
    ("arch", "attention", "world_size", "seq_len"),
    [("mistral", "ring", 4, 37), ("qwen2", "ring", 3, 24), ("mistral", "ulysses", 3, 13), ("qwen2", "ulysses", 2, 9)],
)
def test_sliding_window_models_are_the_unsharded_model(pool, arch, attention, world_size, seq_len):
    """transformers models with ``sliding_window = 5`` (Mistral: every layer; Qwen2: a full layer then a sliding
    one), float64, through ``attn_implementation="commlib"`` (each sliding layer's ``mask=SlidingWindow(5)``):
    every rank's logits and every parameter's gradient (summed over the ranks) within 1e-10 of the unsharded
    SDPA model's, whose mask is transformers' own. Refused before the rule existed."""
    for errors in pool(world_size).run(jobs.sliding_window_model, arch, attention, seq_len, 5):
        assert max(errors) <= TOLERANCE, errors
