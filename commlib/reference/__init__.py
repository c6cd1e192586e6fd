"""The float64 references: what every frontend is compared against, in one package, one module per family.

- `commlib.reference.collectives` (re-exported here, so `commlib.reference.all_reduce(xs, op)` is the op):
  every public collective on W simulated numpy ranks, forward and VJP, walking the plan the frontends walk;
- `commlib.reference.attention`: unsharded float64 GQA attention with masks over global positions and segment
  ids, forward and VJP (`attention`, `attention_vjp`, `causal_mask`; `commlib.attention` re-exports them);
- `commlib.reference.ring`: ring attention and USP, unsharded (`reference`) and the spec's ring walk on W
  simulated ranks (`simulate_ring`, `SimulatedRanks`);
- `commlib.reference.ulysses`: the spec's Ulysses walk on W simulated ranks (`simulate_ulysses`);
- `commlib.reference.cross_attention`: cross-attention of q to the full k, v, forward and VJP (`reference`);
- `commlib.reference.sequence`: the whole-model sequence helpers on W simulated ranks (tokens, the take and
  gather of a sequence, the loss over every rank's tokens);
- `commlib.reference.joint`: joint attention (MMDiT), the full sequence and the joint tokens concatenated
  (`reference`, `concatenated`);
- `commlib.reference.video`: video DiTs' latent helpers on W simulated ranks, forward and VJP
  (`shard_latents_reference`, `gather_latents_reference`; `to_tokens`, `to_latents` between latents and tokens);
- `commlib.reference.moe`: the spec's MoE walk on W simulated ranks, both layouts (`simulate_moe`).

A reference imports the spec's rules (plans, schedules, walks, index tables) and never a frontend; the spec's
modules do not import the references, except `commlib.attention`, which re-exports the attention reference at
its documented path (`commlib.reference.attention` imports no layer module, so there is no cycle).
"""

from commlib.reference import collectives
from commlib.reference.collectives import *  # noqa: F403 -- the ops, at `commlib.reference.<op>`

__all__ = list(collectives.__all__)  # one list of the re-exported names: collectives' own
