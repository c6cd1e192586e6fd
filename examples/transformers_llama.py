"""Train a transformers `LlamaForCausalLM` (GQA: 8 query heads, 2 kv heads) sequence-parallel with commlib's attention
through transformers' attention registry, and check it against the same model trained unsharded in this process
(float64, CPU, gloo). Exit status 1 if the first step's loss, logits or any parameter's gradient differs by more than
1e-10 relative, or any AdamW step's loss by more than 1e-12.

    torchrun --standalone --nproc-per-node 4 examples/transformers_llama.py --attention ulysses --seq-len 37
    torchrun --standalone --nproc-per-node 4 examples/transformers_llama.py --attention ring --seq-len 37
    torchrun --standalone --nproc-per-node 4 examples/transformers_llama.py --attention usp --seq-len 37   # 2 x 2
    torchrun --standalone --nproc-per-node 4 examples/transformers_llama.py --attention ring --packed

``--packed``: each row packs documents of random lengths (some shorter than a shard, some crossing shard
boundaries) and ends in padding; `shard_tokens(..., segment_ids=)` gives positions that restart at each document
and labels that stop at each document's end, the model gets those positions (``parallel(..., packed=True)``)
and the padding ``attention_mask``; the reference is the unsharded model given the same documents as a 4-D mask
(logits compared on the tokens that are not padding).

The recipe (what a user writes): `register()` once; build the model with ``attn_implementation="commlib"``;
inside ``commlib_torch.sequence.parallel(layout, ...)`` feed each rank its shard of the tokens with their GLOBAL
``position_ids`` (RoPE), take the loss as the mean over every rank's tokens (`cross_entropy`), and sum the replicated
parameters' gradients over the group (`sync_gradients`) before the optimizer step: all four from
`commlib_torch.sequence`.
Rank 0 prints the steps and the verdict; every rank's exit status is the verdict.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import commlib
from commlib.sequence_helpers import document_labels, document_positions
from commlib_torch import all_reduce
from commlib_torch.integrations.transformers import register
from commlib_torch.sequence import cross_entropy, parallel, shard_tokens, sync_gradients

TOLERANCE = 1e-10  # the first step: loss, logits, every parameter's gradient (relative, float64)
LOSS_TOLERANCE = 1e-12  # every AdamW step's loss


def usp_groups(ulysses_size: int):
    """The Ulysses group (ranks ``r * U + u`` of ring index r) and the ring group (Ulysses index u) of this rank;
    every rank makes every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ring_size = world // ulysses_size
    ulysses = [dist.new_group([r * ulysses_size + u for u in range(ulysses_size)]) for r in range(ring_size)]
    ring = [dist.new_group([r * ulysses_size + u for r in range(ring_size)]) for u in range(ulysses_size)]
    return ulysses[rank // ulysses_size], ring[rank % ulysses_size]


def context(attention: str, seq_len: int, ulysses_size: int, packed: bool = False):
    """The layout and the `parallel` context of `attention` over WORLD (this rank holds shard ``rank``);
    `packed`: the position_ids restart at each document."""
    world = dist.get_world_size()
    if attention == "ulysses":
        layout = commlib.SequenceLayout(seq_len, ulysses_size=world)
        return layout, parallel(layout, attention="ulysses", packed=packed)
    if attention == "ring":
        layout = commlib.SequenceLayout(seq_len, ring_size=world, layout="zigzag")
        return layout, parallel(layout, attention="ring", packed=packed)
    layout = commlib.SequenceLayout(
        seq_len, ring_size=world // ulysses_size, ulysses_size=ulysses_size, layout="zigzag"
    )
    ulysses_group, ring_group = usp_groups(ulysses_size)
    return layout, parallel(layout, attention="usp", ulysses_group=ulysses_group, ring_group=ring_group, packed=packed)


def models(seed: int) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The same seeded random float64 Llama twice: with commlib's attention, and with SDPA (the reference)."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=256,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    reference = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64)
    sharded = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="commlib", dtype=torch.float64)
    sharded.load_state_dict(reference.state_dict())
    return sharded, reference


