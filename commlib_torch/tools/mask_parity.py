"""Torch side of ``commlib parity --workload masks`` (run by `commlib_torch.tools.parity_runner`): every case of
`commlib.tools.mask_parity.cases` on a `WorkerPool`'s gloo ranks (mode "gloo"): the layer with ``segment_ids=``
on this rank's exact shard, then backward of ``sum(out * cotangent)``; each rank's output and dq, dk, dv padded
to the JAX layout (rows past its own: 0)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from commlib.tools import mask_parity as spec
from commlib.tools import progress
from commlib.tools.sequence_parity import pad
from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from commlib_torch.tools.parity_jobs import usp_groups
from commlib_torch.tools.pool import WorkerError, WorkerPool

__all__ = ["masked", "record"]


def _call(case: spec.MaskCase, q, k, v, segment_ids) -> torch.Tensor:
    options = dict(causal=case.causal, layout=case.layout, segment_ids=segment_ids)
    if case.op == "usp_attention":
        return usp_attention(q, k, v, *usp_groups(case.layout.world_size, case.layout.ulysses_size), **options)
    return (ulysses_attention if case.op == "ulysses_attention" else ring_attention)(q, k, v, **options)


def _gradient(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.grad is None:
        raise RuntimeError("backward left no gradient on an input")
    return tensor.grad


def masked(ctx, case: spec.MaskCase, seed: int) -> dict[str, np.ndarray]:
    """A pool job: this rank's `spec.OUTPUTS` of `case` (float64), padded to ``layout.max_size`` rows."""
    layout, inputs = case.layout, spec.data(case, seed)
    mine = {name: layout.shard(value, 1)[ctx.rank] for name, value in inputs.items()}
    q, k, v = (torch.from_numpy(mine[name]).requires_grad_() for name in "qkv")
    out = _call(case, q, k, v, torch.from_numpy(mine["segment_ids"]))
    (out * torch.from_numpy(mine["cotangent"])).sum().backward()
    found = [out.detach(), *(_gradient(x) for x in (q, k, v))]
    return {key: pad(value.numpy(), layout.max_size) for key, value in zip(spec.OUTPUTS, found, strict=True)}


def record(pool: WorkerPool, in_dir: Path, results: spec.MaskResults) -> None:
    """Every case of the workload at the pool's world size (mode "gloo") into `results`."""
    settings = json.loads((in_dir / "masks.json").read_text())
    found = spec.cases(settings["world_size"])
    progress.expect(len(found))
    for case in found:
        try:
            results.add(case.name, "gloo", pool.run(masked, case, settings["seed"]))
        except WorkerError as error:
            results.fail(case.name, "gloo", error)
