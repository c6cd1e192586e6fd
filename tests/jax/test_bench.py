"""The JAX train-step bench: commlib's block with `value_and_grad` and the same block on bare jax.lax compute
the unsharded loss and gradients (the numpy float64 reference), so their times compare the same work."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from commlib import training
from commlib.tools.bench import train_step_config
from commlib_jax.tools import bench_train


def test_train_step_variants_compute_the_unsharded_step():
    config = train_step_config(4096, 2)  # [1, 4, 256] activations per rank
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("sp", "tp"))
    params, x, target = training.init(config, seed=0)
    want_loss, want_grads = training.loss_and_grads(config, params, x, target)
    args = ({name: jnp.asarray(value, jnp.float32) for name, value in params.items()},
            jnp.asarray(x, jnp.float32), jnp.asarray(target, jnp.float32))
    for name, step in bench_train.steps(config, mesh).items():
        loss, grads = step(*args)
        assert abs(float(loss) - want_loss) <= 1e-5 * abs(want_loss), name
        for key, want in want_grads.items():
            np.testing.assert_allclose(np.asarray(grads[key]), want, rtol=1e-3, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{name} {key}")
