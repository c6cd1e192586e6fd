"""Run a `commlib.cases.Case` through `commlib_jax` the way the parity runner does, for the JAX tests.

`parity_runner.run_case` traces and compiles one program per call (its cotangent is a constant), which
is right for the case table, where every row is a distinct program. Property tests draw many examples that
lower to a program already seen (same shapes, dims only spelled differently, new random values), so `run`
traces every call -- the commlib_jax code under test runs each time with the example's own arguments --
and compiles each distinct lowered program (keyed by its StableHLO text) only once.

Each rank's loss is ``sum(out_r * cotangent_r)``; the per-rank losses leave the map as a [W] array and are
summed outside, so the gradients follow ``convention="sum"`` (DESIGN.md, Test harness).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError
from commlib.tools import cases, parity
from commlib_jax.tools import parity_runner

__all__ = ["REVERSED_MESH", "check", "error_text", "mapped", "on_mesh", "run"]

#: A mode of these tests only: the 2 x 2 mesh ("x", "y") with the op over ("y", "x"), ranks row-major over y, x.
REVERSED_MESH = "shard_map[2x2 mesh, ('y', 'x')]"

_COMPILED: dict[str, jax.stages.Compiled] = {}


def error_text(error: BaseException) -> str:
    """``"CommError: ..."``: the form `commlib.tools.parity.check` compares with the spec's text."""
    return f"{type(error).__name__}: {error}"


def mapped(case: cases.Case, mode: str, per_rank=None):
    """``(cotangent, *inputs) -> (outputs, losses)`` over stacked [W, ...] arrays in a `parity_runner` mode
    or `REVERSED_MESH`.

    `per_rank`: ``axis_name -> body(cotangent, *inputs) -> (out[None], loss[None])`` (each argument with a
    leading axis of size 1), in place of the parity runner's body that calls the op of `case`.
    """
    if mode == REVERSED_MESH:
        return on_mesh(case, (2, 2), ("x", "y"), ("y", "x"), per_rank=per_rank)
    if per_rank is None:
        return parity_runner._mapped(case, mode)
    if mode == "pmap":
        body = per_rank("i")
        leading = lambda t: t[None]  # noqa: E731
        return jax.pmap(lambda *args: jax.tree.map(lambda t: t[0], body(*map(leading, args))), axis_name="i")
    if mode == "shard_map[2x2 mesh]":
        return on_mesh(case, (2, 2), ("x", "y"), ("x", "y"), per_rank=per_rank)
    check_vma = mode != "shard_map[check_vma=False]"
    return on_mesh(case, (case.world_size,), ("i",), "i", check_vma, per_rank=per_rank)


def on_mesh(case: cases.Case, mesh_shape, mesh_axes, axis_name, check_vma=True, per_rank=None):
    """Like `mapped`, on a mesh of the first ``prod(mesh_shape)`` devices. The stacked arrays are split over
    all the mesh axes, in the order of `axis_name` when it names them all (so block r is rank r), else
    row-major over `mesh_axes`; the op runs over `axis_name`: all the axes, or one of them (then each line
    of the mesh along it is a world of its own)."""
    devices = np.array(jax.devices()[: math.prod(mesh_shape)]).reshape(mesh_shape)
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    spec = P(names if set(names) == set(mesh_axes) else tuple(mesh_axes))
    body = (per_rank or (lambda axis: parity_runner._per_rank(case, axis)))(axis_name)
    n = len(case.inputs) + 1
    return jax.shard_map(
        body, mesh=Mesh(devices, tuple(mesh_axes)), in_specs=(spec,) * n, out_specs=(spec, spec), check_vma=check_vma
    )


def _program(function):
    def differentiated(inputs, cotangent):
        def total(inputs):
            out, losses = function(cotangent, *inputs)
            return losses.sum(), out

        return jax.grad(total, has_aux=True)(inputs)

    return differentiated


def _forward(function):
    return lambda inputs, cotangent: function(cotangent, *inputs)[0]


def _compiled(program, *args):
    lowered = jax.jit(program).trace(*args).lower()
    key = lowered.as_text()
    if key not in _COMPILED:
        _COMPILED[key] = lowered.compile()
    return _COMPILED[key]


def _zeros_cotangent(case: cases.Case, rows: int):
    """A stand-in cotangent for a forward-only run (input-shaped where the spec rejects the call: the
    frontend must raise while tracing, before the shape matters)."""
    shape = case.shape if cases.error_text(case) else case.out_shape()
    return jnp.zeros((rows, *shape), dtype=case.dtype)


def run(case: cases.Case, arrays, function) -> tuple[list[np.ndarray], dict[str, list[np.ndarray]]]:
    """Every rank's outputs and {input: every rank's gradient} of `case` under `function` (from `mapped` or
    `on_mesh`); forward only (no gradients) for integer cases. Raises the frontend's CommError / TypeError."""
    inputs = [parity_runner._stacked(case, arrays, name) for name in case.inputs]
    rows = len(arrays[case.inputs[0]])
    if not case.differentiable or "cotangent" not in arrays:  # integers, and calls the spec rejects
        cotangent = _zeros_cotangent(case, rows)
        out = _compiled(_forward(function), inputs, cotangent)(inputs, cotangent)
        return list(np.asarray(out)), {}
    cotangent = parity_runner._stacked(case, arrays, "cotangent")
    grads, out = _compiled(_program(function), inputs, cotangent)(inputs, cotangent)
    as_numpy = lambda a: list(np.asarray(a, dtype=np.float64))  # noqa: E731
    return as_numpy(out), {name: as_numpy(g) for name, g in zip(case.inputs, grads, strict=True)}


def check(case: cases.Case, arrays, function, label: str = ""):
    """`commlib.tools.parity.check` of `run` (a rejected call is compared by its error text)."""
    try:
        outputs, gradients = run(case, arrays, function)
    except (CommError, TypeError) as error:
        return parity.check(case, arrays, None, None, error_text(error), "jax", label)
    return parity.check(case, arrays, outputs, gradients, None, "jax", label)
