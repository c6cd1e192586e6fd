"""`commlib_jax.attention.ring_attention` / `usp_attention` with a `commlib.SequenceLayout` of any length on 4
simulated CPU devices: every shard held padded to ``layout.max_size`` with NaN in its padding rows (inputs and
cotangent), its output and dq/dk/dv against unsharded float64 attention (tests/any_length_cases.py), the padding
rows of the output and of every gradient exactly 0, W = 1-4 and USP 2 x 2; and the layout's sizes checked
against the mesh axes' before communicating."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError, SequenceLayout
from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention
from tests import any_length_cases as any_length


def _padded(layout, x):
    """``[W, B, max_size, H, D]``: the shards of `x`, each padded to `max_size` rows of NaN."""
    shards = layout.shard(x, 1, padded=True)
    for shard, size in zip(shards, layout.sizes, strict=True):
        shard[:, size:] = np.nan
    return np.stack(shards)


def _program(layout, causal, op):
    """``(cotangent, q, k, v) -> (outputs, per-shard losses)`` over the stacked padded shards."""
    if op == "ulysses_attention":
        mesh, axes = Mesh(np.array(jax.devices()[:4]), ("seq",)), "seq"
        call = lambda q, k, v: ulysses_attention(q, k, v, "seq", causal=causal, layout=layout)  # noqa: E731
    elif layout.ulysses_size == 1:
        mesh, axes = Mesh(np.array(jax.devices()[: layout.world_size]), ("ring",)), "ring"
        call = lambda q, k, v: ring_attention(q, k, v, "ring", causal=causal, layout=layout)  # noqa: E731
    else:
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("ring", "ulysses"))
        axes = ("ring", "ulysses")
        call = lambda q, k, v: usp_attention(q, k, v, "ulysses", "ring", causal=causal, layout=layout)  # noqa: E731

    def body(cotangent, q, k, v):
        out = call(q[0], k[0], v[0])
        real = jnp.isfinite(cotangent[0])  # the cotangent's NaN padding stays out of the loss, not out of the VJP
        return out[None], jnp.where(real, out * cotangent[0], 0.0).sum()[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * 4, out_specs=(P(axes), P(axes)))


def _results(layout, causal, whole, op):
    """Every shard's (out, dq, dk, dv), padded, float64 numpy."""
    mapped = _program(layout, causal, op)
    cotangent = jnp.asarray(_padded(layout, whole["cotangent"]))

    def total(inputs):
        out, losses = mapped(cotangent, *inputs)
        return losses.sum(), out

    inputs = [jnp.asarray(_padded(layout, whole[name])) for name in ("q", "k", "v")]
    grads, out = jax.jit(jax.grad(total, has_aux=True))(inputs)
    return [np.asarray(x) for x in (out, *grads)]


def _check(layout, causal, op=None):
    """Error of the valid rows against the reference; the padding rows must be exactly 0."""
    whole = any_length.whole_inputs(layout.seq_len)
    results = _results(layout, causal, whole, op)
    for result in results:
        for shard, size in zip(result, layout.sizes, strict=True):
            assert (shard[:, size:] == 0).all(), f"{layout} causal={causal}: padding rows not 0"
    got = [[shard[:, :size] for shard, size in zip(result, layout.sizes, strict=True)] for result in results]
    return any_length.worst_error(got, any_length.expected(layout, whole, causal))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_any_length(world_size):
    """S = 37, 5, 3 (empty shards at W = 4), contiguous and zigzag, causal and not: within 1e-10 on every shard."""
    failed = [
        f"{layout} causal={causal}: {error:.2e}"
        for layout, causal in any_length.ring_settings(world_size)
        if (error := _check(layout, causal)) > any_length.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_usp_any_length():
    """USP 2 x 2 at S = 37 and 5, both layouts, causal and not: within 1e-10 on every shard."""
    failed = [
        f"{layout} causal={causal}: {error:.2e}"
        for layout, causal in any_length.usp_settings()
        if (error := _check(layout, causal)) > any_length.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_ulysses_layout():
    """``ulysses_attention(..., layout=SequenceLayout)`` is ``seq_sizes=layout.sizes``: within 1e-10 on every shard."""
    failed = [
        f"{layout} causal={causal}: {error:.2e}"
        for layout, causal in any_length.ulysses_settings()
        if (error := _check(layout, causal, "ulysses_attention")) > any_length.TOLERANCE
    ]
    assert not failed, "\n".join(failed)


def test_layout_of_another_world_size_is_refused():
    """A layout for 2 ranks on an axis of 4, and shards not padded to max_size: CommError at trace time."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("ring",))
    zeros = jnp.zeros((4, 1, 5, 2, 3))

    def traced(layout):
        body = lambda q: ring_attention(q[0], q[0], q[0], "ring", layout=layout)[None]  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P("ring"), out_specs=P("ring"))(zeros)

    with pytest.raises(CommError, match=r"layout.ring_size \(2\) must be the ring group's world size \(4\)"):
        traced(SequenceLayout(9, ring_size=2))
    with pytest.raises(CommError, match=r"seq \(5\) must be layout.max_size \(3\)"):
        traced(SequenceLayout(9, ring_size=4))
    body = lambda q: ulysses_attention(q[0], q[0], q[0], "ring", layout=SequenceLayout(9, ulysses_size=2))[None]  # noqa: E731
    with pytest.raises(CommError, match=r"layout.world_size \(2\) must be the group's world size \(4\)"):
        jax.shard_map(body, mesh=mesh, in_specs=P("ring"), out_specs=P("ring"))(zeros)
