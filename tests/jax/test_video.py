"""The video helpers on simulated CPU devices (W = 1-4, every grid layout of `tests.video_cases`: uneven, a grid
smaller than W, per-rank seq_sizes, USP), under shard_map (check_vma True; False and pmap at W = 4): every rank's
grid_position_ids, shard_latents' and gather_latents' outputs and input gradients against the float64 references
of `commlib.reference.video` in the padded layout (padding rows of the tokens hold random values: ignored,
gradient exactly 0), and bad input refused with the spec's text naming the helper."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError, SequenceLayout
from commlib import sequence_helpers as spec_sequence
from commlib import video as spec
from commlib.reference import video as reference
from commlib_jax import video
from tests.video_cases import B, C, data, layouts

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]", "pmap")
CASES = [
    (layout, mode)
    for world_size in (1, 2, 3, 4)
    for layout in layouts(world_size)
    for mode in MODES
    if mode == MODES[0] or (world_size == 4 and layout.grid == (2, 3, 5) and layout.layout == "contiguous")
]


def _per_rank(body, mode: str, world_size: int):
    """`body` on each of `world_size` ranks over arrays stacked [W, ...]; its outputs come back stacked."""
    if mode == "pmap":
        return jax.pmap(body, axis_name="i", devices=jax.devices()[:world_size])
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("i",))

    def stacked(*args):
        return jax.tree.map(lambda t: t[None], body(*(arg[0] for arg in args)))

    return jax.shard_map(stacked, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=mode == MODES[0])


@functools.cache
def _program(layout: SequenceLayout, mode: str):
    def body(x, tokens_sum, tokens_replicated, shard_cotangent, sum_cotangent, replicated_cotangent):
        outputs = (
            video.shard_latents(x, layout, "i"),
            video.gather_latents(tokens_sum, layout, "i"),
            video.gather_latents(tokens_replicated, layout, "i", convention="replicated"),
        )
        cotangents = (shard_cotangent, sum_cotangent, replicated_cotangent)
        loss = sum(jnp.sum(out * cotangent) for out, cotangent in zip(outputs, cotangents, strict=True))
        return (video.grid_position_ids(layout, "i"), *outputs), loss

    mapped = _per_rank(body, mode, layout.world_size)

    def run(x, tokens_sum, tokens_replicated, cotangents):
        def total(x, tokens_sum, tokens_replicated):
            outputs, losses = mapped(x, tokens_sum, tokens_replicated, *cotangents)
            return losses.sum(), outputs

        return jax.grad(total, argnums=(0, 1, 2), has_aux=True)(x, tokens_sum, tokens_replicated)

    return jax.jit(run)


def _padded(shards, layout: SequenceLayout, rng) -> np.ndarray:
    """Every rank's tokens ``[B, sizes[r], C]`` padded to max_size rows of random values, stacked."""
    return np.stack(
        [
            np.concatenate([shard, rng.standard_normal((B, layout.max_size - shard.shape[1], C))], axis=1)
            for shard in shards
        ]
    )


