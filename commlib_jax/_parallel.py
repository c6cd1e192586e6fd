"""The state of `commlib_jax.sequence.parallel`: the innermost context of this thread (a contextvar: nested
contexts restore the outer one on exit), its plan from the spec and its axes, decided on entry; `current` and
`Parallel.attend` are what `commlib_jax.sequence.dot_product_attention` calls while JAX traces the model.

The axes' sizes are known only inside the enclosing ``shard_map`` / ``pmap``: a context entered outside it (the
usual place, around the jitted step) has the layout's sizes checked against the axes when the attention is
traced."""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from commlib import parallel as spec
from commlib_jax._compat import JitKeyedState
from commlib_jax._op import axis_size
from commlib_jax._types import Array
from commlib_jax._vma import axes_of, axis_arg, to_varying
from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention
from commlib_jax.functional import AxisName
from commlib_jax.testing_trace import ACTIVE, recorded_layer


@dataclasses.dataclass(frozen=True)
class Parallel:
    """One entered context: the spec's plan and the layer's axes (``axis_name`` for Ulysses and ring)."""

    plan: spec.ParallelPlan
    axis_name: AxisName | None
    ulysses_axis: AxisName | None
    ring_axis: AxisName | None

    def sizes(self, op_name: str) -> dict:
        """``{"ulysses_size", "ring_size"}`` of the layer's axes (inside the enclosing shard_map / pmap)."""
        if self.plan.attention == "usp":
            return dict(
                ulysses_size=axis_size(op_name, _axes(self.ulysses_axis)),
                ring_size=axis_size(op_name, _axes(self.ring_axis)),
            )
        size = axis_size(op_name, _axes(self.axis_name))
        return (
            dict(ulysses_size=size, ring_size=1)
            if self.plan.attention == "ulysses"
            else dict(ulysses_size=1, ring_size=size)
        )

    def key(self) -> tuple[object, ...]:
        """What the context decides for the code traced inside it (the plan and the axes, hashable): part of
        jit's cache key (`JIT_KEY`)."""
        axes = (self.axis_name, self.ulysses_axis, self.ring_axis)
        return (self.plan, *(None if axis is None else axes_of(axis) for axis in axes))

    def sequence_axes(self) -> tuple[str, ...]:
        """The axes the layout's shards lie along, in shard order: ``axis_name``'s, or USP's ring axes then its
        Ulysses axes (the rank at ring index r and Ulysses index u holds shard ``r * U + u``)."""
        if self.plan.attention == "usp":
            return _axes(self.ring_axis) + _axes(self.ulysses_axis)
        return _axes(self.axis_name)

    def check_positions(self, positions: Array) -> None:
        """Refuse, on every rank, a model's `positions` ``[..., max_size]`` whose valid rows are not the global
        positions of the rank's shard (RoPE fed local positions, tokens sharded by another layout). The shape is
        checked when traced; the values when the step runs: the ranks' positions are all-gathered over the
        layout's axes (``W * positions.size`` ints) and a host callback on every device raises the spec's error
        for the first shard that differs (expected against received), inside JAX's runtime error."""
        spec.check_positions_shape(self.plan, tuple(np.shape(positions)))
        axes = self.sequence_axes()
        positions = to_varying(jnp.asarray(positions).astype(jnp.int32), axes)
        everyone = lax.all_gather(positions, axis_arg(axes))  # [W, ..., max_size], shard order
        io_callback(functools.partial(_refuse_positions, self.plan), None, everyone, ordered=False)

    def attend(
        self,
        q: Array,
        k: Array,
        v: Array,
        *,
        causal: bool,
        scale: float | None,
        segment_ids: Array | None = None,
    ) -> jax.Array:
        """The plan's layer on this rank's ``[B, max_size, H, D]`` / ``[B, max_size, H_kv, D]`` shards (and
        segment ids ``[B, max_size]``, None: no segment mask); one call of a `commlib_jax.testing.record()` trace
        while recording."""
        if ACTIVE:
            axes = (
                axes_of(self.axis_name)
                if self.axis_name is not None
                else _axes(self.ring_axis) + _axes(self.ulysses_axis)
            )  # shard r * U + u
            return recorded_layer(
                f"{self.plan.attention}_attention",
                self._layer,
                axes,
                q,
                k,
                v,
                causal=causal,
                scale=scale,
                segment_ids=segment_ids,
            )
        return self._layer(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)

    def _layer(
        self,
        q: Array,
        k: Array,
        v: Array,
        *,
        causal: bool,
        scale: float | None,
        segment_ids: Array | None = None,
    ) -> jax.Array:
        keywords = self.plan.keywords if segment_ids is None else {**self.plan.keywords, "segment_ids": segment_ids}
        axis_name, ulysses_axis, ring_axis = (
            cast(AxisName, axis)
            for axis in (self.axis_name, self.ulysses_axis, self.ring_axis)  # checked by `enter`
        )
        if self.plan.attention == "ulysses":
            return ulysses_attention(q, k, v, axis_name, causal=causal, scale=scale, **keywords)
        if self.plan.attention == "ring":
            return ring_attention(q, k, v, axis_name, causal=causal, scale=scale, **keywords)
        return usp_attention(q, k, v, ulysses_axis, ring_axis, causal=causal, scale=scale, **keywords)


