"""diffusers' own context parallelism and commlib's diffusers route on the same tiny Wan, against the model run
unsharded (issue 35 item 7's errors table): float64, one forward + backward of ``F.mse_loss`` on the whole
output, the parameters' gradients summed over the ranks; per case the largest relative error of the output and
of any parameter's gradient, over the ranks, or what the run raised. Run at each world size:

    torchrun --standalone --nproc-per-node 2 benchmarks/dit_errors.py --json dit-errors-2.json   # and 3, 4

The cases: a tiny ``WanTransformer3DModel`` (2 blocks, heads of 8, text 5 tokens) at 4 heads and 36 video
tokens (even at W = 2, 3 [tokens], 4), 27 tokens (not a multiple of 2 or 4), and 6 heads (not a multiple of 4);
each through

- ``diffusers ulysses`` (``ContextParallelConfig(ulysses_degree=W)``, backend ``native``), ``diffusers
  ulysses_anything`` (``ulysses_anything=True``: its uneven sharder);
- ``diffusers ring`` (``ring_degree=W``): the ``native`` backend's forward refuses ``return_lse=True`` and no
  backend that returns the LSE has a CPU path, so this row runs diffusers' ``TemplatedRingAttention`` with a
  float64 einsum forward that returns the LSE and a backward from the given ``out`` and ``lse`` (the bench's
  ``_lse_ops``, patched in for this row only): diffusers' ring schedule, exact kernels;
- ``commlib ulysses`` / ``commlib ring`` (``parallelize`` under ``parallel(...)``, any token and head count).

``enable_parallelism`` is called with ``torch.accelerator.device_count`` patched to 1 (0 on CPU, which diffusers
divides by). Wan's blocks cast to float32 with ``.float()``; as in ``examples/diffusers_dit.py`` a float64 tensor
stays float64 there, in both models.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commlib
from commlib_torch.integrations.diffusers import parallelize
from commlib_torch.sequence import parallel, sync_gradients

CASES = {  # name: (heads, latent frames, latent height, latent width); video tokens = F * H/2 * W/2
    "4 heads, 36 tokens": (4, 4, 6, 6),
    "4 heads, 27 tokens": (4, 3, 6, 6),
    "6 heads, 36 tokens": (6, 4, 6, 6),
}


def wan(heads: int, frames: int, height: int, width: int) -> tuple[torch.nn.Module, dict, torch.Tensor, int]:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
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
    ).to(torch.float64)
    generator = torch.Generator().manual_seed(1)
    shape = (2, 4, frames, height, width)
    inputs = dict(
        hidden_states=torch.randn(shape, generator=generator, dtype=torch.float64),
        encoder_hidden_states=torch.randn(2, 5, 16, generator=generator, dtype=torch.float64),
        timestep=torch.tensor([3.0, 700.0], dtype=torch.float64),
        return_dict=False,
    )
    tokens = frames * (height // 2) * (width // 2)
    return model, inputs, torch.randn(shape, generator=generator, dtype=torch.float64), tokens


@contextlib.contextmanager
def float64_kept() -> Iterator[None]:
    """``Tensor.float()`` keeps a float64 tensor float64 (Wan's blocks call it by design)."""
    cast = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else cast(self, *a, **k)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.float = cast  # type: ignore[method-assign]


@contextlib.contextmanager
def _lse_ops() -> Iterator[None]:
    """diffusers' native forward op returning the LSE when asked (einsum, float64), and its backward op from the
    ring's given ``out`` and ``lse`` -- what a CPU ring needs and diffusers 0.42.1 has not."""
    from diffusers.models import attention_dispatch as dispatch

    forward, backward = dispatch._native_attention_forward_op, dispatch._native_attention_backward_op

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):  # fmt: skip
        if not return_lse:
            return forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False,
                           _save_ctx, _parallel_config)  # fmt: skip
        if _save_ctx:
            ctx.save_for_backward(query, key, value)
        ctx.ring_scale = scale if scale is not None else query.shape[-1] ** -0.5
        scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * ctx.ring_scale
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), value)
        return out, lse.transpose(1, 2)  # [B, S, H, D], [B, S, H]

    def backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
        if lse is None:
            return backward(ctx, grad_out, *args, **kwargs)
        scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * ctx.ring_scale
        p = torch.exp(scores - lse.transpose(1, 2)[..., None])
        dv = torch.einsum("bhqk,bqhd->bkhd", p, grad_out)
        dp = torch.einsum("bqhd,bkhd->bhqk", grad_out, value)
        ds = p * (dp - (grad_out * out).sum(-1).transpose(1, 2)[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, key) * ctx.ring_scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, query) * ctx.ring_scale
        return dq, dk, dv

    with (
        mock.patch.object(dispatch, "_native_attention_forward_op", forward_op),
        mock.patch.object(dispatch, "_native_attention_backward_op", backward_op),
    ):
        yield


