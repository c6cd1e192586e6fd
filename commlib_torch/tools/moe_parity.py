"""Torch side of ``commlib parity --workload moe`` (run by `commlib_torch.tools.parity_runner`): every case of
`commlib.tools.moe_parity.cases` on a `WorkerPool`'s gloo ranks in the layouts ``exact`` and ``padded`` (a case
with another T per rank: exact only): route, dispatch, the per-expert experts, combine, then backward of
``sum(out * cotangent)``; in the padded layout NaN in y's padded rows and in the padded rows of the dispatched
rows' cotangent. Non-contiguous cases give x, the weights and the indices as strided views."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from commlib.tools import moe_parity as spec
from commlib.tools import progress
from commlib_torch import moe
from commlib_torch.tools.pool import WorkerError, WorkerPool

__all__ = ["layer", "record"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _input(values: np.ndarray, dtype: torch.dtype, view: str | None):
    """(the tensor given to the op, a function giving its gradient as float64 numpy, zeros when none reached
    it): a leaf, or (`view`) a strided view of one: ``"rows"`` every other entry of a last dim twice as wide,
    ``"transposed"`` the transpose of a transposed copy."""
    if view == "transposed":
        leaf = torch.from_numpy(values.T.copy()).to(dtype).requires_grad_()
        given, pick = leaf.t(), lambda grad: grad.t()
    elif view == "rows":
        wide = np.zeros((*values.shape[:-1], 2 * values.shape[-1]))
        wide[..., ::2] = values
        leaf = torch.from_numpy(wide).to(dtype).requires_grad_()
        given, pick = leaf[..., ::2], lambda grad: grad[..., ::2]
    else:
        leaf = torch.from_numpy(values).to(dtype).requires_grad_()
        given, pick = leaf, lambda grad: grad

    def gradient() -> np.ndarray:
        return np.zeros(values.shape) if leaf.grad is None else pick(leaf.grad).double().numpy()

    return given, gradient


def layer(ctx, case: spec.MoeCase, seed: int, layout: str) -> dict[str, np.ndarray]:
    """A pool job: this rank's `spec.OUTPUTS` (float64) and `spec.COUNTS` of `case` in `layout`."""
    inputs = spec.data(case, seed)
    mine = {name: values[ctx.rank] for name, values in inputs.items()}
    dtype, strided = DTYPES[case.dtype], case.noncontiguous
    x, x_grad = _input(mine["x"], dtype, "rows" if strided else None)
    w, w_grad = _input(mine["weights"], dtype, "transposed" if strided else None)
    indices = torch.from_numpy(mine["indices"].T.copy()).t() if strided else torch.from_numpy(mine["indices"])
    assert not strided or case.tokens[ctx.rank] < 2 or not (x.is_contiguous() or w.is_contiguous())
    routing = moe.route(indices, case.num_experts, layout=layout, **spec.route_options(case, inputs["indices"]))
    d = moe.dispatch(x, routing)
    first = routing.plan.expert_offsets[ctx.rank]
    scale = spec.expert_scales(
        routing.tokens_per_expert.tolist(), first, int(routing.rows), d.shape[0], case.num_experts
    )
    shape = (-1,) + (1,) * (d.ndim - 1)
    valid = (torch.arange(d.shape[0]) < routing.rows).reshape(shape)
    if layout == "padded":  # the padded rows' cotangent: NaN, never read
        d.register_hook(lambda grad: torch.where(valid, grad, torch.nan))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    y = torch.tanh(torch.from_numpy(scale).to(compute).reshape(shape) * d.to(compute)).to(dtype)
    y = torch.where(valid, y, torch.nan)  # NaN in the padded rows of y: never read
    y.retain_grad()
    out = moe.combine(y, routing, w if case.weighted else None)
    (out.double() * torch.from_numpy(mine["cotangent"])).sum().backward()
    per_expert = np.zeros(max(routing.plan.experts_per_rank), np.int64)
    per_expert[: routing.tokens_per_expert.numel()] = routing.tokens_per_expert.numpy()
    y_grad = y.grad if y.grad is not None else torch.zeros_like(y)
    return {
        "dispatched": d.detach().double().numpy(),
        "out": out.detach().double().numpy(),
        "x_grad": x_grad(),
        "y_grad": y_grad.double().numpy(),
        "w_grad": w_grad(),
        "tokens_per_expert": per_expert,
        "counts": np.array([routing.rows, routing.dropped]),
    }


def record(pool: WorkerPool, in_dir: Path, results: spec.MoeResults) -> None:
    """Every case of the workload at the pool's world size in its layouts into `results`."""
    settings = json.loads((in_dir / "moe.json").read_text())
    runs = [(case, mode) for case in spec.cases(settings["world_size"]) for mode in spec.modes("torch", case)]
    progress.expect(len(runs))
    for case, mode in runs:
        try:
            results.add(case.name, mode, pool.run(layer, case, settings["seed"], mode))
        except WorkerError as error:
            results.fail(case.name, mode, error)
