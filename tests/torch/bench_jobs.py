"""Pool jobs for test_bench.py: the train-step bench case's two variants on a 2 x 2 mesh of 4 gloo ranks."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from commlib.tools import train_block
from commlib.tools.bench import TRAIN_STEP, train_step_config
from commlib_torch.tools import bench_train
from commlib_torch.tools.bench_cases import CASES


def train_step_variants(ctx, nbytes: int):
    """Both variants of the train-step case once: (max |commlib - raw| over this rank's loss and gradients, the
    loss summed over SP, {parameter: this rank's gradient summed over SP}) -- the unsharded step's loss and
    this TP rank's block of each gradient."""
    variants = CASES[TRAIN_STEP].build(ctx, nbytes)
    flat = {name: call() for name, call in variants.items()}
    difference = float((flat["commlib"] - flat["torch.distributed"]).abs().max())
    sp, tp = train_block.mesh_shape(ctx.world_size)
    sp_group = bench_train._mesh(sp, tp).get_group("sp")
    summed = flat["commlib"].clone()
    dist.all_reduce(summed, group=sp_group)
    config = train_step_config(nbytes, sp)
    grads, offset = {}, 1
    for name, shape in config.shapes().items():  # the order of the case's parameters
        local = train_block.shard_parameter(name, np.zeros(shape), tp, 0).shape
        grads[name] = summed[offset : offset + int(np.prod(local))].reshape(local).double().numpy()
        offset += int(np.prod(local))
    return difference, float(summed[0]), grads
