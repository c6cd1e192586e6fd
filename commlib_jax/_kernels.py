"""The attention kernel of a piece, chosen in one place for the JAX layers (DESIGN "Long sequences"): the
spec's blockwise rules (`commlib.blockwise.attend_blocks` / `attend_blocks_vjp`, the keys `block_size` at a
time in a ``lax.fori_loop``: a piece holds ``[B, H, S_q, block_size]`` scores, never ``[B, H, S_q, S_k]``), or,
on a GPU where it serves, cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``).

- `attend_piece`: a ring piece's ``(out, lse)`` (its backward is the ring's own, `commlib.ring.backward`, which
  calls `commlib.blockwise.attend_blocks_vjp` from the final LSE);
- `local_attention`: Ulysses' attention over the whole sequence, one ``jax.custom_vjp``: the forward saves the
  output and the LSE, the backward recomputes blockwise from them (FlashAttention-2's ``dS = P * (dP -
  rowsum(dO * O))``).

cuDNN serves where its rules are the spec's: float16 / bfloat16, one head dim (``D == D_v``, a multiple of 8 up
to 128), no mask beyond causal on a square piece (every row then sees a key, so the rule "a row that sees no key
outputs 0" cannot arise), no segment ids. Read on jax 0.10.2 and written against its documented signature
(``return_residual=True`` gives the LSE ``[B, T, N]``); no GPU was at hand when it was written, so that path is
untested: the CPU tests run the blockwise rules.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commlib import blockwise
from commlib_jax._vma import to_varying, varying_axes

__all__ = ["MATH", "fused_serves", "attend_piece", "local_attention"]


class _JaxMath(blockwise.ArrayMath):
    """`commlib.blockwise.ArrayMath` traced: the key loop a ``lax.fori_loop``, blocks dynamic slices, the loop's
    accumulators typed varying over every mesh axis its inputs vary over (``shard_map(check_vma=True)``)."""

    def full(self, shape: tuple[int, ...], value: float, dtype: Any, like: tuple[Any, ...]) -> Any:
        axes = set().union(*(varying_axes(x) for x in like))
        return to_varying(jnp.full(shape, value, dtype), tuple(sorted(axes, key=str)))

    def loop(self, count: int, body: Any, carry: Any) -> Any:
        if count == 0:  # no keys (S = 0): the accumulators as they start (a traced body would slice nothing)
            return carry
        if count == 1:  # one block: no loop in the program
            return body(0, carry)
        return lax.fori_loop(0, count, body, carry)

    def block(self, x: Any, start: Any, size: int, axis: int) -> Any:
        return lax.dynamic_slice_in_dim(x, start, size, axis % x.ndim)

    def set_block(self, x: Any, start: Any, value: Any, axis: int) -> Any:
        return lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), start, axis % x.ndim)

    def pad(self, x: Any, axis: int, amount: int, value: Any) -> Any:
        widths = [(0, 0)] * x.ndim
        widths[axis % x.ndim] = (0, amount)
        return jnp.pad(x, widths, constant_values=value)


MATH = _JaxMath(jnp)

_FUSED_DTYPES = ("float16", "bfloat16")


def fused_serves(dtype: str, q_shape: tuple, k_shape: tuple, value_dim: int, mask: Any, ids: Any) -> bool:
    """Whether cuDNN's fused attention computes this piece by the spec's rules (the module's list): on a GPU
    backend, half dtypes, ``D == D_v`` a multiple of 8 up to 128, mask "full" or "causal-diagonal" on a square
    piece, no segment ids."""
    if jax.default_backend() not in ("gpu", "cuda") or dtype not in _FUSED_DTYPES or ids is not None:
        return False
    head_dim = q_shape[-1]
    if head_dim != value_dim or head_dim % 8 or head_dim > 128:
        return False
    return mask == "full" or (mask == "causal-diagonal" and q_shape[1] == k_shape[1])


def _fused(q: Any, k: Any, v: Any, scale: float, causal: bool, dtype: str, residual: bool) -> Any:
    """cuDNN's attention on q, k, v in `dtype` (exact: the ring's compute dtype holds the inputs' half values)."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    if residual:
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="cudnn", return_residual=True
        )
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")


