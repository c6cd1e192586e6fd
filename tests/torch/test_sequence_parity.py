"""The torch runner's jobs of ``commlib parity --workload sequence`` on real gloo ranks: every helper's stored
outputs and gradients (padded to the JAX layout) are the float64 reference's at W = 3 and 4, and the
transformers example's model row (Ulysses, S = 37) measures its own first step within the tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.tools import sequence_parity as spec
from commlib_torch.tools import sequence_parity

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [3, 4])
def test_helpers_job_stores_the_reference(pool, world_size):
    for layout in spec.layouts(world_size):
        got, want = pool(world_size).run(sequence_parity.helpers, layout, 0), spec.expected(layout)
        for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
            assert set(mine) == set(spec.OUTPUTS)
            for key in spec.OUTPUTS:
                np.testing.assert_allclose(
                    mine[key], theirs[key], rtol=1e-13, atol=1e-14, err_msg=f"{spec.name(layout)} rank {rank} {key}"
                )


def test_model_job_measures_the_transformers_example(pool):
    pytest.importorskip("transformers")
    replies = pool(4).run(sequence_parity.model, "ulysses", spec.MODEL_LENGTH)
    for errors in replies:
        assert set(errors) == {"loss", "logits", "gradients"}
        assert max(errors.values()) < spec.TOLERANCE and errors["gradients"] > 0  # float64 rounding, not zero


def handwritten(ctx) -> list[float]:
    """A pool job: benchmarks/handwritten_glue.py against `commlib_torch.sequence` on this rank for the layouts the
    transformers example runs at S = 37 (Ulysses, ring zigzag, USP 2 x 2 zigzag): the largest differences of the
    tokens, positions, labels, the loss and the logits' gradient."""
    import importlib.util
    from pathlib import Path

    import torch

    from commlib import SequenceLayout
    from commlib_torch import sequence

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "handwritten_glue.py"
    found = importlib.util.spec_from_file_location("handwritten_glue", path)
    glue = importlib.util.module_from_spec(found)
    found.loader.exec_module(glue)
    errors = []
    for ring, ulysses, zigzag in ((1, 4, False), (4, 1, True), (2, 2, True)):
        layout = SequenceLayout(37, ring, ulysses, layout="zigzag" if zigzag else "contiguous")
        ids = torch.randint(0, 11, (2, 37), generator=torch.Generator().manual_seed(3))
        mine = glue.my_shard_tokens(ids, glue.my_positions(37, ring, ulysses, zigzag, ctx.rank))
        theirs = sequence.shard_tokens(ids, layout)
        errors += [float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)]
        logits = torch.randn(
            2, layout.sizes[ctx.rank], 11, dtype=torch.float64, generator=torch.Generator().manual_seed(ctx.rank)
        ).requires_grad_()
        share, loss = glue.my_loss(logits, mine[2])
        share.backward()
        mine_grad, logits.grad = logits.grad, None
        want = sequence.cross_entropy(logits, theirs[2])
        want.backward()
        errors += [abs(loss.item() - want.item()), float((mine_grad - logits.grad).abs().max())]
    return errors


def test_handwritten_glue_is_the_helpers(pool):
    """The "before" of docs/sequence-parallel.md's line count does what the helpers do."""
    for errors in pool(4).run(handwritten):
        assert errors[:3] + errors[5:8] + errors[10:13] == [0.0] * 9
        assert max(errors) < 1e-15
