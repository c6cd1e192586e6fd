"""The torch train-step bench: commlib's block and the same block on raw torch.distributed (DeepSpeed-style
Ulysses, Megatron's f and g as autograd Functions) compute the same loss and gradients on every rank -- the
unsharded step's, against the numpy float64 reference -- so their times compare the same work."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from commlib.tools import train_block
from commlib.tools.bench import TRAIN_STEP, train_step_config
from commlib_torch.tools import bench_train
from commlib_torch.tools.bench_cases import CASES

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# The train-step bench case's two variants on a 2 x 2 mesh of 4 gloo ranks.


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


# --- the tests ----------------------------------------------------------------------------------------------


def test_train_step_variants_compute_the_unsharded_step(pool):
    nbytes = 4096  # [1, 4, 256] activations per rank
    config = train_step_config(nbytes, 2)
    params, x, target = train_block.init(config, seed=0)
    want_loss, want_grads = train_block.loss_and_grads(config, params, x, target)
    per_rank = pool(4).run(train_step_variants, nbytes)
    for rank, (difference, loss, grads) in enumerate(per_rank):
        assert difference <= 1e-5, (rank, difference)
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), rank
        tp_rank = rank % 2  # init_device_mesh("cpu", (2, 2)): global rank 2 * s + t
        for name, got in grads.items():
            want = train_block.shard_parameter(name, want_grads[name], 2, tp_rank)
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * np.abs(want).max(), err_msg=f"{rank} {name}")
