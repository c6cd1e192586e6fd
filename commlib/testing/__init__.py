"""Parity tests for your own models (numpy + stdlib only; the frontends' halves are `commlib_torch.testing` and
`commlib_jax.testing`): compare every rank's outputs and gradients of a port with `assert_parity`, map parameters
between a torch module and a JAX pytree with `ParameterMap`. See docs/testing.md, "Testing a port".

- `commlib.testing.parity`: `assert_parity`, the per-dtype `TOLERANCES` of `commlib parity`;
- `commlib.testing.parameters`: `ParameterMap`, `Rule`, `LINEAR`, `ParameterMapError`;
- `commlib.testing.runs`: what both frontends' ``run`` share: seeded inputs and cotangents, `RunResult`,
  `RankError`;
- `commlib.testing.trees`: pytree paths (`flatten`, `unflatten`);
- `commlib.testing.trace`: traces of commlib calls (`Trace`, `Call`), what the frontends' ``record()`` collects;
- `commlib.testing.divergence`: `first_divergence` of two traces (`Divergence`). See docs/testing.md, "Finding
  the first divergence".
"""

from commlib.testing.divergence import Divergence, first_divergence
from commlib.testing.parameters import LINEAR, ParameterMap, ParameterMapError, Rule
from commlib.testing.parity import TOLERANCES, assert_parity, tolerance
from commlib.testing.runs import RankError, RunResult, cotangents, seeded_inputs
from commlib.testing.trace import Call, Trace
from commlib.testing.trees import flatten, unflatten

__all__ = [
    "assert_parity",
    "tolerance",
    "TOLERANCES",
    "ParameterMap",
    "ParameterMapError",
    "Rule",
    "LINEAR",
    "RunResult",
    "RankError",
    "seeded_inputs",
    "cotangents",
    "flatten",
    "unflatten",
    "Trace",
    "Call",
    "first_divergence",
    "Divergence",
]
