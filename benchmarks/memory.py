"""Peak memory of the attention layers, forward + backward (issue 32 item 3): Ulysses, ring and USP at B = 1,
H = 8, D = 64, float32, causal, W = 4, each (framework, layer, S) in a fresh subprocess.

- JAX (4 CPU devices in one process): ``jax.jit(jax.grad(loss))`` of ``shard_map(layer)`` compiled, XLA's
  ``memory_analysis().temp_size_in_bytes`` of the program (per device: the SPMD program every device runs),
  then, for S <= ``--run-up-to``, run once and the process's peak RSS (``ru_maxrss``: the 4 devices together)
  and the seconds of a second call;
- torch (4 gloo ranks on CPU, `commlib_torch.tools.pool.WorkerPool`): one fwd+bwd per rank after a warm-up
  call at S = 1024, each rank's peak RSS (the largest rank's is stored) and seconds.

``--baseline-path DIR`` runs the JAX layers of another tree (e.g. ``/work/main``) at ``--speed-seq`` in the same
invocation, and stores the speed ratio of this tree's to it (``--repeats`` calls each, median).

    PYTHONPATH=. python -m benchmarks.memory --out benchmarks/results/<dir>/memory.json
    PYTHONPATH=. python -m benchmarks.memory --frameworks jax --sizes 4096 8192 --run-up-to 0
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("ulysses", "ring", "usp")
HEADS, DIM, WORLD = 8, 64, 4
STDERR_LINES = 20  # of a failed child's stderr, stored with its row


def _rss_mib() -> float:
    """This process's resident memory now (``/proc/self/status`` VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------------------
# JAX: one (layer, S) in this process
# ---------------------------------------------------------------------------------------------------------


def xla_flags(timeout: float, flags: str = "") -> str:
    """`flags` with the JAX child's: 4 CPU devices, and XLA's CPU collectives allowed to wait `timeout` seconds.

    A device that reaches a collective waits for the others there; XLA's CPU runtime ends the process after
    ``--xla_cpu_collective_call_terminate_timeout_seconds`` (default 40: "Termination timeout ... Exiting to
    ensure a consistent program state", then a native stack trace) and fails a collective after
    ``--xla_cpu_collective_timeout_seconds`` (default 1,800). The causal contiguous ring is skewed (device 0
    skips what device 3 computes), so at S = 65,536 on 2 shared cores a device waits minutes at a step's
    permute: with the defaults that run died."""
    seconds = max(int(timeout), 1)
    return " ".join(
        [
            flags,
            f"--xla_force_host_platform_device_count={WORLD}",
            f"--xla_cpu_collective_call_terminate_timeout_seconds={seconds}",
            f"--xla_cpu_collective_timeout_seconds={seconds}",
        ]
    ).strip()


def _jax_child(layer: str, seq: int, run: bool, repeats: int, block_size: int | None, timeout: float) -> dict:
    os.environ["XLA_FLAGS"] = xla_flags(timeout, os.environ.get("XLA_FLAGS", ""))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import commlib_jax
    from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention

    devices = np.array(jax.devices()[:WORLD])
    kwargs = {} if block_size is None else {"block_size": block_size}  # a tree before issue 32 has no keyword
    if layer == "usp":
        mesh, spec = Mesh(devices.reshape(2, 2), ("ring", "ulysses")), P(None, ("ring", "ulysses"))
        call = lambda q, k, v: usp_attention(q, k, v, "ulysses", "ring", causal=True, **kwargs)  # noqa: E731
    else:
        mesh, spec = Mesh(devices, ("i",)), P(None, "i")
        attend = ulysses_attention if layer == "ulysses" else ring_attention
        call = lambda q, k, v: attend(q, k, v, "i", causal=True, **kwargs)  # noqa: E731
    mapped = jax.shard_map(call, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    grad = jax.jit(jax.grad(lambda q, k, v: (mapped(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))
    shape = jax.ShapeDtypeStruct((1, seq, HEADS, DIM), jnp.float32)
    before = _rss_mib()
    start = time.perf_counter()
    compiled = grad.lower(shape, shape, shape).compile()
    facts = {
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "compile_s": time.perf_counter() - start,
        "rss_before_mib": before,
        "imported": str(Path(commlib_jax.__file__).parent),  # the tree whose layers were measured
        "xla_flags": os.environ["XLA_FLAGS"],
    }
    if run:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, (1, seq, HEADS, DIM), jnp.float32) for key in keys)
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times = [time.perf_counter() - start] if repeats == 0 else []  # --repeats 0: the first call timed
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - start)
        facts |= {"peak_rss_mib": _peak_mib(), "seconds": statistics.median(times), "times": times}
    return facts


