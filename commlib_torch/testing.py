"""Parity tests for your own models, torch's half (`commlib.testing` has the comparison and the parameter map):
`run` a function on W gloo ranks and bring every rank's outputs and gradients back as numpy; `named_arrays` /
`load_named_arrays` move a module's parameters to and from numpy by ``named_parameters()`` name.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from commlib.testing.runs import RankError, RunResult, cotangents, is_floating, seeded_inputs
from commlib.testing.trees import flatten, tree_map, unflatten
from commlib_torch._pool import WorkerContext, WorkerError, WorkerPool
from commlib_torch.testing_trace import record

__all__ = ["load_named_arrays", "named_arrays", "record", "run"]


def run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    inputs: Any = None,
    seed: int = 0,
    timeout: float = 120.0,
    grad: bool = True,
    pool: WorkerPool | None = None,
) -> RunResult:
    """Call ``fn(**inputs)`` (``fn(*inputs)`` for a tuple) on `world_size` gloo ranks; every rank's outputs and
    gradients as numpy.

    Each rank is a process whose default group (WORLD, ``group=None``) is the W-rank gloo group: `fn` finds its
    rank with ``torch.distributed.get_rank()``, as under ``torchrun``. Every rank gets the same `inputs` (see
    `commlib.testing.seeded_inputs`: numpy arrays, or ``inputs(numpy.random.default_rng(seed))``) as CPU tensors
    of their dtype, the floating ones with ``requires_grad`` (with `grad`), and shards them itself. `fn` returns a
    pytree (dicts, lists, tuples) of tensors or numbers. `fn` travels to the ranks by reference: a module-level
    function of an importable module (what ``torch.multiprocessing.spawn`` needs too).

    Gradients: of each rank's loss, ``sum(output * cotangent)`` over its floating outputs (cotangent 1 for a
    0-d output, else seeded: `commlib.testing.cotangents`), all ranks' losses summed (convention "sum"); a
    pytree of `inputs`' structure, None at non-floating inputs, zeros where the loss does not depend on one.
    Parameters whose gradients you want are inputs: ``torch.func.functional_call(module, params, args)``.

    Returns a `commlib.testing.RunResult`: per rank, ``{"outputs": ..., "gradients": ...}`` (bfloat16 comes
    back as float32, numpy has no bfloat16). `pool`: a running `WorkerPool` of `world_size` ranks to reuse
    (the pytest plugin's ``torch_ranks`` fixture keeps one per world size); None starts one for this call.

    Raises `commlib.testing.RankError` naming the ranks that raised, died or did not answer within `timeout`
    seconds (the ranks are killed; a pool starts fresh ones on its next run), TypeError for an `fn` that does
    not pickle or `inputs` of another kind.

    >>> import numpy as np
    >>> from commlib.testing import cotangents
    >>> from commlib_torch import all_gather
    >>> result = run(all_gather, 2, inputs={"x": np.arange(3.0)})
    >>> result.outputs[1]
    array([0., 1., 2., 0., 1., 2.])
    >>> cotangent = [cotangents(output, seed=0, rank=r) for r, output in enumerate(result.outputs)]
    >>> bool(np.allclose(result.gradients[1]["x"], cotangent[0][3:] + cotangent[1][3:]))  # reduce_scatter
    True
    """
    arrays = seeded_inputs(inputs, seed, "commlib_torch.testing.run")
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise TypeError(
            f"commlib_torch.testing.run: fn must be a module-level function of an importable module "
            f"(the ranks import it by name). Received: {fn!r} ({error})"
        ) from None
    if pool is not None and pool.world_size != world_size:
        raise ValueError(f"commlib_torch.testing.run: the pool has {pool.world_size} ranks, world_size is {world_size}")
    try:
        if pool is not None:
            return RunResult(pool.run(_rank, fn, arrays, seed, grad, timeout=timeout))
        with WorkerPool(world_size, timeout=timeout) as started:
            return RunResult(started.run(_rank, fn, arrays, seed, grad))
    except WorkerError as error:
        name = getattr(fn, "__qualname__", repr(fn))
        raise RankError(f"commlib_torch.testing.run({name}, world_size={world_size}): {error}", error.ranks) from None


def _rank(context: WorkerContext, fn: Callable[..., Any], arrays: dict | tuple, seed: int, grad: bool) -> dict:
    """One rank's part of `run`: call `fn`, take the gradients, return numpy."""
    tensors = tree_map(lambda array: _tensor(array, grad), arrays)
    outputs = fn(**tensors) if isinstance(tensors, dict) else fn(*tensors)
    numpy_outputs = tree_map(_numpy, outputs)
    if not grad:
        return {"outputs": numpy_outputs, "gradients": None}
    return {"outputs": numpy_outputs, "gradients": _gradients(tensors, outputs, numpy_outputs, seed, context.rank)}


def _gradients(tensors: Any, outputs: Any, numpy_outputs: Any, seed: int, rank: int) -> Any:
    flat_outputs, flat_cotangents = flatten(outputs), flatten(cotangents(numpy_outputs, seed, rank))
    terms = [
        (output * torch.as_tensor(flat_cotangents[path], dtype=output.dtype)).sum()
        for path, output in flat_outputs.items()
        if flat_cotangents[path] is not None and isinstance(output, torch.Tensor) and output.requires_grad
    ]
    leaves = {path: tensor for path, tensor in flatten(tensors).items() if tensor.requires_grad}
    found: tuple = (None,) * len(leaves)
    if terms and leaves:
        found = torch.autograd.grad(torch.stack(terms).sum(), list(leaves.values()), allow_unused=True)
    gradients = dict.fromkeys(flatten(tensors))
    for (path, tensor), gradient in zip(leaves.items(), found, strict=True):
        gradients[path] = _numpy(torch.zeros_like(tensor) if gradient is None else gradient)
    return unflatten(gradients, tensors)


def _tensor(array: np.ndarray, grad: bool) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # a writable copy
    return tensor.requires_grad_() if grad and is_floating(array) else tensor


def _numpy(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return np.asarray(value)
    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def named_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every ``module.named_parameters()`` as a numpy copy (bfloat16 as float32), by name.

    >>> named_arrays(torch.nn.Linear(3, 2))["weight"].shape
    (2, 3)
    """
    return {name: _numpy(parameter).copy() for name, parameter in module.named_parameters()}


def load_named_arrays(module: torch.nn.Module, arrays: Mapping[str, Any]) -> torch.nn.Module:
    """Copy `arrays` (by ``named_parameters()`` name) into `module`'s parameters, in place; returns `module`.

    Raises `commlib.testing.ParameterMapError` listing every missing, unknown or mis-shaped name, before copying.

    >>> import numpy as np
    >>> linear = load_named_arrays(torch.nn.Linear(3, 2), {"weight": np.ones((2, 3)), "bias": np.zeros(2)})
    >>> linear.weight.sum().item()
    6.0
    """
    from commlib.testing.parameters import ParameterMapError

    parameters = dict(module.named_parameters())
    problems = [f"no array for parameter {name!r}" for name in parameters if name not in arrays]
    problems += [f"no parameter named {name!r}" for name in arrays if name not in parameters]
    problems += [
        f"shape differs: {name!r} is {tuple(parameters[name].shape)}, the array is {np.shape(array)}"
        for name, array in arrays.items()
        if name in parameters and tuple(parameters[name].shape) != np.shape(array)
    ]
    if problems:
        raise ParameterMapError("load_named_arrays: parameters cannot be loaded:\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for name, array in arrays.items():
            parameters[name].copy_(torch.as_tensor(np.asarray(array)))
    return module
