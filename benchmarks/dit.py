"""A tiny-Wan training step (issue 35 item 7), forward + backward, commlib beside diffusers' own context
parallelism, in one run: diffusers 0.42's ``WanTransformer3DModel`` from a small config (seeded random weights,
float32), S video tokens after patchify (default 4096: latents 16 x 4 x 64 x 64, patches 1 x 2 x 2) and 512 text
tokens, over W gloo ranks:

- ``commlib ulysses``: ``commlib_torch.integrations.diffusers.parallelize(model)`` inside
  ``parallel(SequenceLayout(S, ulysses_size=W), attention="ulysses")``;
- ``commlib ring``: the same with ``SequenceLayout(S, ring_size=W)`` and ``attention="ring"``;
- ``diffusers ulysses``: ``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=W))`` on the
  ``native`` backend (SDPA). On a machine without an accelerator diffusers 0.42.1's ``enable_parallelism``
  raises ``ZeroDivisionError`` (``rank % torch.accelerator.device_count()``, 0 on CPU): the bench calls it with
  ``torch.accelerator.device_count`` patched to 1 (nothing else is changed). It runs where S and the head count
  are multiples of W (else its sharder's assertion or head split fails, and the row says so);
- ``diffusers ring``: ``ContextParallelConfig(ring_degree=W)``: tried once; on CPU it stops at diffusers' own
  ``ValueError: Native attention does not support return_lse=True`` (its ring needs a kernel that returns the
  LSE: flash, cuDNN, sage, none with a CPU path), reported as not run.

Every variant runs the same step on its own copy of the same model: the whole latents and text on every rank,
the whole output back (both routes gather it), ``F.mse_loss`` against a fixed target, ``loss.backward()``, and
the parameters' gradients summed over the ranks (``commlib_torch.sequence.sync_gradients``; both routes give
each rank its tokens' part). Before timing each variant's output and summed gradients are compared with the
same model run unsharded on every rank (largest relative difference, over ranks; float32). Then the variants
run interleaved, repeat after repeat (the order rotating), each step timed between two barriers as the slowest
rank's seconds; the medians, min and max, and the load average before and after go to stdout and ``--json``.
Progress to stderr (tqdm).

    torchrun --standalone --nproc-per-node 4 benchmarks/dit.py --json benchmarks/results/<dir>/dit.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commlib
from commlib_torch.integrations.diffusers import parallelize
from commlib_torch.sequence import parallel, sync_gradients


def wan(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, Any], torch.Tensor, int]:
    """The model (seeded), its inputs and target (the same on every rank), and its video token count."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=args.heads,
        attention_head_dim=args.head_dim,
        in_channels=args.channels,
        out_channels=args.channels,
        text_dim=args.text_dim,
        freq_dim=64,
        ffn_dim=args.ffn,
        num_layers=args.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    )
    generator = torch.Generator().manual_seed(1)
    shape = (1, args.channels, args.frames, args.height, args.width)
    inputs = dict(
        hidden_states=torch.randn(shape, generator=generator),
        encoder_hidden_states=torch.randn(1, args.text, args.text_dim, generator=generator),
        timestep=torch.tensor([500.0]),
        return_dict=False,
    )
    tokens = args.frames * (args.height // 2) * (args.width // 2)
    return model, inputs, torch.randn(shape, generator=generator), tokens


def step_of(
    model: torch.nn.Module, inputs: dict, target: torch.Tensor, context: Callable[[], Any], *, sync: bool = True
) -> Callable:
    """One training step of `model`: grads cleared, forward, loss, backward, gradients summed over the ranks
    (each rank's part of them; not for the unsharded model, `sync=False`)."""

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with context():
            (out,) = model(**inputs)
            loss = F.mse_loss(out, target)
            loss.backward()
        if sync:
            sync_gradients(model.parameters())
        return out.detach(), [p.grad for p in model.parameters()]

    return step


def commlib_variant(model: torch.nn.Module, layout: commlib.SequenceLayout, attention: str) -> Callable:
    parallelize(model)
    return lambda: parallel(layout, attention=attention)


def diffusers_variant(model: torch.nn.Module, ring: int, ulysses: int) -> Callable:
    from diffusers.models._modeling_parallel import ContextParallelConfig

    with mock.patch("torch.accelerator.device_count", return_value=1):  # 0 on CPU: diffusers divides by it
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses))
    return nullcontext


def timed(run: Callable[[], object]) -> float:
    """The slowest rank's seconds for `run()`, between two barriers."""
    dist.barrier()
    start = time.perf_counter()
    run()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def largest(value: float) -> float:
    seen = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return float(seen)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def compared(result: tuple, reference: tuple) -> dict[str, float]:
    out, grads = result
    want_out, want_grads = reference
    worst = max(relative(g, w) for g, w in zip(grads, want_grads, strict=True))
    return {"output": largest(relative(out, want_out)), "gradients": largest(worst)}


