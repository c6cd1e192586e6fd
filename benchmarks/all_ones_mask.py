"""A tokenizer's all-ones ``attention_mask`` through the transformers route: fwd+bwd of a Llama built with
``attn_implementation="commlib"`` at W = 4 gloo ranks on CPU (ring zigzag or Ulysses), given no mask, the
all-ones mask (which `commlib_torch.integrations.transformers._keeps_every_token` drops after one int all_reduce
per forward), and the all-ones mask kept as segment ids (the route before: every id 0, the masked layer); the
median and fastest of the repeats (each ending with its slowest rank), the all_reduces `_keeps_every_token` made
per forward, and the largest difference of the logits against the run without a mask. Prints one JSON object.

    PYTHONPATH=. python -m benchmarks.all_ones_mask > benchmarks/results/<dir>/all_ones_mask.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch
import torch.distributed as dist

import commlib

VARIANTS = ("no mask", "all-ones mask", "all-ones mask kept as segment ids")


def _model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from commlib_torch.integrations.transformers import register

    register()
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="commlib", dtype=torch.float32)


def timed(ctx, attention: str, seq_len: int, layers: int, hidden: int, variant: str, repeats: int) -> dict:
    """This rank's seconds per fwd+bwd of `variant`, the all_reduces per forward and its logits (the last call)."""
    from commlib_torch.integrations import transformers as integration
    from commlib_torch.sequence import parallel

    model = _model(layers, hidden)
    layout = (
        commlib.SequenceLayout(seq_len, ring_size=ctx.world_size, layout="zigzag")
        if attention == "ring"
        else commlib.SequenceLayout(seq_len, ulysses_size=ctx.world_size)
    )
    positions = torch.as_tensor(layout.positions(ctx.rank))[None]
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(1))[:, positions[0]]
    mask = None if variant == VARIANTS[0] else torch.ones_like(ids)
    decide, reduces = integration._keeps_every_token, []

    def counted(*args):
        if variant != VARIANTS[1]:
            return False  # the route before: the mask always became segment ids
        before = integration._LAST[0] if integration._LAST else None
        kept = decide(*args)
        reduces.extend([1] if integration._LAST[0] is not before else [])  # a new decision: one all_reduce
        return kept

    integration._keeps_every_token = counted
    times = []
    try:
        for _ in range(repeats + 1):  # the first call warms up
            reduces.clear()
            dist.barrier()
            start = time.perf_counter()
            with parallel(layout, attention=attention):
                logits = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
            logits.sum().backward()
            times.append(time.perf_counter() - start)
    finally:
        integration._keeps_every_token = decide
    return {"times": times[1:], "decisions": len(reduces), "logits": logits.detach()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=("ring", "ulysses"), default="ring")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from commlib_torch.tools.pool import WorkerPool

    job = importlib.import_module("benchmarks.all_ones_mask").timed  # picklable by its module's name
    rows, logits = [], {}
    with WorkerPool(4, timeout=900.0) as pool:
        for variant in VARIANTS:
            replies = pool.run(job, args.attention, args.seq, args.layers, args.hidden, variant, args.repeats)
            slowest = [max(step) for step in zip(*(reply["times"] for reply in replies), strict=True)]
            logits[variant] = [reply["logits"] for reply in replies]
            difference = max(
                float((mine - theirs).abs().max())
                for mine, theirs in zip(logits[variant], logits[VARIANTS[0]], strict=True)
            )
            rows.append(
                {
                    "variant": variant,
                    "median_s": statistics.median(slowest),
                    "min_s": min(slowest),
                    "layer_calls_per_forward": args.layers,
                    "decisions_per_forward": replies[0]["decisions"],
                    "logits_max_difference_to_no_mask": difference,
                }
            )
    print(
        json.dumps(
            {
                "world_size": 4,
                "attention": args.attention,
                "seq_len": args.seq,
                "layers": args.layers,
                "hidden": args.hidden,
                "heads": 8,
                "kv_heads": 2,
                "dtype": "float32",
                "repeats": args.repeats,
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
