"""commlib: the framework-free spec of differentiable collectives (numpy + stdlib only).

- `commlib.plans`: one plan builder per public op (validation, shapes, the layout plan) -- what both
  frontends call first;
- `commlib.layout`: `Plan` (composed of a step, a layout, its arithmetic and uneven sizes), `Rearrange`, the
  `Convention` enum, and the pack/unpack plans;
- `commlib.steps`: the step kinds of a plan (`Step`): the collectives and the local steps;
- `commlib.uneven`: uneven sizes (`split_sizes`, the exact and padded layouts);
- `commlib.attention`: the attention layers' head and position bookkeeping (`ulysses_plan`);
- `commlib.masks`: segment masks (`segment_ids`, their validation and the mask of two id arrays);
- `commlib.sequence`: the sequence layouts (`SequenceLayout` for any length; the even `shard_positions`,
  `shard_sequence`, `unshard_sequence`);
- `commlib.sequence_helpers`: the whole model's sequence helpers (tokens, positions, global labels, the take and
  gather of a sequence, the loss over every rank's tokens): validation, index tables;
- `commlib.ring`: the ring's schedule (`ring_plan`) and its one walk, forward and backward, over a backend
  that torch, JAX and the reference implement; `commlib.blockwise`: the online-softmax step rules;
  `commlib.reference.ring`: the float64 references (unsharded, and the ring on simulated numpy ranks);
- `commlib.moe`: expert parallelism's routing walk, both layouts and the VJP rules over a backend, with their
  validation; `commlib.reference.moe`: `simulate_moe`, the float64 walk on simulated numpy ranks;
- `commlib.gradients`: every gradient rule (the VJP plan of each plan, and the max/min/product rules);
- `commlib.reference`: the float64 references, one module per family (every op on W simulated numpy ranks,
  outputs and VJPs: `commlib.reference.collectives`, re-exported by the package; attention, ring, Ulysses,
  cross-attention, the sequence helpers, MoE);
- `commlib.check` (checked mode's fingerprints), `commlib.failures` (backend errors -> CommTimeout /
  CommFailure), `commlib.errors` (every exception and the message format);
- `commlib.tools`: the parity table and the `commlib` command (tooling, not the library).

Frontends: `commlib_torch`, `commlib_jax`. Importing this package never imports torch or jax.
"""

from commlib.errors import CommError, CommFailure, CommTimeout
from commlib.layout import Convention, Plan, Rearrange
from commlib.masks import segment_ids
from commlib.plans import CONVENTIONS, OP_NAMES
from commlib.reduce_op import ReduceOp
from commlib.sequence import SequenceLayout, shard_positions, shard_sequence, unshard_sequence
from commlib.steps import Step
from commlib.uneven import split_sizes

__all__ = [
    "CommError",
    "CommFailure",
    "CommTimeout",
    "ReduceOp",
    "Step",
    "Convention",
    "Plan",
    "Rearrange",
    "CONVENTIONS",
    "OP_NAMES",
    "split_sizes",
    "SequenceLayout",
    "segment_ids",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
]
__version__ = "0.1.0"
