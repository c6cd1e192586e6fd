"""`SequenceLayout(..., grid=...)` and `commlib.video`: each shard's (f, h, w) coordinates for any grid over W 1-4
(raster order, frames outermost), the latents' tokens and back bit for bit, the references' gradients, and bad
grids and latents refused by name with both numbers."""

import itertools
import re

import numpy as np
import pytest

from commlib import CommError, SequenceLayout, video
from commlib.reference import video as reference


def _layouts():
    for grid, world_size in itertools.product([(1, 1, 1), (2, 3, 5), (3, 1, 4), (5, 2, 2)], (1, 2, 3, 4)):
        seq = int(np.prod(grid))
        yield SequenceLayout(seq, ring_size=world_size, grid=grid)
        yield SequenceLayout(seq, ring_size=world_size, layout="zigzag", grid=grid)
        if world_size == 4:
            yield SequenceLayout(seq, ring_size=2, ulysses_size=2, grid=grid)


@pytest.mark.parametrize("layout", list(_layouts()), ids=repr)
def test_grid_positions_and_latents(layout):
    grid = np.stack(np.meshgrid(*(np.arange(n) for n in layout.grid), indexing="ij"), -1).reshape(-1, 3)
    for index in range(layout.world_size):
        assert np.array_equal(layout.grid_positions(index), grid[layout.positions(index)])
        assert np.array_equal(video.grid_table(layout)[index, : layout.sizes[index]], grid[layout.positions(index)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, *layout.grid))
    for padded in (False, True):
        shards, _ = reference.shard_latents_reference(x, None, layout, padded=padded)
        whole, _ = reference.gather_latents_reference(shards, [x] * layout.world_size, layout, padded=padded)
        assert all(np.array_equal(w, x) for w in whole)  # gather(shard(x)) == x, bit for bit
    token_cotangents = [rng.standard_normal((2, size, 3)) for size in layout.sizes]
    _, grads = reference.shard_latents_reference(x, token_cotangents, layout)
    want = reference.to_latents(layout.unshard(token_cotangents, 1), layout.grid)
    assert all(np.array_equal(g, want) for g in grads)


@pytest.mark.parametrize(
    ("grid", "text"),
    [((2, 2, 2), "prod(grid) (8) must equal seq_len (12)"), ((2, 0, 6), "grid[1] (0) must be >= 1")],
)
def test_bad_grids_are_refused_by_name(grid, text):
    with pytest.raises(CommError, match="^SequenceLayout: " + re.escape(text)):
        SequenceLayout(12, grid=grid)
    with pytest.raises(TypeError, match=r"^SequenceLayout: grid must be a non-empty sequence of ints"):
        SequenceLayout(12, grid=(2.0, 6))


def test_bad_latents_are_refused_by_name():
    layout = SequenceLayout(12, ring_size=2, grid=(2, 2, 3))
    with pytest.raises(CommError, match=r"^shard_latents: latents.shape\[2:\] \(\(2, 3, 2\)\) must be layout.grid"):
        video.check_latents("shard_latents", (1, 4, 2, 3, 2), layout)
    with pytest.raises(CommError, match=r"^gather_latents: tokens.shape\[1\] \(5\) must be layout.sizes\[0\] \(6\)"):
        video.check_tokens("gather_latents", (1, 5, 4), layout, 6, "layout.sizes[0]")
    with pytest.raises(CommError, match=r"^shard_latents: layout.grid \(None\) must be the token grid"):
        video.check_latents("shard_latents", (1, 4, 12), SequenceLayout(12, ring_size=2))
