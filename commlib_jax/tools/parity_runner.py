"""JAX side of `commlib parity`: ``python -m commlib_jax.tools.parity_runner IN_DIR OUT_DIR --world-size N``
(``--workload train``: the training block instead, `commlib_jax.tools.train_parity`; ``--workload sequence``: the
sequence helpers and the flax example, `commlib_jax.tools.sequence_parity`; ``--workload masks``: the attention
layers with segment ids, `commlib_jax.tools.mask_parity`; ``--workload moe``: expert parallelism's route, dispatch
and combine, `commlib_jax.tools.moe_parity`).

Runs every case of the table on N CPU devices under ``jax.shard_map`` with check_vma on and off, under
``jax.pmap``, on a 2 x 2 mesh with a tuple axis name when N = 4, and the attention cases unsharded on one
device. ``usp_attention`` rows need two mesh axes: they run on an R x U mesh ("x" the ring, "y" the Ulysses
axis; device (r, u) is rank ``r * U + u``) under ``jax.shard_map`` with check_vma on and off (nested ``pmap`` does
not run on jax 0.10). Each rank's loss is ``sum(out_r * cotangent_r)``; the per-rank losses leave the map as a [W] array
and are summed outside, so gradients follow ``convention="sum"``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["MODES", "WORKLOADS", "main", "modes_for", "run_case"]

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]", "pmap", "shard_map[2x2 mesh]")


_USP = "usp_attention"


def modes_for(world_size: int, case=None) -> tuple[str, ...]:
    """The modes the runner runs at `world_size` (for `case`, where given: USP rows only under shard_map)."""
    if case is not None and case.op == _USP:
        return MODES[:2]
    return MODES if world_size == 4 else MODES[:3]


def _stacked(case, arrays, name):
    """Every rank's `name` stacked, in the case's dtype, as numpy: jit and pmap place its rows on the devices
    directly (a ``jax.Array`` on one device would first be resharded: a small program compiled per shape)."""
    import jax.numpy as jnp

    return np.asarray(np.stack(arrays[name]), dtype=jnp.dtype(case.dtype))


def _per_rank(case, axis_name):
    """This rank's output and loss for its slice of the stacked inputs (leading axis of size 1)."""
    import commlib_jax
    from commlib.tools import cases
    from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention

    def body(cotangent, *inputs):
        inputs = [x[0] for x in inputs]
        if case.op == cases.ATTENTION:
            out = ulysses_attention(*inputs, axis_name, **cases.attention_kwargs(case))
        elif case.op == "ring_attention":
            out = ring_attention(*inputs, axis_name, **cases.context_kwargs(case))
        elif case.op == _USP:  # axis_name: (ring axis, Ulysses axis)
            out = usp_attention(*inputs, axis_name[1], axis_name[0], **cases.context_kwargs(case))
        else:
            out = getattr(commlib_jax, case.op)(inputs[0], axis_name, **case.params)
        loss = (out * cotangent[0]).sum() if cotangent is not None else out.sum()
        return out[None], loss[None]

    return body


def _mapped(case, mode: str):
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    W = case.world_size
    if mode == "pmap":
        return jax.pmap(
            lambda ct, *xs: jax.tree.map(
                lambda t: t[0], _per_rank(case, "i")(None if ct is None else ct[None], *(x[None] for x in xs))
            ),
            axis_name="i",
        )
    devices = np.array(jax.devices()[:W])
    axis: str | tuple[str, str]
    if case.op == _USP:
        from commlib.tools import cases

        ring_size, ulysses_size, _ = cases.context_layout(case)
        mesh, axis = Mesh(devices.reshape(ring_size, ulysses_size), ("x", "y")), ("x", "y")
    elif mode == "shard_map[2x2 mesh]":
        mesh, axis = Mesh(devices.reshape(2, 2), ("x", "y")), ("x", "y")
    else:
        mesh, axis = Mesh(devices, ("i",)), "i"
    check_vma = mode != "shard_map[check_vma=False]"
    spec = P(axis)
    n = len(case.inputs) + 1
    return jax.shard_map(
        _per_rank(case, axis), mesh=mesh, in_specs=(spec,) * n, out_specs=(spec, spec), check_vma=check_vma
    )


