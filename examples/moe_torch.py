"""Train a transformer block with a mixture-of-experts MLP, its experts sharded over the expert-parallel ranks
(commlib_torch.moe), for 5 AdamW steps in float64, and check every step against the same model trained
unsharded in this process: the loss and every parameter's gradient (the router's included) within 1e-10
relative. Exit status 1 if not.

    torchrun --standalone --nproc-per-node 4 examples/moe_torch.py

The block: x + attention(rms_norm(x)) (one causal head per sequence), then h + shared(n) + moe(n) with
n = rms_norm(h): a shared expert, and E = 8 experts (a two-layer SiLU MLP each) of which each token takes the
top 2 of a softmax router, weighted by their probabilities. The loss: the mean squared error against a target,
plus 0.01 times the router's load-balancing loss ``E * sum_e f_e * P_e`` (f_e: the fraction of routes to
expert e, P_e: the mean router probability of e, both over every rank's tokens).

Each rank holds its own sequences (data parallel) and E / W experts (expert parallel, one group: every rank).
`route` sends each token's rows to its experts' ranks, `dispatch` / `combine` move them and back, and their
gradients come back the same way: an expert's weight gradient is complete on its rank (every rank's tokens
reached it), so it is not all_reduced; every other parameter (attention, norms, shared expert, router) is
replicated and its gradient is summed over the ranks. f_e needs the global counts (one all_reduce, no gradient);
P_e enters linearly, so each rank adds its tokens' share.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as functional

from commlib_torch import moe

E, K, H, F, B, S = 8, 2, 8, 16, 2, 6  # experts, top-k, hidden, expert hidden, sequences per rank, length
STEPS, AUX, LR, TOLERANCE = 5, 0.01, 1e-2, 1e-10
EXPERTS = ("expert_in", "expert_out")  # [E, ...]: sharded over the ranks by expert


def init(world_size: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The parameters, and every rank's sequences x and targets ``[W * B, S, H]`` (numpy, float64)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(shape[-2])

    params = {
        "norm_1": 1 + 0.1 * rng.standard_normal(H),
        "wq": normal(H, H),
        "wk": normal(H, H),
        "wv": normal(H, H),
        "wo": normal(H, H),
        "norm_2": 1 + 0.1 * rng.standard_normal(H),
        "router": normal(H, E),
        "shared_in": normal(H, F),
        "shared_out": normal(F, H),
        "expert_in": normal(E, H, F),
        "expert_out": normal(E, F, H),
    }
    x = rng.standard_normal((world_size * B, S, H))
    return params, x, rng.standard_normal(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight


def trunk(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, n, probs)``: the attention residual ``[b, S, H]``, its norm as tokens ``[b * S, H]`` and the router's
    softmax ``[b * S, E]``."""
    a = rms_norm(x, p["norm_1"])
    q, k, v = a @ p["wq"], a @ p["wk"], a @ p["wv"]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / H**0.5).masked_fill(~causal, -torch.inf)
    h = x + (scores.softmax(-1) @ v) @ p["wo"]
    n = rms_norm(h, p["norm_2"]).reshape(-1, H)
    return h, n, (n @ p["router"]).softmax(-1)