# ---------------------------------------------------------------------------------------------------------
# torch: one (layer, S) on a fresh pool of 4 gloo ranks
# ---------------------------------------------------------------------------------------------------------


def torch_job(ctx, layer: str, seq: int) -> dict:
    """One rank: a warm-up fwd+bwd at S = 1024, then one at `seq`; its RSS before and its peak, its seconds."""
    import torch
    import torch.distributed as dist

    from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
    from commlib_torch.tools.bench_context import _usp_groups

    groups = _usp_groups(ctx.world_size) if layer == "usp" else None

    def step(rows: int) -> float:
        generator = torch.Generator().manual_seed(ctx.rank)
        q, k, v = (torch.randn(1, rows, HEADS, DIM, generator=generator).requires_grad_() for _ in range(3))
        dist.barrier()
        start = time.perf_counter()
        if layer == "usp":
            out = usp_attention(q, k, v, *groups, causal=True)
        elif layer == "ring":
            out = ring_attention(q, k, v, causal=True)
        else:
            out = ulysses_attention(q, k, v, causal=True)
        (out**2).sum().backward()
        return time.perf_counter() - start

    step(1024 // ctx.world_size)
    before = _rss_mib()
    seconds = step(seq // ctx.world_size)
    return {"rss_before_mib": before, "peak_rss_mib": _peak_mib(), "seconds": seconds}


def _torch_child(layer: str, seq: int) -> dict:
    from commlib_torch.tools.pool import WorkerPool

    sys.path.insert(0, str(ROOT))  # this tree's benchmarks package (run as a script: its folder is first)
    job = importlib.import_module("benchmarks.memory").torch_job  # picklable by its module's name
    with WorkerPool(WORLD, timeout=3600.0) as pool:
        ranks = pool.run(job, layer, seq)
    largest = max(ranks, key=lambda rank: rank["peak_rss_mib"])
    return {
        "peak_rss_mib": largest["peak_rss_mib"],
        "rss_before_mib": largest["rss_before_mib"],
        "seconds": max(rank["seconds"] for rank in ranks),
        "ranks": ranks,
    }


# ---------------------------------------------------------------------------------------------------------
# The parent: every measurement in its own subprocess
# ---------------------------------------------------------------------------------------------------------


def _measure(
    framework: str, layer: str, seq: int, run: bool, repeats: int, path: Path, timeout: float, block_size: int = 0
) -> dict:
    # run as a script from `path`: sys.path is this file's folder, then `path` (its commlib, commlib_jax), then
    # this tree (`python -m` would put the working folder, this tree, first and import its packages instead)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", framework, layer, str(seq), str(int(run))]
    command += ["--repeats", str(repeats), "--child-block-size", str(block_size), "--timeout", str(timeout)]
    env = dict(os.environ, PYTHONPATH=f"{path}{os.pathsep}{ROOT}")
    row = {"framework": framework, "layer": layer, "seq": seq, "tree": str(path), "block_size": block_size or None}
    try:
        done = subprocess.run(command, env=env, cwd=path, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return row | {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode:  # the last line, and the last lines that are not a native stack trace's frames
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        said = [line for line in lines if not line.lstrip().startswith("@")][-STDERR_LINES:]
        return row | {"error": lines[-1], "exit": done.returncode, "stderr": said}
    return row | json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    parser.add_argument("--sizes", nargs="+", type=int, default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument(
        "--run-up-to", type=int, default=65536, help="run (RSS, seconds) only up to this S; JAX above it: compiled only"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed JAX calls after the first (median; 0: the first call timed)"
    )
    parser.add_argument("--baseline-path", type=Path, help="another tree whose JAX layers run at --speed-seq")
    parser.add_argument("--speed-seq", type=int, default=8192)
    parser.add_argument("--speed-layers", nargs="+", choices=LAYERS, help="the layers timed against the baseline")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    parser.add_argument("--out", type=Path, help="the JSON to write (default: print only)")
    parser.add_argument(
        "--block-sizes", nargs="+", type=int, default=[0], help="JAX layers' block_size= (0: the default, not passed)"
    )
    parser.add_argument("--child-block-size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=4, metavar=("FRAMEWORK", "LAYER", "SEQ", "RUN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        framework, layer, seq, run = args.child
        if framework == "jax":
            facts = _jax_child(layer, int(seq), run == "1", args.repeats, args.child_block_size or None, args.timeout)
        else:
            facts = _torch_child(layer, int(seq))
        print(json.dumps(facts))
        return 0

    from tqdm import tqdm

    from commlib.tools.quotes import memory_table

    plan = [
        (f, layer, seq, b)
        for f in args.frameworks
        for layer in args.layers
        for seq in args.sizes
        for b in args.block_sizes
    ]
    plan = [(f, layer, seq, b) for f, layer, seq, b in plan if f == "jax" or (seq <= args.run_up_to and not b)]
    rows: list[dict] = []
    baseline_rows: list[dict] = []
    speed: list[dict] = []
    started = time.perf_counter()

    def result(complete: bool) -> dict:
        return {
            "shape_B_H_D": [1, HEADS, DIM],
            "world_size": WORLD,
            "dtype": "float32",
            "causal": True,
            "command": " ".join(["python -m benchmarks.memory", *(argv if argv is not None else sys.argv[1:])]),
            "load_average": os.getloadavg(),
            "seconds": time.perf_counter() - started,
            "complete": complete,  # False: written after a row, the run still going (or cut off there)
            "rows": rows,
            "baseline_rows": baseline_rows,
            "speed": speed,
        }

    def write(complete: bool) -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result(complete), indent=1) + "\n")

    for framework, layer, seq, block_size in (bar := tqdm(plan, unit="run")):
        bar.set_description(f"{framework} {layer} S={seq}" + (f" block {block_size}" if block_size else ""))
        run = seq <= args.run_up_to
        rows.append(_measure(framework, layer, seq, run, args.repeats, ROOT, args.timeout, block_size))
        write(False)  # each row stored as it comes: a long run cut off keeps what it measured
    if args.baseline_path is not None:  # the baseline's compiled temp bytes at every size (compiled only)
        for layer, seq in (bar := tqdm([(layer, seq) for layer in args.layers for seq in args.sizes], unit="run")):
            bar.set_description(f"baseline jax {layer} S={seq}")
            baseline_rows.append(_measure("jax", layer, seq, False, 0, args.baseline_path, args.timeout))
        for layer in (bar := tqdm(args.speed_layers or args.layers, unit="layer")):
            bar.set_description(f"speed at S={args.speed_seq}: {layer}")
            pair = [
                _measure("jax", layer, args.speed_seq, True, args.repeats, p, args.timeout)
                for p in (ROOT, args.baseline_path)
            ]
            ratio = pair[0]["seconds"] / pair[1]["seconds"] if all("seconds" in x for x in pair) else None
            speed.append({"layer": layer, "seq": args.speed_seq, "this": pair[0], "baseline": pair[1], "ratio": ratio})
    print(memory_table(rows))
    if baseline_rows:
        print(f"baseline {args.baseline_path}:")
        print(memory_table(baseline_rows))
    for entry in speed:
        print(f"speed at S={entry['seq']} {entry['layer']}: this / baseline = {entry['ratio']}")
    write(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
