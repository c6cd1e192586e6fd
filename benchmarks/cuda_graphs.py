"""Can CUDA graphs capture the torch ops? (issue 13, part 4) -- for a machine with a GPU; not run on CPU.

    python benchmarks/cuda_graphs.py --out DIR     # 47 s on the H200; every row also in DIR/rows.json
    python benchmarks/cuda_graphs.py --dry-run     # no GPU: checks the script itself on the CPU (~40 s)

Four settings, each in its own process with its own time limit; every row is written to DIR/<setting>.jsonl
the moment it is known, so a setting that hangs or runs out of time still leaves the rows it finished:

- ``fake``: torch's fake process group (W=4, CUDA tensors) moves nothing, so what is captured is commlib's
  whole path -- plan look-up, the autograd Function, the pack/unpack passes (torch copies, the word copy, the
  Triton pack kernel for the large bf16 rows), the buffers -- for every op, forward and forward+backward, in a
  ``torch.cuda.CUDAGraph``, then replayed; the eager warm-up calls run under
  ``torch.cuda.set_sync_debug_mode("error")``, so a host synchronisation in commlib raises. (The fake backend
  writes nothing, so values are not compared here.)
- ``nccl``: one process, NCCL at world size 1 (every op is the identity there): captured as above.
- ``gloo``: two processes on the one GPU, CUDA tensors: every op eagerly, outputs and input gradients compared
  with the same call on CPU tensors. No capture: gloo stages CUDA tensors through host memory, and a capture
  that fails on one rank inside a collective leaves the other rank waiting.
- ``compile``: ``torch.compile(mode="reduce-overhead")`` of a small layer of ops on the fake group: Inductor's
  CUDA graphs must not be skipped.

Checked mode is not in any of them: it reads every rank's fingerprint on the host, by design.
Exit status 0 when every fake, nccl and compile row captured and every gloo row matched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

_SETTINGS = ("fake", "nccl", "gloo", "compile")
_LIMITS = {"fake": 140.0, "nccl": 50.0, "gloo": 70.0, "compile": 80.0}  # seconds per setting's process
_DEVICE = "cuda"  # "cpu" with --dry-run
_ROWS: Path | None = None  # a setting's process appends each row here as soon as it has it


def _ops(world_size: int):
    """(name, input shape, dtype, call) for every public op, the dims and roots that take different paths."""
    import commlib_torch as cl
    from commlib import split_sizes

    W = world_size
    ring = [(rank, (rank + 1) % W) for rank in range(W)]
    heads_total = max(2, 2 * W - 2)
    seq, heads = split_sizes(4 * W - 1, W), split_sizes(heads_total, W)
    return [
        ("all_reduce sum", (256,), torch.float32, lambda x: cl.all_reduce(x)),
        ("all_reduce avg", (256,), torch.bfloat16, lambda x: cl.all_reduce(x, "avg")),
        ("all_reduce max", (256,), torch.float32, lambda x: cl.all_reduce(x, "max")),
        ("all_reduce product", (256,), torch.float32, lambda x: cl.all_reduce(x, "product")),
        ("all_reduce bf16 accum fp32", (256,), torch.bfloat16, lambda x: cl.all_reduce(x, accum_dtype=torch.float32)),
        ("all_reduce replicated", (256,), torch.float32, lambda x: cl.all_reduce(x, convention="replicated")),
        ("all_gather dim 0", (8, 32), torch.float32, lambda x: cl.all_gather(x, 0)),
        ("all_gather dim -1", (8, 32), torch.float32, lambda x: cl.all_gather(x, -1)),
        ("reduce_scatter dim 0", (8 * W, 32), torch.float32, lambda x: cl.reduce_scatter(x, 0)),
        ("reduce_scatter dim 1", (8, 8 * W), torch.float32, lambda x: cl.reduce_scatter(x, 1)),
        ("all_to_all (1, 0)", (1, 64 * W), torch.float32, lambda x: cl.all_to_all(x, 1, 0)),
        ("all_to_all_4d (2, 1) B=1", (1, 8, 8 * W, 16), torch.float32, lambda x: cl.all_to_all_4d(x, 2, 1)),
        ("all_to_all_4d (1, 2) B=2", (2, 8 * W, 8, 16), torch.float32, lambda x: cl.all_to_all_4d(x, 1, 2)),
        (
            "all_to_all_4d (2, 1) B=2 bf16 8 MiB",
            (2, 512, 8 * W, 128),
            torch.bfloat16,
            lambda x: cl.all_to_all_4d(x, 2, 1),
        ),  # the word-copy pack
        (
            "all_to_all_4d (2, 1) B=2 bf16 32 MiB",
            (2, 2048, 8 * W, 128),
            torch.bfloat16,
            lambda x: cl.all_to_all_4d(x, 2, 1),
        ),  # the Triton pack kernel
        ("broadcast src 0", (256,), torch.float32, lambda x: cl.broadcast(x, 0)),
        ("broadcast src W-1", (256,), torch.float32, lambda x: cl.broadcast(x, W - 1)),
        ("gather dst 0", (8, 32), torch.float32, lambda x: cl.gather(x, 0, 0)),
        ("gather dst W-1", (8, 32), torch.float32, lambda x: cl.gather(x, W - 1, 0)),
        ("scatter src 0", (8 * W, 32), torch.float32, lambda x: cl.scatter(x, 0, 0)),
        ("scatter src W-1", (8 * W, 32), torch.float32, lambda x: cl.scatter(x, W - 1, 0)),
        ("permute ring", (256,), torch.float32, lambda x: cl.permute(x, ring)),
        ("sum_grad", (256,), torch.float32, lambda x: cl.sum_grad(x)),
        ("shard dim 0", (8 * W, 32), torch.float32, lambda x: cl.shard(x, 0)),
        ("reduce dst 0", (256,), torch.float32, lambda x: cl.reduce(x, 0)),
        ("reduce dst W-1 avg", (256,), torch.bfloat16, lambda x: cl.reduce(x, W - 1, "avg")),
        # uneven sizes (rank 0's shape: the fake and nccl settings only), S = 4W - 1, H = 2W - 2 (2 at W = 1)
        (
            "all_to_all_4d (2, 1) B=1 uneven",
            (1, seq[0], heads_total, 16),
            torch.float32,
            lambda x: cl.all_to_all_4d(x, 2, 1, gather_sizes=seq, scatter_sizes=heads),
        ),
        ("all_gather dim 0 uneven", (seq[0], 32), torch.float32, lambda x: cl.all_gather(x, 0, sizes=seq)),
    ]


def _step(call, backward: bool):
    """x -> output (forward) or x -> (output, input gradient) through autograd with a fixed cotangent."""
    if not backward:
        return call

    def forward_backward(x):
        out = call(x)
        (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
        return out, grad

    return forward_backward


def _capture(fn, x) -> str:
    """Warm `fn` up eagerly (host syncs raise), capture it in a CUDA graph and replay it: "ok" or the error.
    (--dry-run, on the CPU: the eager calls only.)"""
    try:
        if not x.is_cuda:
            for _ in range(3):
                fn(x)
            return "ok"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    fn(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        return "ok"
    except Exception as error:  # the report says what failed, op by op
        return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def _emit(rows: list[dict], row: dict, to: Path | None = None) -> None:
    """Keep `row` and, when a rows file was named, append it there at once (a later hang keeps it)."""
    rows.append(row)
    to = to or _ROWS
    if to is not None:
        with to.open("a") as out:
            out.write(json.dumps(row) + "\n")


def _capture_rows(world_size: int, setting: str) -> list[dict]:
    rows: list[dict] = []
    for name, shape, dtype, call in _ops(world_size):
        differentiable = dtype.is_floating_point
        x = torch.randn(shape, device=_DEVICE).to(dtype).requires_grad_(differentiable)
        _emit(rows, {"setting": setting, "op": name, "what": "forward", "result": _capture(_step(call, False), x)})
        if differentiable:
            _emit(
                rows,
                {"setting": setting, "op": name, "what": "forward+backward", "result": _capture(_step(call, True), x)},
            )
    return rows


def _compile() -> list[dict]:
    """torch.compile(mode="reduce-overhead") of a small layer: Inductor's CUDA graphs must not be skipped."""
    from torch._dynamo.utils import counters
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commlib_torch as cl

    def layer(x):
        y = cl.all_to_all_4d(x, 2, 1) * 2.0
        return cl.all_reduce(cl.all_to_all_4d(y, 1, 2), "avg")

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        x = torch.randn(1, 8, 32, 16, device=_DEVICE)
        for _ in range(3):
            compiled(x)
        if _DEVICE == "cuda":
            torch.cuda.synchronize()
        skipped = {key: value for key, value in counters["inductor"].items() if "cudagraph_skip" in key and value}
        if _DEVICE == "cpu":  # (--dry-run: no CUDA graphs to skip; that the layer compiled is the check)
            skipped = {}
        result = "ok" if not skipped else f"cudagraphs skipped: {skipped}"
    except Exception as error:
        result = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    dist.destroy_process_group()
    rows: list[dict] = []
    _emit(
        rows,
        {
            "setting": "compile",
            "op": "reduce-overhead (a2a4d, a2a4d, all_reduce), fake W=4",
            "what": "forward",
            "result": result,
        },
    )
    return rows


