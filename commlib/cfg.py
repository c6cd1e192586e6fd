"""CFG parallelism (classifier-free guidance on two rank groups, as xDiT's): the rules both frontends'
``cfg_split`` / ``cfg_combine`` follow.

Guidance runs a diffusion model twice per step, on the unconditional and on the conditional inputs, and mixes
``uncond + guidance_scale * (cond - uncond)``. On one group the two passes are one batch (diffusers:
``torch.cat([negative, positive])``, then ``noise_pred.chunk(2)``); CFG parallelism runs them on the two halves
of a "cfg" group of size 2 (rank 0 the unconditional pass, rank 1 the conditional), each half with its own
sequence group, and all-gathers the outputs once. Both frontends write the two cases as ONE formula:

- ``cfg_split(uncond, cond, group, dim=d) = shard(concat([uncond, cond], d), d, group)``: at W = 1 the batch of
  both, at W = 2 rank 0 keeps uncond and rank 1 cond (`shard`'s backward all-gathers the cotangents: both
  ranks get the full gradient of uncond and cond, as Megatron's split);
- ``cfg_combine(out, s, group, dim=d) = guide(*chunk(all_gather(out, d, group), 2, d), s)``: at W = 1 the
  batch's halves, at W = 2 the two ranks' outputs; the result is the same on both ranks. The all_gather's
  ``convention`` is the caller's: "sum" (each rank's loss its own) or "replicated" (both ranks compute the same
  loss from the guided output, which then counts once).

So a CFG-parallel step equals the one-group step value for value (the guidance arithmetic is the same in the
same order), and gradients follow the collectives' rules.

>>> check_split("cfg_split", (2, 5, 8), (2, 5, 8), 2, 0)
0
>>> try:
...     check_split("cfg_split", (2, 5, 8), (2, 5, 8), 4, 0)
... except ValueError as error:
...     print(str(error).split(". Received")[0])
cfg_split: world_size (4) must be 1 or 2 (the unconditional and the conditional pass)
>>> guide(1.0, 3.0, 2.5)  # uncond + 2.5 * (cond - uncond)
6.0
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from commlib.errors import comm_error, kind_error

__all__ = ["SPLIT_OP", "COMBINE_OP", "check_split", "check_combine", "guide"]

SPLIT_OP = "cfg_split"
COMBINE_OP = "cfg_combine"


def _dim(op_name: str, dim: object, ndim: int, received: dict) -> int:
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise kind_error(op_name, f"dim must be an int, not {type(dim).__name__}", **received)
    value = operator.index(dim)
    if not -ndim <= value < ndim:
        raise comm_error(op_name, f"dim ({value}) must be in [{-ndim}, {ndim}) for ndim {ndim}", **received)
    return value % ndim


def _world_size(op_name: str, world_size: int, received: dict) -> None:
    if world_size not in (1, 2):
        message = f"world_size ({world_size}) must be 1 or 2 (the unconditional and the conditional pass)"
        raise comm_error(op_name, message, **received)


def check_split(
    op_name: str, uncond_shape: Sequence[int], cond_shape: Sequence[int], world_size: int, dim: object
) -> int:
    """`dim` normalised, after checking ``cfg_split``'s call: a cfg group of 1 or 2 ranks, uncond and cond of
    one shape, `dim` in range."""
    uncond, cond = tuple(int(n) for n in uncond_shape), tuple(int(n) for n in cond_shape)
    received = dict(uncond_shape=uncond, cond_shape=cond, world_size=world_size, dim=dim)
    _world_size(op_name, world_size, received)
    if uncond != cond:
        raise comm_error(op_name, f"cond shape {cond} must equal uncond shape {uncond}", **received)
    return _dim(op_name, dim, len(uncond), received)


def check_combine(
    op_name: str, shape: Sequence[int], world_size: int, dim: object, guidance_scale: object
) -> tuple[int, float]:
    """``(dim, guidance_scale)`` normalised, after checking ``cfg_combine``'s call: a cfg group of 1 or 2 ranks,
    `dim` in range, at W = 1 an even ``shape[dim]`` (the two passes' batch), a finite number as the scale."""
    dims = tuple(int(n) for n in shape)
    received = dict(shape=dims, world_size=world_size, dim=dim, guidance_scale=guidance_scale)
    _world_size(op_name, world_size, received)
    axis = _dim(op_name, dim, len(dims), received)
    if world_size == 1 and dims[axis] % 2:
        message = f"shape[dim] ({dims[axis]}) must be even at world_size 1 (the uncond and cond halves)"
        raise comm_error(op_name, message, **received)
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)):
        raise kind_error(op_name, f"guidance_scale must be a number, not {type(guidance_scale).__name__}", **received)
    if not math.isfinite(guidance_scale):
        raise comm_error(op_name, f"guidance_scale ({guidance_scale}) must be finite", **received)
    return axis, float(guidance_scale)


def guide(uncond: Any, cond: Any, guidance_scale: float) -> Any:
    """Classifier-free guidance, in diffusers' order of operations: ``uncond + guidance_scale * (cond - uncond)``
    (any array module)."""
    return uncond + guidance_scale * (cond - uncond)
