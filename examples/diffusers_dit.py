"""Train a tiny diffusers DiT sequence-parallel with commlib's layers through the diffusers attention backend
(`commlib_torch.integrations.diffusers`), and check it against the same model trained unsharded in this process
(float64, CPU, gloo). Exit status 1 if the first step's loss, output or any parameter's gradient differs by more
than 1e-10 relative, or any AdamW step's loss by more than 1e-12.

    torchrun --standalone --nproc-per-node 4 examples/diffusers_dit.py --model wan --attention ulysses
    torchrun --standalone --nproc-per-node 4 examples/diffusers_dit.py --model wan --attention ring
    torchrun --standalone --nproc-per-node 4 examples/diffusers_dit.py --model wan --attention usp   # 2 x 2
    torchrun --standalone --nproc-per-node 4 examples/diffusers_dit.py --model flux --attention ulysses

Wan (`WanTransformer3DModel`): self-attention over the video tokens (27 of them after patchify: shards of 7, 7,
7, 6 rows) and cross-attention to the text, replicated. Flux (`FluxTransformer2DModel`, an MMDiT): 5 text tokens
replicated, 15 image tokens sharded, joint attention (Ulysses here: over a ring of 4 its 15 image
tokens are uneven shards, which ring and USP refuse with joint tensors; tests/torch/test_diffusers.py runs Flux
on a ring of 3).

The recipe (what a user writes): `parallelize(model)` once; inside ``commlib_torch.sequence.parallel(layout,
...)``, whose layout's ``seq_len`` is the model's number of video (image) tokens, call the model with the whole
inputs on every rank; it returns the whole output on every rank; take the loss from it as the unsharded model
does, and sum the parameters' gradients over the group (`sync_gradients`) before the optimizer step.
Rank 0 prints the steps and the verdict; every rank's exit status is the verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commlib
from commlib_torch import all_reduce
from commlib_torch.integrations.diffusers import parallelize
from commlib_torch.sequence import parallel, sync_gradients

TOLERANCE = 1e-10  # the first step: loss, output, every parameter's gradient (relative, float64)
LOSS_TOLERANCE = 1e-12  # every AdamW step's loss


def usp_groups(ulysses_size: int):
    """The Ulysses group (ranks ``r * U + u`` of ring index r) and the ring group (Ulysses index u) of this rank;
    every rank makes every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ring_size = world // ulysses_size
    ulysses = [dist.new_group([r * ulysses_size + u for u in range(ulysses_size)]) for r in range(ring_size)]
    ring = [dist.new_group([r * ulysses_size + u for r in range(ring_size)]) for u in range(ulysses_size)]
    return ulysses[rank // ulysses_size], ring[rank % ulysses_size]


def context(attention: str, seq_len: int, ulysses_size: int):
    """The layout and the `parallel` context of `attention` over WORLD (this rank holds shard ``rank``)."""
    world = dist.get_world_size()
    if attention == "ulysses":
        layout = commlib.SequenceLayout(seq_len, ulysses_size=world)
        return layout, parallel(layout, attention="ulysses")
    if attention == "ring":
        layout = commlib.SequenceLayout(seq_len, ring_size=world, layout="zigzag")
        return layout, parallel(layout, attention="ring")
    layout = commlib.SequenceLayout(
        seq_len, ring_size=world // ulysses_size, ulysses_size=ulysses_size, layout="zigzag"
    )
    ulysses_group, ring_group = usp_groups(ulysses_size)
    return layout, parallel(layout, attention="usp", ulysses_group=ulysses_group, ring_group=ring_group)


def wan(batch: int):
    """A tiny Wan (2 blocks, 4 heads of 8) and its inputs: video latents [B, 4, 3, 6, 6] (27 tokens after the
    1 x 2 x 2 patches), 5 text tokens, a timestep per row; the target has the latents' shape."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    generator = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(batch, 4, 3, 6, 6, generator=generator, dtype=torch.float64),
        encoder_hidden_states=torch.randn(batch, 5, 16, generator=generator, dtype=torch.float64),
        timestep=torch.tensor([3.0, 700.0][:batch], dtype=torch.float64),
        return_dict=False,
    )
    return model, inputs, 27, torch.randn(batch, 4, 3, 6, 6, generator=generator, dtype=torch.float64)


def flux(batch: int):
    """A tiny Flux (1 double-stream and 1 single-stream block, 4 heads of 8) and its inputs: 15 image tokens
    (a 3 x 5 grid of ids), 5 text tokens, pooled text, a timestep and a guidance per row."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=16,
        pooled_projection_dim=12,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    generator = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(15, 3, dtype=torch.float64)
    img_ids[:, 1] = torch.arange(15) // 5
    img_ids[:, 2] = torch.arange(15) % 5
    inputs = dict(
        hidden_states=torch.randn(batch, 15, 8, generator=generator, dtype=torch.float64),
        encoder_hidden_states=torch.randn(batch, 5, 16, generator=generator, dtype=torch.float64),
        pooled_projections=torch.randn(batch, 12, generator=generator, dtype=torch.float64),
        timestep=torch.tensor([0.3, 0.9][:batch], dtype=torch.float64),
        guidance=torch.tensor([3.5, 2.0][:batch], dtype=torch.float64),
        img_ids=img_ids,
        txt_ids=torch.zeros(5, 3, dtype=torch.float64),
        return_dict=False,
    )
    return model, inputs, 15, torch.randn(batch, 15, 8, generator=generator, dtype=torch.float64)


@contextlib.contextmanager
def float64_kept():
    """``Tensor.float()`` keeps a float64 tensor float64 inside (Wan's blocks cast their residual stream and
    norms to float32 with ``.float()`` by design, and float32 rounding then decides the gradients to ~1e-7 in
    either model: the check compares float64 models, so both run with float64 kept)."""
    cast = torch.Tensor.float
    torch.Tensor.float = lambda self, *args, **kwargs: (  # type: ignore[method-assign]
        self if self.dtype == torch.float64 else cast(self, *args, **kwargs)
    )
    try:
        yield
    finally:
        torch.Tensor.float = cast  # type: ignore[method-assign]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def worst(error: float) -> float:
    """The largest of every rank's `error` (so every rank reaches the same verdict)."""
    return float(all_reduce(torch.tensor(error, dtype=torch.float64), op="max"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("wan", "flux"), default="wan")
    parser.add_argument("--attention", choices=("ulysses", "ring", "usp"), default="ulysses")
    parser.add_argument("--ulysses-size", type=int, default=2, help="USP's Ulysses group size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference, inputs, tokens, target = (wan if args.model == "wan" else flux)(args.batch)
    reference = reference.to(torch.float64)
    sharded = parallelize(copy.deepcopy(reference))
    layout, sequence_parallel = context(args.attention, tokens, args.ulysses_size)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in (sharded, reference)]
    errors = {"loss": 0.0, "output": 0.0, "gradients": 0.0}
    # the reference's attention is diffusers' own (SDPA): the context changes nothing there
    with sequence_parallel, float64_kept():
        for step in range(1, args.steps + 1):
            (out,) = sharded(**inputs)  # the whole output, on every rank
            loss = F.mse_loss(out, target)
            loss.backward()
            sync_gradients(sharded.parameters())
            (want_out,) = reference(**inputs)
            want = F.mse_loss(want_out, target)
            want.backward()
            errors["loss"] = max(errors["loss"], worst(relative(loss.detach(), want.detach())))
            if step == 1:
                errors["output"] = worst(relative(out.detach(), want_out.detach()))
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
    passed = errors["loss"] <= LOSS_TOLERANCE and errors["output"] <= TOLERANCE and errors["gradients"] <= TOLERANCE
    if rank == 0:
        shown = ", ".join(f"{name} {value:.1e}" for name, value in errors.items())
        print(
            f"{'PASS' if passed else 'FAIL'}: {args.model} {args.attention} W={dist.get_world_size()} "
            f"tokens={tokens} sizes={layout.sizes}, {args.steps} AdamW steps; relative errors {shown}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
