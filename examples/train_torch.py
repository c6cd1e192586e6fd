"""Train the transformer block of commlib.tools.train_block with torchrun over an SP x TP mesh, and check every step
against the same model trained unsharded in this process (float64). Exit status 1 if any step's loss or any
parameter differs by more than 1e-10 relative.

    torchrun --standalone --nproc-per-node 4 examples/train_torch.py                 # SP 2 x TP 2
    torchrun --standalone --nproc-per-node 4 examples/train_torch.py --sp 4 --tp 1

    # two nodes (here both on this machine), one command per node:
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        examples/train_torch.py
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        examples/train_torch.py

    # GPUs (not run by CI): one process per GPU, NCCL, each process on GPU LOCAL_RANK
    torchrun --standalone --nproc-per-node 4 examples/train_torch.py --device cuda

Rank 0 prints the steps and the verdict (on two nodes: node 0's log); every rank's exit status is the verdict.
The block (commlib_torch/tools/train_block.py): RMSNorm, Ulysses attention over the SP group, a Megatron MLP
over the TP group (f = sum_grad before the column-parallel matmul, g = all_reduce(convention="replicated")
after the row-parallel one), residuals. The recipe is the step below: each rank's backward, then every
gradient all_reduced over the SP group (every parameter is replicated over SP).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commlib import CommError
from commlib.tools import train_block
from commlib_torch.tools.train_block import block_loss

TOLERANCE = 1e-10


def sgd(params: dict[str, torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        for p in params.values():
            p -= lr * p.grad
            p.grad = None


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def my_block(name: str, value: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's block of an unsharded parameter (w_in: columns, w_out: rows; the rest whole)."""
    return torch.from_numpy(train_block.shard_parameter(name, value.cpu().numpy(), tp, tp_rank)).to(value.device)


def start(device_type: str) -> torch.device:
    """This process's device: the CPU (gloo), or GPU LOCAL_RANK (NCCL; torchrun sets LOCAL_RANK), made current
    before any process group is made so NCCL binds each rank to its own GPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA build of torch and a GPU per process; this machine has none")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    return device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, help="sequence-parallel size (default: world size / tp)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: 2 if the world size is even, else 1)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo process groups; cuda: NCCL, one GPU per process (default: cpu)",
    )
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        sp, tp = train_block.mesh_shape(world_size, args.sp, args.tp)
    except CommError as error:
        parser.error(str(error))
    torch.set_default_dtype(torch.float64)
    device = start(args.device)

    mesh = init_device_mesh(args.device, (sp, tp), mesh_dim_names=("sp", "tp"))  # cpu: gloo, cuda: NCCL
    groups = ((mesh, "sp"), (mesh, "tp"))  # commlib's group=: a mesh dim (a ProcessGroup works too)
    sp_group = mesh.get_group("sp")  # torch.distributed's own calls take the process group
    s, t = mesh.get_local_rank("sp"), mesh.get_local_rank("tp")

    config = train_block.BlockConfig.for_world_size(world_size)
    params, x, target = train_block.init(config, seed=0)  # numpy, the same on every rank
    mine = {
        name: torch.tensor(train_block.shard_parameter(name, value, tp, t), device=device, requires_grad=True)
        for name, value in params.items()
    }
    x_mine, target_mine = (torch.tensor(train_block.sequence_block(a, sp, s), device=device) for a in (x, target))
    unsharded = {name: torch.tensor(value, device=device, requires_grad=True) for name, value in params.items()}
    x, target = torch.tensor(x, device=device), torch.tensor(target, device=device)

    worst = 0.0
    for step in range(1, config.steps + 1):
        loss = block_loss(mine, x_mine, target_mine, config, groups)  # this rank's tokens
        loss.backward()
        for p in mine.values():
            dist.all_reduce(p.grad, group=sp_group)  # each rank's gradient, summed over SP
        total = loss.detach()
        dist.all_reduce(total, group=sp_group)  # the unsharded loss: the sum over SP
        sgd(mine, config.lr)

        expected = block_loss(unsharded, x, target, config)  # the same model, unsharded, in this process
        expected.backward()
        sgd(unsharded, config.lr)
        expected = expected.detach()

        loss_error = abs(float(total) - float(expected)) / abs(float(expected))
        param_error = max(
            relative(mine[name].detach(), my_block(name, unsharded[name].detach(), tp, t)) for name in mine
        )
        worst = max(worst, loss_error, param_error)
        if dist.get_rank() == 0:
            print(
                f"step {step:2d}  loss {float(total):.12f}  unsharded {float(expected):.12f}  "
                f"relative difference: loss {loss_error:.1e}, parameters {param_error:.1e}",
                flush=True,
            )

    everyone = torch.tensor(worst, device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MAX)  # the worst over every rank
    passed = float(everyone) <= TOLERANCE
    if dist.get_rank() == 0:
        verdict = "PASS" if passed else "FAIL"
        print(
            f"{verdict}: sp={sp} tp={tp}, {config.steps} steps, largest relative difference {float(everyone):.1e} "
            f"(limit {TOLERANCE:.0e}) over {world_size} ranks",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
