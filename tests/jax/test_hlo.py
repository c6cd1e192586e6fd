"""The compiled HLO of each commlib JAX op, forward and gradient, runs the same collectives as the bare
`jax.lax` op -- same kinds, same counts, nothing extra -- and no more copies or transposes.

What runs is the optimised HLO of ``jax.jit(...).lower(...).compile()``: the custom_vjp, the varying-type
casts (pcast, a no-op) and the plan's bookkeeping must all compile away. Rooted ops have no bare lax op;
their collectives are pinned to the one the docs name (broadcast = psum of the source's value, ...).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib_jax

W = 4
AXIS = "i"
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
LAYOUT = ("copy", "transpose")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES + LAYOUT) + r")(?:-start)?\(")
RING = [(rank, (rank + 1) % W) for rank in range(W)]

#: name -> (per-rank shape, commlib op, bare lax op); both take this rank's block.
PAIRS = {
    "all_reduce sum": ((8, 16), lambda x: commlib_jax.all_reduce(x, AXIS), lambda x: lax.psum(x, AXIS)),
    "all_reduce avg": ((8, 16), lambda x: commlib_jax.all_reduce(x, AXIS, "avg"), lambda x: lax.pmean(x, AXIS)),
    "all_gather dim 0": (
        (8, 16),
        lambda x: commlib_jax.all_gather(x, AXIS, dim=0),
        lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True),
    ),
    "all_gather dim -1": (
        (8, 16),
        lambda x: commlib_jax.all_gather(x, AXIS, dim=-1),
        lambda x: lax.all_gather(x, AXIS, axis=1, tiled=True),
    ),
    "reduce_scatter dim 0": (
        (8, 16),
        lambda x: commlib_jax.reduce_scatter(x, AXIS, dim=0),
        lambda x: lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True),
    ),
    "reduce_scatter dim 1": (
        (8, 16),
        lambda x: commlib_jax.reduce_scatter(x, AXIS, dim=1),
        lambda x: lax.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True),
    ),
    "all_to_all (0, 2)": (
        (8, 3, 5),
        lambda x: commlib_jax.all_to_all(x, AXIS, 0, 2),
        lambda x: lax.all_to_all(x, AXIS, 0, 2, tiled=True),
    ),
    "all_to_all_4d (2, 1)": (
        (2, 8, 8, 16),
        lambda x: commlib_jax.all_to_all_4d(x, AXIS, 2, 1),
        lambda x: lax.all_to_all(x, AXIS, 2, 1, tiled=True),
    ),
    "all_to_all_4d (1, 2) batch 1": (
        (1, 8, 8, 16),
        lambda x: commlib_jax.all_to_all_4d(x, AXIS, 1, 2),
        lambda x: lax.all_to_all(x, AXIS, 1, 2, tiled=True),
    ),
    "permute": ((8, 16), lambda x: commlib_jax.permute(x, AXIS, RING), lambda x: lax.ppermute(x, AXIS, RING)),
}

#: name -> (shape, commlib op, collectives of the forward, collectives of the gradient).
ROOTED = {
    "broadcast": ((8, 16), lambda x: commlib_jax.broadcast(x, AXIS, 1), {"all-reduce": 1}, {"all-reduce": 1}),
    "gather": ((8, 16), lambda x: commlib_jax.gather(x, AXIS, 2, dim=0), {"all-gather": 1}, {"reduce-scatter": 1}),
    "scatter": ((8, 16), lambda x: commlib_jax.scatter(x, AXIS, 3, dim=0), {"reduce-scatter": 1}, {"all-gather": 1}),
    "sum_grad": ((8, 16), lambda x: commlib_jax.sum_grad(x, AXIS), {}, {"all-reduce": 1}),
}

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]", "pmap")

SEQ, HEADS = (16, 16, 16, 15), (2, 2, 1, 1)  # S = 63, H = 6
#: name -> (shape, commlib op with uneven sizes (padded layout), shape on the padded size, the even lax op there).
UNEVEN = {
    "all_to_all_4d (2, 1)": (
        (2, 16, 6, 16),
        lambda x: commlib_jax.all_to_all_4d(x, AXIS, 2, 1, scatter_sizes=HEADS, gather_sizes=SEQ),
        (2, 16, 8, 16),
        lambda x: lax.all_to_all(x, AXIS, 2, 1, tiled=True),
    ),
    "all_to_all_4d (1, 2)": (
        (2, 63, 2, 16),
        lambda x: commlib_jax.all_to_all_4d(x, AXIS, 1, 2, scatter_sizes=SEQ, gather_sizes=HEADS),
        (2, 64, 2, 16),
        lambda x: lax.all_to_all(x, AXIS, 1, 2, tiled=True),
    ),
    "all_gather": (
        (16, 8),
        lambda x: commlib_jax.all_gather(x, AXIS, 0, sizes=SEQ),
        (16, 8),
        lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True),
    ),
    "reduce_scatter": (
        (8, 63),
        lambda x: commlib_jax.reduce_scatter(x, AXIS, 1, sizes=SEQ),
        (8, 64),
        lambda x: lax.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True),
    ),
}


def _mapped(body, mode: str):
    """`body` on each rank's block of a [W, *shape] array, in `mode`."""
    if mode == "pmap":
        return jax.pmap(body, axis_name=AXIS)
    mesh = Mesh(np.array(jax.devices()[:W]), (AXIS,))
    return jax.shard_map(
        lambda x: body(x[0])[None],
        mesh=mesh,
        in_specs=P(AXIS),
        out_specs=P(AXIS),
        check_vma=mode != "shard_map[check_vma=False]",
    )


