"""Video DiTs' token grid over `torch.distributed`: this rank's ``(f, h, w)`` token coordinates
(`grid_position_ids`, for 3-D RoPE), its tokens of the replicated latents ``[B, C, F, H, W]`` (`shard_latents`)
and every rank's tokens gathered back into the latents before unpatchify (`gather_latents`).

Each takes a ``commlib.SequenceLayout(F * H * W, ..., grid=(F, H, W))`` whose world size is the group's (inside a
`commlib_torch.sequence.parallel` context, the context's layout and group where None); rank r holds shard r
exactly (``layout.sizes[r]`` tokens, possibly none). The rules, their checks and the float64 references are the
spec's (`commlib.video`); the sharding and gathering are `commlib_torch.sequence`'s, so the gradients are
`shard_sequence`'s and `gather_sequence`'s.
"""

from __future__ import annotations

import torch

from commlib import SequenceLayout
from commlib import video as spec
from commlib_torch._groups import GroupArgument, check_tensor
from commlib_torch.sequence import _gather_sequence, _rank_layout, _shard_sequence

__all__ = ["grid_position_ids", "shard_latents", "gather_latents"]


def grid_position_ids(layout: SequenceLayout | None = None, group: GroupArgument = None) -> torch.Tensor:
    """This rank's tokens' grid coordinates: int64 ``[layout.sizes[rank], len(grid)]`` (``(f, h, w)`` per row,
    ``layout.grid_positions(rank)``) on the CPU, for 3-D RoPE (Wan / HunyuanVideo's rope over frames, height and
    width); no communication.

    Raises:
        CommError: a layout without a grid, ``layout.world_size`` not the group's; a layout other than the
            `parallel` context's, or none outside one. TypeError: `layout` not a `SequenceLayout`.

    Example:
        >>> from commlib import SequenceLayout
        >>> grid_position_ids(SequenceLayout(4, grid=(2, 1, 2)))  # W = 1: every token, frames outermost
        tensor([[0, 0, 0],
                [0, 0, 1],
                [1, 0, 0],
                [1, 0, 1]])
    """
    layout, _, rank = _rank_layout("grid_position_ids", layout, group)
    spec.check_grid("grid_position_ids", layout)
    return torch.tensor(spec.grid_table(layout)[rank, : layout.sizes[rank]], dtype=torch.int64)


def shard_latents(x: torch.Tensor, layout: SequenceLayout | None = None, group: GroupArgument = None) -> torch.Tensor:
    """Differentiable take of this rank's tokens of replicated latents: ``[B, C, *grid] -> [B, sizes[rank], C]``
    (``[B, C, F, H, W]`` for a video grid; tokens in the layout's order, channels last), x's dtype; no
    communication forward.

    Gradient: `shard_sequence`'s: every rank's cotangent gathered into place and back to ``[B, C, *grid]``, so
    each rank gets the gradient of the one replicated x.

    Raises:
        CommError: a layout without a grid, ``x.shape`` not ``[B, C, *layout.grid]``, ``layout.world_size`` not
            the group's; a layout other than the `parallel` context's, or none outside one.
        TypeError: x not a tensor, `layout` not a `SequenceLayout`.

    Example:
        >>> from commlib import SequenceLayout
        >>> x = torch.arange(8.0).reshape(1, 2, 2, 1, 2)  # B = 1, C = 2, (F, H, W) = (2, 1, 2)
        >>> shard_latents(x, SequenceLayout(4, grid=(2, 1, 2)))  # W = 1: every token, [1, 4, 2]
        tensor([[[0., 4.],
                 [1., 5.],
                 [2., 6.],
                 [3., 7.]]])
    """
    x = check_tensor("shard_latents", x)
    layout, _, _ = _rank_layout("shard_latents", layout, group)
    spec.check_latents("shard_latents", tuple(x.shape), layout)
    return _shard_sequence("shard_latents", x.flatten(2).transpose(1, 2), layout, group, 1)


def gather_latents(
    tokens: torch.Tensor, layout: SequenceLayout | None = None, group: GroupArgument = None, *, convention: str = "sum"
) -> torch.Tensor:
    """The inverse of `shard_latents`: every rank's tokens ``[B, sizes[r], C]`` gathered into the latents
    ``[B, C, *grid]`` on every rank (before unpatchify); tokens' dtype.

    One `gather_sequence` (one `all_gather`, ``sizes=layout.sizes`` when uneven) and a reshape. Gradient as
    all_gather's: "sum" -> this rank's tokens of the sum of every rank's cotangent; "replicated" -> of its own.

    Raises:
        CommError: a layout without a grid, tokens not ``[B, sizes[rank], C]``, unknown convention,
            ``layout.world_size`` not the group's; a layout other than the `parallel` context's, or none outside
            one. TypeError: tokens not a tensor, `layout` not a `SequenceLayout`.

    Example:
        >>> from commlib import SequenceLayout
        >>> tokens = torch.arange(8.0).reshape(1, 4, 2)  # [B, S_r, C], W = 1
        >>> gather_latents(tokens, SequenceLayout(4, grid=(2, 1, 2))).shape  # [B, C, F, H, W]
        torch.Size([1, 2, 2, 1, 2])
    """
    tokens = check_tensor("gather_latents", tokens)
    layout, _, rank = _rank_layout("gather_latents", layout, group)
    batch, channels = spec.check_tokens(
        "gather_latents", tuple(tokens.shape), layout, layout.sizes[rank], f"layout.sizes[{rank}]"
    )
    whole = _gather_sequence("gather_latents", tokens, layout, group, 1, convention)
    return whole.transpose(1, 2).reshape(spec.latents_shape(layout, batch, channels))
