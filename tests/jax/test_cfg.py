"""`commlib_jax.cfg`: a CFG step on a (cfg 2, sp 2) mesh of 4 CPU devices against the one-group step (a 1 x 1
mesh, both passes as one batch), values and gradients (check_vma True and False); the validation. Each step is one
jitted program per mesh, mode and scale, its weights arguments (eager shard_map dispatches op by op: 6x the CPU
seconds)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError
from commlib_jax.attention import cross_attention, ulysses_attention
from commlib_jax.cfg import cfg_combine, cfg_split

HEADS, HEAD_DIM, ROWS = 2, 3, 8
SCALE = 4.5


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    channels = HEADS * HEAD_DIM
    names = ("q", "k", "v", "o", "cq", "ck", "cv", "co")
    return {
        "x": rng.standard_normal((2, ROWS, channels)),
        "uncond": rng.standard_normal((2, 4, channels)),
        "cond": rng.standard_normal((2, 4, channels)),
        "cotangent": rng.standard_normal((2, ROWS, channels)),
        "weights": {name: rng.standard_normal((channels, channels)) / channels for name in names},
    }


def _block(x, emb, weights):
    heads = lambda t: t.reshape(*t.shape[:2], HEADS, HEAD_DIM)  # noqa: E731
    q, k, v = (heads(x @ weights[name]) for name in ("q", "k", "v"))
    x = x + ulysses_attention(q, k, v, "sp").reshape(x.shape) @ weights["o"]
    q, k, v = heads(x @ weights["cq"]), heads(emb @ weights["ck"]), heads(emb @ weights["cv"])
    return x + cross_attention(q, k, v, "sp").reshape(x.shape) @ weights["co"]


def _step(arrays, cfg_size, check_vma, scale=SCALE):
    """Every rank's guided output and the gradients of x (its rows), uncond and cond (per-rank copies)."""
    sp_size = 2 if cfg_size == 2 else 1
    ranks = cfg_size * sp_size
    rows = np.split(np.arange(ROWS), sp_size)
    x = np.stack([arrays["x"][:, rows[rank % sp_size]] for rank in range(ranks)])
    cot = np.stack([arrays["cotangent"][:, rows[rank % sp_size]] for rank in range(ranks)])
    uncond, cond = (np.stack([arrays[name]] * ranks) for name in ("uncond", "cond"))
    (_, guided), grads = _step_program(cfg_size, check_vma, scale)(x, uncond, cond, cot, arrays["weights"])
    return np.asarray(guided), [np.asarray(g) for g in grads]


@functools.cache
def _step_program(cfg_size, check_vma, scale):
    """The jitted value and gradient of the step (one program per mesh, mode and scale; the weights are arguments,
    so every seed's arrays run the same program)."""
    sp_size = 2 if cfg_size == 2 else 1
    mesh = Mesh(np.array(jax.devices()[: cfg_size * sp_size]).reshape(cfg_size, sp_size), ("cfg", "sp"))
    per_rank = P(("cfg", "sp"))

    def total(x, uncond, cond, cot, weights):
        def body(x, uncond, cond, cot):
            both_x = x[0] if cfg_size == 2 else jnp.concatenate([x[0], x[0]])
            out = _block(both_x, cfg_split(uncond[0], cond[0], "cfg"), weights)
            guided = cfg_combine(out, scale, "cfg", convention="replicated")
            return guided[None], (guided * cot[0]).sum()[None]

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(per_rank,) * 4, out_specs=(per_rank,) * 2, check_vma=check_vma
        )
        guided, losses = mapped(x, uncond, cond, cot)
        return losses.sum(), guided

    return jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True))


