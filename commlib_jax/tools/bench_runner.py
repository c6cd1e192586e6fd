"""JAX side of `commlib bench`: ``python -m commlib_jax.tools.bench_runner OUT.json --world-sizes 2 4 --sizes-mib 1 16
--repeats 7 [--quick]``.

Each case runs the commlib op and the bare `jax.lax` collective on the same per-device block inside
``jax.shard_map`` (check_vma=True) over W CPU devices, jitted: the forward, and the forward plus backward
(``value_and_grad`` of ``sum(out * cotangent)``). Variants are timed in rotating order, each call until
``block_until_ready``, in wall-clock and in CPU time (all threads); the driver (`commlib.tools.bench`) takes
medians. The forward values must agree, except where the bare op runs on another shape: the uneven Ulysses
case (padded layout, `commlib.tools.bench.uneven_ulysses`) against the even ``lax.all_to_all`` on the padded
size, with the bytes each sends from the spec's plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from commlib.tools import progress
from commlib.tools.bench import TRAIN_STEP, TRAIN_STEP_SIZES_MIB
from commlib_jax.tools import bench_context, bench_train

__all__ = ["JaxCase", "main", "time_calls"]

_AXIS = "i"
_HEADS, _HEAD_DIM = 8, 64


@dataclasses.dataclass(frozen=True)
class JaxCase:
    """One row family: per-device shape from (W, float32 elements), the commlib op and the bare lax op."""

    shape: Callable[[int, int], tuple[int, ...]]
    ours: Callable  # (x, axis_name) -> out, x this device's block
    bare: Callable
    quick: bool = False
    bare_shape: Callable[[int, int], tuple[int, ...]] | None = None  # the bare op's block, where it differs
    wire: Callable[[int, int], dict[str, int]] | None = None  # (W, bytes per device) -> bytes sent per variant
    baseline: str = "jax.lax"  # the bare op's name in the rows (the JAX target applies to "jax.lax" only)


def _flat(world_size: int, numel: int) -> tuple[int, ...]:
    return (numel // world_size // 128 * world_size, 128)


def _ulysses(batch: int) -> Callable[[int, int], tuple[int, ...]]:
    def shape(world_size: int, numel: int) -> tuple[int, ...]:
        seq = max(world_size, numel // (batch * _HEADS * _HEAD_DIM) // world_size * world_size)
        return (batch, seq, _HEADS, _HEAD_DIM)

    return shape


_PADDED_LAX = "jax.lax even on the padded size"


def _uneven_shape(padded: bool) -> Callable[[int, int], tuple[int, ...]]:
    """The uneven Ulysses block [1, n, H, 64] (padded rows, all heads), or the even one on the padded size."""

    def shape(world_size: int, numel: int) -> tuple[int, ...]:
        from commlib.tools.bench import UNEVEN_HEAD_DIM, uneven_ulysses

        _, heads, rows, padded_heads = uneven_ulysses(world_size, 4 * numel)
        return (1, rows, padded_heads if padded else sum(heads), UNEVEN_HEAD_DIM)

    return shape


def _uneven_ours(x, axis_name):
    """The padded layout's uneven all-to-all: sizes from the block (S = W n - 1 rows, the block's H heads)."""
    from jax import lax

    import commlib_jax as cl
    from commlib import split_sizes

    W = lax.axis_size(axis_name)
    return cl.all_to_all_4d(
        x, axis_name, 2, 1, scatter_sizes=split_sizes(x.shape[2], W), gather_sizes=split_sizes(W * x.shape[1] - 1, W)
    )


def _uneven_wire(world_size: int, nbytes: int) -> dict[str, int]:
    from commlib import plans
    from commlib.tools.bench import UNEVEN_HEAD_DIM, uneven_ulysses, wire_bytes

    seq, heads, rows, padded_heads = uneven_ulysses(world_size, nbytes)
    ours = plans.all_to_all_4d(
        (1, rows, sum(heads), UNEVEN_HEAD_DIM), world_size, scatter_sizes=heads, gather_sizes=seq
    )
    even = plans.all_to_all_4d((1, rows, padded_heads, UNEVEN_HEAD_DIM), world_size)
    return {"commlib": wire_bytes(ours), _PADDED_LAX: wire_bytes(even)}


def _cases() -> dict[str, JaxCase]:
    from jax import lax

    import commlib_jax as cl

    return {
        "all_reduce": JaxCase(_flat, lambda x, a: cl.all_reduce(x, a), lambda x, a: lax.psum(x, a), quick=True),
        "all_gather (dim 0)": JaxCase(
            _flat, lambda x, a: cl.all_gather(x, a, dim=0), lambda x, a: lax.all_gather(x, a, axis=0, tiled=True)
        ),
        "reduce_scatter (dim 0)": JaxCase(
            _flat,
            lambda x, a: cl.reduce_scatter(x, a, dim=0),
            lambda x, a: lax.psum_scatter(x, a, scatter_dimension=0, tiled=True),
            quick=True,
        ),
        "all_to_all_4d (2, 1) B=1": JaxCase(
            _ulysses(1),
            lambda x, a: cl.all_to_all_4d(x, a, 2, 1),
            lambda x, a: lax.all_to_all(x, a, 2, 1, tiled=True),
            quick=True,
        ),
        "all_to_all_4d (2, 1) B=2": JaxCase(
            _ulysses(2), lambda x, a: cl.all_to_all_4d(x, a, 2, 1), lambda x, a: lax.all_to_all(x, a, 2, 1, tiled=True)
        ),
        "all_to_all_4d (2, 1) B=1 uneven": JaxCase(
            _uneven_shape(False),
            _uneven_ours,
            lambda x, a: lax.all_to_all(x, a, 2, 1, tiled=True),
            bare_shape=_uneven_shape(True),
            wire=_uneven_wire,
            baseline=_PADDED_LAX,
        ),
    }


def _functions(case: JaxCase, world_size: int) -> dict[str, Callable]:
    """{"commlib fwd", "lax fwd", "commlib fwd+bwd", "lax fwd+bwd"} -> jitted functions of (x, cotangent)."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:world_size]), (_AXIS,))
    functions: dict[str, Callable] = {}
    for label, op in (("commlib", case.ours), ("lax", case.bare)):
        mapped = jax.shard_map(lambda x, op=op: op(x, _AXIS), mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS))
        functions[f"{label} fwd"] = jax.jit(lambda x, cotangent, mapped=mapped: mapped(x))
        loss = lambda x, cotangent, mapped=mapped: (mapped(x) * cotangent).sum()  # noqa: E731
        functions[f"{label} fwd+bwd"] = jax.jit(jax.value_and_grad(loss))
    return functions


