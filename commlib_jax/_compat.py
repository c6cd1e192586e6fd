"""Every version-gated JAX API the JAX frontend reads, in one place.

Each reader says what it is for, the jax releases it was read on (0.10.2-0.11.2) and what it falls back to. The
frontend uses jax's public API only (``jax.typeof``, ``jax.sharding.get_abstract_mesh``, ``lax.pcast``,
``lax.axis_size``); what moves between releases is where those objects keep the varying-type and mesh facts,
read here with ``getattr`` so an older or newer layout degrades to "no checked axes" rather than failing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Hashable, Iterator
from typing import Any

import jax

__all__ = ["JitKeyedState", "bound_axis_names", "distributed_client", "manual_axes", "mesh_axis_names", "varying_axes"]


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes `x` is typed varying over (empty under check_vma=False and pmap).

    jax 0.10-0.11 keep them in ``jax.typeof(x).mat.varying`` (a ``ManualAxisType``); earlier releases in
    ``.vma`` (read first), some in ``.manual_axis_type.varying``. None of these: no varying axes.
    """
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def mesh_axis_names() -> tuple[str, ...]:
    """The axis names of the enclosing mesh (``get_abstract_mesh().axis_names``, read on 0.10.2-0.11.2); none
    under pmap or outside a mesh, or where the abstract mesh lacks the attribute."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()))


def manual_axes() -> tuple[str, ...]:
    """The manual axes of the enclosing ``shard_map``, in the mesh's order (``get_abstract_mesh().manual_axes``,
    read on 0.10.2-0.11.2); none under pmap or outside a shard_map, or where the abstract mesh lacks it."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def bound_axis_names() -> tuple[str, ...]:
    """The axis names the enclosing maps bind (shard_map, pmap, vmap), for error messages only: jax's private
    ``jax._src.core.unsafe_get_axis_names`` (read on 0.10.2), else the shard_map's manual axes."""
    try:
        from jax._src.core import unsafe_get_axis_names
    except ImportError:
        return manual_axes()
    return tuple(name for name in unsafe_get_axis_names() if isinstance(name, str))


def distributed_client() -> Any:
    """``jax.distributed``'s runtime client, whose key-value store on the coordinator the processes share
    (``key_value_set_bytes``, ``blocking_key_value_get_bytes``): jax's private
    ``jax._src.distributed.global_state.client`` (read on 0.10.2); None without ``jax.distributed`` or where
    jax keeps it elsewhere."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(getattr(distributed, "global_state", None), "client", None)


class JitKeyedState:
    """A per-thread value that code reads while JAX traces it, made part of ``jax.jit``'s cache key: a function
    jitted (traced) under one value and called under another is traced again, instead of silently keeping what
    it read the first time.

    jax keeps such values (its mesh and compute-on contexts) in ``jax._src.config.config_ext.Config(name, default,
    include_in_jit_key=True, include_in_trace_context=True)``, private, read on 0.10.2; where it is missing, a
    contextvar (a function jitted under one value then keeps it when called under another).
    """

    def __init__(self, name: str) -> None:
        try:
            from jax._src.config import config_ext

            self._state: Any = config_ext.Config(name, None, include_in_jit_key=True, include_in_trace_context=True)
        except (ImportError, AttributeError, TypeError):
            self._state = None
        self._fallback: contextvars.ContextVar[Any] = contextvars.ContextVar(name, default=None)

    @property
    def keyed(self) -> bool:
        """Whether the value is part of jit's cache key (False: the contextvar fallback)."""
        return self._state is not None

    def get(self) -> Any:
        """The value bound in this thread (None where none is)."""
        return self._fallback.get() if self._state is None else self._state.value

    @contextlib.contextmanager
    def bound(self, value: Hashable) -> Iterator[None]:
        """`value` inside the ``with`` (hashable: it is part of jit's key), the previous one after."""
        if self._state is None:
            token = self._fallback.set(value)
            try:
                yield
            finally:
                self._fallback.reset(token)
            return
        previous = self._state.swap_local(value)
        try:
            yield
        finally:
            self._state.set_local(previous)
