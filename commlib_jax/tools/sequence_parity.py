"""JAX side of ``commlib parity --workload sequence`` (run by `commlib_jax.tools.parity_runner`): every sequence helper
on every layout of `commlib.tools.sequence_parity.layouts` under ``jax.shard_map`` with check_vma on and off (a
USP layout on an R x U mesh with the tuple axis ``("ring", "ulysses")``), each rank's outputs and input gradients
in the padded layout (padding rows of the inputs hold 7.0: ignored, gradient 0); each rank's loss is
``sum(out_r * cotangent_r)`` plus its `cross_entropy`, summed outside the map. At W = 4 also examples/flax_llama.py's
first jitted step with ulysses, ring and usp against the same decoder unsharded."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib.sequence import SequenceLayout
from commlib.tools import progress
from commlib.tools import sequence_parity as spec
from commlib_jax import sequence

__all__ = ["MODES", "helpers", "model", "record"]

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]")
FILL = 7.0  # the padding rows' inputs: every helper must ignore them


def _mesh(layout: SequenceLayout):
    """The mesh and axis name: ``("ring", "ulysses")`` for a USP layout (shard ``r * U + u``), else ``"i"``."""
    devices = np.array(jax.devices()[: layout.world_size])
    if layout.ring_size > 1 and layout.ulysses_size > 1:
        return Mesh(devices.reshape(layout.ring_size, layout.ulysses_size), ("ring", "ulysses")), ("ring", "ulysses")
    return Mesh(devices, ("i",)), "i"


def _body(layout: SequenceLayout, axis):
    def body(ids, x, shards, replicated, logits, labels, shard_ct, gather_ct, replicated_ct):
        ids, x, shards, replicated, logits, labels, shard_ct, gather_ct, replicated_ct = (
            a[0] for a in (ids, x, shards, replicated, logits, labels, shard_ct, gather_ct, replicated_ct)
        )
        tokens = sequence.shard_tokens(ids, layout, axis, ignore_index=spec.IGNORE)
        outs = (
            sequence.shard_sequence(x, layout, axis),
            sequence.gather_sequence(shards, layout, axis),
            sequence.gather_sequence(replicated, layout, axis, convention="replicated"),
        )
        loss = sequence.cross_entropy(logits, labels, axis, ignore_index=spec.IGNORE)
        total = sum(jnp.sum(out * ct) for out, ct in zip(outs, (shard_ct, gather_ct, replicated_ct), strict=True))
        found = (*tokens, sequence.position_ids(layout, axis)[None], *outs, loss)
        return jax.tree.map(lambda a: a[None], found), (total + loss)[None]

    return body


def _program(layout: SequenceLayout, mode: str):
    mesh, axis = _mesh(layout)
    mapped = jax.shard_map(
        _body(layout, axis), mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=mode == MODES[0]
    )

    def run(ids, x, shards, replicated, logits, labels, *cotangents):
        def total(x, shards, replicated, logits):
            found, losses = mapped(ids, x, shards, replicated, logits, labels, *cotangents)
            return losses.sum(), found

        return jax.grad(total, argnums=(0, 1, 2, 3), has_aux=True)(x, shards, replicated, logits)

    return jax.jit(run)


def _padded(shards: list[np.ndarray], rows: int, value: float = FILL) -> np.ndarray:
    return np.stack([spec.pad(shard, rows, value) for shard in shards])


def helpers(layout: SequenceLayout, seed: int, mode: str) -> list[dict[str, np.ndarray]]:
    """Every helper of `spec.OUTPUTS` on every rank (padded layout)."""
    case, W, rows = spec.data(layout, seed), layout.world_size, layout.max_size
    shards = _padded(layout.shard(case["x"], 1), rows)
    labels = _padded(layout.shard(case["labels"], 1), rows, spec.IGNORE)
    inputs = (
        np.broadcast_to(case["ids"], (W, *case["ids"].shape)),
        np.broadcast_to(case["x"], (W, *case["x"].shape)),
        shards,
        shards.copy(),
        _padded(layout.shard(case["logits"], 1), rows),
        labels,
        _padded(case["shard_cotangents"], rows),
        np.stack(case["gather_cotangents"]),
        np.stack(case["replicated_cotangents"]),
    )
    grads, found = _program(layout, mode)(*inputs)
    outputs = ("ids", "positions", "labels", "position_ids", "shard_out", "gather_out", "gather_replicated_out", "loss")
    named = dict(zip(outputs, found, strict=True))
    named |= dict(zip(("shard_grad", "gather_grad", "gather_replicated_grad", "loss_grad"), grads, strict=True))
    return [{key: np.asarray(value[rank]) for key, value in named.items()} for rank in range(W)]


def model(example, attention: str, seq_len: int) -> dict[str, float]:
    """examples/flax_llama.py's first jitted step (its `setup`, `Decoder`, `sharded_step`, `unsharded_step`)
    against the unsharded decoder: the relative errors of the loss, the logits and every gradient."""
    import optax  # type: ignore[import-untyped]  # optax ships no stubs
    from flax import nnx

    layout, mesh, axes, sequence_parallel = example.setup(attention, seq_len, 2)
    graphdef, params = nnx.split(example.Decoder(nnx.Rngs(0)), nnx.Param)
    optimizer = optax.adamw(1e-3)
    input_ids = jax.random.randint(jax.random.key(1), (2, seq_len), 0, example.VOCAB)
    with sequence_parallel:
        step = example.sharded_step(graphdef, optimizer, layout, mesh, axes)
        *_, loss, grads, logits = step(params, optimizer.init(params), input_ids)
    *_, want, want_grads, want_logits = example.unsharded_step(graphdef, optimizer)(
        params, optimizer.init(params), input_ids
    )
    shards = np.split(np.asarray(logits), layout.world_size, axis=1)
    return {
        "loss": example.relative(loss, want),
        "logits": example.relative(layout.unshard(shards, dim=1, padded=True), want_logits),
        "gradients": max(jax.tree.leaves(jax.tree.map(example.relative, grads, want_grads))),
    }


def record(in_dir: Path, results: spec.SequenceResults) -> None:
    """Every layout's helpers in both modes and, at W = 4, the flax example's rows into `results`."""
    settings = json.loads((in_dir / "sequence.json").read_text())
    world_size, seed = settings["world_size"], settings["seed"]
    models = [attention for example, attention in spec.model_cases(world_size) if example == "flax"]
    example = None
    if models:  # imported first: it sets the device count, which JAX takes only before its first use
        try:
            example = spec.example("flax_llama")
        except Exception as error:  # no checkout or no flax: failed rows, the helpers still run
            for attention in models:
                results.fail(spec.model_name("flax", attention), MODES[0], f"crash: {error!r}")
    layouts = spec.layouts(world_size)
    progress.expect(len(layouts) + len(models))
    for layout in layouts:
        for mode in MODES:
            try:
                results.add(spec.name(layout), mode, helpers(layout, seed, mode))
            except Exception as error:  # a crash in one layout is a failed row, not a dead runner
                results.fail(spec.name(layout), mode, error)
    for attention in models if example is not None else []:
        case = spec.model_name("flax", attention)
        try:
            results.add(case, MODES[0], [model(example, attention, spec.MODEL_LENGTH)])
        except Exception as error:  # as above
            results.fail(case, MODES[0], error)
