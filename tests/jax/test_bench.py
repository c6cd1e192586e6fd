"""The JAX train-step bench: commlib's block with `value_and_grad` and the same block on bare jax.lax compute
the unsharded loss and gradients (the numpy float64 reference), so their times compare the same work."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from commlib.tools import train_block
from commlib.tools.bench import train_step_config
from commlib_jax.tools import bench_train


def test_train_step_variants_compute_the_unsharded_step():
    config = train_step_config(4096, 2)  # [1, 4, 256] activations per rank
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("sp", "tp"))
    params, x, target = train_block.init(config, seed=0)
    want_loss, want_grads = train_block.loss_and_grads(config, params, x, target)
    args = (
        {name: jnp.asarray(value, jnp.float32) for name, value in params.items()},
        jnp.asarray(x, jnp.float32),
        jnp.asarray(target, jnp.float32),
    )
    for name, step in bench_train.steps(config, mesh).items():
        loss, grads = step(*args)
        assert abs(float(loss) - want_loss) <= 1e-5 * abs(want_loss), name
        for key, want in want_grads.items():
            np.testing.assert_allclose(
                np.asarray(grads[key]), want, rtol=1e-3, atol=1e-5 * np.abs(want).max(), err_msg=f"{name} {key}"
            )


def test_context_bench_variants_compute_the_reference():
    """The ring case and its all-gather-KV baseline (`commlib_jax.tools.bench_context`) both compute causal GQA
    attention on the whole zigzag sequence and its gradients (the float64 reference), so their times compare the
    same work; the wire bytes are the spec's counts."""
    from commlib import shard_positions
    from commlib.reference.ring import reference
    from commlib.tools.bench import context_rows, context_wire
    from commlib_jax.tools import bench_context

    W, rows = 4, 4
    inputs = bench_context._inputs(W, rows)
    expected = reference(*[list(np.asarray(x, np.float64)) for x in inputs], W, causal=True, layout="zigzag")
    baseline = bench_context._all_gather_kv(shard_positions(rows * W, W, "zigzag"))
    for name, attend in (("ring", bench_context._attend("ring")), ("all-gather KV", baseline)):
        got = bench_context._step(attend, W, usp=False)(*inputs)
        for mine, theirs in zip(got, expected, strict=True):
            np.testing.assert_allclose(np.asarray(mine), np.stack(theirs), rtol=1e-4, atol=1e-5, err_msg=name)
    assert context_rows(2**20) == 512
    kv_bytes = 512 * 2 * 64 * 2 * 4  # 1 MiB of q per rank: 512 rows; k and v [1, 512, 2, 64] float32
    assert context_wire("ring", W, 2**20) == {
        "commlib ring": W * (3 * W - 2) * kv_bytes,
        "all-gather KV": W * 2 * (W - 1) * kv_bytes,
    }
