"""Sequence parallelism for a whole model over `jax.lax` (inside ``shard_map`` / ``pmap``): the `parallel`
context that names the attention layer (Ulysses, ring, USP), its mesh axes and the `commlib.SequenceLayout`,
and `dot_product_attention`, the drop-in for ``jax.nn.dot_product_attention`` that runs that layer (a Flax
model swaps it in for its attention call). JAX holds every shard padded to ``layout.max_size`` rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from commlib import parallel as parallel_spec
from commlib.sequence import SequenceLayout
from commlib_jax import _parallel

__all__ = ["dot_product_attention", "parallel"]


@contextlib.contextmanager
def parallel(layout: SequenceLayout, axis_name=None, *, attention: str = "ulysses", ulysses_axis=None,
             ring_axis=None) -> Iterator[parallel_spec.ParallelPlan]:
    """A context in which `dot_product_attention` runs commlib's `attention` layer on this rank's shard of
    `layout` (enter it around the code that traces the model: the jitted step, or inside the shard_map body).

    Args:
        layout: the `commlib.SequenceLayout` of the sequence (any length; each shard held padded to
            ``layout.max_size`` rows, the valid ones first).
        axis_name: the mesh axis (or tuple of axes) of ``"ulysses"`` and ``"ring"``; required for them.
        attention: ``"ulysses"`` (`commlib_jax.attention.ulysses_attention`: ``layout.ulysses_size`` = the axis
            size, ``ring_size`` 1), ``"ring"`` (`ring_attention`: ``ring_size`` = the axis size) or ``"usp"``
            (`usp_attention` over `ulysses_axis` and `ring_axis`, both required).

    Yields the spec's `commlib.parallel.ParallelPlan`. Contexts nest (the innermost wins; the outer one is back
    on exit) and are per thread (a contextvar). The layout's sizes are checked against the axes' on entry
    inside a shard_map, else when the attention is traced. A jitted function keeps the layer it was traced with:
    jit it inside the context it runs in. Gradients are the layers' (exact, every JAX mode).

    Raises:
        CommError: an unknown `attention`, USP without both axes (Ulysses / ring without `axis_name`, or given
            USP's axes), a layout whose Ulysses or ring size is not its axis size.
        TypeError: `layout` not a SequenceLayout, `attention` not a str.

    Example (4 CPU devices: S = 10 over 4 ranks, held padded to 3 rows):
        >>> import commlib, jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> layout = commlib.SequenceLayout(10, ulysses_size=4)
        >>> x = np.random.default_rng(0).standard_normal((1, 10, 4, 8)).astype(np.float32)
        >>> shards = jnp.asarray(np.concatenate(layout.shard(x, padded=True), axis=1))  # [1, 4 * 3, 4, 8]
        >>> body = lambda q: dot_product_attention(q, q, q, is_causal=True)
        >>> with parallel(layout, "x"):
        ...     out = jax.shard_map(body, mesh=Mesh(jax.devices()[:4], ("x",)), in_specs=P(None, "x"),
        ...                         out_specs=P(None, "x"))(shards)
        >>> whole = layout.unshard(np.split(np.asarray(out), 4, axis=1), padded=True)
        >>> want = jax.nn.dot_product_attention(x, x, x, is_causal=True)
        >>> bool(np.allclose(whole, want, atol=1e-5))
        True
    """
    state = _parallel.enter(layout, axis_name, attention, ulysses_axis, ring_axis)
    token = _parallel.push(state)
    try:
        yield state.plan
    finally:
        _parallel.pop(token)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False):
    """``jax.nn.dot_product_attention``'s signature and layout, run by the innermost `parallel` context's layer on
    this rank's shard: query ``[B, T, N, H]``, key and value ``[B, T, K, H]`` (``T = layout.max_size``; GQA by head
    counts, ``N % K == 0``) -> ``[B, T, N, H]``, query's dtype; rows past this shard's own are zeros.

    `is_causal` masks by global positions; `scale` defaults to ``1 / sqrt(H)``. Gradient: exact, the layer's
    (rows past a shard's own get gradient 0).

    Raises:
        CommError: outside a `parallel` context (at trace time); a `bias` or a `mask` (commlib owns the causal
            mask only); T not ``layout.max_size``; the layout's sizes not the axes'; the layer's own errors.

    Example (4 CPU devices, ring attention over a zigzag layout of 16 positions, GQA):
        >>> import commlib, jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> layout = commlib.SequenceLayout(16, ring_size=4, layout="zigzag")
        >>> rng = np.random.default_rng(0)
        >>> q, k = rng.standard_normal((2, 16, 4, 8), np.float32), rng.standard_normal((2, 16, 2, 8), np.float32)
        >>> cut = lambda x: jnp.asarray(np.concatenate(layout.shard(x), axis=1))  # shard r's rows at block r
        >>> body = lambda q, k: dot_product_attention(q, k, k, is_causal=True)
        >>> with parallel(layout, "x", attention="ring"):
        ...     out = jax.shard_map(body, mesh=Mesh(jax.devices()[:4], ("x",)), in_specs=P(None, "x"),
        ...                         out_specs=P(None, "x"))(cut(q), cut(k))
        >>> whole = layout.unshard(np.split(np.asarray(out), 4, axis=1))
        >>> bool(np.allclose(whole, jax.nn.dot_product_attention(q, k, k, is_causal=True), atol=1e-5))
        True
    """
    state = _parallel.current(parallel_spec.CALL_OP)
    parallel_spec.check_call(state.plan, shard=None, rows=query.shape[1], mask=mask is not None,
                             bias=bias is not None)
    parallel_spec.check_sizes(state.plan.layout, state.plan.attention, **state.sizes(parallel_spec.CALL_OP))
    return state.attend(query, key, value, causal=is_causal, scale=scale)