def _fake() -> list[dict]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    rows = _capture_rows(4, "fake")
    dist.destroy_process_group()
    return rows


def _nccl() -> list[dict]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rows = _capture_rows(1, "nccl")
    dist.destroy_process_group()
    return rows


def _gloo_job(ctx, rows_file: Path | None, device: str) -> list[dict]:
    """On each of two gloo ranks, one GPU: every op on CUDA tensors against the same op on CPU tensors."""
    rows: list[dict] = []
    for name, shape, dtype, call in _ops(ctx.world_size):
        if "uneven" in name:  # shapes differ by rank: the fake and nccl settings cover them
            continue
        torch.manual_seed(ctx.rank)
        cpu = torch.randn(shape).to(dtype)
        try:
            results = []
            for where in ("cpu", device):
                x = cpu.to(where).requires_grad_(dtype.is_floating_point)
                out = call(x)
                grad = torch.autograd.grad(out, x, torch.ones_like(out))[0] if x.requires_grad else None
                results.append((out.detach().cpu().float(), None if grad is None else grad.cpu().float()))
            (out_cpu, grad_cpu), (out_cuda, grad_cuda) = results
            error = (out_cpu - out_cuda).abs().max().item()
            if grad_cpu is not None:
                error = max(error, (grad_cpu - grad_cuda).abs().max().item())
            result = "ok" if error <= (1e-2 if dtype == torch.bfloat16 else 1e-5) else f"differs by {error:.3g}"
        except Exception as failure:
            result = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300] if str(failure) else ''}"
        _emit(
            rows,
            {"setting": "gloo", "op": name, "what": f"eager {device} vs cpu", "result": result},
            to=rows_file if ctx.rank == 0 else Path(os.devnull),
        )
    return rows


