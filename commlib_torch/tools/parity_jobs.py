"""Torch jobs of `commlib parity` (and of the tests): each case run on every rank of a `WorkerPool`, every
rank's output and input gradients back (`run_case`, `merge`), a whole table into a `Results` (`run_table`).
The runner process is `commlib_torch.tools.parity_runner`."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import torch
import torch.distributed as dist

import commlib_torch
from commlib.errors import CommError
from commlib.tools import cases
from commlib.tools.parity import Results
from commlib_torch.attention import attention, ring_attention, ulysses_attention, usp_attention
from commlib_torch.tools.pool import WorkerError, WorkerPool

__all__ = ["failure_text", "merge", "run_case", "run_table", "usp_groups"]


def _tensor(array: np.ndarray, case: cases.Case, channels_last: bool = False, strided: bool = False) -> torch.Tensor:
    """The case's value as a tensor of its dtype; a non-contiguous transposed view when the case says so,
    channels_last strides (4-D) when asked, a stride-2 view (every other element of a last dim twice as
    long: ``base[..., ::2]``) when `strided`."""
    if strided and array.ndim >= 1:
        base = torch.zeros((*array.shape[:-1], 2 * array.shape[-1]), dtype=getattr(torch, case.dtype))
        base[..., ::2] = torch.from_numpy(array.copy()).to(base.dtype)
        return base[..., ::2]
    if case.transposed and array.ndim >= 2:
        return torch.from_numpy(np.swapaxes(array, 0, -1).copy()).to(getattr(torch, case.dtype)).transpose(0, -1)
    tensor = torch.from_numpy(array.copy()).to(getattr(torch, case.dtype))
    return tensor.contiguous(memory_format=torch.channels_last) if channels_last and tensor.ndim == 4 else tensor


_USP_GROUPS: dict[tuple[int, int], tuple] = {}


def usp_groups(world_size: int, ulysses_size: int) -> tuple:
    """(Ulysses group, ring group) of this rank when WORLD's `world_size` ranks form a ring of
    ``world_size / ulysses_size`` Ulysses groups: rank ``r * U + u`` has Ulysses index u and ring index r. Made
    once per worker (every rank creates every group, in the same order)."""
    key = (world_size, ulysses_size)
    if key not in _USP_GROUPS:
        rank, ring_size = dist.get_rank(), world_size // ulysses_size
        mine: list = [None, None]
        for r in range(ring_size):
            group = dist.new_group([r * ulysses_size + u for u in range(ulysses_size)])
            mine[0] = group if rank // ulysses_size == r else mine[0]
        for u in range(ulysses_size):
            group = dist.new_group([r * ulysses_size + u for r in range(ring_size)])
            mine[1] = group if rank % ulysses_size == u else mine[1]
        _USP_GROUPS[key] = tuple(mine)
    return _USP_GROUPS[key]


def _call(case: cases.Case, inputs: dict[str, torch.Tensor], group=None) -> torch.Tensor:
    if case.op == "ring_attention":
        return ring_attention(inputs["q"], inputs["k"], inputs["v"], group, **cases.context_kwargs(case))
    if case.op == "usp_attention":
        groups = usp_groups(case.world_size, cases.context_layout(case)[1])
        return usp_attention(inputs["q"], inputs["k"], inputs["v"], *groups, **cases.context_kwargs(case))
    if case.op == cases.ATTENTION:
        return ulysses_attention(inputs["q"], inputs["k"], inputs["v"], group, **cases.attention_kwargs(case))
    return getattr(commlib_torch, case.op)(inputs["x"], **case.params, **({} if group is None else {"group": group}))


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64 if tensor.is_floating_point() else tensor.dtype).numpy()


def _gradient(tensor: torch.Tensor) -> torch.Tensor:
    """The gradient backward left on `tensor` (every input of a differentiable case gets one)."""
    if tensor.grad is None:
        raise RuntimeError("backward left no gradient on an input")
    return tensor.grad


_GRAD_MODES = {
    "grad": contextlib.nullcontext,
    "func": contextlib.nullcontext,
    "constant": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


def run_case(
    context,
    case: cases.Case,
    arrays: dict[str, list[np.ndarray]],
    *,
    grad_mode: str = "grad",
    channels_last: bool = False,
    group=None,
    strided: bool = False,
):
    """One case on this rank (a `WorkerPool` job): ("ok", output, {input: grad}) or ("error", text) when
    the call is rejected. Outputs and gradients come back as float64 (integers as they are).

    `grad_mode` (see `tests.bad_input.GRAD_MODES`): "grad" (``loss.backward()``), "func" (``torch.func.vjp``), or
    forward only with an input that doesn't
    require grad ("constant") or under ``torch.no_grad()`` / ``torch.inference_mode()``. `channels_last`:
    4-D inputs and cotangents get channels_last strides; `strided`: stride-2 views (the fuzz loop's inputs and
    cotangents, issue 23). `group`: the process group the op runs over (None:
    the op's default, WORLD; `context.rank` is then the rank in it). Uneven sizes: this rank's rows only (the
    exact layout), results padded back to the case's layout (`commlib.tools.cases.exact_arrays`,
    `padded_result`)."""
    mine = cases.exact_arrays(case, arrays, context.rank)
    inputs = {name: _tensor(mine[name], case, channels_last, strided) for name in case.inputs}
    for tensor in inputs.values():
        tensor.requires_grad_(case.differentiable and grad_mode != "constant")
    if grad_mode == "func" and case.differentiable:
        return _run_func(context, case, inputs, mine, channels_last, group)
    try:
        with _GRAD_MODES[grad_mode]():
            out = _call(case, inputs, group)
    except (CommError, TypeError) as error:
        return "error", f"{type(error).__name__}: {error}"
    if not case.differentiable or grad_mode != "grad":
        return "ok", *cases.padded_result(case, context.rank, _numpy(out), {})
    cotangent = _tensor(mine["cotangent"], case, channels_last, strided)
    if strided:  # the view itself reaches the op's backward (a product's gradient would be a fresh tensor)
        out.backward(cotangent)
    else:
        (out * cotangent).sum().backward()
    gradients = {name: _numpy(_gradient(tensor)) for name, tensor in inputs.items()}
    return "ok", *cases.padded_result(case, context.rank, _numpy(out), gradients)


def _run_func(context, case: cases.Case, inputs: dict, mine: dict, channels_last: bool, group):
    """`run_case` with the gradient from ``torch.func.vjp`` (the functional transform over the same Functions)."""
    names = list(inputs)
    try:
        # torch annotates vjp's result as 2 or 3 long (3 with has_aux, which this call does not pass):
        out, pullback = torch.func.vjp(  # type: ignore[misc]
            lambda *xs: _call(case, dict(zip(names, xs, strict=True)), group),
            *(tensor.detach() for tensor in inputs.values()),
        )
    except (CommError, TypeError) as error:
        return "error", f"{type(error).__name__}: {error}"
    grads = pullback(_tensor(mine["cotangent"], case, channels_last))
    gradients = {name: _numpy(grad) for name, grad in zip(names, grads, strict=True)}
    return "ok", *cases.padded_result(case, context.rank, _numpy(out), gradients)


def _unsharded(case: cases.Case, arrays) -> tuple[list, dict]:
    """Attention (the default `attn_fn`, SDPA) on the whole sequence in one process, cut back into every rank's
    (padded) rows."""
    kwargs = cases.attention_kwargs(case)
    dtype = getattr(torch, case.dtype)
    whole = {name: torch.from_numpy(value).to(dtype) for name, value in cases.attention_whole(case, arrays).items()}
    leaves = [whole[name].requires_grad_() for name in case.inputs]
    out = attention(*leaves, causal=kwargs.get("causal", False), scale=kwargs.get("scale"))
    (out * whole["cotangent"]).sum().backward()
    shards = lambda tensor: cases.attention_shards(case, _numpy(tensor))  # noqa: E731
    return shards(out), {name: shards(leaf.grad) for name, leaf in zip(case.inputs, leaves, strict=True)}


def merge(case: cases.Case, per_rank: list) -> tuple[list | None, dict | None, str | None]:
    """`run_case` replies of every rank -> (outputs, {input: gradients}, error text or None)."""
    errors = sorted({reply[1] for reply in per_rank if reply[0] == "error"})
    if errors:
        return None, None, errors[0] if len(errors) == 1 else f"ranks disagree: {errors}"
    gradients = {name: [reply[2][name] for reply in per_rank] for name in per_rank[0][2]}
    return [reply[1] for reply in per_rank], gradients, None


def _record(results: Results, case: cases.Case, per_rank: list) -> None:
    outputs, gradients, error = merge(case, per_rank)
    if error is not None:
        results.fail(case, "gloo", error)
    else:
        assert outputs is not None and gradients is not None  # merge gives both where no rank failed
        results.add(case, "gloo", outputs, gradients)


def failure_text(error: WorkerError) -> str:
    """``"WorkerError: rank 1 died with exit code -9; rank 0 raised CommFailure: ..."``: the first line of
    each failed rank's report, without the tracebacks."""
    lines = re.findall(r"\brank \d+ (?:raised|died with|did not answer)[^\n]*", str(error))
    return "WorkerError: " + "; ".join(lines or str(error).splitlines()[:1])


def run_table(pool: WorkerPool, table, results: Results, job=run_case) -> None:
    """Run each (case, arrays) of `table` on every rank of `pool` (`job`: a `run_case`-like job) into
    `results`. A case whose ranks raised, died or hung becomes a failed row naming them (`failure_text`);
    the pool starts fresh workers for the next case."""
    for case, arrays in table:
        try:
            _record(results, case, pool.run(job, case, arrays))
        except WorkerError as error:
            results.fail(case, "gloo", failure_text(error))
        if case.op == cases.ATTENTION and cases.error_text(case) is None:
            try:
                results.add(case, "unsharded", *_unsharded(case, arrays))
            except Exception as error:  # a crash in one case is a failed row, not a dead runner
                results.fail(case, "unsharded", f"crash: {type(error).__name__}: {error}")
