"""Train a transformer block with a mixture-of-experts MLP, its experts sharded over 4 CPU devices
(commlib_jax.moe inside jax.shard_map), for 5 AdamW steps in float64, and check every step against the same
model trained unsharded: the loss and every parameter's gradient (the router's included) within 1e-10
relative. Exit status 1 if not.

    python examples/moe_jax.py

The block and its loss are examples/moe_torch.py's: x + attention(rms_norm(x)) (one causal head per sequence),
then h + shared(n) + moe(n) with n = rms_norm(h) (a shared expert, and E = 8 SiLU experts of which each token
takes the top 2 of a softmax router, weighted by their probabilities); the mean squared error plus 0.01 times
the load-balancing loss ``E * sum_e f_e * P_e``.

Each device holds its own sequences and E / W experts (``P("ep")`` on the experts' leading dim); every other
parameter is replicated (``P()``). The per-device losses leave the map and are summed outside, so ``jax.grad``
gives each replicated parameter the sum of every device's gradient (the transpose of its replication) and each
expert the gradient of every token that reached it (dispatch's and combine's VJPs): no gradient is synced by
hand. JAX's `route` is the padded layout: each dispatched row runs its local expert's weights, the padded rows
(zero) give zero and are never read by combine.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)  # before JAX's first use
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from commlib_jax import moe  # noqa: E402

E, K, H, F, B, S = 8, 2, 8, 16, 2, 6  # experts, top-k, hidden, expert hidden, sequences per device, length
STEPS, AUX, LR, TOLERANCE, WORLD = 5, 0.01, 1e-2, 1e-10, 4
EXPERTS = ("expert_in", "expert_out")  # [E, ...]: sharded over the devices by expert


def init(world_size: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The parameters, and every device's sequences x and targets ``[W * B, S, H]`` (numpy, float64)."""
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


def rms_norm(x, weight):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * weight


def trunk(p, x):
    """``(h, n, probs)``: the attention residual ``[b, S, H]``, its norm as tokens ``[b * S, H]`` and the router's
    softmax ``[b * S, E]``."""
    a = rms_norm(x, p["norm_1"])
    q, k, v = a @ p["wq"], a @ p["wk"], a @ p["wv"]
    scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)), q @ jnp.swapaxes(k, -1, -2) / H**0.5, -jnp.inf)
    h = x + (jax.nn.softmax(scores, -1) @ v) @ p["wo"]
    n = rms_norm(h, p["norm_2"]).reshape(-1, H)
    return h, n, jax.nn.softmax(n @ p["router"], -1)


def expert(n, w_in, w_out):
    return jax.nn.silu(n @ w_in) @ w_out


def finish(p, target, h, n, probs, mixed, counts, tokens: int):
    """These tokens' share of the loss of `tokens` in all, given every device's routes per expert `counts`."""
    out = h + (expert(n, p["shared_in"], p["shared_out"]) + mixed).reshape(h.shape)
    fraction = counts / (tokens * K)
    return jnp.sum((out - target) ** 2) / (tokens * H) + AUX * E * jnp.sum(fraction * probs.sum(0) / tokens)


def unsharded_loss(p, x, target):
    """The same block on every sequence on one device, every expert on every token's top-k."""
    h, n, probs = trunk(p, x)
    weights, indices = jax.lax.top_k(probs, K)
    every = jnp.stack([expert(n, p["expert_in"][e], p["expert_out"][e]) for e in range(E)], 1)  # [T, E, H]
    chosen = jnp.take_along_axis(every, indices[..., None], axis=1)  # [T, K, H]
    counts = jnp.bincount(indices.reshape(-1), length=E).astype(x.dtype)
    return finish(p, target, h, n, probs, (weights[..., None] * chosen).sum(1), counts, n.shape[0])