def _gloo() -> list[dict]:
    from commlib_torch.tools.pool import WorkerPool

    with WorkerPool(2, timeout=60.0, pg_timeout=30.0) as pool:
        return pool.run(_gloo_job, _ROWS, _DEVICE)[0]


def _run_setting(setting: str) -> list[dict]:
    try:
        return {"fake": _fake, "nccl": _nccl, "gloo": _gloo, "compile": _compile}[setting]()
    except Exception:
        rows: list[dict] = []
        _emit(rows, {"setting": setting, "op": "(setting)", "what": "setup", "result": traceback.format_exc()[-600:]})
        return rows


def _child(setting: str, out: Path, limit: float) -> list[dict]:
    """Run one setting in a fresh process (one default process group each) for at most `limit` seconds; its
    rows, from the rows file, with one more row when the process failed or ran out of time."""
    rows_file, log = out / f"{setting}.jsonl", out / f"{setting}.log"
    rows_file.unlink(missing_ok=True)
    command = [
        sys.executable,
        __file__,
        "--setting",
        setting,
        "--rows",
        str(rows_file),
        *(["--dry-run"] if _DEVICE == "cpu" else []),
    ]
    with log.open("w") as stderr:
        try:
            status = f"exit {subprocess.run(command, stdout=stderr, stderr=stderr, timeout=limit).returncode}"
        except subprocess.TimeoutExpired:
            status = f"killed after {limit:.0f} s"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    if status != "exit 0":
        tail = log.read_text()[-400:]
        rows.append(
            {
                "setting": setting,
                "op": "(setting)",
                "what": "process",
                "result": f"{status} after {len(rows)} rows; log tail: {tail}",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    global _DEVICE, _ROWS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir()) / "commlib-cuda-graphs",
        help="folder for the rows and logs (default: %(default)s)",
    )
    parser.add_argument("--only", choices=_SETTINGS, nargs="+", default=list(_SETTINGS), help="these settings")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: the fake (eager calls only), gloo (cpu against cpu) and compile settings "
        "on the CPU, to check the script itself",
    )
    parser.add_argument("--setting", choices=_SETTINGS, help=argparse.SUPPRESS)  # one setting, in this process
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        _DEVICE = "cpu"
    if args.setting:
        _ROWS = args.rows
        _run_setting(args.setting)
        return 0
    if _DEVICE == "cuda" and not torch.cuda.is_available():
        print(
            "cuda_graphs.py needs a CUDA GPU and a CUDA build of torch (or --dry-run to check the script on the CPU)",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for setting in args.only:
        if _DEVICE == "cpu" and setting == "nccl":
            continue
        done = _child(setting, args.out, _LIMITS[setting])
        for row in done:
            print(f"{row['setting']:7}  {row['op']:40}  {row['what']:18}  {row['result']}", flush=True)
        rows += done
    (args.out / "rows.json").write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if _DEVICE == "cuda" else "cpu",
                "rows": rows,
            },
            indent=1,
        )
    )
    failed = [row for row in rows if row["result"] != "ok"]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} rows ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