def build(args: argparse.Namespace, progress: Callable[[str], None]) -> tuple[dict, dict, tuple]:
    """The variants that run ({name: step}), those that did not ({name: why}), and the unsharded result."""
    world = dist.get_world_size()
    model, inputs, target, tokens = wan(args)
    reference = step_of(copy.deepcopy(model), inputs, target, nullcontext, sync=False)()
    makers: dict[str, Callable[[torch.nn.Module], Callable]] = {
        "commlib ulysses": lambda m: commlib_variant(m, commlib.SequenceLayout(tokens, ulysses_size=world), "ulysses"),
        "commlib ring": lambda m: commlib_variant(m, commlib.SequenceLayout(tokens, ring_size=world), "ring"),
        "diffusers ulysses": lambda m: diffusers_variant(m, 1, world),
        "diffusers ring": lambda m: diffusers_variant(m, world, 1),
    }
    steps, failed = {}, {}
    for name, make in makers.items():
        if name not in args.variants:
            continue
        copied = copy.deepcopy(model)
        try:
            step = step_of(copied, inputs, target, make(copied))
            step()  # the first step: a variant that fails fails here, on every rank alike
        except Exception as error:  # a peer's failure is a result here
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            progress(f"{name}: not run ({failed[name]})")
            continue
        steps[name] = step
    return steps, failed, reference


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=4, help="latent frames")
    parser.add_argument("--height", type=int, default=64, help="latent height (patches of 2)")
    parser.add_argument("--width", type=int, default=64, help="latent width (patches of 2)")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--text", type=int, default=512, help="text tokens")
    parser.add_argument("--text-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    variants = ["commlib ulysses", "commlib ring", "diffusers ulysses", "diffusers ring"]
    parser.add_argument("--variants", nargs="+", default=variants, choices=variants)
    parser.add_argument("--json", help="also write the result as JSON (rank 0)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # diffusers' "experimental feature" and funcol's autograd warnings
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    command = "torchrun --standalone --nproc-per-node " + str(world) + " " + shlex.join(sys.argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.warmup + args.repeats, file=sys.stderr, desc="dit bench")

    def progress(line: str) -> None:
        if bar is not None:
            bar.write(line, file=sys.stderr)

    steps, failed, reference = build(args, progress)
    errors = {name: compared(step(), reference) for name, step in steps.items()}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for repeat in range(args.warmup + args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        took = {name: timed(steps[name]) for name in order}
        if repeat >= args.warmup:
            for name in names:
                seconds[name].append(took[name])
        if bar is not None:
            bar.update(1)
            progress(f"repeat {repeat + 1}: " + ", ".join(f"{name} {value:.3f} s" for name, value in took.items()))
    if bar is not None:
        bar.close()
    load_after = os.getloadavg()
    summary = {
        name: {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "seconds": values,
            "vs_unsharded": errors[name],
        }
        for name, values in seconds.items()
    }
    medians = {name: row["median_s"] for name, row in summary.items()}
    ratios = {
        f"{ours} / {theirs}": medians[ours] / medians[theirs]
        for ours in medians
        if ours.startswith("commlib")
        for theirs in medians
        if theirs.startswith("diffusers")
    }
    if rank == 0:
        tokens = args.frames * (args.height // 2) * (args.width // 2)
        print(
            f"W={world} video tokens {tokens} + text {args.text}, {args.layers} block(s), {args.heads} heads of "
            f"{args.head_dim}, ffn {args.ffn}, float32, fwd+bwd; {args.repeats} timed steps per variant after "
            f"{args.warmup} warmup; torch {torch.__version__}; load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
        )
        print("  ratios of the medians: " + "; ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        for name, row in summary.items():
            print(
                f"  {name:18s} median {row['median_s']:.3f} s (min {row['min_s']:.3f}, max {row['max_s']:.3f}); "
                f"vs unsharded: output {row['vs_unsharded']['output']:.1e}, "
                f"gradients {row['vs_unsharded']['gradients']:.1e}"
            )
        for name, why in failed.items():
            print(f"  {name:18s} not run: {why}")
        if args.json:
            import diffusers

            facts = {
                "command": command,
                "world_size": world,
                "arguments": {key: value for key, value in vars(args).items() if key != "json"},
                "video_tokens": tokens,
                "threads_per_rank": torch.get_num_threads(),
                "load_before": load_before,
                "load_after": load_after,
                "seconds": time.perf_counter() - started,
                "versions": {
                    "torch": torch.__version__,
                    "diffusers": diffusers.__version__,
                    "python": sys.version.split()[0],
                },
            }
            with open(args.json, "w") as file:
                json.dump({"facts": facts, "ratios": ratios, "variants": summary, "not_run": failed}, file, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