def packed_documents(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Segment ids ``[batch, seq_len]``: per row, documents of random lengths 1..seq_len/3 packed in order, then
    1..seq_len/8 tokens of padding (-1)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        padding = int(torch.randint(1, max(2, seq_len // 8 + 1), (1,), generator=generator))
        lengths: list[int] = []
        while sum(lengths) < seq_len - padding:
            lengths.append(
                min(
                    int(torch.randint(1, max(2, seq_len // 3 + 1), (1,), generator=generator)),
                    seq_len - padding - sum(lengths),
                )
            )
        rows.append(torch.as_tensor(commlib.segment_ids(lengths, seq_len), dtype=torch.int64))
    return torch.stack(rows)


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """The unsharded reference's 4-D bool mask ``[B, 1, S, S]``: causal and within a document; a padding row sees
    itself only (its output is not compared and its label ignored; a row seeing nothing would be NaN in SDPA)."""
    seq_len = segments.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] >= 0)
    return ((same & causal) | torch.eye(seq_len, dtype=torch.bool))[:, None]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def worst(error: float) -> float:
    """The largest of every rank's `error` (so every rank reaches the same verdict)."""
    return float(all_reduce(torch.tensor(error, dtype=torch.float64), op="max"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=("ulysses", "ring", "usp"), default="ulysses")
    parser.add_argument(
        "--seq-len", type=int, default=37, help="tokens per row: any length >= the world size (uneven is fine)"
    )
    parser.add_argument("--ulysses-size", type=int, default=2, help="USP's Ulysses group size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--packed", action="store_true", help="packed documents of random lengths and padding")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.seq_len < world:  # every rank must hold a token: transformers cannot run a rank's empty shard
        # (on every rank: torchrun stops the others as soon as one exits, so rank 0 alone might not get to print)
        parser.error(f"--seq-len ({args.seq_len}) must be at least the world size ({world}): one token a rank")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    register()
    layout, sequence_parallel = context(args.attention, args.seq_len, args.ulysses_size, packed=args.packed)
    sharded, reference = models(seed=0)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in (sharded, reference)]
    input_ids = torch.randint(0, 256, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    # this rank's shard (WORLD rank r holds shard r), and the unsharded model's inputs and labels
    whole: dict = dict(input_ids=input_ids, use_cache=False)
    if args.packed:
        segments = packed_documents(args.batch, args.seq_len, seed=2)
        ids, position_ids, labels, mine = shard_tokens(input_ids, layout, segment_ids=segments)
        extra = dict(attention_mask=(mine >= 0).long())  # padding; the documents come from position_ids
        whole_labels = torch.as_tensor(document_labels(input_ids, segments))
        whole |= dict(
            position_ids=torch.as_tensor(document_positions(segments)), attention_mask=document_mask(segments)
        )
        kept = (segments >= 0)[:, layout.positions(rank)]  # the tokens whose logits are compared
    else:
        ids, position_ids, labels = shard_tokens(input_ids, layout)
        extra, whole_labels = {}, torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], 1)
        kept = torch.ones_like(ids, dtype=torch.bool)
    errors = {"loss": 0.0, "logits": 0.0, "gradients": 0.0}
    with sequence_parallel:
        for step in range(1, args.steps + 1):
            logits = sharded(input_ids=ids, position_ids=position_ids, use_cache=False, **extra).logits
            loss = cross_entropy(logits, labels)
            loss.backward()
            sync_gradients(sharded.parameters())
            want_logits = reference(**whole).logits
            want = F.cross_entropy(want_logits.flatten(0, 1), whole_labels.flatten(), ignore_index=-100)
            want.backward()
            errors["loss"] = max(errors["loss"], relative(loss.detach(), want.detach()))
            if step == 1:
                errors["logits"] = worst(
                    relative(logits.detach()[kept], want_logits.detach()[:, layout.positions(rank)][kept])
                )
                errors["gradients"] = worst(
                    max(
                        relative(p.grad, q.grad)
                        for p, q in zip(sharded.parameters(), reference.parameters(), strict=True)
                    )
                )
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            if rank == 0:
                print(f"step {step:3d}  loss {loss.item():.12f}  unsharded {want.item():.12f}", flush=True)
    passed = errors["loss"] <= LOSS_TOLERANCE and errors["logits"] <= TOLERANCE and errors["gradients"] <= TOLERANCE
    if rank == 0:
        shown = ", ".join(f"{name} {value:.1e}" for name, value in errors.items())
        print(
            f"{'PASS' if passed else 'FAIL'}: {args.attention} W={dist.get_world_size()} S={args.seq_len} "
            f"sizes={layout.sizes}{' packed' if args.packed else ''}, {args.steps} AdamW steps; relative errors "
            f"{shown}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
