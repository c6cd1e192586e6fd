"""Video DiTs' token grid over `jax.lax` (inside ``shard_map`` / ``pmap``): this rank's ``(f, h, w)`` token
coordinates (`grid_position_ids`, for 3-D RoPE), its tokens of the replicated latents ``[B, C, F, H, W]``
(`shard_latents`) and every rank's tokens gathered back into the latents before unpatchify (`gather_latents`).

Each takes a ``commlib.SequenceLayout(F * H * W, ..., grid=(F, H, W))`` whose world size is the size of
`axis_name` (inside a `commlib_jax.sequence.parallel` context, the context's layout and axes where None). Every
device holds one shape: shard r padded to ``layout.max_size`` tokens, its own ``layout.sizes[r]`` first (padding
rows: coordinates 0, zeros in `shard_latents`' output, ignored by `gather_latents` with gradient exactly 0). The
rules, their checks and the float64 references are the spec's (`commlib.video`); the sharding and gathering are
`commlib_jax.sequence`'s, so the gradients are `shard_sequence`'s and `gather_sequence`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from commlib import SequenceLayout
from commlib import video as spec
from commlib_jax._types import Array
from commlib_jax._vma import rank
from commlib_jax.functional import AxisName
from commlib_jax.sequence import _check_array, _gather_sequence, _layout, _shard_sequence

__all__ = ["grid_position_ids", "shard_latents", "gather_latents"]


def grid_position_ids(layout: SequenceLayout | None = None, axis_name: AxisName | None = None) -> jax.Array:
    """This rank's tokens' grid coordinates: int32 ``[layout.max_size, len(grid)]`` (``(f, h, w)`` per row,
    ``layout.grid_positions(rank)``, then 0 on padding rows), for 3-D RoPE; no communication.

    Raises:
        CommError: a layout without a grid, ``layout.world_size`` not the size of `axis_name`; a layout or axes
            not the `parallel` context's. TypeError: `layout` not a `SequenceLayout`.

    Example:
        >>> import jax
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib import SequenceLayout
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4: 2 frames of 1 x 3 tokens, shards (2, 2, 1, 1)
        >>> layout = SequenceLayout(6, ring_size=4, grid=(2, 1, 3))
        >>> f = jax.shard_map(lambda: grid_position_ids(layout, "x")[None], mesh=mesh, in_specs=(), out_specs=P("x"))
        >>> f()[1].tolist(), f()[3].tolist()  # rank 1: tokens 2, 3; rank 3: token 5 and a padding row
        ([[0, 0, 2], [1, 0, 0]], [[1, 0, 2], [0, 0, 0]])
    """
    layout, axes = _layout("grid_position_ids", layout, axis_name)
    spec.check_grid("grid_position_ids", layout)
    return jnp.asarray(np.maximum(spec.grid_table(layout), 0).astype(np.int32))[rank(axes)]


def shard_latents(x: Array, layout: SequenceLayout | None = None, axis_name: AxisName | None = None) -> jax.Array:
    """Differentiable take of this rank's tokens of replicated latents: ``[B, C, *grid] -> [B, max_size, C]``
    (``[B, C, F, H, W]`` for a video grid; tokens in the layout's order, channels last, rows past
    ``sizes[rank]`` zeros), x's dtype; no communication forward.

    Gradient: `shard_sequence`'s: every rank's cotangent gathered into place and back to ``[B, C, *grid]``, so
    each rank gets the gradient of the one replicated x (padding rows' cotangents dropped).

    Raises:
        CommError: a layout without a grid, ``x.shape`` not ``[B, C, *layout.grid]``, ``layout.world_size`` not
            the axis size; a layout or axes not the `parallel` context's. TypeError: `layout` not a
            `SequenceLayout`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib import SequenceLayout
        >>> mesh = Mesh(jax.devices()[:2], ("x",))
        >>> layout = SequenceLayout(4, ring_size=2, grid=(2, 1, 2))  # rank r: frame r
        >>> f = jax.shard_map(lambda x: shard_latents(x, layout, "x"), mesh=mesh, in_specs=P(), out_specs=P("x"),
        ...                   check_vma=False)
        >>> f(jnp.arange(8.0).reshape(1, 2, 2, 1, 2))[0].tolist()  # rank 0's tokens then rank 1's, [S_r, C] each
        [[0.0, 4.0], [1.0, 5.0]]
    """
    x = _check_array("shard_latents", x)
    layout, _ = _layout("shard_latents", layout, axis_name)
    spec.check_latents("shard_latents", x.shape, layout)
    tokens = jnp.swapaxes(x.reshape(*x.shape[:2], -1), 1, 2)
    return _shard_sequence("shard_latents", tokens, layout, axis_name, 1)


def gather_latents(
    tokens: Array, layout: SequenceLayout | None = None, axis_name: AxisName | None = None, *, convention: str = "sum"
) -> jax.Array:
    """The inverse of `shard_latents`: every rank's tokens ``[B, max_size, C]`` (its first ``sizes[r]`` valid)
    gathered into the latents ``[B, C, *grid]`` on every rank (before unpatchify); tokens' dtype.

    One `gather_sequence` and a reshape. Gradient as all_gather's: "sum" -> this rank's tokens of the sum of every
    rank's cotangent; "replicated" -> of its own; padding rows get exactly 0.

    Raises:
        CommError: a layout without a grid, tokens not ``[B, max_size, C]``, unknown convention,
            ``layout.world_size`` not the axis size; a layout or axes not the `parallel` context's.
            TypeError: `layout` not a `SequenceLayout`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib import SequenceLayout
        >>> mesh = Mesh(jax.devices()[:2], ("x",))
        >>> layout = SequenceLayout(4, ring_size=2, grid=(2, 1, 2))
        >>> f = jax.shard_map(lambda t: gather_latents(t, layout, "x")[None], mesh=mesh, in_specs=P(None, "x"),
        ...                   out_specs=P("x"))
        >>> f(jnp.arange(8.0).reshape(1, 4, 2))[0].shape  # [B, C, F, H, W] on rank 0
        (1, 2, 2, 1, 2)
    """
    tokens = _check_array("gather_latents", tokens)
    layout, _ = _layout("gather_latents", layout, axis_name)
    batch, channels = spec.check_tokens("gather_latents", tokens.shape, layout, layout.max_size, "layout.max_size")
    whole = _gather_sequence("gather_latents", tokens, layout, axis_name, 1, convention)
    return jnp.swapaxes(whole, 1, 2).reshape(spec.latents_shape(layout, batch, channels))