def counts(body, shape, mode: str, part: str) -> dict[str, int]:
    """Collectives, copies and transposes in the optimised HLO of the forward or the gradient."""
    mapped = _mapped(body, mode)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((W, *shape)), jnp.float32)
    if part == "forward":
        lowered = jax.jit(mapped).lower(x)
    else:
        cotangent = jnp.ones(jax.eval_shape(mapped, x).shape, jnp.float32)
        lowered = jax.jit(jax.grad(lambda x, cotangent: (mapped(x) * cotangent).sum())).lower(x, cotangent)
    found: dict[str, int] = {}
    for match in _OP.finditer(lowered.compile().as_text()):
        found[match.group(1)] = found.get(match.group(1), 0) + 1
    return found


def _split(found: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    return (
        {kind: n for kind, n in found.items() if kind in COLLECTIVES},
        {kind: n for kind, n in found.items() if kind in LAYOUT},
    )


@pytest.mark.parametrize("part", ["forward", "gradient"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_same_collectives_as_lax(name, mode, part):
    shape, ours, bare = PAIRS[name]
    our_collectives, our_layout = _split(counts(ours, shape, mode, part))
    bare_collectives, bare_layout = _split(counts(bare, shape, mode, part))
    assert our_collectives == bare_collectives
    assert sum(our_collectives.values()) == 1  # one collective per op and per gradient: nothing extra
    for kind in LAYOUT:
        assert our_layout.get(kind, 0) <= bare_layout.get(kind, 0), (kind, our_layout, bare_layout)


@pytest.mark.parametrize("part", ["forward", "gradient"])
@pytest.mark.parametrize("name", sorted(UNEVEN))
def test_uneven_sizes_run_the_even_collective_on_the_padded_size(name, part):
    """The padded layout's index maps fuse into the passes around the collective: no copy or transpose more."""
    shape, ours, padded_shape, bare = UNEVEN[name]
    our_collectives, our_layout = _split(counts(ours, shape, "shard_map[check_vma=True]", part))
    bare_collectives, bare_layout = _split(counts(bare, padded_shape, "shard_map[check_vma=True]", part))
    assert our_collectives == bare_collectives and sum(our_collectives.values()) == 1
    for kind in LAYOUT:
        assert our_layout.get(kind, 0) <= bare_layout.get(kind, 0), (kind, our_layout, bare_layout)


@pytest.mark.parametrize("part", ["forward", "gradient"])
@pytest.mark.parametrize("name", sorted(ROOTED))
def test_rooted_ops_run_one_collective(name, part):
    shape, ours, forward, gradient = ROOTED[name]
    collectives, _ = _split(counts(ours, shape, "shard_map[check_vma=True]", part))
    assert collectives == (forward if part == "forward" else gradient)


def test_counter_sees_every_kind():
    """The HLO scan finds each collective kind (guards against a renamed op making the tests vacuous)."""
    seen = set()
    for name in PAIRS:
        shape, ours, _ = PAIRS[name]
        seen |= set(counts(ours, shape, "shard_map[check_vma=True]", "forward"))
    assert set(COLLECTIVES) <= seen