def run_case(case, arrays, mode: str):
    """(outputs, {input: gradients}) per rank for `case` in `mode`; raises the frontend's error if rejected."""
    import jax

    mapped = _mapped(case, mode)
    inputs = [_stacked(case, arrays, name) for name in case.inputs]
    if not case.differentiable or "cotangent" not in arrays:  # integers, and calls the spec rejects
        out, _ = jax.jit(lambda *xs: mapped(None, *xs))(*inputs)  # no cotangent: the loss is out.sum()
        return list(jax.device_get(out)), {}  # numpy before iterating (a jax.Array's rows: a compile each)
    cotangent = _stacked(case, arrays, "cotangent")

    def total(inputs):
        out, losses = mapped(cotangent, *inputs)
        return losses.astype("float32").sum(), out

    grads, out = jax.device_get(jax.jit(jax.grad(total, has_aux=True))(inputs))
    as_numpy = lambda a: list(np.asarray(a, dtype=np.float64))  # noqa: E731
    return as_numpy(out), {name: as_numpy(g) for name, g in zip(case.inputs, grads, strict=True)}


def _unsharded(case, arrays):
    import jax
    import jax.numpy as jnp

    from commlib.tools import cases
    from commlib_jax.attention import attention

    kwargs = cases.attention_kwargs(case)
    options = dict(causal=kwargs.get("causal", False), scale=kwargs.get("scale"))
    whole = {name: jnp.asarray(value, dtype=case.dtype) for name, value in cases.attention_whole(case, arrays).items()}
    loss = lambda q, k, v: (attention(q, k, v, **options) * whole["cotangent"]).sum()  # noqa: E731
    grads = jax.grad(loss, argnums=(0, 1, 2))(whole["q"], whole["k"], whole["v"])
    shards = lambda a: cases.attention_shards(case, np.asarray(a, dtype=np.float64))  # noqa: E731
    out = attention(whole["q"], whole["k"], whole["v"], **options)
    return shards(out), dict(zip("qkv", map(shards, grads), strict=True))


#: workload -> (the spec module of its results class, that class, this frontend's module with its ``record``).
WORKLOADS = {
    "train": ("commlib.tools.train_parity", "TrainResults", "commlib_jax.tools.train_parity"),
    "sequence": ("commlib.tools.sequence_parity", "SequenceResults", "commlib_jax.tools.sequence_parity"),
    "masks": ("commlib.tools.mask_parity", "MaskResults", "commlib_jax.tools.mask_parity"),
    "moe": ("commlib.tools.moe_parity", "MoeResults", "commlib_jax.tools.moe_parity"),
    "fuzz": ("commlib.tools.fuzz_parity", "FuzzResults", "commlib_jax.tools.fuzz_parity"),
}


def _workload(args) -> int:
    """A workload of `WORKLOADS` (float64): its module's ``record(in_dir, results)``, then the results saved.
    Imported here: the device count is set first."""
    import importlib

    import jax

    jax.config.update("jax_enable_x64", True)
    spec_module, name, runner = WORKLOADS[args.workload]
    results = getattr(importlib.import_module(spec_module), name)("jax")
    importlib.import_module(runner).record(args.in_dir, results)
    results.save(args.out_dir, {"jax": jax.__version__, "python": sys.version.split()[0]})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib_jax.tools.parity_runner")
    parser.add_argument("in_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--workload", choices=("ops", *WORKLOADS), default="ops")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", args.world_size)
    with tempfile.TemporaryDirectory(prefix="commlib-jax-programs-") as programs:
        _compile_once(programs)
        return _workload(args) if args.workload in WORKLOADS else _ops(args)


def _compile_once(directory: str) -> None:
    """Compile each distinct program once in this run: JAX's compilation cache in `directory` (this run's, no
    minimum compile time or size), keyed by the program's text without its source locations, so modes that
    lower to the same program (shard_map over a 2 x 2 mesh and over ``("i",)``, ...) compile it once."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _ops(args) -> int:
    """The case table (float64 rows stay float64), every case in its modes, then the results saved."""
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 rows stay float64 (every other row names its dtype)
    from commlib.errors import CommError
    from commlib.tools import cases
    from commlib.tools.parity import Results

    results = Results("jax")
    for case, arrays in cases.read(args.in_dir):
        for mode in modes_for(args.world_size, case):
            try:
                results.add(case, mode, *run_case(case, arrays, mode))
            except (CommError, TypeError) as error:
                results.fail(case, mode, error)
            except Exception as error:  # a crash in one case is a failed row, not a dead runner
                results.fail(case, mode, f"crash: {type(error).__name__}: {error}")
        if case.op == cases.ATTENTION and cases.error_text(case) is None:
            try:
                results.add(case, "unsharded", *_unsharded(case, arrays))
            except Exception as error:  # as above: a failed row
                results.fail(case, "unsharded", f"crash: {type(error).__name__}: {error}")
    results.save(args.out_dir, {"jax": jax.__version__, "python": sys.version.split()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
