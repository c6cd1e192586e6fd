"""The ``train-step`` case of `commlib bench` (torch): the training block of `commlib_torch.tools.train_block`,
forward and backward, with commlib (groups given as mesh dims, as the example does) against the same block on
raw ``torch.distributed`` as users write it today (`commlib_torch.tools.baselines.block_loss_by_hand`:
DeepSpeed-style Ulysses around ``torch.distributed.nn.functional.all_to_all_single``, Megatron's f and g as
hand-written autograd Functions). Both variants compute the loss and every parameter's gradient of this
rank, float32, on an ``init_device_mesh("cpu", (SP, TP))`` of the pool's ranks (`commlib.tools.train_block.mesh_shape`),
at the case's own sizes (`commlib.tools.bench.train_step_config`).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from commlib.tools import train_block
from commlib.tools.bench import TRAIN_STEP, TRAIN_STEP_SIZES_MIB, train_step_config
from commlib_torch.tools.baselines import block_loss_by_hand
from commlib_torch.tools.bench_cases import bench_case
from commlib_torch.tools.train_block import block_loss

__all__: list[str] = []

_MESHES: dict[tuple[int, int], DeviceMesh] = {}


def _mesh(sp: int, tp: int) -> DeviceMesh:
    if (sp, tp) not in _MESHES:
        _MESHES[(sp, tp)] = init_device_mesh("cpu", (sp, tp), mesh_dim_names=("sp", "tp"))
    return _MESHES[(sp, tp)]


@bench_case(TRAIN_STEP, baselines=("torch.distributed",), sizes_mib=TRAIN_STEP_SIZES_MIB)
def _train_step(ctx, nbytes):
    sp, tp = train_block.mesh_shape(ctx.world_size)
    mesh = _mesh(sp, tp)
    s, t = mesh.get_local_rank("sp"), mesh.get_local_rank("tp")
    config = train_step_config(nbytes, sp)
    params, x, target = train_block.init(config, seed=0)
    tensors = {
        name: torch.from_numpy(train_block.shard_parameter(name, value, tp, t)).float().requires_grad_()
        for name, value in params.items()
    }
    x, target = (torch.from_numpy(train_block.sequence_block(a, sp, s)).float() for a in (x, target))

    def step(loss_fn, groups) -> torch.Tensor:
        """This rank's loss and gradients, flat (what the bench compares across variants)."""
        loss = loss_fn(tensors, x, target, config, groups)
        grads = torch.autograd.grad(loss, list(tensors.values()))
        return torch.cat([loss.detach().reshape(1), *(grad.reshape(-1) for grad in grads)])

    return {
        "commlib": lambda: step(block_loss, ((mesh, "sp"), (mesh, "tp"))),
        "torch.distributed": lambda: step(block_loss_by_hand, (mesh.get_group("sp"), mesh.get_group("tp"))),
    }
