"""One process of a two-process JAX program (``jax.distributed`` on CPU, gloo collectives, 2 devices each: a
4-device mesh "x") for tests/jax/test_checked_processes.py:

    python -m tests.jax.checked_processes PROCESS PORT LAYER OPTIONS_JSON

runs ``LAYER(q, k, v, "x", **options[PROCESS])`` under jit(shard_map) on q, k, v ``[1, 8, 4, 8]`` (the same
seeded arrays in both processes, rows sharded over "x") with ``COMMLIB_CHECK=1``, and prints one JSON line:
``{"error": message}`` for a CommError, else ``{"error": null, "max_error": ...}`` (this process's output rows
against `commlib_jax.attention.attention` on the whole sequence).
"""

from __future__ import annotations

import json
import os
import sys


def main(process: int, port: int, layer: str, options: list[dict]) -> dict:
    os.environ.update(JAX_PLATFORMS="cpu", COMMLIB_CHECK="1")
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process, initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import commlib_jax.attention
    from commlib import CommError

    mesh = Mesh(np.array(jax.devices()), ("x",))
    whole = [np.random.default_rng(seed).standard_normal((1, 8, 4, 8)).astype(np.float32) for seed in range(3)]
    sharding = NamedSharding(mesh, P(None, "x"))
    q, k, v = (jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index]) for x in whole)
    call = getattr(commlib_jax.attention, layer)
    step = jax.jit(
        jax.shard_map(
            lambda q, k, v: call(q, k, v, "x", **options[process]),
            mesh=mesh,
            in_specs=P(None, "x"),
            out_specs=P(None, "x"),
        )
    )
    try:
        out = step(q, k, v)
    except CommError as error:
        return {"error": str(error)}
    want = np.asarray(commlib_jax.attention.attention(*map(jnp.asarray, whole), **options[process]))
    errors = [float(np.abs(np.asarray(shard.data) - want[shard.index]).max()) for shard in out.addressable_shards]
    return {"error": None, "max_error": max(errors)}


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
    print(json.dumps(result), flush=True)
    import jax

    jax.distributed.shutdown()  # (a barrier: the process hosting the coordinator leaves last)
