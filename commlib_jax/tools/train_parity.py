"""JAX side of ``commlib parity --workload train``: the block of `commlib.tools.train_block` trained on every SP x
TP mesh in every mode, each rank's loss and gradients recorded per step (run by `commlib_jax.tools.parity_runner`).

Modes: ``shard_map`` with check_vma on and off over a ("sp", "tp") mesh, and ``pmap`` (over the axis with more
than one rank; on a 2-D mesh over SP with TP a ``vmap``, as jax has no nested pmap). The step is
`commlib_jax.training.value_and_grad` of `block_loss`, the gradient taken inside the map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib.tools import progress, train_block, train_parity
from commlib_jax.tools.train_block import block_loss, parameter_specs
from commlib_jax.training import value_and_grad

__all__ = ["MODES", "per_rank", "record", "run", "train_step"]

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]", "pmap")
AXES = ("sp", "tp")


def _split(x, parts: int, dim: int):
    """``[..., n, ...] -> [parts, ..., n / parts, ...]``, differentiable."""
    return jnp.stack(jnp.split(x, parts, axis=dim))


def _pmapped(body, sp: int, tp: int):
    """`body` under ``jax.pmap`` over the mesh's devices: pmap over TP when SP is 1, else over SP with TP a
    ``jax.vmap`` (jax has no nested pmap). Arguments: params split over TP, x and target over SP."""
    tp_axes = {name: None if dim is None else 0 for name, dim in train_block.TP_DIM.items()}
    if sp == 1 and tp > 1:
        inner = jax.pmap(body, axis_name="tp", in_axes=(tp_axes, None, None))
        return jax.vmap(inner, axis_name="sp", in_axes=(None, 0, 0))
    return jax.pmap(jax.vmap(body, in_axes=(tp_axes, None, None), axis_name="tp"), axis_name="sp", in_axes=(None, 0, 0))


def per_rank(body, mode: str, sp: int, tp: int):
    """``fn(params, x, target) -> results[sp, tp, ...]``: ``body(params, x, target)`` on every rank of the mesh
    in `mode`, fed this rank's blocks of the unsharded params, x and target (differentiable in them); every
    leaf of the result gets a leading [sp, tp] of the ranks' values."""
    if mode == "pmap":
        mapped = _pmapped(body, sp, tp)

        def split(params, x, target):
            params = {
                name: value if train_block.TP_DIM[name] is None else _split(value, tp, train_block.TP_DIM[name])
                for name, value in params.items()
            }
            return mapped(params, _split(x, sp, 1), _split(target, sp, 1))

        return split
    mesh = Mesh(np.array(jax.devices()[: sp * tp]).reshape(sp, tp), AXES)
    sequence = P(None, "sp")
    ranks = lambda *args: jax.tree.map(lambda leaf: leaf[None, None], body(*args))  # noqa: E731
    return jax.shard_map(
        ranks,
        mesh=mesh,
        in_specs=(parameter_specs("tp"), sequence, sequence),
        out_specs=P("sp", "tp"),
        check_vma=mode != "shard_map[check_vma=False]",
    )


def train_step(config: train_block.BlockConfig):
    """This rank's ``(params, x, target) -> (loss, grads)``: the torch recipe (`value_and_grad` over "sp")."""
    return value_and_grad(functools.partial(block_loss, config=config, axes=AXES), "sp")


def run(config: train_block.BlockConfig, params: dict, x, target, mode: str, sp: int, tp: int, steps: int):
    """`steps` SGD steps; per step every rank's (loss [sp, tp], {name: grads [sp, tp, ...]})."""
    step = jax.jit(per_rank(train_step(config), mode, sp, tp))
    params = {name: jnp.asarray(value) for name, value in params.items()}
    history = []
    for _ in range(steps):
        losses, grads = step(params, x, target)
        history.append((np.asarray(losses), {name: np.asarray(value) for name, value in grads.items()}))
        full = train_parity.unshard_gradients(history[-1][1], tp)
        params = {name: value - config.lr * full[name] for name, value in params.items()}
    return history


def _unsharded(config: train_block.BlockConfig, params: dict, x, target, steps: int):
    """The block without communication on one device: the history of a 1 x 1 mesh."""
    step = jax.jit(jax.value_and_grad(functools.partial(block_loss, config=config)))
    history = []
    for _ in range(steps):
        loss, grads = step(params, x, target)
        grads = {name: np.asarray(value) for name, value in grads.items()}
        history.append((np.full((1, 1), float(loss)), {name: value[None, None] for name, value in grads.items()}))
        params = {name: value - config.lr * grads[name] for name, value in params.items()}
    return history


def record(in_dir, results) -> None:
    """Every mesh in every mode, and the unsharded block, into `results` (a `train_parity.TrainResults`);
    a run that raises becomes its error."""
    config, params, x, target, meshes = train_parity.read(in_dir)
    progress.expect(len(meshes) * len(MODES) + 1)
    for sp, tp in meshes:
        for mode in MODES:
            try:
                results.add(mode, (sp, tp), run(config, params, x, target, mode, sp, tp, config.steps))
            except Exception as error:  # a crash in one run is a failed row, not a dead runner
                results.fail(mode, (sp, tp), error)
    results.add(train_parity.UNSHARDED, None, _unsharded(config, params, x, target, config.steps))
