"""The float64 references of video DiTs' latent helpers (`commlib.video`; both frontends' `shard_latents` and
`gather_latents`): the latents ``[B, C, *grid]`` as tokens ``[B, prod(grid), C]`` in raster order (frames
outermost, channels last) and back, and the two helpers on W simulated ranks, forward and VJP (the sequence
helpers' references, `commlib.reference.sequence`, on the tokens).

>>> from commlib import SequenceLayout
>>> layout = SequenceLayout(2 * 1 * 3, ring_size=2, grid=(2, 1, 3))  # rank r: frame r
>>> x = np.arange(12.0).reshape(1, 2, 2, 1, 3)  # [B, C, F, H, W]
>>> [shard[0].tolist() for shard in shard_latents_reference(x, None, layout)[0]]  # [S_r, C] per rank
[[[0.0, 6.0], [1.0, 7.0], [2.0, 8.0]], [[3.0, 9.0], [4.0, 10.0], [5.0, 11.0]]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from commlib.reference.sequence import gather_sequence_reference, shard_sequence_reference
from commlib.sequence import SequenceLayout
from commlib.video import check_grid

__all__ = ["to_tokens", "to_latents", "shard_latents_reference", "gather_latents_reference"]


def to_tokens(x: npt.ArrayLike) -> np.ndarray:
    """numpy ``[B, C, *grid] -> [B, prod(grid), C]``: the tokens in raster order, channels last."""
    x = np.asarray(x)
    return np.moveaxis(x.reshape(*x.shape[:2], -1), 1, 2)


def to_latents(tokens: npt.ArrayLike, grid: Sequence[int]) -> np.ndarray:
    """numpy ``[B, prod(grid), C] -> [B, C, *grid]``: the inverse of `to_tokens`."""
    tokens = np.asarray(tokens)
    return np.moveaxis(tokens, 2, 1).reshape(tokens.shape[0], tokens.shape[2], *grid)


def shard_latents_reference(
    x: npt.ArrayLike, cotangents: Sequence[npt.ArrayLike] | None, layout: SequenceLayout, *, padded: bool = False
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """`shard_latents` on W simulated ranks, each holding the replicated latents `x`: every rank's tokens and,
    with `cotangents` (every rank's, of its tokens), every rank's gradient of x (the same on every rank)."""
    grid = check_grid("shard_latents", layout)
    tokens = to_tokens(x)
    if cotangents is None:
        return layout.shard(tokens, 1, padded=padded), None
    outputs, grads = shard_sequence_reference(tokens, cotangents, layout, padded=padded)
    return outputs, [to_latents(grad, grid) for grad in grads]


def gather_latents_reference(
    shards: Sequence[npt.ArrayLike],
    cotangents: Sequence[npt.ArrayLike],
    layout: SequenceLayout,
    *,
    convention: str = "sum",
    padded: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`gather_latents` on W simulated ranks: every rank's latents ``[B, C, *grid]`` and every rank's gradient of
    its tokens, from every rank's cotangent of the latents (`gather_sequence`'s rule, "sum" or "replicated")."""
    grid = check_grid("gather_latents", layout)
    token_cotangents = [to_tokens(cotangent) for cotangent in cotangents]
    wholes, grads = gather_sequence_reference(shards, token_cotangents, layout, convention=convention, padded=padded)
    return [to_latents(whole, grid) for whole in wholes], grads