def _refuse_positions(plan: spec.ParallelPlan, everyone: jax.Array) -> None:
    """Host side of `Parallel.check_positions`: every shard's positions ``[W, ..., max_size]``; the error of
    the first shard whose valid rows are not its global positions (the same on every device)."""
    on_host = np.asarray(everyone)
    for shard, size in enumerate(plan.layout.sizes):
        mine = on_host[shard][..., :size]
        if (mine != plan.layout.positions(shard)).any():
            raise spec.positions_error(plan, shard, mine, name="positions")


#: The entered contexts of this thread; `current(op_name)` is the innermost (the spec's error outside every one).
CONTEXTS = spec.Contexts[Parallel]("commlib_jax_parallel", "commlib_jax.sequence.parallel")
current = CONTEXTS.current
#: The innermost context's `Parallel.key`, part of jax.jit's cache key: a function jitted (traced) in one context
#: -- or outside every one -- and called in another is traced again there, instead of keeping the first one's
#: layer, layout and axes (and its helpers' checks against them).
JIT_KEY = JitKeyedState("commlib_jax_parallel")
_NAMES = ("axis_name", "ulysses_axis", "ring_axis")


def _axes(axis: AxisName | None) -> tuple[str, ...]:
    """`axes_of(axis)`; () for an axis the context's layer does not use (the spec's `check_groups` refused a
    missing one it does)."""
    return () if axis is None else axes_of(axis)


def _known_size(axis: AxisName | None) -> int | None:
    """The size of `axis` where it is bound (inside shard_map / pmap), else None (checked at the call)."""
    if axis is None:  # (not this layer's: the spec's check_groups refused a missing one it needs)
        return None
    try:
        return lax.axis_size(axis_arg(axes_of(axis)))
    except NameError:
        return None


def enter(
    layout: object,
    axis_name: AxisName | None,
    attention: str,
    ulysses_axis: AxisName | None,
    ring_axis: AxisName | None,
) -> Parallel:
    """The context of ``parallel(layout, axis_name, attention=..., ...)``, checked by the spec."""
    spec.check_groups(
        attention, dict(zip(_NAMES, (axis_name, ulysses_axis, ring_axis), strict=True)), _NAMES, group_required=True
    )
    if attention == "usp":
        sizes = dict(ulysses_size=_known_size(ulysses_axis), ring_size=_known_size(ring_axis))
    elif attention == "ulysses":
        sizes = dict(ulysses_size=_known_size(axis_name), ring_size=1)
    else:
        sizes = dict(ulysses_size=1, ring_size=_known_size(axis_name))
    plan = spec.parallel_plan(layout, attention, **sizes)
    return Parallel(plan, axis_name, ulysses_axis, ring_axis)
