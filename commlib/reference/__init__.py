"""The float64 references: what every frontend is compared against, in one package, one module per family.

- `commlib.reference.collectives` (re-exported here, so `commlib.reference.all_reduce(xs, op)` is the op):
  every public collective on W simulated numpy ranks, forward and VJP, walking the plan the frontends walk;
- `commlib.reference.ring`: ring attention and USP, unsharded (`reference`) and the spec's ring walk on W
  simulated ranks (`simulate_ring`, `SimulatedRanks`);
- `commlib.reference.ulysses`: the spec's Ulysses walk on W simulated ranks (`simulate_ulysses`);
- `commlib.reference.moe`: the spec's MoE walk on W simulated ranks, both layouts (`simulate_moe`).

A reference module imports the spec's rules (plans, schedules, walks) and never the reverse: no library
module imports this package, so a rule cannot be "tested" against itself by accident.
"""

from commlib.reference.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_4d,
    broadcast,
    forward,
    gather,
    permute,
    reduce,
    reduce_scatter,
    run,
    scatter,
    shard,
    sum_grad,
    vjp,
)

__all__ = [
    "forward",
    "run",
    "vjp",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_4d",
    "broadcast",
    "gather",
    "scatter",
    "permute",
    "sum_grad",
    "shard",
    "reduce",
]
