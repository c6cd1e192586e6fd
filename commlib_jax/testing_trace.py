"""`record()`: every commlib call traced inside the block, in program order, with the nnx module that made it and
every device's input and output arrays (as numpy), into a `commlib.testing.trace.Trace`.

Recorded: each public op (`commlib_jax.functional`, and the ops the sequence helpers call), forward only, as
the plan it walks; each attention layer run through a `commlib_jax.sequence.parallel` context
(`commlib_jax.sequence.dot_product_attention`), as one call with inputs q, k, v ``[B, T, H, D]`` (the
collectives inside it are part of it). The module is the innermost ``flax.nnx.Module`` whose method is on the
Python stack when the call is traced, named by its path in the outermost one's graph (``layers.1.attention``).

Under ``jax.jit`` (and ``shard_map``, ``grad``): a call's place in the trace is decided when it is traced, and
its arrays arrive through ``jax.debug.callback`` when the compiled program runs, each tagged with its call and
device, so the order the callbacks run in does not matter; the block waits for them on exit
(``jax.effects_barrier``). So trace the function inside the block: a function jitted and traced before it is
not recorded, and one traced inside keeps its callbacks (a no-op once its trace holds a value: a call's first
run stays). A device's rank is its index in the enclosing shard_map's mesh (row-major over its axes).

Off, recording costs one check of an empty list per op and attention layer while JAX traces, nothing when a
compiled program runs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from commlib.layout import Plan
from commlib.testing.trace import Recorder, Trace, calling_module, describe_plan
from commlib_jax._compat import manual_axes
from commlib_jax._types import Array
from commlib_jax._vma import rank

__all__ = ["record"]  # `ACTIVE`, `recorded_op` and `recorded_layer`: the hooks of the call path

#: The recorders of the enclosing `record()` blocks, innermost last; empty when not recording (the one check).
ACTIVE: list[Recorder] = []


@contextlib.contextmanager
def record() -> Iterator[Trace]:
    """Record the commlib calls traced inside the block into the `Trace` it yields (every device's arrays; filled
    as the compiled programs run, complete when the block exits). Compare two traces with
    `commlib.testing.divergence.first_divergence`. Nested blocks record into the innermost only.

    Example (4 CPU devices):
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> from commlib_jax import all_gather
        >>> f = jax.jit(jax.shard_map(lambda x: all_gather(x, "x", dim=0), mesh=Mesh(jax.devices()[:4], ("x",)),
        ...                           in_specs=P("x"), out_specs=P("x")))
        >>> with record() as trace:
        ...     out = f(jnp.arange(8.0))
        >>> [(call.op, call.plan["in_shape"], call.ranks) for call in trace]
        [('all_gather', '(2,)', (0, 1, 2, 3))]
        >>> trace[0].inputs["x"][3], trace[0].outputs["out"][0]
        (array([6., 7.], dtype=float32), array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32))
    """
    recorder = Recorder()
    ACTIVE.append(recorder)
    try:
        yield recorder.trace
    finally:
        ACTIVE.remove(recorder)
        jax.effects_barrier()


def _is_module(owner: object) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(owner, nnx.Module)


def _named(root: Any) -> Iterator[tuple[str, Any]]:
    """``(path, module)`` of every nnx module in `root`'s graph, the path joined by dots."""
    nnx = sys.modules["flax.nnx"]
    return ((".".join(map(str, path)), node) for path, node in nnx.iter_graph(root) if isinstance(node, nnx.Module))


def _device(axes: tuple[str, ...]) -> jax.Array:
    """This device's index in the enclosing shard_map's mesh (pmap: its rank along `axes`)."""
    mesh_axes = manual_axes()
    return lax.axis_index(mesh_axes) if mesh_axes else rank(axes)


def _store(recorder: Recorder, index: int, role: str, name: str, device: jax.Array, x: Array) -> None:
    """Send this device's `x` to the recorder when the program runs (bfloat16 as float32, as torch's side)."""
    x = x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
    jax.debug.callback(functools.partial(recorder.store, index, role, name), device, x)


def recorded_op(
    plan: Plan, axes: tuple[str, ...], x: Array, apply: Callable[[Plan, tuple[str, ...], Array], jax.Array]
) -> jax.Array:
    """``apply(plan, axes, x)``, recorded as one call of `plan`'s op (`commlib_jax._op.apply` calls this while
    recording, outside every recorded call; the backward's collectives are not recorded)."""
    recorder = ACTIVE[-1]
    index = recorder.open(plan.op_name, calling_module(recorder, _is_module, _named), describe_plan(plan))
    device = _device(axes)
    _store(recorder, index, "inputs", "x", device, x)
    with recorder.inside():
        out = apply(plan, axes, x)
    _store(recorder, index, "outputs", "out", device, out)
    return out


def recorded_layer(
    op: str, layer: Callable[..., jax.Array], axes: tuple[str, ...], q: Array, k: Array, v: Array, **keywords: Any
) -> jax.Array:
    """``layer(q, k, v, **keywords)`` recorded as one call of the attention layer `op` (inputs q, k, v)."""
    recorder = ACTIVE[-1]
    if recorder.depth:
        return layer(q, k, v, **keywords)
    plan = {name: str(tuple(x.shape)) for name, x in (("q", q), ("k", k), ("v", v))}
    plan.update(dtype=jnp.dtype(q.dtype).name, **{key: str(value) for key, value in keywords.items()})
    index = recorder.open(op, calling_module(recorder, _is_module, _named), plan, inputs=("q", "k", "v"))
    device = _device(axes)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _store(recorder, index, "inputs", name, device, x)
    with recorder.inside():
        out = layer(q, k, v, **keywords)
    _store(recorder, index, "outputs", "out", device, out)
    return out
