"""Torch side of ``commlib parity --workload sequence`` (run by `commlib_torch.tools.parity_runner`): every sequence
helper on every layout of `commlib.tools.sequence_parity.layouts` on a `WorkerPool`'s gloo ranks (mode "gloo"),
each rank's outputs and input gradients padded to the JAX layout, and at W = 4 examples/transformers_llama.py's
first step with ulysses, ring and usp against the same Llama unsharded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from commlib.sequence import SequenceLayout
from commlib.tools import progress
from commlib.tools import sequence_parity as spec
from commlib_torch import sequence
from commlib_torch.tools.pool import WorkerError, WorkerPool

__all__ = ["helpers", "model", "record"]


def _numpy(tensor: torch.Tensor, rows: int, value: float = 0) -> np.ndarray:
    return spec.pad(tensor.detach().numpy(), rows, value) if tensor.ndim >= 2 else tensor.detach().numpy()


def _gradient(tensor: torch.Tensor) -> torch.Tensor:
    """The gradient backward left on `tensor`."""
    if tensor.grad is None:
        raise RuntimeError("backward left no gradient on an input")
    return tensor.grad


def _backward(out: torch.Tensor, cotangent: np.ndarray) -> None:
    (out * torch.from_numpy(cotangent)).sum().backward()


def helpers(ctx, layout: SequenceLayout, seed: int) -> dict[str, np.ndarray]:
    """A pool job: every helper of `spec.OUTPUTS` on this rank, padded to ``layout.max_size`` rows."""
    case, rank, rows = spec.data(layout, seed), ctx.rank, layout.max_size
    ids, positions, labels = sequence.shard_tokens(torch.from_numpy(case["ids"]), layout, ignore_index=spec.IGNORE)
    found = {
        "ids": _numpy(ids, rows),
        "positions": _numpy(positions, rows),
        "labels": _numpy(labels, rows, spec.IGNORE),
        "position_ids": _numpy(sequence.position_ids(layout)[None], rows),
    }
    x = torch.from_numpy(case["x"]).requires_grad_()
    out = sequence.shard_sequence(x, layout)
    _backward(out, case["shard_cotangents"][rank])
    found |= {"shard_out": _numpy(out, rows), "shard_grad": _gradient(x).numpy()}
    for convention, prefix, cotangents in (
        ("sum", "gather", "gather_cotangents"),
        ("replicated", "gather_replicated", "replicated_cotangents"),
    ):
        shard = torch.from_numpy(layout.shard(case["x"], 1)[rank]).requires_grad_()
        whole = sequence.gather_sequence(shard, layout, convention=convention)
        _backward(whole, case[cotangents][rank])
        found |= {f"{prefix}_out": whole.detach().numpy(), f"{prefix}_grad": _numpy(_gradient(shard), rows)}
    logits = torch.from_numpy(layout.shard(case["logits"], 1)[rank]).requires_grad_()
    loss = sequence.cross_entropy(
        logits, torch.from_numpy(layout.shard(case["labels"], 1)[rank]), ignore_index=spec.IGNORE
    )
    loss.backward()
    return found | {"loss": loss.detach().numpy(), "loss_grad": _numpy(_gradient(logits), rows)}


def model(ctx, attention: str, seq_len: int) -> dict[str, float]:
    """A pool job: examples/transformers_llama.py's first step (its `context`, `models`, data and recipe) on this
    rank against the unsharded Llama: the relative errors of the loss, this rank's logits and every gradient."""
    example = spec.example("transformers_llama")
    example.register()
    layout, sequence_parallel = example.context(attention, seq_len, 2)
    sharded, reference = example.models(seed=0)
    input_ids = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(1))
    ids, position_ids, labels = sequence.shard_tokens(input_ids, layout)
    with sequence_parallel:
        logits = sharded(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        loss = sequence.cross_entropy(logits, labels)
        loss.backward()
        sequence.sync_gradients(sharded.parameters())
    want_logits = reference(input_ids=input_ids, use_cache=False).logits
    want = torch.nn.functional.cross_entropy(want_logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
    want.backward()
    gradients = max(
        example.relative(p.grad, q.grad) for p, q in zip(sharded.parameters(), reference.parameters(), strict=True)
    )
    mine = want_logits.detach()[:, layout.positions(ctx.rank)]
    return {
        "loss": example.relative(loss.detach(), want.detach()),
        "logits": example.relative(logits.detach(), mine),
        "gradients": gradients,
    }


def _worst(replies: list[dict[str, float]]) -> dict[str, float]:
    return {key: max(reply[key] for reply in replies) for key in replies[0]}


def record(pool: WorkerPool, in_dir: Path, results: spec.SequenceResults) -> None:
    """Every layout's helpers (mode "gloo") and, at W = 4, the transformers example's rows into `results`."""
    settings = json.loads((in_dir / "sequence.json").read_text())
    world_size, seed = settings["world_size"], settings["seed"]
    models = [attention for example, attention in spec.model_cases(world_size) if example == "transformers"]
    layouts = spec.layouts(world_size)
    progress.expect(len(layouts) + len(models))
    torch.set_default_dtype(torch.float64)
    for layout in layouts:
        try:
            results.add(spec.name(layout), "gloo", pool.run(helpers, layout, seed))
        except WorkerError as error:
            results.fail(spec.name(layout), "gloo", error)
    for attention in models:
        case = spec.model_name("transformers", attention)
        try:
            results.add(case, "gloo", [_worst(pool.run(model, attention, spec.MODEL_LENGTH))])
        except WorkerError as error:
            results.fail(case, "gloo", error)
