"""The state of `commlib_jax.sequence.parallel`: the innermost context of this thread (a contextvar: nested
contexts restore the outer one on exit), its plan from the spec and its axes, decided on entry; `current` and
`Parallel.attend` are what `commlib_jax.sequence.dot_product_attention` calls while JAX traces the model.

The axes' sizes are known only inside the enclosing ``shard_map`` / ``pmap``: a context entered outside it (the
usual place, around the jitted step) has the layout's sizes checked against the axes when the attention is
traced."""

from __future__ import annotations

import dataclasses

from jax import lax

from commlib import parallel as spec
from commlib_jax._op import axis_size
from commlib_jax._vma import axes_of, axis_arg
from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention
from commlib_jax.testing_trace import ACTIVE, recorded_layer


@dataclasses.dataclass(frozen=True)
class Parallel:
    """One entered context: the spec's plan and the layer's axes (``axis_name`` for Ulysses and ring)."""

    plan: spec.ParallelPlan
    axis_name: object
    ulysses_axis: object
    ring_axis: object

    def sizes(self, op_name: str) -> dict:
        """``{"ulysses_size", "ring_size"}`` of the layer's axes (inside the enclosing shard_map / pmap)."""
        if self.plan.attention == "usp":
            return dict(ulysses_size=axis_size(op_name, axes_of(self.ulysses_axis)),
                        ring_size=axis_size(op_name, axes_of(self.ring_axis)))
        size = axis_size(op_name, axes_of(self.axis_name))
        return dict(ulysses_size=size, ring_size=1) if self.plan.attention == "ulysses" else \
            dict(ulysses_size=1, ring_size=size)

    def attend(self, q, k, v, *, causal: bool, scale: float | None):
        """The plan's layer on this rank's ``[B, max_size, H, D]`` / ``[B, max_size, H_kv, D]`` shards (one call of
        a `commlib_jax.testing_trace.record()` trace while recording)."""
        if ACTIVE:
            axes = axes_of(self.axis_name) if self.axis_name is not None else \
                axes_of(self.ring_axis) + axes_of(self.ulysses_axis)  # shard r * U + u
            return recorded_layer(f"{self.plan.attention}_attention", self._layer, axes, q, k, v, causal=causal,
                                  scale=scale)
        return self._layer(q, k, v, causal=causal, scale=scale)

    def _layer(self, q, k, v, *, causal: bool, scale: float | None):
        keywords = self.plan.keywords
        if self.plan.attention == "ulysses":
            return ulysses_attention(q, k, v, self.axis_name, causal=causal, scale=scale, **keywords)
        if self.plan.attention == "ring":
            return ring_attention(q, k, v, self.axis_name, causal=causal, scale=scale, **keywords)
        return usp_attention(q, k, v, self.ulysses_axis, self.ring_axis, causal=causal, scale=scale, **keywords)


#: The entered contexts of this thread; `current(op_name)` is the innermost (the spec's error outside every one).
CONTEXTS = spec.Contexts[Parallel]("commlib_jax_parallel", "commlib_jax.sequence.parallel")
current = CONTEXTS.current
_NAMES = ("axis_name", "ulysses_axis", "ring_axis")


def _known_size(axis) -> int | None:
    """The size of `axis` where it is bound (inside shard_map / pmap), else None (checked at the call)."""
    try:
        return lax.axis_size(axis_arg(axes_of(axis)))
    except NameError:
        return None


def enter(layout: object, axis_name: object, attention: str, ulysses_axis: object, ring_axis: object) -> Parallel:
    """The context of ``parallel(layout, axis_name, attention=..., ...)``, checked by the spec."""
    given = dict(zip(_NAMES, (axis_name is not None, ulysses_axis is not None, ring_axis is not None), strict=True))
    spec.check_groups(attention, given, _NAMES, group_required=True)
    if attention == "usp":
        sizes = dict(ulysses_size=_known_size(ulysses_axis), ring_size=_known_size(ring_axis))
    elif attention == "ulysses":
        sizes = dict(ulysses_size=_known_size(axis_name), ring_size=1)
    else:
        sizes = dict(ulysses_size=1, ring_size=_known_size(axis_name))
    plan = spec.parallel_plan(layout, attention, **sizes)
    return Parallel(plan, axis_name, ulysses_axis, ring_axis)
