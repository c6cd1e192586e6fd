"""`commlib_torch.cfg`: a CFG step on a cfg group of 2 x a sequence group of 2 (4 gloo ranks) against the
one-group step (each rank alone, both passes as one batch), values and gradients; the validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from commlib import split_sizes
from commlib_torch.attention import cross_attention, ulysses_attention
from commlib_torch.cfg import cfg_combine, cfg_split
from commlib_torch.tools.parity_jobs import usp_groups

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------


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


# --- the tests ----------------------------------------------------------------------------------------------


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    channels = HEADS * HEAD_DIM
    names = ("q", "k", "v", "o", "cq", "ck", "cv", "co")
    return {
        "x": rng.standard_normal((2, 7, channels)),  # 7 video tokens: 4 and 3 rows on the sequence ranks
        "uncond": rng.standard_normal((2, 4, channels)),  # 4 text tokens
        "cond": rng.standard_normal((2, 4, channels)),
        "cotangent": rng.standard_normal((2, 7, channels)),
        "weights": {name: rng.standard_normal((channels, channels)) / channels for name in names},
    }


def test_cfg_parallel_equals_the_one_group_step(pool):
    arrays = _arrays()
    single = pool(4).run(cfg_step, arrays, 4.5, False)[0]
    parallel = pool(4).run(cfg_step, arrays, 4.5, True)
    rows = np.array_split(np.arange(7), 2)
    for rank, (guided, *_) in enumerate(parallel):
        np.testing.assert_allclose(guided, single[0][:, rows[rank % 2]], rtol=0, atol=1e-13)
    for s in range(2):  # x is shared by the cfg pair (c * 2 + s): its gradient is their sum
        np.testing.assert_allclose(parallel[s][1] + parallel[2 + s][1], single[1][:, rows[s]], rtol=0, atol=1e-13)
    for c in range(2):  # each rank's uncond / cond gradient comes from its sequence rows' queries
        for index in (2, 3):
            total = parallel[2 * c][index] + parallel[2 * c + 1][index]
            np.testing.assert_allclose(total, single[index], rtol=0, atol=1e-13)
    assert np.abs(single[2]).max() > 0 and np.abs(single[3]).max() > 0


def test_guidance_scale_reaches_the_result(pool):
    """Scale 1 gives the conditional pass and 0 the unconditional, each the block run alone on that embedding."""
    arrays = _arrays(1)
    rows = np.array_split(np.arange(7), 2)
    for scale, name in ((1.0, "cond"), (0.0, "uncond")):
        alone = pool(4).run(plain_pass, arrays, name)[0]
        for rank, (guided, *_) in enumerate(pool(4).run(cfg_step, arrays, scale, True)):
            np.testing.assert_allclose(guided, alone[:, rows[rank % 2]], rtol=0, atol=1e-13)
    assert np.abs(alone - pool(4).run(plain_pass, arrays, "cond")[0]).max() > 1e-3


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("split4", "CommError: cfg_split: world_size (4) must be 1 or 2 (the unconditional and the conditional pass)"),
        ("shapes", "CommError: cfg_split: cond shape (2, 3) must equal uncond shape (1, 3)"),
        ("odd", "CommError: cfg_combine: shape[dim] (3) must be even at world_size 1 (the uncond and cond halves)"),
        ("scale", "TypeError: cfg_combine: guidance_scale must be a number, not str"),
    ],
)
def test_bad_calls(pool, call, expected):
    assert all(message.startswith(expected) for message in pool(4).run(cfg_error, call))
