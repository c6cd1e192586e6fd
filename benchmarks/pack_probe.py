"""Probe of the CUDA pack pass: device time and host time of the ways to run one row transpose
``[A, B, C] -> [B, A, C]`` (bf16), to choose `commlib_torch._pack`'s path. Each is checked against torch's
eager permute copy first.

    python benchmarks/pack_probe.py [--repeats 50] [--json PATH]     # needs a GPU (exit 2 without one)

Device time: events around the call while a sleep kernel keeps the GPU busy (launch time excluded); host
time: the host's time to enqueue one call (the launch overhead that shows when the GPU is not ahead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from commlib import plans
from commlib_torch import _pack, _walk

_SLEEP_CYCLES = 2_000_000


def device_seconds(fn, repeats: int) -> float:
    times = []
    for index in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if index >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def host_seconds(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


def _wide(x: torch.Tensor, out: torch.Tensor, dims: tuple[int, int, int], dtype: torch.dtype):
    """torch's copy_ over the rows viewed as wider words."""
    rows, columns, _size = dims
    source = x.view(-1).view(dtype).view(rows, columns, -1).permute(1, 0, 2)
    target = out.view(-1).view(dtype).view(columns, rows, -1)
    return lambda: target.copy_(source)


def _launch_only(x: torch.Tensor, out: torch.Tensor, dims: tuple[int, int, int]):
    """The Triton launch with every argument prepared: `transpose_rows` less its Python."""
    rows, columns, size = dims
    kernel, word_types = _pack._kernel()
    width = _pack._word(size * x.element_size(), (4, 2), x, out)
    words = size * x.element_size() // width
    block_words = min(_pack._TILE_WORDS, 1 << (words - 1).bit_length())
    block_rows = max(1, _pack._TILE_WORDS // block_words)
    word_blocks = -(-words // block_words)
    grid = (-(-rows * columns // block_rows) * word_blocks,)
    return lambda: kernel[grid](
        x,
        out,
        rows,
        columns,
        words,
        word_blocks,
        WORD=word_types[width],
        BLOCK_ROWS=block_rows,
        BLOCK_WORDS=block_words,
        num_warps=4,
    )


def probes(x: torch.Tensor, step, shape) -> dict:
    dims = _pack.row_transpose(step)
    out = torch.empty(step.out_shape, dtype=x.dtype, device=x.device)
    source = x.reshape(step.split_shape).permute(step.perm)
    result = {
        "copy (reference)": lambda: out.view(-1).copy_(x.view(-1)),
        "eager copy_ (bf16)": lambda: out.copy_(source),
        "eager copy_ (int32 words)": _wide(x, out, dims, torch.int32),
        "eager copy_ (int64 words)": _wide(x, out, dims, torch.int64),
        "_pack.copy_words": lambda: _pack.copy_words(x, out, *dims),
        "triton transpose_rows": lambda: _pack.transpose_rows(x, out, *dims),
        "triton launch only": _launch_only(x, out, dims),
        "_pack.copy_into": lambda: _pack.copy_into(out, x, step),
        "_walk.rearrange (alloc + kernel)": lambda: _walk.rearrange(x, step, shape, x.dtype),
    }
    return out, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "pack_probe.py needs a CUDA GPU and a CUDA build of torch (it times the CUDA pack pass); "
            f"this torch ({torch.__version__}) sees none",
            file=sys.stderr,
        )
        return 2
    rows = []
    cases = {
        "B=1 pack (2, 1)": (plans.all_to_all_4d((1, 32768, 24, 128), 8, 2, 1), "pack"),
        "B=2 unpack (2, 1)": (plans.all_to_all_4d((2, 16384, 24, 128), 8, 2, 1), "unpack"),
        "small B=1 pack": (plans.all_to_all_4d((1, 64, 24, 128), 8, 2, 1), "pack"),
    }
    for case, (plan, part) in cases.items():
        step, shape, source_shape = (
            (plan.layout.pack, plan.layout.send_shape, plan.in_shape)
            if part == "pack"
            else (plan.layout.unpack, plan.out_shape, plan.layout.recv_shape)
        )
        x = torch.randn(source_shape, device="cuda").to(torch.bfloat16)
        expected = x.reshape(step.split_shape).permute(step.perm).contiguous()
        out, calls = probes(x, step, shape)
        for name, fn in calls.items():
            checked = ""
            if name != "copy (reference)":
                out.view(torch.uint8).fill_(0xA5)
                result = fn()
                produced = result if isinstance(result, torch.Tensor) and name.startswith("_walk") else out
                if result is False:  # copy_into declined (small pass): the caller's plain copy_ runs instead
                    checked = "declined"
                else:
                    checked = "ok" if torch.equal(produced.view(expected.shape), expected) else "WRONG"
            rows.append(
                {
                    "case": case,
                    "way": name,
                    "device_us": 1e6 * device_seconds(fn, args.repeats),
                    "host_us": 1e6 * host_seconds(fn),
                    "check": checked,
                }
            )
        reference = next(row["device_us"] for row in rows if row["case"] == case and row["way"].startswith("copy"))
        for row in rows:
            if row["case"] == case:
                row["over_copy"] = row["device_us"] / reference
        del x, out, calls, expected
        torch.cuda.empty_cache()
    for row in rows:
        print(
            f"{row['case']:18s} {row['way']:34s} device {row['device_us']:8.1f} us ({row['over_copy']:.2f}x copy)"
            f"  host {row['host_us']:6.1f} us  {row['check']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
