"""One training step (forward, backward, gradient sync, AdamW) of examples/transformers_llama.py's Llama at
S = 2048 over W = 4 gloo ranks on the CPU: commlib's Ulysses (``attn_implementation="commlib"`` in a
``commlib_torch.sequence.parallel`` context) against the same model with DeepSpeed's ``DistributedAttention``
(``deepspeed.sequence.layer``, registered as a transformers attention function over SDPA), issue 21's bench.
DeepSpeed 0.19.8 refuses fewer kv heads than ranks (2 < 4 here), so its side repeats each kv head W / H_kv times
first, as its users do; commlib sends each kv head to the ranks whose q heads use it.

Both models start from the same weights and use the same glue (`shard_tokens`, `cross_entropy`,
`sync_gradients`): only the attention differs. The variants run interleaved, repeat after repeat (the order
alternating), each step timed between two barriers as the slowest rank's seconds; prints the load average before
and after (the machine is shared), the median and spread per variant, their ratio and the largest relative
difference of the two models' losses over the steps. Progress goes to stderr.

DeepSpeed is not a commlib dependency: run it in a venv of its own (README of the result's folder):

    torchrun --standalone --nproc-per-node 4 benchmarks/model_step.py --json benchmarks/results/<dir>/model_step.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

import commlib
from commlib_torch.integrations.transformers import register
from commlib_torch.sequence import cross_entropy, parallel, shard_tokens, sync_gradients

VARIANTS = ("commlib", "deepspeed")
CALLS = {"deepspeed": 0}  # DeepSpeed attention calls (printed: the baseline did run its own attention)


def deepspeed_attention(group):
    """A transformers attention function (``[B, H, S_r, D]`` in, ``[B, S_r, H, D]`` out) running DeepSpeed's
    ``DistributedAttention`` over `group` with causal SDPA on the gathered sequence (GQA by head counts)."""
    from deepspeed.sequence.layer import DistributedAttention

    def local(query, key, value):  # [B, S, H / W, D] after DeepSpeed's all-to-all
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return out.transpose(1, 2)

    ulysses = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        CALLS["deepspeed"] += 1
        copies = max(1, dist.get_world_size(group) // key.shape[1])  # DeepSpeed refuses kv heads < W: repeat them
        key, value = key.repeat_interleave(copies, dim=1), value.repeat_interleave(copies, dim=1)
        return ulysses(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0), None

    return attention


def models(dtype: torch.dtype) -> dict[str, LlamaForCausalLM]:
    """The example's Llama (hidden 64, 2 layers, 8 heads, 2 kv heads, vocab 256) twice, the same seeded weights."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=256,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    built = {
        name: LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=name, dtype=dtype)
        for name in VARIANTS
    }
    built["deepspeed"].load_state_dict(built["commlib"].state_dict())
    return built


def step(model, optimizer, ids, position_ids, labels) -> float:
    """fwd + bwd + sync_gradients + AdamW; the loss (the same value on every rank)."""
    optimizer.zero_grad()
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    loss = cross_entropy(logits, labels)
    loss.backward()
    sync_gradients(model.parameters())
    optimizer.step()
    return loss.item()


def timed(run) -> float:
    """The slowest rank's seconds for `run()`, between two barriers."""
    dist.barrier()
    start = time.perf_counter()
    run()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--json", help="also write the result as JSON (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer over the same process group
    rank, world = dist.get_rank(), dist.get_world_size()
    load_before = os.getloadavg()
    register()
    AttentionInterface.register("deepspeed", deepspeed_attention(dist.group.WORLD))
    layout = commlib.SequenceLayout(args.seq_len, ulysses_size=world)
    built = models(getattr(torch, args.dtype))
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in built.items()}
    input_ids = torch.randint(0, 256, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    tokens = shard_tokens(input_ids, layout)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with parallel(layout, attention="ulysses"):
        for repeat in range(args.warmup + args.repeats):
            order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
            took = {
                name: timed(lambda name=name: losses[name].append(step(built[name], optimizers[name], *tokens)))
                for name in order
            }
            for name in VARIANTS if repeat >= args.warmup else ():
                seconds[name].append(took[name])
            if rank == 0:
                print(
                    f"repeat {repeat + 1}/{args.warmup + args.repeats}{' (warmup)' if repeat < args.warmup else ''}: "
                    + ", ".join(f"{name} loss {losses[name][-1]:.6f} {took[name]:.3f} s" for name in VARIANTS),
                    file=sys.stderr,
                    flush=True,
                )
    load_after = os.getloadavg()
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses["commlib"], losses["deepspeed"], strict=True))
    summary = {
        name: {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "seconds": values}
        for name, values in seconds.items()
    }
    ratio = summary["commlib"]["median_s"] / summary["deepspeed"]["median_s"]
    if rank == 0:
        for name, row in summary.items():
            print(
                f"{name:9s} median {row['median_s']:.3f} s  (min {row['min_s']:.3f}, max {row['max_s']:.3f}, "
                f"{len(row['seconds'])} steps)"
            )
        print(
            f"ratio commlib / deepspeed (medians): {ratio:.3f}; largest relative loss difference over "
            f"{len(losses['commlib'])} steps: {loss_error:.1e}; W={world} S={args.seq_len} batch={args.batch} "
            f"{args.dtype}; {CALLS['deepspeed']} DeepSpeed attention calls; "
            f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; torch {torch.__version__}, "
            f"deepspeed {deepspeed.__version__}"
        )
        if args.json:
            facts = {
                "world_size": world,
                "seq_len": args.seq_len,
                "batch": args.batch,
                "dtype": args.dtype,
                "warmup": args.warmup,
                "load_before": load_before,
                "load_after": load_after,
                "versions": {
                    "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__,
                    "python": sys.version.split()[0],
                },
            }
            with open(args.json, "w") as file:
                json.dump(
                    {
                        "facts": facts,
                        "ratio": ratio,
                        "loss_error": loss_error,
                        "losses": losses,
                        "deepspeed_attention_calls": CALLS["deepspeed"],
                        "variants": summary,
                    },
                    file,
                    indent=1,
                )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
