"""The attention pieces on the fused kernels against the spec's einsum rules, and their peak memory and time per
piece (issue 32 items 2 and 4): one framework per process (``--framework torch`` or ``jax``), on one GPU, or on
the CPU with ``--cpu --small`` (the smoke mode CI runs: small shapes, the CPU kernels).

- torch: a ring piece (`commlib_torch.ring._attend` / `_attend_vjp`, the kernel `piece_kernel` chooses: flash for
  float16 / bfloat16 full or causal, the memory-efficient kernel for float32 and masks; the CPU flash kernel on
  CPU) against `commlib.blockwise.attend` / `attend_vjp` in float64 on the same inputs -- values, LSE and dq,
  dk, dv -- for each dtype, mask (full, causal, packed documents) and GQA; Ulysses' attention with segment ids
  (`commlib_torch.attention.attention`: on CUDA query blocks on the efficient kernel) against the same
  reference, values and gradients; `ring_attention` on a world of one rank (gloo) against `attention`; then
  one causal piece fwd+bwd per S: seconds and peak memory (``torch.cuda.max_memory_allocated``; CPU: -).
- JAX: `commlib_jax._kernels.attend_piece` (cuDNN where `fused_serves`) against the blockwise rules, and
  `local_attention`'s values and gradients; then `ring_attention` on a mesh of one device fwd+bwd per S:
  seconds, XLA's temp bytes and the device's peak bytes (where it reports them).

    python benchmarks/attention_check.py --framework torch --out /tmp/out/attention
    python benchmarks/attention_check.py --framework jax --cpu --small --out /tmp/smoke

Prints one line per check and per size; writes ``<framework>.json`` under ``--out``; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HEADS, DIM = 8, 64
#: Largest error of each check (value or gradient, relative to the reference's largest magnitude) per dtype.
TOLERANCE = {"float64": 1e-9, "float32": 2e-3, "bfloat16": 3e-2, "float16": 1e-2}
GPU_SIZES = (4096, 8192, 16384, 32768, 65536, 131072)
SMALL_SIZES = (128, 256)
EINSUM_UP_TO = 16384  # the einsum rules' piece holds [B, H, S, S] scores: timed only up to here


def _relative(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want[np.isfinite(want)]).max(initial=0.0)), 1e-30)
    both = np.isfinite(want) & np.isfinite(got)
    if (np.isfinite(want) != np.isfinite(got)).any():
        return math.inf
    return float(np.abs(got[both] - want[both]).max(initial=0.0)) / scale


def _check(results: list, name: str, dtype: str, kernel: str, errors: dict[str, float]) -> None:
    worst = max(errors.values())
    row = {"check": name, "dtype": dtype, "kernel": kernel, "errors": errors, "passed": worst <= TOLERANCE[dtype]}
    results.append(row)
    status = "ok  " if row["passed"] else "FAIL"
    print(f"{status} {name:<34} {dtype:<9} {kernel:<10} " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()))


# ---------------------------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------------------------


def _torch_checks(device: str, small: bool) -> tuple[list, list]:
    import torch

    from commlib import blockwise, segment_ids
    from commlib import ring as spec
    from commlib_torch import attention as layers
    from commlib_torch import ring

    dtypes = ["float32", "float64"] if device == "cpu" else ["float16", "bfloat16", "float32"]
    seq = 40 if small else 1000  # not a multiple of the kernels' tiles
    results: list = []
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for heads, kv_heads in ((HEADS, HEADS), (HEADS, 2)):
            shapes = ((2, seq, heads, DIM), (2, seq, kv_heads, DIM), (2, seq, kv_heads, DIM))
            plan = spec.ring_plan(*shapes, 1, dtypes=(dtype,) * 3)
            cpu = [torch.randn(shape, generator=generator).to(getattr(torch, dtype)) for shape in (*shapes, shapes[0])]
            ids = torch.from_numpy(np.stack([segment_ids([seq // 3, seq // 2], seq)] * 2))
            documents = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
            # a bool mask as the ring gives a piece one: [B, 1, 1, Sq, Sk] (`commlib.blockwise.attend`)
            masks = {"full": "full", "causal": "causal-diagonal", "documents": documents.tril()[:, None, None]}
            for mask_name, mask in masks.items():
                compute = plan.compute_dtype
                q, k, v, d_out = (x.to(device, getattr(torch, compute)) for x in cpu)
                on_device = mask if isinstance(mask, str) else mask.to(device)
                kernel = ring.piece_kernel(q.device.type, plan, on_device)
                out, lse = ring._attend(plan, q, k, v, on_device)
                rowsums = blockwise.delta(ring._MATH, out, d_out)
                grads = ring._attend_vjp(plan, q, k, v, out, d_out, lse, rowsums, on_device)
                ref = [x.double() for x in cpu]
                want_out, want_lse = blockwise.attend(ring._MATH, *ref[:3], plan.scale, mask)
                delta = blockwise.delta(ring._MATH, want_out, ref[3])
                wants = blockwise.attend_vjp(ring._MATH, *ref[:3], ref[3], want_lse, delta, plan.scale, mask)
                errors = {"out": _relative(out.cpu(), want_out), "lse": _relative(lse.cpu(), want_lse)}
                errors |= {n: _relative(g.cpu(), w) for n, g, w in zip(("dq", "dk", "dv"), grads, wants, strict=True)}
                _check(results, f"ring piece {mask_name} H={heads}/{kv_heads}", dtype, kernel, errors)
            # Ulysses' attention with segment ids (the query-block route on CUDA), values and gradients
            leaves = [x.to(device).clone().requires_grad_() for x in cpu[:3]]
            got = layers.attention(*leaves, causal=True, segment_ids=ids.to(device))
            got_grads = torch.autograd.grad(got, leaves, cpu[3].to(device))
            mask = documents.tril()[:, None, None]
            ref = [x.double() for x in cpu]
            want, want_lse = blockwise.attend(ring._MATH, *ref[:3], 1 / math.sqrt(DIM), mask)
            delta = blockwise.delta(ring._MATH, want, ref[3])
            wants = blockwise.attend_vjp(ring._MATH, *ref[:3], ref[3], want_lse, delta, 1 / math.sqrt(DIM), mask)
            errors = {"out": _relative(got.detach().cpu(), want)}
            errors |= {n: _relative(g.cpu(), w) for n, g, w in zip(("dq", "dk", "dv"), got_grads, wants, strict=True)}
            route = layers._kernels.choose(device, dtype, DIM, DIM, "array")
            route = route if route in ("flash", "efficient") else "sdpa-dense"
            _check(results, f"ulysses attention segments H={heads}/{kv_heads}", dtype, route, errors)
    results += _torch_layer(device, small)
    return results, _torch_sizes(device, small)


def _torch_layer(device: str, small: bool) -> list:
    """`ring_attention` (causal) on a gloo world of one rank, tensors on `device`, against `attention`."""
    import os

    import torch
    import torch.distributed as dist

    from commlib_torch.attention import attention, ring_attention

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    results: list = []
    dtype = "float32" if device == "cpu" else "bfloat16"
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 128 if small else 2048, HEADS, DIM, generator=generator) for _ in range(4)]
    runs = []
    for layer in (ring_attention, attention):
        leaves = [x.to(device, getattr(torch, dtype)).clone().requires_grad_() for x in inputs[:3]]
        out = layer(*leaves, causal=True)
        grads = torch.autograd.grad(out, leaves, inputs[3].to(device, out.dtype))
        runs.append([x.detach().float().cpu() for x in (out, *grads)])
    errors = {n: _relative(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), *runs, strict=True)}
    _check(results, "ring_attention W=1 vs attention", dtype, "layer", errors)
    return results


def _torch_sizes(device: str, small: bool) -> list:
    """One causal ring piece fwd+bwd per S (B = 1, H = 8, D = 64): seconds (the best of 3 after a warm-up)
    and peak memory above the inputs, on the fused kernel and (up to `EINSUM_UP_TO`) on the einsum rules."""
    import torch

    from commlib import ring as spec
    from commlib_torch import _compat, ring

    dtype = "float32" if device == "cpu" else "bfloat16"
    rows: list = []
    for seq in SMALL_SIZES if small else GPU_SIZES:
        shape = (1, seq, HEADS, DIM)
        plan = spec.ring_plan(shape, shape, shape, 1, causal=True, dtypes=(dtype,) * 3)
        q, k, v, d_out = (torch.randn(shape, device=device, dtype=torch.float32) for _ in range(4))
        for rules in ("fused", "einsum"):
            if rules == "einsum" and seq > EINSUM_UP_TO:
                continue
            saved = _compat.FLASH_CPU, _compat.FLASH_CUDA, _compat.EFFICIENT_CUDA
            if rules == "einsum":
                _compat.FLASH_CPU = _compat.FLASH_CUDA = _compat.EFFICIENT_CUDA = None
            try:
                kernel = ring.piece_kernel(device, plan, "causal-diagonal")
                rows.append(_time_piece(torch, plan, ring, (q, k, v, d_out), device) | {"seq": seq, "kernel": kernel})
            except torch.cuda.OutOfMemoryError as error:
                rows.append({"seq": seq, "kernel": rules, "error": str(error).splitlines()[0]})
            finally:
                _compat.FLASH_CPU, _compat.FLASH_CUDA, _compat.EFFICIENT_CUDA = saved
            print(f"size S={seq:<7} {rows[-1]}")
    return rows


def _time_piece(torch: Any, plan: Any, ring: Any, inputs: tuple, device: str) -> dict:
    from commlib import blockwise

    q, k, v, d_out = inputs

    def step() -> None:
        out, lse = ring._attend(plan, q, k, v, "causal-diagonal")
        rowsums = blockwise.delta(ring._MATH, out, d_out)
        ring._attend_vjp(plan, q, k, v, out, d_out, lse, rowsums, "causal-diagonal")

    cuda = device == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"seconds": min(times), "peak_mib": peak, "dtype": plan.dtype}


# ---------------------------------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------------------------------


def _jax_checks(device: str, small: bool) -> tuple[list, list]:
    import jax
    import jax.numpy as jnp

    from commlib import blockwise
    from commlib_jax import _kernels

    results: list = []
    dtypes = ["float32"] if device == "cpu" else ["float16", "bfloat16", "float32"]
    seq = 40 if small else 1000
    keys = jax.random.split(jax.random.key(0), 4)
    scale = 1 / math.sqrt(DIM)
    for dtype in dtypes:
        q, k, v, d_out = (jax.random.normal(key, (2, seq, HEADS, DIM), jnp.float32).astype(dtype) for key in keys)
        ref = [np.asarray(x, np.float64) for x in (q, k, v, d_out)]
        for mask in ("full", "causal-diagonal"):
            fused = _kernels.fused_serves(dtype, q.shape, k.shape, DIM, mask, None)
            compute = [x.astype(jnp.promote_types(dtype, jnp.float32)) for x in (q, k, v)]
            out, lse = _kernels.attend_piece(*compute, scale, mask, blockwise.BLOCK_SIZE, dtype)
            want_out, want_lse = blockwise.attend(blockwise.ArrayMath(np), *ref[:3], scale, mask)
            errors = {"out": _relative(out, want_out), "lse": _relative(lse, want_lse)}
            _check(results, f"jax ring piece {mask}", dtype, "cudnn" if fused else "blockwise", errors)

            def loss(q, k, v, mask=mask, d_out=d_out):
                out = _kernels.local_attention(
                    q, k, v, causal=mask != "full", scale=scale, block_size=blockwise.BLOCK_SIZE
                )
                return (out.astype(jnp.float32) * d_out.astype(jnp.float32)).sum(), out

            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            delta = blockwise.delta(blockwise.ArrayMath(np), want_out, ref[3])
            wants = blockwise.attend_vjp(blockwise.ArrayMath(np), *ref[:3], ref[3], want_lse, delta, scale, mask)
            errors = {"out": _relative(out, want_out)}
            errors |= {n: _relative(g, w) for n, g, w in zip(("dq", "dk", "dv"), grads, wants, strict=True)}
            _check(results, f"jax local_attention {mask}", dtype, "cudnn" if fused else "blockwise", errors)
    return results, _jax_sizes(small)


def _jax_sizes(small: bool) -> list:
    """`ring_attention` (causal) on a mesh of one device, fwd+bwd per S: seconds (best of 3 after the compiled
    call's first run), XLA's temp bytes, the device's peak bytes where it reports them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from commlib_jax.attention import ring_attention

    device = jax.devices()[0]
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    mesh, spec = Mesh(np.array([device]), ("i",)), P(None, "i")
    mapped = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, "i", causal=True), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
    )
    grad = jax.jit(jax.grad(lambda q, k, v: (mapped(q, k, v).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2)))
    rows: list = []
    for seq in SMALL_SIZES if small else GPU_SIZES:
        shape = jax.ShapeDtypeStruct((1, seq, HEADS, DIM), dtype)
        try:
            compiled = grad.lower(shape, shape, shape).compile()
            keys = jax.random.split(jax.random.key(seq), 3)
            q, k, v = (jax.random.normal(key, shape.shape, jnp.float32).astype(dtype) for key in keys)
            jax.block_until_ready(compiled(q, k, v))
            times = []
            for _ in range(3):
                start = time.perf_counter()
                jax.block_until_ready(compiled(q, k, v))
                times.append(time.perf_counter() - start)
            stats = device.memory_stats() or {}
            peak = stats.get("peak_bytes_in_use")
            row = {
                "seq": seq,
                "seconds": min(times),
                "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
                "peak_mib": None if peak is None else peak / 2**20,
                "dtype": jnp.dtype(dtype).name,
            }
        except Exception as error:  # an out-of-memory at the largest S is a result to store, not a crash
            row = {"seq": seq, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        rows.append(row)
        print(f"size S={seq:<7} {row}")
    return rows


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["torch", "jax"], required=True)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (no GPU needed)")
    parser.add_argument("--small", action="store_true", help="small shapes and sizes (the smoke mode)")
    parser.add_argument("--out", type=Path, help="the folder for <framework>.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: this tree's packages
    started = time.perf_counter()
    if args.framework == "torch":
        import torch

        device = "cpu" if args.cpu else "cuda"
        if device == "cuda" and not torch.cuda.is_available():
            print("attention_check: no CUDA device (pass --cpu)", file=sys.stderr)
            return 2
        versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        checks, sizes = _torch_checks(device, args.small)
    else:
        import jax

        if args.cpu:
            jax.config.update("jax_platforms", "cpu")
        elif jax.default_backend() not in ("gpu", "cuda"):
            print("attention_check: no GPU backend for JAX (pass --cpu)", file=sys.stderr)
            return 2
        versions, name = {"jax": jax.__version__}, str(jax.devices()[0].device_kind)
        checks, sizes = _jax_checks("cpu" if args.cpu else "gpu", args.small)
    failed = [row["check"] + " " + row["dtype"] for row in checks if not row["passed"]]
    result = {
        "framework": args.framework,
        "device": name,
        "versions": versions,
        "command": " ".join(["python benchmarks/attention_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "seconds": time.perf_counter() - started,
        "checks": checks,
        "sizes": sizes,
        "failed": failed,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.framework}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{len(checks) - len(failed)} of {len(checks)} checks passed in {result['seconds']:.1f} s"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