def device_loss(p, x, target, tokens: int):
    """One device's share of the loss: its sequences, its experts (p's expert arrays: its block)."""
    h, n, probs = trunk(p, x)
    weights, indices = jax.lax.top_k(probs, K)
    routing = moe.route(indices, E, "ep")  # experts in contiguous blocks: this device's are E / W of them
    rows = moe.dispatch(n, routing)  # [plan.padded_rows, H], expert-major, zero past routing.rows
    ends = jnp.cumsum(routing.tokens_per_expert)
    local = jnp.minimum(jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right"), E // WORLD - 1)
    hidden = jax.nn.silu(jnp.einsum("rh,rhf->rf", rows, p["expert_in"][local]))
    y = jnp.einsum("rf,rfh->rh", hidden, p["expert_out"][local])  # each row through its own expert
    mixed = moe.combine(y, routing, weights)  # [T, H]: the weighted top-k, back at each token
    counts = jax.lax.psum(jnp.bincount(indices.reshape(-1), length=E), "ep")  # every device's routes
    return finish(p, target, h, n, probs, mixed, jax.lax.stop_gradient(counts).astype(x.dtype), tokens)


def sharded_loss(mesh: Mesh):
    specs = {name: P("ep") if name in EXPERTS else P() for name in init(1)[0]}

    def body(p, x, target):
        return device_loss(p, x, target, WORLD * B * S)[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep"), P("ep")), out_specs=P("ep"))
    return lambda p, x, target: mapped(p, x, target).sum()


def adamw(p, grads, state, step: int, b1=0.9, b2=0.999, eps=1e-8, decay=0.01):
    """torch.optim.AdamW's update, written out (both models take the same one)."""
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state[0], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state[1], grads)

    def update(x, m, v):
        return x * (1 - LR * decay) - LR * (m / (1 - b1**step)) / (jnp.sqrt(v / (1 - b2**step)) + eps)

    return jax.tree.map(update, p, m, v), (m, v)


def relative(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-300))


def main() -> int:
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("ep",))
    params, x, target = init(WORLD)
    sharded = {name: jnp.asarray(value) for name, value in params.items()}
    unsharded = dict(sharded)
    zeros = jax.tree.map(jnp.zeros_like, sharded)
    states = [(zeros, zeros), (zeros, zeros)]
    steps = [jax.jit(jax.value_and_grad(loss)) for loss in (sharded_loss(mesh), unsharded_loss)]
    worst = {"loss": 0.0, "gradients": 0.0, "router": 0.0, "parameters": 0.0}
    for step in range(1, STEPS + 1):
        (total, grads), (expected, want) = (
            run(p, x, target) for run, p in zip(steps, (sharded, unsharded), strict=True)
        )
        errors = {name: relative(grads[name], want[name]) for name in grads}
        sharded, states[0] = adamw(sharded, grads, states[0], step)
        unsharded, states[1] = adamw(unsharded, want, states[1], step)
        found = {
            "loss": abs(float(total - expected)) / abs(float(expected)),
            "gradients": max(errors.values()),
            "router": errors["router"],
            "parameters": max(relative(sharded[name], unsharded[name]) for name in sharded),
        }
        worst = {key: max(worst[key], found[key]) for key in worst}
        print(
            f"step {step}  loss {float(total):.12f}  unsharded {float(expected):.12f}  max relative error: "
            f"loss {found['loss']:.1e}, gradients {found['gradients']:.1e} (router {found['router']:.1e}), "
            f"parameters {found['parameters']:.1e}",
            flush=True,
        )
    passed = max(worst.values()) <= TOLERANCE
    print(
        f"{'PASS' if passed else 'FAIL'}: {WORLD} devices, E={E} K={K}, {STEPS} AdamW steps, max relative error: "
        f"loss {worst['loss']:.1e}, gradients {worst['gradients']:.1e} (router {worst['router']:.1e}), "
        f"parameters {worst['parameters']:.1e} (limit {TOLERANCE:.0e})",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
