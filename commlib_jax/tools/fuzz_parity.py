"""JAX side of ``commlib parity --workload fuzz`` (run by `commlib_jax.tools.parity_runner`): every drawn case of
`commlib.tools.fuzz_parity.cases` under ``jax.shard_map`` on its first W CPU devices, in one mode drawn per case
(check_vma on or off; USP on a 2 x 2 mesh, ``usp_attention(..., "ulysses", "ring")``), in the case's dtype. Every
shard is padded to ``layout.max_size`` rows: q, k, v and the cotangent hold `spec.FILL` there and the segment ids
-1. Each rank's loss is ``sum(out * cotangent)``; the per-rank losses leave the map and are summed outside, so
dq, dk, dv follow ``convention="sum"``."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib.tools import fuzz_parity as spec
from commlib.tools import progress
from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention

__all__ = ["MODES", "fuzzed", "mode_of", "record"]

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]")


def mode_of(case: spec.FuzzCase, seed: int) -> str:
    """The mode `case` runs in (drawn from its index and the seed)."""
    return MODES[int(np.random.default_rng([seed, case.index, 11]).integers(len(MODES)))]


def _mesh(case: spec.FuzzCase):
    devices = np.array(jax.devices()[: case.layout.world_size])
    if case.op == "usp_attention":
        shape = (case.layout.ring_size, case.layout.ulysses_size)
        return Mesh(devices.reshape(shape), ("ring", "ulysses")), P(("ring", "ulysses"))
    return Mesh(devices, ("i",)), P("i")


def _call(case: spec.FuzzCase, q, k, v, segment_ids):
    options: dict = dict(causal=case.causal, layout=case.layout, segment_ids=segment_ids)
    if case.op == "usp_attention":
        return usp_attention(q, k, v, "ulysses", "ring", **options)
    if case.op == "ulysses_attention":
        return ulysses_attention(q, k, v, "i", chunks=case.chunks, **options)
    return ring_attention(q, k, v, "i", **options)


def _program(case: spec.FuzzCase, mode: str, documents: bool):
    mesh, axes = _mesh(case)

    def body(cotangent, segment_ids, q, k, v):
        out = _call(case, q[0], k[0], v[0], segment_ids[0] if documents else None)
        return out[None], (out * cotangent[0]).sum()[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(axes,) * 5, out_specs=(axes, axes), check_vma=mode == MODES[0])

    def run(cotangent, segment_ids, q, k, v):
        def total(q, k, v):
            out, losses = mapped(cotangent, segment_ids, q, k, v)
            return losses.sum(), out

        (dq, dk, dv), out = jax.grad(total, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, dq, dk, dv

    return jax.jit(run)


def fuzzed(case: spec.FuzzCase, seed: int, mode: str) -> list[dict[str, np.ndarray]]:
    """Every rank's `spec.OUTPUTS` of `case` in `mode` (float64, the padded layout)."""
    inputs = spec.data(case, seed)
    stacked = [
        jnp.asarray(np.stack(spec.shards(inputs[name], case.layout, spec.FILL)).astype(case.dtype))
        for name in ("cotangent", "q", "k", "v")
    ]
    ids = inputs.get("segment_ids", np.zeros((case.batch, case.layout.seq_len), np.int32))
    stacked_ids = jnp.asarray(np.stack(spec.segment_shards(ids, case.layout)))
    found = _program(case, mode, "segment_ids" in inputs)(stacked[0], stacked_ids, *stacked[1:])
    return [
        {key: np.asarray(value[rank], np.float64) for key, value in zip(spec.OUTPUTS, found, strict=True)}
        for rank in range(case.layout.world_size)
    ]


def record(in_dir: Path, results: spec.FuzzResults) -> None:
    """Every drawn case in its mode into `results` (a crash in one is a failed row)."""
    found, seed = spec.settings(in_dir)
    progress.expect(len(found))
    for case in found:
        mode = mode_of(case, seed)
        try:
            results.add(case.name, mode, fuzzed(case, seed, mode))
        except Exception as error:  # a crash in one case is a failed row, not a dead runner
            results.fail(case.name, mode, error)