def diffusers_route(**config: Any) -> Callable[[torch.nn.Module, int], contextlib.AbstractContextManager]:
    def prepare(model: torch.nn.Module, tokens: int) -> contextlib.AbstractContextManager:
        from diffusers.models._modeling_parallel import ContextParallelConfig

        with mock.patch("torch.accelerator.device_count", return_value=1):  # 0 on CPU: diffusers divides by it
            model.enable_parallelism(config=ContextParallelConfig(**config))
        return _lse_ops() if config.get("ring_degree", 1) > 1 else contextlib.nullcontext()

    return prepare


def commlib_route(attention: str) -> Callable[[torch.nn.Module, int], contextlib.AbstractContextManager]:
    def prepare(model: torch.nn.Module, tokens: int) -> contextlib.AbstractContextManager:
        parallelize(model)
        world = dist.get_world_size()
        sizes = {"ulysses_size": world} if attention == "ulysses" else {"ring_size": world}
        return parallel(commlib.SequenceLayout(tokens, **sizes), attention=attention)

    return prepare


def routes(world: int) -> dict[str, Callable]:
    return {
        "diffusers ulysses": diffusers_route(ulysses_degree=world),
        "diffusers ulysses_anything": diffusers_route(ulysses_degree=world, ulysses_anything=True),
        "diffusers ring (LSE ops added)": diffusers_route(ring_degree=world),
        "commlib ulysses": commlib_route("ulysses"),
        "commlib ring": commlib_route("ring"),
    }


def step(model: torch.nn.Module, inputs: dict, target: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    (out,) = model(**inputs)
    F.mse_loss(out, target).backward()
    return out.detach(), [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def largest(value: float) -> float:
    seen = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return float(seen)


def run_case(heads: int, frames: int, height: int, width: int, prepare: Callable) -> dict[str, Any]:
    model, inputs, target, tokens = wan(heads, frames, height, width)
    with float64_kept():
        want_out, want_grads = step(copy.deepcopy(model), inputs, target)
        try:
            context = prepare(model, tokens)
            with context:
                out, _ = step(model, inputs, target)
            sync_gradients(model.parameters())
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        except Exception as error:  # what the route raised is the result
            return {"raised": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"}
    worst = max(relative(g, w) for g, w in zip(grads, want_grads, strict=True))
    return {"output": largest(relative(out, want_out)), "gradients": largest(worst)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", help="also write the rows as JSON (rank 0)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for case in args.cases:
        for route, prepare in routes(world).items():
            result = run_case(*CASES[case], prepare)
            rows.append({"world_size": world, "case": case, "route": route, **result})
            if rank == 0:
                shown = result.get("raised") or f"output {result['output']:.1e}, gradients {result['gradients']:.1e}"
                print(f"W={world} | {case} | {route} | {shown}", flush=True)
    if rank == 0 and args.json:
        import diffusers

        facts = {
            "command": f"torchrun --standalone --nproc-per-node {world} benchmarks/dit_errors.py "
            + " ".join(sys.argv[1:]),
            "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
        }
        with open(args.json, "w") as file:
            json.dump({"facts": facts, "rows": rows}, file, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
