"""Torch side of `commlib parity`: ``python -m commlib_torch.tools.parity_runner IN_DIR OUT_DIR --world-size N``.

Runs every case of the table on N gloo worker processes (mode "gloo"), and the attention cases also
unsharded on one process (mode "unsharded"); writes every rank's output and input gradients. With
``--workload train``: the training block on every SP x TP mesh instead (`commlib_torch.tools.train_parity`);
``--workload sequence``: the sequence helpers and the transformers example (`commlib_torch.tools.sequence_parity`);
``--workload masks``: the attention layers with segment ids (`commlib_torch.tools.mask_parity`); ``--workload moe``:
expert parallelism's route, dispatch and combine in both layouts (`commlib_torch.tools.moe_parity`); ``--workload
fuzz``: the seeded fuzzer of the attention layers (`commlib_torch.tools.fuzz_parity`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from commlib.tools import cases
from commlib.tools.fuzz_parity import FuzzResults
from commlib.tools.mask_parity import MaskResults
from commlib.tools.moe_parity import MoeResults
from commlib.tools.parity import Results
from commlib.tools.sequence_parity import SequenceResults
from commlib.tools.train_parity import TrainResults
from commlib_torch.tools import fuzz_parity, mask_parity, moe_parity, sequence_parity, train_parity
from commlib_torch.tools.parity_jobs import run_table
from commlib_torch.tools.pool import WorkerPool

__all__ = ["WORKLOADS", "main"]

#: workload -> (its results class, the function that records it on a `WorkerPool`).
WORKLOADS: dict[str, tuple[Any, Callable[..., None]]] = {
    "train": (TrainResults, train_parity.record),
    "sequence": (SequenceResults, sequence_parity.record),
    "masks": (MaskResults, mask_parity.record),
    "moe": (MoeResults, moe_parity.record),
    "fuzz": (FuzzResults, fuzz_parity.record),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib_torch.tools.parity_runner")
    parser.add_argument("in_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--workload", choices=("ops", *WORKLOADS), default="ops")
    args = parser.parse_args(argv)
    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if args.workload in WORKLOADS:
        kind, record = WORKLOADS[args.workload]
        found = kind("torch")
        with WorkerPool(args.world_size) as pool:
            record(pool, args.in_dir, found)
        found.save(args.out_dir, versions)
        return 0
    results = Results("torch")
    with WorkerPool(args.world_size) as pool:
        run_table(pool, cases.read(args.in_dir), results)
    results.save(args.out_dir, versions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
