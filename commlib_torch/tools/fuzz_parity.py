"""Torch side of ``commlib parity --workload fuzz`` (run by `commlib_torch.tools.parity_runner`): every drawn case
of `commlib.tools.fuzz_parity.cases` on gloo ranks of its world size (one `WorkerPool` per world size, mode
"gloo"): the layer on this rank's exact shard in the case's dtype (``segment_ids=`` where it has documents,
``chunks=`` for Ulysses), then backward of ``sum(out * cotangent)``; each rank's output and dq, dk, dv as float64,
padded to the JAX layout (rows past its own: 0). A case that hangs fails after `TIMEOUT` seconds."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from commlib.tools import fuzz_parity as spec
from commlib.tools import progress
from commlib.tools.sequence_parity import pad
from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from commlib_torch.tools.parity_jobs import usp_groups
from commlib_torch.tools.pool import WorkerError, WorkerPool

__all__ = ["TIMEOUT", "fuzzed", "record"]

TIMEOUT = 60.0


def _call(case: spec.FuzzCase, q, k, v, segment_ids) -> torch.Tensor:
    options: dict = dict(causal=case.causal, layout=case.layout, segment_ids=segment_ids)
    if case.op == "usp_attention":
        return usp_attention(q, k, v, *usp_groups(case.layout.world_size, case.layout.ulysses_size), **options)
    if case.op == "ulysses_attention":
        return ulysses_attention(q, k, v, chunks=case.chunks, **options)
    return ring_attention(q, k, v, **options)


def _gradient(x: torch.Tensor) -> torch.Tensor:
    """x's gradient; an empty shard may have none (zeros of its shape), any other input must."""
    if x.grad is None and x.numel():
        raise RuntimeError("backward left no gradient on an input")
    return torch.zeros_like(x) if x.grad is None else x.grad


def fuzzed(ctx, case: spec.FuzzCase, seed: int) -> dict[str, np.ndarray]:
    """A pool job: this rank's `spec.OUTPUTS` of `case` (float64), padded to ``layout.max_size`` rows."""
    layout, inputs, dtype = case.layout, spec.data(case, seed), getattr(torch, case.dtype)
    mine = {name: layout.shard(value, 1)[ctx.rank] for name, value in inputs.items()}
    q, k, v = (torch.from_numpy(mine[name]).to(dtype).requires_grad_() for name in "qkv")
    ids = None if "segment_ids" not in mine else torch.from_numpy(mine["segment_ids"])
    out = _call(case, q, k, v, ids)
    (out * torch.from_numpy(mine["cotangent"]).to(dtype)).sum().backward()
    found = [out.detach(), *(_gradient(x) for x in (q, k, v))]
    return {key: pad(value.double().numpy(), layout.max_size) for key, value in zip(spec.OUTPUTS, found, strict=True)}


def record(pool: WorkerPool, in_dir: Path, results: spec.FuzzResults) -> None:
    """Every drawn case (mode "gloo") into `results`; the runner's pool serves its world size, others get one
    pool each."""
    found, seed = spec.settings(in_dir)
    progress.expect(len(found))
    with ExitStack() as stack:
        pools = {pool.world_size: pool}
        for case in found:
            size = case.layout.world_size
            if size not in pools:
                pools[size] = stack.enter_context(WorkerPool(size))
            try:
                results.add(case.name, "gloo", pools[size].run(fuzzed, case, seed, timeout=TIMEOUT))
            except WorkerError as error:
                results.fail(case.name, "gloo", error)
