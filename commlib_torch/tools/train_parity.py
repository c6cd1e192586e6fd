"""Torch side of ``commlib parity --workload train``: the block of `commlib.tools.train_block` trained on every SP x TP
mesh of a `WorkerPool`'s gloo ranks (groups from ``init_device_mesh``), each rank's loss and gradients recorded
per step (run by `commlib_torch.tools.parity_runner`), and the unsharded block in the runner's own process.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commlib.tools import progress, train_block, train_parity
from commlib_torch.tools.pool import WorkerError, WorkerPool
from commlib_torch.tools.train_block import block_loss

__all__ = ["mesh_groups", "record", "run_mesh", "train_step"]


def mesh_groups(sp: int, tp: int):
    """``init_device_mesh("cpu", (sp, tp), mesh_dim_names=("sp", "tp"))`` on the default process group:
    ((SP group, TP group), (this rank's SP index, its TP index))."""
    mesh = init_device_mesh("cpu", (sp, tp), mesh_dim_names=("sp", "tp"))
    return (mesh.get_group("sp"), mesh.get_group("tp")), (mesh.get_local_rank("sp"), mesh.get_local_rank("tp"))


def train_step(params: dict[str, torch.Tensor], x, target, config: train_block.BlockConfig, groups):
    """One SGD step the torch way: this rank's backward, every gradient all_reduced over SP, then the update.
    Returns (the unsharded loss, {name: the unsharded gradient's block on this rank})."""
    loss = block_loss(params, x, target, config, groups)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
    total = loss.detach().clone()
    for tensor in (total, *grads.values()):
        dist.all_reduce(tensor, group=groups[0])
    with torch.no_grad():
        for name, value in params.items():
            value -= config.lr * grads[name]
    return total, grads


def _local(config, params, x, target, sp, tp, coordinate):
    s, t = coordinate
    tensors = {
        name: torch.from_numpy(train_block.shard_parameter(name, value, tp, t).copy()).requires_grad_()
        for name, value in params.items()
    }
    block = lambda a: torch.from_numpy(train_block.sequence_block(a, sp, s).copy())  # noqa: E731
    return tensors, block(x), block(target)


def run_mesh(context, config: train_block.BlockConfig, params, x, target, sp: int, tp: int):
    """A `WorkerPool` job: `config.steps` steps on the (sp, tp) mesh; this rank's ((s, t), [(loss, grads)])."""
    groups, coordinate = mesh_groups(sp, tp)
    tensors, x_local, target_local = _local(config, params, x, target, sp, tp, coordinate)
    history = []
    for _ in range(config.steps):
        loss, grads = train_step(tensors, x_local, target_local, config, groups)
        history.append((float(loss), {name: value.numpy() for name, value in grads.items()}))
    return coordinate, history


def _stacked(replies, sp: int, tp: int) -> train_parity.History:
    """Every rank's `run_mesh` reply -> one `History` with [sp, tp] leading dims."""
    by_coordinate = dict(replies)
    steps = len(replies[0][1])
    history = []
    for step in range(steps):
        losses = np.array([[by_coordinate[(s, t)][step][0] for t in range(tp)] for s in range(sp)])
        grads = {
            name: np.stack([np.stack([by_coordinate[(s, t)][step][1][name] for t in range(tp)]) for s in range(sp)])
            for name in train_block.TP_DIM
        }
        history.append((losses, grads))
    return history


def _unsharded(config: train_block.BlockConfig, params, x, target) -> train_parity.History:
    tensors = {name: torch.from_numpy(value.copy()).requires_grad_() for name, value in params.items()}
    x, target = torch.from_numpy(x), torch.from_numpy(target)
    history = []
    for _ in range(config.steps):
        loss = block_loss(tensors, x, target, config)
        grads = dict(zip(tensors, torch.autograd.grad(loss, list(tensors.values())), strict=True))
        ranks = {name: value.numpy()[None, None] for name, value in grads.items()}  # a 1 x 1 mesh
        history.append((np.full((1, 1), loss.item()), ranks))
        with torch.no_grad():
            for name, value in tensors.items():
                value -= config.lr * grads[name]
    return history


def record(pool: WorkerPool, in_dir, results: train_parity.TrainResults) -> None:
    """Every mesh (mode "gloo") and the unsharded block into `results`; a run whose ranks failed is its error."""
    config, params, x, target, meshes = train_parity.read(in_dir)
    progress.expect(len(meshes) + 1)
    torch.set_default_dtype(torch.float64)
    for sp, tp in meshes:
        try:
            results.add("gloo", (sp, tp), _stacked(pool.run(run_mesh, config, params, x, target, sp, tp), sp, tp))
        except WorkerError as error:
            results.fail("gloo", (sp, tp), error)
    results.add(train_parity.UNSHARDED, None, _unsharded(config, params, x, target))
