"""Parity tests for your own models, JAX's half (`commlib.testing` has the comparison and the parameter map): `run`
a function on W JAX devices under ``jax.shard_map`` and bring every device's outputs and gradients back as numpy;
`named_arrays` / `load_named_arrays` move a pytree's (or an nnx ``State``'s) arrays to and from numpy by dotted path.

JAX fixes its device count at first use: for W CPU devices call ``jax.config.update("jax_num_cpu_devices", W)``
(or set ``XLA_FLAGS=--xla_force_host_platform_device_count=W``) before anything touches JAX, e.g. at the top of a
``conftest.py``; the pytest plugin's ``--commlib-jax-devices W`` does it. `run` refuses a mesh larger than that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib.testing.runs import RunResult, cotangents, is_floating, seeded_inputs
from commlib.testing.trees import flatten, tree_map, unflatten
from commlib_jax.testing_trace import record

__all__ = ["load_named_arrays", "named_arrays", "record", "run"]


def run(
    fn: Callable[..., Any],
    mesh_shape: int | tuple[int, ...],
    *,
    axis_names: str | tuple[str, ...] | None = None,
    inputs: Any = None,
    seed: int = 0,
    grad: bool = True,
    check_vma: bool = True,
) -> RunResult:
    """Call ``fn(**inputs)`` (``fn(*inputs)`` for a tuple) on every device of a mesh of `mesh_shape` under
    ``jax.jit(jax.shard_map(...))``; every device's outputs and gradients as numpy, in rank order.

    The mesh is the first ``prod(mesh_shape)`` of ``jax.devices()`` with `axis_names` (default ``("sp",)`` for a
    1-D mesh; required for more axes); rank r is device r of the mesh in row-major order (``lax.axis_index``
    of the axes in order), as shard ``r`` of ``P(axis_names)``. Inside, `fn` uses the axis names as any
    shard_map body does. Every device gets the same `inputs` (`commlib.testing.seeded_inputs`) as whole
    arrays of their dtype (float64 needs ``jax_enable_x64``) and shards them itself; `fn` returns a pytree of
    arrays, one value per device (nothing is summed or gathered for it).

    Gradients: as `commlib_torch.testing.run`'s, of the sum over devices of ``sum(output * cotangent)`` with
    the same seeded cotangents, each device's own copy of the inputs differentiated (so a device's gradient
    is what torch's rank r gets, convention "sum"), None at non-floating inputs.

    Raises ValueError for a mesh larger than JAX's device count (saying how to set it) or float64 inputs
    without x64, TypeError for `inputs` of another kind; `fn`'s own errors propagate.

    >>> import numpy as np
    >>> from commlib.testing import cotangents
    >>> from commlib_jax import all_gather
    >>> result = run(lambda x: all_gather(x, "sp"), 2, inputs={"x": np.arange(3.0, dtype=np.float32)})
    >>> result.outputs[1]
    array([0., 1., 2., 0., 1., 2.], dtype=float32)
    >>> cotangent = [cotangents(output, seed=0, rank=r) for r, output in enumerate(result.outputs)]
    >>> bool(np.allclose(result.gradients[1]["x"], cotangent[0][3:] + cotangent[1][3:]))  # reduce_scatter
    True
    """
    arrays = seeded_inputs(inputs, seed, "commlib_jax.testing.run")
    mesh = _mesh(mesh_shape, axis_names)
    _check_x64(arrays)
    world_size = mesh.devices.size
    flat = flatten(arrays)
    floating = [path for path, array in flat.items() if grad and is_floating(array)]
    stacked = {path: np.broadcast_to(array, (world_size, *array.shape)) for path, array in flat.items()}
    spec = P(mesh.axis_names)

    def body(differentiable: dict, fixed: dict) -> Any:
        local = {path: value[0] for path, value in {**fixed, **differentiable}.items()}
        tree = unflatten(local, arrays)
        outputs = fn(**tree) if isinstance(tree, dict) else fn(*tree)
        return tree_map(lambda output: None if output is None else jax.numpy.asarray(output)[None], outputs)

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=check_vma))
    fixed = {path: value for path, value in stacked.items() if path not in floating}
    differentiable = {path: stacked[path] for path in floating}
    if not grad:
        outputs = mapped(differentiable, fixed)
        return RunResult({"outputs": _rank_outputs(outputs, rank), "gradients": None} for rank in range(world_size))
    outputs, pullback = jax.vjp(lambda values: mapped(values, fixed), differentiable)
    per_rank = [_rank_outputs(outputs, rank) for rank in range(world_size)]
    (gradients,) = pullback(_stacked_cotangents(outputs, per_rank, seed))
    return RunResult(
        {"outputs": output, "gradients": _rank_gradients(flat, gradients, rank, arrays)}
        for rank, output in enumerate(per_rank)
    )


def _mesh(mesh_shape: int | tuple[int, ...], axis_names: str | tuple[str, ...] | None) -> Mesh:
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    names = ("sp",) if axis_names is None and len(shape) == 1 else axis_names
    names = (names,) if isinstance(names, str) else names
    if names is None or len(names) != len(shape):
        raise ValueError(
            f"commlib_jax.testing.run: axis_names must name each of the {len(shape)} mesh axes. "
            f"Received: mesh_shape={shape}, axis_names={axis_names!r}"
        )
    devices, needed = jax.devices(), math.prod(shape)
    if len(devices) < needed:
        raise ValueError(
            f"commlib_jax.testing.run: mesh_shape {shape} needs {needed} devices, JAX has {len(devices)} "
            f"({devices[0].platform}). JAX fixes the count at first use: call "
            f"jax.config.update('jax_num_cpu_devices', {needed}) before anything uses JAX (or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}); under pytest, pass "
            f"--commlib-jax-devices={needed}"
        )
    return Mesh(np.array(devices[:needed]).reshape(shape), tuple(names))


def _rank_outputs(outputs: Any, rank: int) -> Any:
    return tree_map(lambda output: None if output is None else np.asarray(output[rank]), outputs)


def _check_x64(arrays: Any) -> None:
    wide = [path for path, array in flatten(arrays).items() if array.dtype.itemsize == 8 and array.dtype.kind in "fiuc"]
    if wide and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"commlib_jax.testing.run: inputs {wide} are 64-bit but JAX's x64 mode is off (they would "
            f"run as 32-bit): call jax.config.update('jax_enable_x64', True) first"
        )


def _stacked_cotangents(outputs: Any, per_rank: list, seed: int) -> Any:
    """Every rank's `commlib.testing.cotangents`, stacked as `outputs` ([W, ...] each; float0 where none)."""
    drawn = [flatten(cotangents(output, seed, rank)) for rank, output in enumerate(per_rank)]
    stacked: dict[str, Any] = {}
    for path, output in flatten(outputs).items():
        if output is None:
            stacked[path] = None
        elif drawn[0][path] is None:
            stacked[path] = np.zeros(output.shape, dtype=jax.dtypes.float0)
        else:
            stacked[path] = np.stack([ranks[path] for ranks in drawn]).astype(output.dtype)
    return unflatten(stacked, outputs)


