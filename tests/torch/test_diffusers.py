"""`commlib_torch.integrations.diffusers` on real gloo process groups: a tiny diffusers Wan (self- and
cross-attention) and Flux (joint attention) from configs, float64, sharded over W ranks by the route against the
same model unsharded: the output and every parameter's gradient (summed by `sync_gradients`) to 1e-10 at odd
token counts and head counts over W; every refusal with its message on every rank. The AdamW training loop is
examples/diffusers_dit.py (tests/test_training_examples.py)."""

import pytest

from tests.torch import diffusers_jobs as jobs

pytest.importorskip("diffusers")
TOLERANCE = 1e-10


@pytest.mark.parametrize(
    ("model", "attention", "world_size"),
    [("wan", "ulysses", 1), ("wan", "ulysses", 3), ("wan", "ring", 3), ("flux", "ulysses", 3), ("flux", "ring", 3)],
)
def test_model_step_is_the_unsharded_models(pool, model, attention, world_size):
    """27 Wan tokens (9 each over 3 ranks, 4 heads over 3: 2, 1, 1) and 15 Flux image tokens plus 5 text tokens."""
    for rank, reply in enumerate(pool(world_size).run(jobs.model_step, model, attention)):
        assert reply["output"] <= TOLERANCE, (rank, reply)
        assert reply["gradients"] <= TOLERANCE, (rank, reply)


def test_refusals(pool):
    replies = pool(2).run(jobs.refusals)
    first = replies[0]
    prefix = "CommError: commlib_torch.integrations.diffusers: "
    assert first["outside"].startswith(prefix + "called outside a commlib_torch.sequence.parallel(...) context")
    assert "called from no attention module of a model prepared by parallelize(model)" in first["no module"]
    assert "attn_mask is not supported (received a (1, 1, 14, 14) mask)" in first["mask"]
    assert "dropout_p (0.1) must be 0" in first["dropout"]
    assert "return_lse=True is not supported" in first["lse"]
    assert "is_causal=True with cross-attention" in first["causal cross"]
    assert "query rows (15) must be layout.sizes[0] (14)" in first["rows"]
    assert "rope output 0.shape[1] (27) must be the layout's seq_len (28)" in first["tokens"]
    # Flux's 15 image tokens over a zigzag ring of 2 are uneven shards: the ring layer refuses joint tensors there
    uneven = "ring_attention: joint_q cannot be given with a SequenceLayout whose shards are uneven"
    assert all(uneven in reply.pop("joint uneven ring") for reply in replies)
    unknown = "the attention processor Unknown of 'blocks.0.attn1' is not one the route knows"
    assert unknown in first["unknown processor"]
    assert "Linear has no edge plan" in first["no plan"]
    assert "diffusers' own context parallelism is enabled on this model" in first["own parallelism"]
    for rank, reply in enumerate(replies):
        assert [name for name, text in reply.items() if not text.startswith(prefix)] == [], (rank, reply)
