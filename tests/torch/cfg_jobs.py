"""Job functions for tests/torch/test_cfg.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from commlib import split_sizes
from commlib_torch.attention import cross_attention, ulysses_attention
from commlib_torch.cfg import cfg_combine, cfg_split
from commlib_torch.tools.parity_jobs import usp_groups

HEADS, HEAD_DIM = 2, 3
_SELF_GROUPS: dict = {}


def _self_group() -> dist.ProcessGroup:
    """A group of this rank alone (every rank creates every one, in the same order, once)."""
    if "mine" not in _SELF_GROUPS:
        for rank in range(dist.get_world_size()):
            group = dist.new_group([rank])
            _SELF_GROUPS["mine"] = group if rank == dist.get_rank() else _SELF_GROUPS.get("mine")
    return _SELF_GROUPS["mine"]


def _block(x, emb, weights, sp_group, seq_sizes):
    """A DiT block: self-attention (Ulysses over `sp_group`), then cross-attention to `emb` (replicated kv)."""
    batch, rows, channels = x.shape
    heads = lambda t: t.reshape(*t.shape[:2], HEADS, HEAD_DIM)  # noqa: E731
    q, k, v = (heads(x @ weights[name]) for name in ("q", "k", "v"))
    x = x + ulysses_attention(q, k, v, sp_group, seq_sizes=seq_sizes).reshape(batch, rows, channels) @ weights["o"]
    q, k, v = heads(x @ weights["cq"]), heads(emb @ weights["ck"]), heads(emb @ weights["cv"])
    return x + cross_attention(q, k, v, sp_group).reshape(batch, rows, channels) @ weights["co"]


def cfg_step(ctx, arrays: dict, guidance_scale: float, parallel: bool):
    """The guided output, d x (this rank's rows) and d uncond, d cond of one CFG step: `parallel`: cfg group
    of 2 x sequence group of 2 (rank ``c * 2 + s``: cfg index c, sequence index s); else every rank alone (the
    one-group step: both passes as one batch)."""
    sp_group, cfg_group = usp_groups(4, 2) if parallel else (_self_group(), _self_group())
    rows = np.array_split(np.arange(arrays["x"].shape[1]), 2)[ctx.rank % 2] if parallel else slice(None)
    weights = {name: torch.tensor(value) for name, value in arrays["weights"].items()}
    x = torch.tensor(arrays["x"][:, rows]).requires_grad_()
    uncond, cond = (torch.tensor(arrays[name]).requires_grad_() for name in ("uncond", "cond"))
    both_x = torch.cat([x, x]) if not parallel else x  # the latents of both passes
    seq_sizes = split_sizes(arrays["x"].shape[1], 2 if parallel else 1)
    out = _block(both_x, cfg_split(uncond, cond, cfg_group), weights, sp_group, seq_sizes)
    guided = cfg_combine(out, guidance_scale, cfg_group, convention="replicated")
    (guided * torch.tensor(arrays["cotangent"][:, rows])).sum().backward()
    return guided.detach().numpy(), x.grad.numpy(), uncond.grad.numpy(), cond.grad.numpy()


def cfg_error(ctx, call: str) -> str:
    """The error text of a bad call (every rank raises it, before any collective)."""
    calls = {
        "split4": lambda: cfg_split(torch.zeros(1, 3), torch.zeros(1, 3)),  # WORLD: 4 ranks
        "shapes": lambda: cfg_split(torch.zeros(1, 3), torch.zeros(2, 3), _self_group()),
        "odd": lambda: cfg_combine(torch.zeros(3, 2), 2.0, _self_group()),
        "scale": lambda: cfg_combine(torch.zeros(2, 2), "7.5", _self_group()),
    }
    try:
        calls[call]()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def plain_pass(ctx, arrays: dict, name: str):
    """The block on this rank alone with `name`'s embedding: one pass, no CFG."""
    weights = {key: torch.tensor(value) for key, value in arrays["weights"].items()}
    x, emb = torch.tensor(arrays["x"]), torch.tensor(arrays[name])
    return _block(x, emb, weights, _self_group(), None).numpy()