def time_case(
    case: JaxCase, world_size: int, nbytes: int, repeats: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each variant (wall and cpu, as `time_calls`), `repeats` rounds in rotating order after
    `warmup` rounds."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    functions = _functions(case, world_size)

    def arrays(label: str, shape: tuple[int, ...]):
        x = jnp.asarray(rng.standard_normal((world_size * shape[0], *shape[1:]), dtype=np.float32))
        out_shape = jax.eval_shape(functions[f"{label} fwd"], x, x).shape
        return x, jnp.asarray(rng.standard_normal(out_shape, dtype=np.float32))

    shape = case.shape(world_size, nbytes // 4)
    inputs = {"commlib": arrays("commlib", shape)}
    inputs["lax"] = (
        inputs["commlib"] if case.bare_shape is None else arrays("lax", case.bare_shape(world_size, nbytes // 4))
    )
    forward = {name: np.asarray(fn(*inputs[name.split()[0]])) for name, fn in functions.items() if name.endswith("fwd")}
    if case.bare_shape is None and not np.allclose(forward["commlib fwd"], forward["lax fwd"], rtol=1e-5, atol=1e-5):
        raise AssertionError(f"commlib and lax disagree at world size {world_size}, shape {shape}")
    return time_calls({name: _bound(fn, inputs[name.split()[0]]) for name, fn in functions.items()}, repeats, warmup)


def _bound(fn: Callable, args: tuple) -> Callable[[], object]:
    """``fn(*args)`` as a call of no arguments."""
    return lambda: fn(*args)


def time_calls(calls: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each of `calls` (until ``block_until_ready``), wall-clock ("wall") and CPU time of all
    threads ("cpu"): `repeats` rounds in rotating order after `warmup` rounds."""
    import jax

    names = list(calls)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(warmup + repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(calls[name]())
            if index >= warmup:
                seconds[name].append(time.perf_counter() - start)
                cpu_seconds[name].append(time.process_time() - start_cpu)
    return {"wall": seconds, "cpu": cpu_seconds}


def _records(name: str, case: JaxCase, world_size: int, size: float, seconds: dict) -> list[dict]:
    wire, bare = case.wire(world_size, int(size * 2**20)) if case.wire else None, case.baseline
    return [
        {
            "framework": "jax",
            "case": f"{name} {part}",
            "world_size": world_size,
            "size_mib": size,
            "subject": "commlib",
            "baselines": [bare],
            "seconds": {"commlib": seconds["wall"][f"commlib {part}"], bare: seconds["wall"][f"lax {part}"]},
            "cpu_seconds": {"commlib": seconds["cpu"][f"commlib {part}"], bare: seconds["cpu"][f"lax {part}"]},
            "wire_bytes": wire,
        }
        for part in ("fwd", "fwd+bwd")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib_jax.tools.bench_runner")
    parser.add_argument("out", type=Path, help="JSON file for the records")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cases", nargs="+", default=None, help="case names (default: all; others ignored)")
    parser.add_argument("--quick", action="store_true", help="only the cases marked quick")
    parser.add_argument("--list-cases", action="store_true", help="print the case names, one a line, and stop")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", max(args.world_sizes))
    cases = _cases()
    if args.list_cases:
        print("\n".join([*cases, TRAIN_STEP, *map(bench_context.case_name, bench_context.KINDS)]))
        return 0
    names = args.cases or [name for name, case in cases.items() if case.quick or not args.quick]
    train_step = TRAIN_STEP in names or not (args.cases or args.quick)  # a whole step: not in --quick
    requested, everything = set(args.cases or ()), not (args.cases or args.quick)  # the context cases: not --quick
    names = [name for name in names if name in cases]  # --cases may name the other framework's cases
    records = []
    progress.expect(len(args.world_sizes) * (len(names) * len(args.sizes_mib) + train_step + 1))
    for world_size in args.world_sizes:
        for name in names:
            for size in args.sizes_mib:
                seconds = time_case(cases[name], world_size, int(size * 2**20), args.repeats, args.warmup)
                records += _records(name, cases[name], world_size, size, seconds)
                progress.done(f"W={world_size} {name} {size:g} MiB")
        if train_step:
            records += bench_train.records(world_size, TRAIN_STEP_SIZES_MIB, args.repeats, args.warmup)
            progress.done(f"W={world_size} {TRAIN_STEP}")
        context = [kind for kind in bench_context.KINDS if bench_context.case_name(kind) in requested or everything]
        records += bench_context.records(
            world_size, context, lambda calls: time_calls(calls, args.repeats, args.warmup)
        )
        progress.done(f"W={world_size} context attention")
    versions = {"jax": jax.__version__, "python": sys.version.split()[0]}
    args.out.write_text(json.dumps({"versions": versions, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
