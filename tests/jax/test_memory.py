"""The JAX layers' memory is linear in the sequence (issue 32 item 3, DESIGN "Long sequences"): XLA's
``memory_analysis().temp_size_in_bytes`` of the compiled ``jax.jit(jax.grad(...))`` of ``shard_map`` over 4 CPU
devices, forward and backward, grows at most 2.2x when S doubles (scores ``[S_q, S_k]`` held at once: 4x).

Compiled only, never run (the sizes are the layers' defaults at work: a piece longer than the default key
block, so it is walked in several blocks; heads of dim 8, so the linear arrays are small beside the scores).
Ring with segment ids too: each key block's mask is made inside the loop from the ids, never a ``[S_q, S_k]``
bool array. Before the blockwise pieces (main at fedf799) every case grew about 4x.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention

W = 4
MOST_PER_DOUBLING = 2.2
#: (layer, segment ids, heads, the two lengths): pieces longer than the default key block (ring: S / W rows), so
#: they are walked in several blocks; the ring with segment ids at one head and longer pieces, where a dense
#: ``[S_q, S_k]`` bool mask per piece stands out beside the scores (3.75x at the 256-key default when the
#: ring still built it).
CASES = {
    "ring": ("ring_attention", False, 1, (4096, 8192)),
    "ring-segments": ("ring_attention", True, 1, (8192, 16384)),
    "ulysses": ("ulysses_attention", False, W, (4096, 8192)),
    "usp": ("usp_attention", False, W, (4096, 8192)),
}


def _layer(name, segments):
    def call(q, k, v, ids):
        kwargs = {} if ids is None else {"segment_ids": ids}
        if name == "usp_attention":
            return usp_attention(q, k, v, "ulysses", "ring", causal=True, **kwargs)
        if name == "ulysses_attention":
            return ulysses_attention(q, k, v, "i", causal=True, **kwargs)
        return ring_attention(q, k, v, "i", causal=True, **kwargs)

    devices = np.array(jax.devices()[:W])
    if name == "usp_attention":
        mesh, spec = Mesh(devices.reshape(2, 2), ("ring", "ulysses")), P(None, ("ring", "ulysses"))
    else:
        mesh, spec = Mesh(devices, ("i",)), P(None, "i")
    in_specs = (spec,) * 3 + ((spec,) if segments else ())

    def loss(q, k, v, *ids):
        mapped = jax.shard_map(
            lambda q, k, v, *ids: call(q, k, v, ids[0] if ids else None), mesh=mesh, in_specs=in_specs, out_specs=spec
        )
        return (mapped(q, k, v, *ids) ** 2).sum()

    return loss


def _temp_bytes(name, seq, segments, heads):
    x = jax.ShapeDtypeStruct((1, seq, heads, 8), jnp.float32)
    args = (x, x, x) + ((jax.ShapeDtypeStruct((1, seq), jnp.int32),) if segments else ())
    compiled = jax.jit(jax.grad(_layer(name, segments), argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("case", list(CASES))
def test_temp_memory_grows_linearly(case):
    name, segments, heads, sizes = CASES[case]
    small, large = (_temp_bytes(name, seq, segments, heads) for seq in sizes)
    assert large <= MOST_PER_DOUBLING * small, (case, small, large, large / small)
