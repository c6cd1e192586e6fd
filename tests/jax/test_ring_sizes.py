"""`commlib_jax.attention.ring_attention`, `usp_attention` (and `ulysses_attention`) with per-rank sizes, a
``SequenceLayout(..., seq_sizes=...)`` (tests/sized_cases.py), on simulated CPU devices, W = 1-4: every shard held
padded to ``layout.max_size`` (NaN in the padding rows of q, k, v and the cotangent), its output and dq/dk/dv
within 1e-10 of the unsharded float64 reference (``jax.grad`` of per-shard losses under ``shard_map``), causal and
segment ids on global positions, empty shards; padding rows of the output and every gradient exactly 0; rows
other than ``max_size`` refused before communicating."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from commlib import CommError, SequenceLayout
from tests import mask_cases as masks
from tests import sized_cases as sized
from tests.jax.layer_meshes import call, mesh


def _padded(x, layout):
    """``[W, B, max_size, ...]``: the shards of `x`, padding rows NaN (floats) or -1 (segment ids)."""
    shards = masks.shards(x, layout, padded=True)
    for shard, size in zip(shards, layout.sizes, strict=True):
        shard[:, size:] = -1 if shard.dtype.kind == "i" else np.nan
    return np.stack(shards)


def _run(op, layout, whole, ids, causal):
    """Per shard: ``[outs, dqs, dks, dvs]`` padded (float64 numpy)."""
    grid, spec = mesh(op, layout)

    def body(cotangent, q, k, v, segment_ids):
        kwargs = {} if segment_ids is None else {"segment_ids": segment_ids[0]}
        out = call(op, layout, q[0], k[0], v[0], causal=causal, **kwargs)
        real = jnp.isfinite(cotangent[0])  # NaN padding stays out of the loss, not out of the VJP
        return out[None], jnp.where(real, out * cotangent[0], 0.0).sum()[None]

    segments = None if ids is None else jnp.asarray(_padded(ids, layout))
    in_specs = (spec,) * 4 + (None if ids is None else spec,)
    mapped = jax.shard_map(body, mesh=grid, in_specs=in_specs, out_specs=(spec, spec))
    cotangent = jnp.asarray(_padded(whole[3], layout))

    def total(inputs):
        out, losses = mapped(cotangent, *inputs, segments)
        return losses.sum(), out

    grads, out = jax.jit(jax.grad(total, has_aux=True))([jnp.asarray(_padded(x, layout)) for x in whole[:3]])
    return [np.asarray(x) for x in (out, *grads)]


def _error(op, layout, causal, segmented, seed):
    whole = masks.whole_inputs(sized.BATCH, layout.seq_len, sized.HEADS, sized.KV_HEADS, sized.HEAD_DIM, seed)
    ids = sized.documents(layout.seq_len, seed) if segmented else None
    results = _run(op, layout, whole, ids, causal)
    for result in results:
        for shard, size in zip(result, layout.sizes, strict=True):
            assert (shard[:, size:] == 0).all(), f"{sized.label(op, layout, causal, segmented)}: padding rows not 0"
    got = [[shard[:, :size] for shard, size in zip(result, layout.sizes, strict=True)] for result in results]
    return masks.worst_error(got, masks.expected(whole, ids, causal), layout)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_per_rank_sizes(world_size):
    """Every (layer, seq_sizes) of the world size, causal with documents (and without, the first)."""
    failed = [
        f"{sized.label(*case)}: {error:.2e}"
        for seed, case in enumerate(sized.cases(world_size, every=False))
        if (error := _error(*case, seed)) > sized.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_rows_other_than_max_size_are_refused():
    """JAX holds every shard padded to ``max_size`` (6 here): 4 rows refused, naming both numbers."""
    layout = SequenceLayout(10, ring_size=2, seq_sizes=(6, 4))
    grid, spec = mesh("ring_attention", layout)
    q = jnp.zeros((2, 4, 2, 3))
    mapped = jax.shard_map(lambda x: call("ring_attention", layout, x, x, x), mesh=grid, in_specs=spec, out_specs=spec)
    with pytest.raises(CommError, match=r"^ring_attention: seq \(4\) must be layout.max_size \(6\)\. Received: "):
        mapped(q)
