"""Video DiTs' token grid: the rules of `grid_position_ids`, `shard_latents` and `gather_latents` (both frontends'
`video` modules) and their validation; their float64 references are `commlib.reference.video`.

A video DiT patchifies latents ``[B, C, F, H, W]`` into a token grid ``(F, H, W)`` (after its patch size) and
attends the tokens in raster order, frames outermost: token ``p = (f * H + h) * W + w``. A
``SequenceLayout(F * H * W, ..., grid=(F, H, W))`` says which shard holds which token (any grid over any W, the
layout's rule: contiguous, zigzag, per-rank `seq_sizes`) and ``grid_positions(i)`` their ``(f, h, w)`` (3-D RoPE).
`shard_latents` takes this rank's tokens ``[B, sizes[rank], C]`` of the replicated latents (channels last, as the
patch embedding's output); `gather_latents`, its inverse, gathers every rank's tokens back into ``[B, C, F, H, W]``
before unpatchify. Their gradients are `shard_sequence`'s and `gather_sequence`'s (each other's duals).

>>> layout = SequenceLayout(2 * 1 * 3, ring_size=2, grid=(2, 1, 3))
>>> grid_table(layout)[1].tolist()  # shard 1: tokens 3, 4, 5 = frame 1
[[1, 0, 0], [1, 0, 1], [1, 0, 2]]
>>> layout.sizes  # tokens per rank
(3, 3)
"""

from __future__ import annotations

import functools
import operator

import numpy as np

from commlib.errors import comm_error, kind_error
from commlib.sequence import SequenceLayout
from commlib.validators import iterable

__all__ = [
    "check_grid",
    "check_latents",
    "check_tokens",
    "grid_table",
    "latents_shape",
]


def check_grid(op_name: str, layout: SequenceLayout) -> tuple[int, ...]:
    """The layout's token grid, or `CommError` naming `op_name` where it has none.

    >>> check_grid("shard_latents", SequenceLayout(6, ring_size=2))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: shard_latents: layout.grid (None) must be the token grid: build the layout with ...
    """
    if layout.grid is None:
        message = "layout.grid (None) must be the token grid: build the layout with grid=(frames, height, width)"
        raise comm_error(op_name, message, layout=layout)
    return layout.grid


def _dims(op_name: str, name: str, shape: object, received: dict) -> tuple[int, ...]:
    try:
        return tuple(operator.index(size) for size in iterable(shape))
    except TypeError:
        raise kind_error(op_name, f"{name} shape must be a sequence of ints", **received) from None


def check_latents(op_name: str, shape: object, layout: SequenceLayout) -> tuple[int, int]:
    """Latents ``[B, C, *layout.grid]`` (a video's ``[B, C, F, H, W]``): returns ``(B, C)``.

    >>> check_latents("shard_latents", (1, 4, 2, 8, 8), SequenceLayout(96, grid=(2, 6, 8)))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: shard_latents: latents.shape[2:] ((2, 8, 8)) must be layout.grid ((2, 6, 8)). ...
    """
    grid = check_grid(op_name, layout)
    received = dict(shape=shape, grid=grid)
    dims = _dims(op_name, "latents", shape, received)
    if len(dims) != 2 + len(grid):
        message = f"latents ndim ({len(dims)}) must be {2 + len(grid)} ([batch, channels, *layout.grid])"
        raise comm_error(op_name, message, **received)
    if dims[2:] != grid:
        raise comm_error(op_name, f"latents.shape[2:] ({dims[2:]}) must be layout.grid ({grid})", **received)
    return dims[0], dims[1]


def check_tokens(op_name: str, shape: object, layout: SequenceLayout, rows: int, what: str) -> tuple[int, int]:
    """This rank's tokens ``[B, rows, C]`` (`what` names the expected `rows`): returns ``(B, C)``.

    >>> check_tokens("gather_latents", (1, 4, 16), SequenceLayout(6, ring_size=2, grid=(1, 2, 3)), 3, "layout.sizes[0]")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: gather_latents: tokens.shape[1] (4) must be layout.sizes[0] (3). Received: ...
    """
    check_grid(op_name, layout)
    received = dict(shape=shape, rows=rows)
    dims = _dims(op_name, "tokens", shape, received)
    if len(dims) != 3:
        raise comm_error(op_name, f"tokens ndim ({len(dims)}) must be 3 ([batch, tokens, channels])", **received)
    if dims[1] != rows:
        raise comm_error(op_name, f"tokens.shape[1] ({dims[1]}) must be {what} ({rows})", **received)
    return dims[0], dims[2]


def latents_shape(layout: SequenceLayout, batch: int, channels: int) -> tuple[int, ...]:
    """``(B, C, *layout.grid)``: what `gather_latents` returns."""
    assert layout.grid is not None, "checked by check_tokens"
    return (batch, channels, *layout.grid)


@functools.lru_cache(maxsize=256)
def grid_table(layout: SequenceLayout) -> np.ndarray:
    """int64 ``[W, max_size, len(grid)]``: row i holds shard i's grid coordinates (`grid_positions`), then -1
    for each padding row."""
    grid = check_grid("grid_position_ids", layout)
    table = np.full((layout.world_size, layout.max_size, len(grid)), -1, dtype=np.int64)
    for index in range(layout.world_size):
        table[index, : layout.sizes[index]] = layout.grid_positions(index)
    table.flags.writeable = False
    return table
