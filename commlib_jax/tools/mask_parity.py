"""JAX side of ``commlib parity --workload masks`` (run by `commlib_jax.tools.parity_runner`): every case of
`commlib.tools.mask_parity.cases` under ``jax.shard_map`` with check_vma on and off (USP on an R x U mesh,
``usp_attention(..., "ulysses", "ring")``; rank ``r * U + u``). Every shard is padded to ``layout.max_size`` rows:
q, k, v and the cotangent hold `spec.FILL` there and the segment ids -1. Each rank's loss is ``sum(out *
cotangent)``; the per-rank losses leave the map and are summed outside, so dq, dk, dv follow
``convention="sum"``."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib.tools import mask_parity as spec
from commlib.tools import progress
from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention

__all__ = ["MODES", "masked", "record"]

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]")


def _mesh(case: spec.MaskCase):
    devices = np.array(jax.devices()[: case.layout.world_size])
    if case.op == "usp_attention":
        shape = (case.layout.ring_size, case.layout.ulysses_size)
        return Mesh(devices.reshape(shape), ("ring", "ulysses")), P(("ring", "ulysses"))
    return Mesh(devices, ("i",)), P("i")


def _call(case: spec.MaskCase, q, k, v, segment_ids):
    options = dict(causal=case.causal, layout=case.layout, segment_ids=segment_ids)
    if case.op == "usp_attention":
        return usp_attention(q, k, v, "ulysses", "ring", **options)
    return (ulysses_attention if case.op == "ulysses_attention" else ring_attention)(q, k, v, "i", **options)


def _program(case: spec.MaskCase, mode: str):
    mesh, axes = _mesh(case)

    def body(cotangent, segment_ids, q, k, v):
        out = _call(case, q[0], k[0], v[0], segment_ids[0])
        return out[None], (out * cotangent[0]).sum()[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(axes,) * 5, out_specs=(axes, axes), check_vma=mode == MODES[0])

    def run(cotangent, segment_ids, q, k, v):
        def total(q, k, v):
            out, losses = mapped(cotangent, segment_ids, q, k, v)
            return losses.sum(), out

        (dq, dk, dv), out = jax.grad(total, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, dq, dk, dv

    return jax.jit(run)


def masked(case: spec.MaskCase, seed: int, mode: str) -> list[dict[str, np.ndarray]]:
    """Every rank's `spec.OUTPUTS` of `case` in `mode` (float64, the padded layout)."""
    inputs = spec.data(case, seed)
    stacked = [
        jnp.asarray(np.stack(spec.shards(inputs[name], case.layout, spec.FILL)))
        for name in ("cotangent", "q", "k", "v")
    ]
    ids = jnp.asarray(np.stack(spec.segment_shards(inputs["segment_ids"], case.layout)))
    found = _program(case, mode)(stacked[0], ids, *stacked[1:])
    return [
        {key: np.asarray(value[rank], np.float64) for key, value in zip(spec.OUTPUTS, found, strict=True)}
        for rank in range(case.layout.world_size)
    ]


def record(in_dir: Path, results: spec.MaskResults) -> None:
    """Every case of the workload in both modes into `results` (a crash in one is a failed row)."""
    settings = json.loads((in_dir / "masks.json").read_text())
    found = spec.cases(settings["world_size"])
    progress.expect(len(found))
    for case in found:
        for mode in MODES:
            try:
                results.add(case.name, mode, masked(case, settings["seed"], mode))
            except Exception as error:  # a crash in one case is a failed row, not a dead runner
                results.fail(case.name, mode, error)