def expert(n: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    return functional.silu(n @ w_in) @ w_out


def finish(p, x, target, h, n, probs, mixed, counts, tokens: int) -> torch.Tensor:
    """The loss of these tokens' share of the `tokens` in all: their squared error / (tokens * H), plus their
    share of the load-balancing loss, given every rank's routes per expert `counts`."""
    out = h + (expert(n, p["shared_in"], p["shared_out"]) + mixed).reshape(h.shape)
    fraction = counts / (tokens * K)
    return ((out - target) ** 2).sum() / (tokens * H) + AUX * E * (fraction * probs.sum(0) / tokens).sum()


def unsharded_loss(p: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The same block on every sequence in one process, every expert on every token's top-k."""
    h, n, probs = trunk(p, x)
    weights, indices = probs.topk(K, dim=-1)
    every = torch.stack([expert(n, p["expert_in"][e], p["expert_out"][e]) for e in range(E)], 1)  # [T, E, H]
    chosen = every.gather(1, indices[..., None].expand(-1, -1, H))  # [T, K, H]
    mixed = (weights[..., None] * chosen).sum(1)
    counts = torch.bincount(indices.reshape(-1), minlength=E).to(x.dtype)
    return finish(p, x, target, h, n, probs, mixed, counts, n.shape[0])


def sharded_loss(p: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor, tokens: int) -> torch.Tensor:
    """This rank's share of the loss: its sequences, its experts (p's expert tensors: this rank's block)."""
    h, n, probs = trunk(p, x)
    weights, indices = probs.topk(K, dim=-1)
    routing = moe.route(indices, E)  # experts in contiguous blocks: this rank's are E / W of them
    rows = moe.dispatch(n, routing)  # [routing.rows, H], expert-major
    parts = torch.split(rows, routing.tokens_per_expert.tolist())
    y = torch.cat([expert(part, p["expert_in"][e], p["expert_out"][e]) for e, part in enumerate(parts)])
    mixed = moe.combine(y, routing, weights)  # [T, H]: the weighted top-k, back at each token
    counts = torch.bincount(indices.reshape(-1), minlength=E).to(x.dtype)
    dist.all_reduce(counts)  # every rank's routes: no gradient flows through counts
    return finish(p, x, target, h, n, probs, mixed, counts, tokens)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def main() -> int:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if E % world:
        raise SystemExit(f"E = {E} experts must split evenly over {world} ranks")
    torch.set_default_dtype(torch.float64)
    params, x, target = init(world)
    per_rank = E // world
    mine_of = {
        name: slice(rank * per_rank, (rank + 1) * per_rank) if name in EXPERTS else slice(None) for name in params
    }
    sharded = {name: torch.tensor(value[mine_of[name]], requires_grad=True) for name, value in params.items()}
    unsharded = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    optimizers = [torch.optim.AdamW(list(p.values()), lr=LR, weight_decay=0.01) for p in (sharded, unsharded)]
    x_all, target_all = torch.tensor(x), torch.tensor(target)
    x_mine, target_mine = x_all[rank * B : (rank + 1) * B], target_all[rank * B : (rank + 1) * B]

    worst = {"loss": 0.0, "gradients": 0.0, "router": 0.0, "parameters": 0.0}
    for step in range(1, STEPS + 1):
        loss = sharded_loss(sharded, x_mine, target_mine, x_all.shape[0] * S)
        loss.backward()
        for name, p in sharded.items():
            if name not in EXPERTS:  # replicated: summed over the ranks (the experts' are complete already)
                dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        expected = unsharded_loss(unsharded, x_all, target_all)
        expected.backward()

        errors = {name: relative(p.grad, unsharded[name].grad[mine_of[name]]) for name, p in sharded.items()}
        expected = expected.detach()
        found = torch.tensor(
            [abs(float(total - expected)) / abs(float(expected)), max(errors.values()), errors["router"]]
        )
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        parameters = max(relative(p.detach(), unsharded[name].detach()[mine_of[name]]) for name, p in sharded.items())
        found = torch.cat([found, torch.tensor([parameters])])
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the worst over every rank
        worst = {key: max(worst[key], float(value)) for key, value in zip(worst, found, strict=True)}
        if rank == 0:
            print(
                f"step {step}  loss {float(total):.12f}  unsharded {float(expected):.12f}  max relative error: "
                f"loss {found[0]:.1e}, gradients {found[1]:.1e} (router {found[2]:.1e}), parameters {found[3]:.1e}",
                flush=True,
            )
    passed = max(worst.values()) <= TOLERANCE
    if rank == 0:
        print(
            f"{'PASS' if passed else 'FAIL'}: {world} ranks, E={E} K={K}, {STEPS} AdamW steps, max relative error: "
            f"loss {worst['loss']:.1e}, gradients {worst['gradients']:.1e} (router {worst['router']:.1e}), "
            f"parameters {worst['parameters']:.1e} (limit {TOLERANCE:.0e})",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
