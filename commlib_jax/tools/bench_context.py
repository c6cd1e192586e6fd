"""The context-parallel attention cases of `commlib bench` (JAX), as the torch ones: ring attention, USP and
Ulysses attention, forward and backward, each against the all-gather-KV baseline in the same sequence layout
(every rank gathers the whole k and v with `commlib_jax.all_gather` and attends with
``jax.nn.dot_product_attention`` under the causal mask at its global positions).

Shapes, sizes and wire bytes are the spec's (`commlib.tools.bench`: ``CONTEXT_SHAPE``, ``CONTEXT_SIZES_MIB``,
`context_wire`): q ``[1, S/W, 8, 64]``, k and v ``[1, S/W, 2, 64]``, float32, causal; ring and USP zigzag,
Ulysses contiguous; USP on a ``(W/2) x 2`` mesh ("x" the ring, "y" the Ulysses pairs: device (r, u) is rank
``2 r + u``). Each variant is one jitted ``shard_map`` returning the output and dq, dk, dv; the bench checks the
variants agree, then times them with the runner's loop (`commlib_jax.tools.bench_runner.time_calls`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from commlib import shard_positions
from commlib.tools import bench

__all__ = ["KINDS", "case_name", "records"]

KINDS = ("ring", "usp", "ulysses")


def case_name(kind: str) -> str:
    """The bench case of `kind` (the torch case's name)."""
    return f"{kind} attention fwd+bwd"


def _attend(kind: str) -> Callable:
    """This rank's attention of `kind`: (q, k, v) -> out."""
    from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention

    if kind == "ring":
        return lambda q, k, v: ring_attention(q, k, v, "i", causal=True, layout="zigzag")
    if kind == "usp":
        return lambda q, k, v: usp_attention(q, k, v, "y", "x", causal=True, layout="zigzag")
    return lambda q, k, v: ulysses_attention(q, k, v, "i", causal=True)


def _all_gather_kv(positions: np.ndarray) -> Callable:
    """The baseline over axis "i": k and v gathered along seq in rank order, attention under the causal mask at
    the shards' global positions (this rank's row of `positions`, indexed by its traced rank)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import commlib_jax

    def attend(q, k, v):
        keys, values = (commlib_jax.all_gather(x, "i", dim=1) for x in (k, v))
        mine = jnp.asarray(positions)[lax.axis_index("i")]
        mask = jnp.asarray(positions.reshape(-1))[None, :] <= mine[:, None]
        return jax.nn.dot_product_attention(q, keys, values, mask=mask[None, None])

    return attend


def _step(attend: Callable, world_size: int, usp: bool) -> Callable:
    """Jitted ``(q, k, v, cotangent) -> (out, dq, dk, dv)`` over stacked ``[W, ...]`` inputs."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices()[:world_size])
    mesh = Mesh(devices.reshape(world_size // 2, 2), ("x", "y")) if usp else Mesh(devices, ("i",))
    spec = P(mesh.axis_names)

    def body(q, k, v, cotangent):
        out, backward = jax.vjp(attend, q[0], k[0], v[0])
        return tuple(x[None] for x in (out, *backward(cotangent[0])))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4))


def _inputs(world_size: int, rows: int) -> list:
    """q, k, v and the output cotangent of every rank, stacked: ``[W, 1, rows, heads, D]``, float32."""
    import jax.numpy as jnp

    rng = np.random.default_rng(1000)
    heads, kv_heads, head_dim = bench.CONTEXT_SHAPE
    return [
        jnp.asarray(rng.standard_normal((world_size, 1, rows, count, head_dim), dtype=np.float32))
        for count in (heads, kv_heads, kv_heads, heads)
    ]


def _record(kind: str, world_size: int, size_mib: float, time_calls: Callable) -> dict:
    nbytes, subject, baseline = int(size_mib * 2**20), f"commlib {kind}", bench.CONTEXT_BASELINE
    rows = bench.context_rows(nbytes)
    ring_size, ulysses_size = (world_size // 2, 2) if kind == "usp" else (world_size, 1)
    positions = shard_positions(
        rows * world_size, ring_size, "contiguous" if kind == "ulysses" else "zigzag", ulysses_size
    )
    steps = {
        subject: _step(_attend(kind), world_size, kind == "usp"),
        baseline: _step(_all_gather_kv(positions), world_size, False),
    }
    inputs = _inputs(world_size, rows)
    values = {name: [np.asarray(x) for x in step(*inputs)] for name, step in steps.items()}
    for mine, theirs in zip(values[subject], values[baseline], strict=True):
        if not np.allclose(mine, theirs, rtol=1e-4, atol=1e-4):
            raise AssertionError(f"{subject} and {baseline} disagree at world size {world_size}, {rows} rows")
    seconds = time_calls({name: (lambda step=step: step(*inputs)) for name, step in steps.items()})
    return {
        "framework": "jax",
        "case": case_name(kind),
        "world_size": world_size,
        "size_mib": size_mib,
        "subject": subject,
        "baselines": [baseline],
        "seconds": seconds["wall"],
        "cpu_seconds": seconds["cpu"],
        "wire_bytes": bench.context_wire(kind, world_size, nbytes),
    }


def records(world_size: int, kinds, time_calls: Callable) -> list[dict]:
    """The records of `kinds` (of KINDS) at `world_size` and every size of ``CONTEXT_SIZES_MIB`` (every kind where
    W > 1; USP where W is even: a ring of W/2 Ulysses pairs). ``time_calls({name: call}) -> {"wall": {name:
    seconds}, "cpu": {name: seconds}}`` times the variants (the runner's loop)."""
    kinds = [kind for kind in kinds if world_size > 1 and (kind != "usp" or world_size % 2 == 0)]
    return [_record(kind, world_size, size, time_calls) for kind in kinds for size in bench.CONTEXT_SIZES_MIB]
