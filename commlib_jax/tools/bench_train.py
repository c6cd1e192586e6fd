"""The ``train-step`` case of `commlib bench` (JAX): the training block of `commlib_jax.tools.train_block`,
forward and backward, inside ``jax.shard_map`` (check_vma=True) over an ("sp", "tp") mesh of W CPU devices,
jitted: commlib's block with `commlib_jax.training.value_and_grad` against the same block on bare `jax.lax`
(``lax.all_to_all`` for Ulysses, ``lax.psum`` over "tp" for g; f is the varying cast JAX inserts where the
replicated activations meet the TP-sharded weight, its transpose the psum) with ``jax.value_and_grad`` and
the loss psummed over "sp". Both return the unsharded loss and every parameter's gradient; they must agree.
Sizes: `commlib.tools.bench.train_step_config`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from commlib.tools import train_block
from commlib.tools.bench import TRAIN_STEP, train_step_config

__all__ = ["bare_block_loss", "records", "steps"]


def bare_block_loss(params: dict, x, target, config: train_block.BlockConfig):
    """`commlib_jax.tools.train_block.block_loss` on the ("sp", "tp") axes, written on bare `jax.lax`."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from commlib_jax.attention import attention
    from commlib_jax.tools.train_block import rms_norm

    p, (B, S_local, _) = params, x.shape
    h = rms_norm(x, p["norm1"], config.eps)
    q, k, v = ((h @ p[name]).reshape(B, S_local, config.heads, config.head_dim) for name in ("wq", "wk", "wv"))
    full = [lax.all_to_all(t, "sp", 2, 1, tiled=True) for t in (q, k, v)]
    attended = lax.all_to_all(attention(*full, causal=config.causal), "sp", 1, 2, tiled=True)
    y = x + attended.reshape(B, S_local, -1) @ p["wo"]
    u = rms_norm(y, p["norm2"], config.eps)
    m = lax.psum(jax.nn.silu(u @ p["w_in"]) @ p["w_out"], "tp")
    return 0.5 * jnp.sum((y + m - target) ** 2) / config.tokens


def steps(config: train_block.BlockConfig, mesh) -> dict[str, Callable]:
    """{variant: jitted (params, x, target) -> (unsharded loss, gradients)} over `mesh`."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from commlib_jax.tools.train_block import block_loss, parameter_specs
    from commlib_jax.training import value_and_grad

    def commlib(params, x, target):
        return value_and_grad(lambda p, a, b: block_loss(p, a, b, config, ("sp", "tp")), "sp")(params, x, target)

    def bare(params, x, target):
        loss, grads = jax.value_and_grad(bare_block_loss)(params, x, target, config)
        return lax.psum(loss, "sp"), grads

    specs, rows = parameter_specs("tp"), P(None, "sp", None)
    return {
        name: jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, rows, rows), out_specs=(P(), specs)))
        for name, step in (("commlib", commlib), ("jax.lax", bare))
    }


def _flat(result) -> np.ndarray:
    loss, grads = result
    return np.concatenate([np.asarray(loss).reshape(1), *(np.asarray(grads[name]).reshape(-1) for name in grads)])


def _time(world_size: int, nbytes: int, repeats: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Wall-clock and CPU seconds per call of each variant, in rotating order, after checking they agree."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    sp, tp = train_block.mesh_shape(world_size)
    config = train_step_config(nbytes, sp)
    mesh = Mesh(np.array(jax.devices()[:world_size]).reshape(sp, tp), ("sp", "tp"))
    params, x, target = train_block.init(config, seed=0)
    args = (
        {name: jnp.asarray(value, jnp.float32) for name, value in params.items()},
        jnp.asarray(x, jnp.float32),
        jnp.asarray(target, jnp.float32),
    )
    compiled = steps(config, mesh)
    results = {name: _flat(step(*args)) for name, step in compiled.items()}
    if not np.allclose(results["commlib"], results["jax.lax"], rtol=1e-4, atol=1e-6):
        raise AssertionError(f"train-step: commlib and jax.lax disagree at world size {world_size}, {config}")
    names = list(compiled)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(compiled[name](*args))
            if index >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return {"wall": wall, "cpu": cpu}


def records(world_size: int, sizes_mib, repeats: int, warmup: int) -> list[dict]:
    """The train-step records of one world size, at each of `sizes_mib`, for the driver."""
    result = []
    for size in sizes_mib:
        seconds = _time(world_size, int(size * 2**20), repeats, warmup)
        result.append(
            {
                "framework": "jax",
                "case": TRAIN_STEP,
                "world_size": world_size,
                "size_mib": size,
                "subject": "commlib",
                "baselines": ["jax.lax"],
                "seconds": seconds["wall"],
                "cpu_seconds": seconds["cpu"],
            }
        )
    return result
