"""JAX side of ``commlib parity --workload moe`` (run by `commlib_jax.tools.parity_runner`): every case of
`commlib.tools.moe_parity.cases` with one T on every rank, under ``jax.shard_map`` with check_vma on, in one
jitted program (compiling dominates: one compile for every case). Each rank routes, dispatches, runs the
per-expert experts with NaN in y's padded rows, combines; the padded rows of the dispatched rows' cotangent are
NaN too. The per-rank losses ``sum(out * cotangent)`` leave the map and are summed outside, so the x, weights
and y gradients (y's through a zero ``probe`` added to the expert outputs) follow ``convention="sum"``."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import moe as moe_spec
from commlib.tools import moe_parity as spec
from commlib.tools import progress
from commlib_jax import moe

__all__ = ["MODES", "layers", "record"]

MODES = ("shard_map[check_vma=True]",)
DTYPES = {"float64": jnp.float64, "float32": jnp.float32, "bfloat16": jnp.bfloat16}


@jax.custom_vjp
def _nan_past(d: jax.Array, valid: jax.Array) -> jax.Array:
    """The identity, whose cotangent is NaN where not `valid` (the padded rows: never read by dispatch)."""
    return d


def _nan_past_forward(d: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    return d, valid


def _nan_past_backward(valid: jax.Array, bar: jax.Array) -> tuple[jax.Array, None]:
    return jnp.where(valid, bar, jnp.nan), None


_nan_past.defvjp(_nan_past_forward, _nan_past_backward)


def _padded_rows(case: spec.MoeCase, options: dict) -> int:
    plan = moe_spec.route_plan(
        (case.tokens[0], case.top_k), "int64", case.num_experts, case.world_size, layout="padded", **options
    )
    return plan.padded_rows


def _layer(case: spec.MoeCase, options: dict, axis: str):
    """One rank's loss and what it stores, from its x, weights, probe (differentiated), indices, cotangent."""

    def body(x, weights, probe, indices, cotangent):
        dtype = DTYPES[case.dtype]
        compute = jnp.float64 if case.dtype == "float64" else jnp.float32
        routing = moe.route(indices, case.num_experts, axis, **options)
        d = moe.dispatch(x, routing)
        most, rows = max(routing.plan.experts_per_rank), jnp.arange(d.shape[0])
        local = jnp.minimum(jnp.searchsorted(jnp.cumsum(routing.tokens_per_expert), rows, side="right"), most - 1)
        first = jnp.asarray(routing.plan.expert_offsets[:-1])[jax.lax.axis_index(axis)]
        shape = (-1,) + (1,) * (d.ndim - 1)
        valid = (rows < routing.rows).reshape(shape)
        scale = jnp.where(valid, 1.0 + (first + local).reshape(shape) / case.num_experts, 0.0).astype(compute)
        expert = jnp.tanh(scale * _nan_past(d, valid).astype(compute)).astype(dtype)
        y = jnp.where(valid, expert, jnp.nan) + probe  # NaN in the padded rows: never read
        out = moe.combine(y, routing, weights if case.weighted else None)
        loss = (out.astype(jnp.float64) * cotangent).sum()
        counts = jnp.stack([routing.rows, routing.dropped])
        return loss, dict(dispatched=d, out=out, tokens_per_expert=routing.tokens_per_expert, counts=counts)

    return body


def _program(found: list[tuple[spec.MoeCase, dict]], world: int, mode: str):
    mesh, axis = Mesh(np.array(jax.devices()[:world]), ("ep",)), "ep"
    bodies = [_layer(case, options, axis) for case, options in found]

    def per_rank(differentiated, fixed):
        results = []
        for body, own, other in zip(bodies, differentiated, fixed, strict=True):
            loss, stored = body(*(a[0] for a in own), *(a[0] for a in other))
            results.append((loss[None], jax.tree.map(lambda a: a[None], stored)))
        return results

    mapped = jax.shard_map(per_rank, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=mode == MODES[0])

    def run(differentiated, fixed):
        def total(differentiated):
            results = mapped(differentiated, fixed)
            return sum(loss.sum() for loss, _ in results), [stored for _, stored in results]

        return jax.grad(total, has_aux=True)(differentiated)

    return jax.jit(run)


def layers(world: int, seed: int, mode: str) -> dict[str, list[dict[str, np.ndarray]]]:
    """Per case name (every case of `world` with one T per rank): every rank's `spec.OUTPUTS` (float64) and
    `spec.COUNTS`, all cases in one program."""
    found = [(case, spec.data(case, seed)) for case in spec.cases(world) if mode in spec.modes("jax", case)]
    with_options = [(case, spec.route_options(case, inputs["indices"])) for case, inputs in found]
    differentiated, fixed = [], []
    for (case, inputs), (_, options) in zip(found, with_options, strict=True):
        dtype = DTYPES[case.dtype]
        probe = np.zeros((world, _padded_rows(case, options), *case.features))
        own = (np.stack(inputs["x"]), np.stack(inputs["weights"]), probe)
        differentiated.append(tuple(jnp.asarray(a, dtype) for a in own))
        fixed.append((jnp.asarray(np.stack(inputs["indices"])), jnp.asarray(np.stack(inputs["cotangent"]))))
    grads, stored = jax.device_get(_program(with_options, world, mode)(differentiated, fixed))
    results = {}
    for (case, _), (x_grad, w_grad, y_grad), values in zip(found, grads, stored, strict=True):
        arrays = values | dict(x_grad=x_grad, w_grad=w_grad, y_grad=y_grad)
        results[case.name] = [
            {key: np.asarray(arrays[key][rank], np.float64 if key in spec.OUTPUTS else np.int64) for key in arrays}
            for rank in range(world)
        ]
    return results


def record(in_dir: Path, results: spec.MoeResults) -> None:
    """Every case of the workload in `MODES` into `results` (a crash is a failed row for every case)."""
    settings = json.loads((in_dir / "moe.json").read_text())
    world = settings["world_size"]
    names = [case.name for case in spec.cases(world) for mode in MODES if mode in spec.modes("jax", case)]
    progress.expect(len(names))
    for mode in MODES:
        try:
            found = layers(world, settings["seed"], mode)
        except Exception as error:  # a crash is failed rows, not a dead runner
            for case in spec.cases(world):
                if mode in spec.modes("jax", case):
                    results.fail(case.name, mode, f"crash: {type(error).__name__}: {error}")
            continue
        for name, ranks in found.items():
            results.add(name, mode, ranks)