def attend_piece(
    q: Any, k: Any, v: Any, scale: float, mask: Any, block_size: int, dtype: str
) -> tuple[jax.Array, jax.Array]:
    """A ring piece's ``(out, lse)`` in the compute dtype of q, k, v (`dtype`: the inputs' own, which the fused
    kernel runs in): cuDNN where `fused_serves`, else `commlib.blockwise.attend_blocks`."""
    if isinstance(mask, str) and fused_serves(dtype, q.shape, k.shape, v.shape[-1], mask, None):
        out, lse = _fused(q, k, v, scale, mask == "causal-diagonal", dtype, True)
        return out.astype(q.dtype), lse.astype(q.dtype)
    if isinstance(mask, blockwise.SegmentedMask):  # segment ids: each key block's mask built in the loop
        return blockwise.attend_blocks(MATH, q, k, v, scale, mask.mask, block_size, mask.q_ids, mask.k_ids)
    return blockwise.attend_blocks(MATH, q, k, v, scale, mask, block_size)


def _compute_dtype(x: Any) -> Any:
    return jnp.promote_types(x.dtype, jnp.float32)  # float64 stays float64, half dtypes compute in float32


def _mask(causal: bool) -> str:
    return "causal-diagonal" if causal else "full"


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))  # options: (causal, scale, block_size, mask rule)
def _local(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array | None, options: tuple) -> jax.Array:
    return _local_forward(q, k, v, ids, options)[0]


def _local_forward(q: Any, k: Any, v: Any, ids: Any, options: tuple) -> tuple[jax.Array, tuple]:
    causal, scale, block_size, rule = options
    dtype = _compute_dtype(q)
    query, keys, values = (x.astype(dtype) for x in (q, k, v))
    out, lse = blockwise.attend_blocks(MATH, query, keys, values, scale, _mask(causal), block_size, ids, ids, rule)
    out = out.astype(v.dtype)
    return out, (q, k, v, ids, out, lse)


def _local_backward(options: tuple, residuals: tuple, d_out: jax.Array) -> tuple:
    causal, scale, block_size, rule = options
    q, k, v, ids, out, lse = residuals
    dtype = _compute_dtype(q)
    query, keys, values, d_out_c = (x.astype(dtype) for x in (q, k, v, d_out))
    rowsums = blockwise.delta(MATH, out.astype(dtype), d_out_c)
    grads = blockwise.attend_blocks_vjp(
        MATH, query, keys, values, d_out_c, lse, rowsums, scale, _mask(causal), block_size, ids, ids, rule
    )
    no_gradient = None if ids is None else np.zeros(ids.shape, dtype=jax.dtypes.float0)  # integers
    return (*(grad.astype(x.dtype) for grad, x in zip(grads, (q, k, v), strict=True)), no_gradient)


_local.defvjp(_local_forward, _local_backward)


def local_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    scale: float | None,
    block_size: int,
    segment_ids: jax.Array | None = None,
    mask: Any = None,
) -> jax.Array:
    """Attention over the whole sequence on ``[B, S, h, D]`` (q head i using kv head ``i // (h // h_kv)``):
    `commlib_jax.attention.attention`'s values and gradients (the spec's rules: a row that sees no key outputs 0
    with gradient 0, a NaN a NaN row, float64 stays float64), computed blockwise in a ``jax.custom_vjp`` (what it
    saves for backward: q, k, v, the output and the LSE); `mask` a `commlib.masks.MaskRule` on the positions
    ``0 .. S - 1``, built a key block at a time; cuDNN where `fused_serves` (never with a rule)."""
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else float(scale)
    dtype = jnp.dtype(q.dtype).name
    if mask is None and fused_serves(dtype, q.shape, k.shape, v.shape[-1], _mask(causal), segment_ids):
        return _fused(q, k, v, scale, causal, dtype, False)
    return _local(q, k, v, segment_ids, (causal, scale, block_size, mask))
