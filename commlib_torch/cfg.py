"""CFG parallelism over `torch.distributed`: `cfg_split` and `cfg_combine`, the spec's formulas
(`commlib.cfg`) on commlib's ``shard`` and ``all_gather``."""

from __future__ import annotations

import torch

from commlib import cfg as spec
from commlib.frontend_errors import wrong_type
from commlib_torch._groups import GroupArgument, resolve_group, world_size
from commlib_torch.functional import all_gather, shard

__all__ = ["cfg_split", "cfg_combine"]


def _tensors(op_name: str, **arrays: object) -> None:
    for name, value in arrays.items():
        if not isinstance(value, torch.Tensor):
            raise wrong_type(op_name, name, value, "torch.Tensor")


def cfg_split(uncond: torch.Tensor, cond: torch.Tensor, group: GroupArgument = None, *, dim: int = 0) -> torch.Tensor:
    """This rank's pass of classifier-free guidance: over a cfg `group` of 2 ranks, rank 0 gets `uncond` and
    rank 1 `cond`; over 1 rank, ``torch.cat([uncond, cond], dim)`` (diffusers' batch of both passes). One formula,
    ``shard(torch.cat([uncond, cond], dim), dim, group)``: no communication forward; gradient: the cotangents
    all-gathered (both ranks get the full gradient of `uncond` and `cond`, which are replicated over the group).

    Args:
        uncond, cond: the same shape and dtype on both ranks (e.g. the negative and the positive prompt
            embeddings, or the latents twice).
        group: the cfg group (None: WORLD), a ProcessGroup, 1-D DeviceMesh or ``(mesh, "cfg")``; 1 or 2 ranks.
        dim: the batch dim the passes are stacked along at W = 1.

    Raises:
        CommError: a group of more than 2 ranks, shapes that differ, `dim` out of range.
        TypeError: uncond or cond not tensors, dim not an int.

    Example:
        >>> cfg_split(torch.zeros(1, 3), torch.ones(1, 3))  # WORLD of 1 rank: the batch of both passes
        tensor([[0., 0., 0.],
                [1., 1., 1.]])
    """
    _tensors(spec.SPLIT_OP, uncond=uncond, cond=cond)
    resolved = resolve_group(spec.SPLIT_OP, group)
    axis = spec.check_split(spec.SPLIT_OP, uncond.shape, cond.shape, world_size(spec.SPLIT_OP, resolved), dim)
    return shard(torch.cat([uncond, cond], dim=axis), axis, resolved)


def cfg_combine(
    out: torch.Tensor,
    guidance_scale: float,
    group: GroupArgument = None,
    *,
    dim: int = 0,
    convention: str = "sum",
) -> torch.Tensor:
    """The guided result ``uncond + guidance_scale * (cond - uncond)`` of this rank's pass `out` (what the model
    returned on `cfg_split`'s input): over 2 ranks the two ranks' outputs, all-gathered once along `dim`
    (``shape[dim]`` as `out`'s, the same value on both ranks); over 1 rank the two halves of `out` along `dim`
    (``shape[dim] / 2``). Equal, value for value, to the one-group step.

    Args:
        out: ``[..., n, ...]`` this rank's output (both passes' batch at W = 1), any floating dtype.
        guidance_scale: the guidance weight (a finite number; 1 gives cond, 0 uncond).
        group: the cfg group, as `cfg_split`'s (1 or 2 ranks).
        dim: the dim `cfg_split` stacked the passes along.
        convention: the all_gather's gradient convention: "sum" (each rank's loss is its own: the cotangents of
            both ranks are summed into each pass) or "replicated" (both ranks compute the same loss from the
            guided output: this rank's slice of the cotangent, so the loss counts once).

    Raises:
        CommError: a group of more than 2 ranks, `dim` out of range, an odd ``shape[dim]`` at W = 1, a scale
            that is not finite, an unknown convention.
        TypeError: out not a tensor, guidance_scale not a number.

    Example:
        >>> out = torch.tensor([[1.0, 2.0], [3.0, 5.0]])  # W = 1: row 0 the uncond pass, row 1 the cond pass
        >>> cfg_combine(out, 2.0)  # 1 + 2 * (3 - 1), 2 + 2 * (5 - 2)
        tensor([[5., 8.]])
    """
    _tensors(spec.COMBINE_OP, out=out)
    resolved = resolve_group(spec.COMBINE_OP, group)
    size = world_size(spec.COMBINE_OP, resolved)
    axis, scale = spec.check_combine(spec.COMBINE_OP, out.shape, size, dim, guidance_scale)
    both = all_gather(out, axis, resolved, convention=convention)  # W = 1: `out` itself, no communication
    uncond, cond = both.chunk(2, dim=axis)
    return spec.guide(uncond, cond, scale)