@pytest.mark.parametrize(("layout", "mode"), CASES, ids=[f"{layout!r}-{mode}" for layout, mode in CASES])
def test_every_video_helper_against_the_reference(layout, mode):
    case, rng, W = data(layout), np.random.default_rng(1), layout.world_size
    own, _ = reference.shard_latents_reference(case["x"], None, layout)
    tokens = _padded(own, layout, rng)
    shard_cotangents = _padded(case["shard_cotangents"], layout, rng)
    cotangents = (shard_cotangents, np.stack(case["gather_cotangents"]), np.stack(case["gather_cotangents"][::-1]))
    x = np.broadcast_to(case["x"], (W, *case["x"].shape))
    grads, outputs = _program(layout, mode)(x, tokens, tokens, cotangents)
    outputs, grads = [np.asarray(out) for out in outputs], [np.asarray(grad) for grad in grads]
    shard_out, shard_grad = reference.shard_latents_reference(case["x"], list(shard_cotangents), layout, padded=True)
    assert shard_grad is not None
    padded_own, _ = reference.shard_latents_reference(case["x"], None, layout, padded=True)
    gather_sum = reference.gather_latents_reference(padded_own, list(cotangents[1]), layout, padded=True)
    gather_replicated = reference.gather_latents_reference(
        padded_own, list(cotangents[2]), layout, convention="replicated", padded=True
    )
    assert outputs[1].dtype == np.float64 and outputs[0].dtype == np.int32
    for rank in range(W):
        positions = np.zeros((layout.max_size, len(layout.grid)), np.int64)
        positions[: layout.sizes[rank]] = layout.grid_positions(rank)
        np.testing.assert_array_equal(outputs[0][rank], positions)
        np.testing.assert_array_equal(outputs[1][rank], shard_out[rank])  # padding rows: zeros
        np.testing.assert_array_equal(grads[0][rank], shard_grad[rank])
        np.testing.assert_array_equal(outputs[2][rank], gather_sum[0][rank])
        np.testing.assert_allclose(grads[1][rank], gather_sum[1][rank], rtol=0, atol=1e-14)
        np.testing.assert_array_equal(grads[1][rank][:, layout.sizes[rank] :], 0.0)  # padding rows: exactly 0
        np.testing.assert_array_equal(outputs[3][rank], gather_replicated[0][rank])
        np.testing.assert_array_equal(grads[2][rank], gather_replicated[1][rank])


def _spec_text(call) -> str:
    with pytest.raises((CommError, TypeError)) as info:
        call()
    return str(info.value)


LAYOUT = SequenceLayout(12, ring_size=4, grid=(2, 2, 3))
NO_GRID = SequenceLayout(12, ring_size=4)
BAD = {
    "latents not the grid": (
        lambda x, t: video.shard_latents(jnp.swapaxes(x, 3, 4).reshape(1, 4, 2, 3, 2), LAYOUT, "i"),
        lambda: spec.check_latents("shard_latents", (1, 4, 2, 3, 2), LAYOUT),
    ),
    "shard without a grid": (
        lambda x, t: video.shard_latents(x.reshape(1, 4, 12), NO_GRID, "i"),
        lambda: spec.check_grid("shard_latents", NO_GRID),
    ),
    "tokens not max_size": (
        lambda x, t: video.gather_latents(t[:, :2], LAYOUT, "i"),
        lambda: spec.check_tokens("gather_latents", (1, 2, 4), LAYOUT, 3, "layout.max_size"),
    ),
    "unknown convention": (
        lambda x, t: video.gather_latents(t, LAYOUT, "i", convention="mean"),
        lambda: spec_sequence.check_sequence("gather_latents", (1, 3, 4), 1, 3, "layout.max_size", convention="mean"),
    ),
    "positions without a grid": (
        lambda x, t: video.grid_position_ids(NO_GRID, "i").astype(jnp.float32),
        lambda: spec.check_grid("grid_position_ids", NO_GRID),
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_refused_by_the_helpers_name(name):
    call, expected = BAD[name]
    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    mapped = jax.shard_map(
        lambda x, t: jnp.sum(call(x, t))[None], mesh=mesh, in_specs=(P(), P()), out_specs=P("i"), check_vma=False
    )
    with pytest.raises((CommError, TypeError)) as raised:
        jax.jit(mapped)(jnp.zeros((1, 4, 2, 2, 3)), jnp.zeros((1, 3, 4)))
    assert str(raised.value) == _spec_text(expected)


def test_a_layout_of_another_world_size_is_refused_by_name():
    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
    mapped = jax.shard_map(
        lambda x: video.shard_latents(x, LAYOUT, "i"), mesh=mesh, in_specs=P(), out_specs=P("i"), check_vma=False
    )
    with pytest.raises(CommError, match=r"^shard_latents: layout.world_size \(4\) must be .*\(2\)"):
        mapped(jnp.zeros((1, 4, 2, 2, 3)))
