"""Train the transformer block of commlib.tools.train_block with JAX over an SP x TP mesh, and check every step against
the same model trained unsharded in this process (float64). Exit status 1 if any step's loss or any parameter
differs by more than 1e-10 relative.

    python examples/train_jax.py                      # 4 CPU devices, SP 2 x TP 2
    python examples/train_jax.py --sp 1 --tp 4

    # two processes with 2 CPU devices each (jax.distributed; here both on this machine):
    python examples/train_jax.py --num-processes 2 --process-id 0 --coordinator 127.0.0.1:29600
    python examples/train_jax.py --num-processes 2 --process-id 1 --coordinator 127.0.0.1:29600

    # GPUs (not run by CI; a CUDA jaxlib, pip install "jax[cuda13]"): every GPU of this machine, XLA's NCCL
    python examples/train_jax.py --device cuda
    # several nodes: one process per node, each with its node's GPUs
    python examples/train_jax.py --device cuda --num-processes 2 --process-id 0 --coordinator node0:29600

Every process prints its verdict line (PASS/FAIL); process 0 also prints the steps. The gloo lines JAX's CPU
collectives print as processes connect ("[Gloo] Rank 0 is connected to 1 peer ranks...") are start-up noise.
The block (commlib_jax/tools/train_block.py) is the torch one line for line: f = sum_grad, g =
all_reduce(convention="replicated"), Ulysses attention. The step is torch's too: each rank's gradient, summed
over SP. commlib_jax.training.value_and_grad takes it that way under shard_map (check_vma on or off) and pmap;
jax.grad of the same loss would count the TP copies of the replicated parameters (docs/training.md).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import numpy as np

TOLERANCE = 1e-10


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, help="sequence-parallel size (default: devices / tp)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: 2 if the device count is even, else 1)")
    parser.add_argument("--num-processes", type=int, default=1, help="processes of jax.distributed")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default="127.0.0.1:29600", help="host:port of process 0")
    parser.add_argument("--local-devices", type=int, help="CPU devices per process (default: 4 / processes)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: simulated CPU devices (gloo between processes); cuda: the GPUs (NCCL)",
    )
    return parser


def start(args: argparse.Namespace) -> None:
    """The platform (CPU devices, or the GPUs) and float64 before JAX starts; jax.distributed when there are
    several processes."""
    if args.device == "cuda":
        jax.config.update("jax_platforms", "cuda")
    else:
        jax.config.update("jax_num_cpu_devices", args.local_devices or max(1, 4 // args.num_processes))
    jax.config.update("jax_enable_x64", True)
    if args.num_processes > 1:
        if args.device == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    if args.device == "cuda":
        try:
            jax.devices()
        except Exception as error:  # jax raises RuntimeError or AssertionError when no backend starts
            raise SystemExit(
                f"--device cuda needs a CUDA jaxlib (pip install 'jax[cuda13]') and a GPU; JAX found "
                f"none ({type(error).__name__}: {error})"
            ) from None


def relative(array, want: np.ndarray) -> float:
    """max |array - want| / max |want| over the blocks of `array` this process holds (no communication)."""
    error = max(float(np.max(np.abs(np.asarray(shard.data) - want[shard.index]))) for shard in array.addressable_shards)
    return error / float(np.max(np.abs(want)))


def main() -> int:
    arguments = parser()
    args = arguments.parse_args()
    start(args)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from commlib import CommError
    from commlib.tools import train_block
    from commlib_jax.tools.train_block import block_loss, parameter_specs
    from commlib_jax.training import value_and_grad

    world_size = jax.device_count()
    try:
        sp, tp = train_block.mesh_shape(world_size, args.sp, args.tp)
    except CommError as error:
        arguments.error(str(error))
    mesh = Mesh(np.array(jax.devices()).reshape(sp, tp), ("sp", "tp"))
    config = train_block.BlockConfig.for_world_size(world_size)
    specs, sequence = parameter_specs("tp"), P(None, "sp")

    # The torch step: each rank's loss on its tokens, its own gradient, summed over "sp"; then SGD.
    grad_step = value_and_grad(functools.partial(block_loss, config=config, axes=("sp", "tp")), "sp")

    def rank_step(params, x, target):
        loss, grads = grad_step(params, x, target)
        return loss, jax.tree.map(lambda p, g: p - config.lr * g, params, grads)

    sharded_step = jax.jit(
        jax.shard_map(rank_step, mesh=mesh, in_specs=(specs, sequence, sequence), out_specs=(P(), specs))
    )

    @jax.jit
    def unsharded_step(params, x, target):  # the same model, unsharded, on this process's first device
        loss, grads = jax.value_and_grad(functools.partial(block_loss, config=config))(params, x, target)
        return loss, jax.tree.map(lambda p, g: p - config.lr * g, params, grads)

    params, x, target = train_block.init(config, seed=0)  # numpy, the same on every process
    place = lambda value, spec: jax.make_array_from_callback(  # noqa: E731
        value.shape, NamedSharding(mesh, spec), lambda index: value[index]
    )
    sharded = {name: place(value, specs[name]) for name, value in params.items()}
    x_sharded, target_sharded = place(x, sequence), place(target, sequence)
    unsharded = params

    worst, first = 0.0, jax.process_index() == 0
    for step in range(1, config.steps + 1):
        loss, sharded = sharded_step(sharded, x_sharded, target_sharded)
        expected, unsharded = unsharded_step(unsharded, x, target)
        loss, expected = float(loss.addressable_data(0)), float(expected)
        loss_error = abs(loss - expected) / abs(expected)
        param_error = max(relative(sharded[name], np.asarray(value)) for name, value in unsharded.items())
        worst = max(worst, loss_error, param_error)
        if first:
            print(
                f"step {step:2d}  loss {loss:.12f}  unsharded {expected:.12f}  "
                f"relative difference: loss {loss_error:.1e}, parameters {param_error:.1e}",
                flush=True,
            )

    passed = worst <= TOLERANCE
    print(
        f"{'PASS' if passed else 'FAIL'}: process {jax.process_index()} of {jax.process_count()}, sp={sp} tp={tp}, "
        f"{config.steps} steps, largest relative difference {worst:.1e} (limit {TOLERANCE:.0e}) over "
        f"{world_size} devices",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