def _rank_gradients(flat: dict, gradients: dict, rank: int, like: Any) -> Any:
    return unflatten({path: np.asarray(gradients[path][rank]) if path in gradients else None for path in flat}, like)


def named_arrays(tree: Any) -> dict[str, np.ndarray]:
    """Every leaf of `tree` (a pytree of dicts, lists, tuples, or a Flax nnx ``State``) as numpy, by dotted path
    (``layers.0.attention.query.kernel``).

    >>> import jax.numpy as jnp
    >>> named_arrays({"head": {"kernel": jnp.zeros((3, 2))}, "layers": [{"scale": jnp.ones(3)}]})["layers.0.scale"]
    array([1., 1., 1.], dtype=float32)
    """
    return {path: np.asarray(leaf) for path, leaf in flatten(_pure(tree)).items()}


def load_named_arrays(tree: Any, arrays: Mapping[str, Any]) -> Any:
    """A copy of `tree` (as `named_arrays` reads it) with every leaf replaced by ``arrays[path]`` as a JAX array of
    the leaf's dtype; an nnx ``State`` stays a ``State``.

    Raises `commlib.testing.ParameterMapError` listing every missing, unknown or mis-shaped path.

    >>> import jax.numpy as jnp
    >>> loaded = load_named_arrays({"head": {"kernel": jnp.zeros((3, 2))}}, {"head.kernel": np.ones((3, 2))})
    >>> loaded["head"]["kernel"].sum()
    Array(6., dtype=float32)
    """
    from commlib.testing.parameters import ParameterMapError

    pure = _pure(tree)
    current = flatten(pure)
    problems = [f"no array for path {path!r}" for path in current if path not in arrays]
    problems += [f"no leaf at path {path!r}" for path in arrays if path not in current]
    problems += [
        f"shape differs: {path!r} is {np.shape(current[path])}, the array is {np.shape(array)}"
        for path, array in arrays.items()
        if path in current and np.shape(current[path]) != np.shape(array)
    ]
    if problems:
        raise ParameterMapError("load_named_arrays: arrays cannot be loaded:\n  " + "\n  ".join(problems))
    loaded = unflatten(
        {path: jax.numpy.asarray(arrays[path], dtype=leaf.dtype) for path, leaf in current.items()}, pure
    )
    if pure is tree:
        return loaded
    from flax import nnx

    state = jax.tree.map(lambda leaf: leaf, tree)  # a copy: replace_by_pure_dict works in place
    nnx.replace_by_pure_dict(state, loaded)
    return state


def _pure(tree: Any) -> Any:
    """`tree` as nested dicts / lists: an nnx ``State`` through ``nnx.to_pure_dict`` (flax imported only then)."""
    if type(tree).__module__.startswith("flax."):
        from flax import nnx

        return nnx.to_pure_dict(tree)
    return tree
