"""The torch train-step bench: commlib's block and the same block on raw torch.distributed (DeepSpeed-style
Ulysses, Megatron's f and g as autograd Functions) compute the same loss and gradients on every rank -- the
unsharded step's, against the numpy float64 reference -- so their times compare the same work."""

import numpy as np

from commlib.tools import train_block
from commlib.tools.bench import train_step_config
from tests.torch import bench_jobs


def test_train_step_variants_compute_the_unsharded_step(pool):
    nbytes = 4096  # [1, 4, 256] activations per rank
    config = train_step_config(nbytes, 2)
    params, x, target = train_block.init(config, seed=0)
    want_loss, want_grads = train_block.loss_and_grads(config, params, x, target)
    per_rank = pool(4).run(bench_jobs.train_step_variants, nbytes)
    for rank, (difference, loss, grads) in enumerate(per_rank):
        assert difference <= 1e-5, (rank, difference)
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), rank
        tp_rank = rank % 2  # init_device_mesh("cpu", (2, 2)): global rank 2 * s + t
        for name, got in grads.items():
            want = train_block.shard_parameter(name, want_grads[name], 2, tp_rank)
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * np.abs(want).max(), err_msg=f"{rank} {name}")
