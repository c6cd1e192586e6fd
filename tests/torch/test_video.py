"""The video helpers on real gloo groups (W = 1-4, every grid layout of `tests.video_cases`: uneven, a grid
smaller than W, per-rank seq_sizes, USP): every rank's grid_position_ids, shard_latents' and gather_latents'
outputs and input gradients against the float64 references of `commlib.reference.video`, and bad input refused
on every rank with the spec's text naming the helper."""

from __future__ import annotations

import pytest

from commlib import CommError, SequenceLayout
from commlib import sequence_helpers as spec_sequence
from commlib import video as spec
from tests.torch import video_jobs

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_video_helper_against_the_reference(pool, world_size):
    results = pool(world_size).run(video_jobs.helpers)
    assert len(results) == world_size
    for rank, per_layout in enumerate(results):
        assert per_layout, rank
        for layout, errors in per_layout.items():
            # positions, shard (out, grad), gather "sum" (out, grad: W cotangents added), "replicated": exact
            assert errors[:4] + errors[5:] == [0.0] * 6 and errors[4] < 1e-14, (rank, layout, errors)


def _spec_text(call) -> str:
    with pytest.raises((CommError, TypeError)) as info:
        call()
    return f"{info.type.__name__}: {info.value}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_input_is_refused_by_the_helpers_name_on_every_rank(pool, world_size):
    layout = SequenceLayout(12, ring_size=world_size, grid=(2, 2, 3))
    no_grid = SequenceLayout(12, ring_size=world_size)
    results = pool(world_size).run(video_jobs.bad_input)
    for rank, messages in enumerate(results):
        own = layout.sizes[rank]
        expected = [
            _spec_text(lambda: spec.check_latents("shard_latents", (1, 4, 2, 3, 2), layout)),
            _spec_text(lambda: spec.check_grid("shard_latents", no_grid)),
            "TypeError: shard_latents: x must be a torch.Tensor, not numpy.ndarray. Received: type='numpy.ndarray'",
            f"CommError: shard_latents: layout.world_size ({world_size + 1}) must be the group's world_size "
            f"({world_size}). Received: layout={SequenceLayout(12, ring_size=world_size + 1, grid=(2, 2, 3))!r}, "
            f"world_size={world_size}",
            _spec_text(
                lambda own=own, rank=rank: spec.check_tokens(
                    "gather_latents", (1, own + 1, 4), layout, own, f"layout.sizes[{rank}]"
                )
            ),
            _spec_text(
                lambda own=own, rank=rank: spec_sequence.check_sequence(
                    "gather_latents", (1, own, 4), 1, own, f"layout.sizes[{rank}]", convention="mean"
                )
            ),
            _spec_text(lambda: spec.check_grid("grid_position_ids", no_grid)),
            "TypeError: grid_position_ids: layout must be a commlib.SequenceLayout, not str. Received: type='str'",
        ]
        assert messages == expected, rank