def _shared_gradient(arrays):
    """d uncond, d cond of the CFG-parallel step with uncond and cond given once, ``P()`` (typed invariant under
    check_vma=True: JAX sums their gradient over the ranks)."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("cfg", "sp"))
    rows = np.split(np.arange(ROWS), 2)
    x = np.stack([arrays["x"][:, rows[rank % 2]] for rank in range(4)])
    cot = np.stack([arrays["cotangent"][:, rows[rank % 2]] for rank in range(4)])
    weights = {name: jnp.asarray(value) for name, value in arrays["weights"].items()}

    def body(x, cot, uncond, cond):
        out = _block(x[0], cfg_split(uncond, cond, "cfg"), weights)
        return (cfg_combine(out, SCALE, "cfg", convention="replicated") * cot[0]).sum()[None]

    per_rank = P(("cfg", "sp"))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(per_rank, per_rank, P(), P()), out_specs=per_rank)
    loss = lambda uncond, cond: mapped(x, cot, uncond, cond).sum()  # noqa: E731
    return [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(arrays["uncond"], arrays["cond"])]


def test_shared_embeddings_get_the_one_group_gradient():
    """Embeddings given once (``P()``, check_vma=True): their gradient is the one-group step's, counted once."""
    arrays = _arrays()
    _, (_, single_du, single_dc) = _step(arrays, 1, True)
    du, dc = _shared_gradient(arrays)
    np.testing.assert_allclose(du, single_du[0], rtol=0, atol=1e-13)
    np.testing.assert_allclose(dc, single_dc[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("check_vma", [True, False])
def test_cfg_parallel_equals_the_one_group_step(check_vma):
    arrays = _arrays()
    single, (single_dx, single_du, single_dc) = _step(arrays, 1, check_vma)
    guided, (dx, du, dc) = _step(arrays, 2, check_vma)
    rows = np.split(np.arange(ROWS), 2)
    for rank in range(4):  # rank c * 2 + s
        np.testing.assert_allclose(guided[rank], single[0][:, rows[rank % 2]], rtol=0, atol=1e-13)
    for s in range(2):  # x is the cfg pair's: its gradient is their sum
        np.testing.assert_allclose(dx[s] + dx[2 + s], single_dx[0][:, rows[s]], rtol=0, atol=1e-13)
    for c in range(2):  # uncond / cond: each sequence rank's queries' share, both cfg ranks the full pair
        np.testing.assert_allclose(du[2 * c] + du[2 * c + 1], single_du[0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(dc[2 * c] + dc[2 * c + 1], single_dc[0], rtol=0, atol=1e-13)
    assert np.abs(single_du).max() > 0 and np.abs(single_dc).max() > 0


def _alone(arrays, name):
    """The block on one device with `name`'s embedding: one pass, no CFG."""
    return np.asarray(_alone_program()(arrays["x"], arrays[name], arrays["weights"]))


@functools.cache
def _alone_program():
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    return jax.jit(jax.shard_map(_block, mesh=mesh, in_specs=P(), out_specs=P()))


def test_the_passes_are_not_swapped():
    """Scale 1 gives the conditional pass and 0 the unconditional, each the block run alone on that embedding."""
    arrays = _arrays(1)
    rows = np.split(np.arange(ROWS), 2)
    for scale, name in ((1.0, "cond"), (0.0, "uncond")):
        guided, alone = _step(arrays, 2, False, scale)[0], _alone(arrays, name)
        for rank in range(4):
            np.testing.assert_allclose(guided[rank], alone[:, rows[rank % 2]], rtol=0, atol=1e-13)
    assert np.abs(_alone(arrays, "cond") - _alone(arrays, "uncond")).max() > 1e-3


def test_bad_calls():
    mesh = Mesh(np.array(jax.devices()[:4]), ("cfg",))
    run = lambda f: jax.shard_map(f, mesh=mesh, in_specs=P("cfg"), out_specs=P("cfg"))(jnp.zeros((4, 2)))  # noqa: E731
    with pytest.raises(CommError, match=r"cfg_split: world_size \(4\) must be 1 or 2"):
        run(lambda x: cfg_split(x, x, "cfg"))
    with pytest.raises(CommError, match=r"cfg_combine: world_size \(4\) must be 1 or 2"):
        run(lambda x: cfg_combine(x, 2.0, "cfg"))
    with pytest.raises(TypeError, match="cfg_combine: guidance_scale must be a number, not str"):
        jax.shard_map(
            lambda x: cfg_combine(x, "7", "cfg"),
            mesh=Mesh(np.array(jax.devices()[:2]), ("cfg",)),
            in_specs=P("cfg"),
            out_specs=P("cfg"),
        )(jnp.zeros((2, 2)))
