"""Every way to take the gradient of a pure sequence-parallel JAX model, measured (docs/sequence-parallel.md's factor
table): a tiny decoder (token and position embeddings, causal Ulysses attention, a head; every parameter
replicated, the sequence sharded over 4 devices, S = 32) whose loss is `commlib_jax.sequence.cross_entropy`.
A factor is the gradient returned divided by the unsharded model's, the same on every rank and parameter; "part"
is a gradient that is no multiple of it (each rank's own part); "refused" is JAX's own ValueError."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import SequenceLayout
from commlib_jax import sequence
from commlib_jax.attention import attention, ulysses_attention
from commlib_jax.training import value_and_grad

W, B, S, HEADS, HEAD_DIM, V = 4, 2, 32, 4, 2, 11
E = HEADS * HEAD_DIM
LAYOUT = SequenceLayout(S, ulysses_size=W)
MODES = ("check_vma=True", "check_vma=False", "pmap")

#: (way, mode) -> the measured factor (the docs' table).
FACTORS = {
    ("grad inside, no psum", "check_vma=True"): 1.0,
    ("grad inside, no psum", "check_vma=False"): "part",
    ("grad inside, no psum", "pmap"): "part",
    ("grad inside + psum", "check_vma=True"): 4.0,
    ("grad inside + psum", "check_vma=False"): 1.0,
    ("grad inside + psum", "pmap"): 1.0,
    ("value_and_grad inside", "check_vma=True"): 1.0,
    ("value_and_grad inside", "check_vma=False"): 1.0,
    ("value_and_grad inside", "pmap"): 1.0,
    ("per-rank losses out, summed, grad outside", "check_vma=True"): 1.0,
    ("per-rank losses out, summed, grad outside", "check_vma=False"): 1.0,
    ("per-rank losses out, summed, grad outside", "pmap"): 1.0,
    ("loss out with P(), grad outside", "check_vma=True"): "refused",
    ("loss out with P(), grad outside", "check_vma=False"): 0.25,
}


def _parameters():
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((V, E)),
        "position": rng.standard_normal((S, E)),
        "qkv": rng.standard_normal((E, 3 * E)) / 3,
        "head": rng.standard_normal((E, V)),
    }


PARAMS = _parameters()
IDS = np.random.default_rng(1).integers(0, V, (B, S))


def _forward(params, tokens, positions, attend):
    hidden = params["embed"][tokens] + params["position"][positions]
    q, k, v = (part.reshape(*hidden.shape[:2], HEADS, HEAD_DIM) for part in jnp.split(hidden @ params["qkv"], 3, -1))
    return (hidden + attend(q, k, v).reshape(hidden.shape)) @ params["head"]


def _unsharded(params):
    positions = jnp.broadcast_to(jnp.arange(S), IDS.shape)
    logits = _forward(params, IDS, positions, lambda q, k, v: attention(q, k, v, causal=True))
    return -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), IDS[:, 1:, None], -1).mean()


def _rank_loss(params, ids):
    """The commlib recipe on one rank: its tokens, global positions and labels; the global mean loss."""
    tokens, positions, labels = sequence.shard_tokens(ids, LAYOUT, "i")
    logits = _forward(params, tokens, positions, lambda q, k, v: ulysses_attention(q, k, v, "i", causal=True))
    return sequence.cross_entropy(logits, labels, "i")


STACKED = P("i")  # each rank's result along a leading [W] axis


def _mapped(body, mode: str, out_specs=STACKED):
    """`body(params, ids)` on every rank, params and ids replicated (pmap: ids given per rank, `_ids`)."""
    if mode == "pmap":
        return jax.pmap(
            body,
            axis_name="i",
            in_axes=(None, 0),
            out_axes=0 if out_specs == P("i") else None,
            devices=jax.devices()[:W],
        )
    mesh = Mesh(np.array(jax.devices()[:W]), ("i",))
    stacked = (lambda *args: jax.tree.map(lambda a: a[None], body(*args))) if out_specs == P("i") else body
    return jax.shard_map(
        stacked, mesh=mesh, in_specs=(P(), P()), out_specs=out_specs, check_vma=mode == "check_vma=True"
    )


def _ids(mode: str) -> np.ndarray:
    return np.broadcast_to(IDS, (W, *IDS.shape)) if mode == "pmap" else IDS


def _inside(mode: str, way: str):
    """Every rank's gradients [W, ...] taken inside the map."""

    def body(params, ids):
        if way == "value_and_grad inside":
            return value_and_grad(_rank_loss, "i")(params, ids)[1]
        grads = jax.grad(_rank_loss)(params, ids)
        return jax.tree.map(lambda g: lax.psum(g, "i"), grads) if way == "grad inside + psum" else grads

    return jax.jit(_mapped(body, mode))(PARAMS, _ids(mode))


def _outside(mode: str, way: str):
    """The gradient [1, ...] of the per-rank losses summed outside, or of the loss leaving with P()."""
    if way == "loss out with P(), grad outside":
        mapped = _mapped(_rank_loss, mode, out_specs=P())
        grads = jax.jit(jax.grad(lambda p: mapped(p, _ids(mode))))(PARAMS)
    else:
        mapped = _mapped(_rank_loss, mode)
        grads = jax.jit(jax.grad(lambda p: mapped(p, _ids(mode)).sum()))(PARAMS)
    return jax.tree.map(lambda g: g[None], grads)


def factor(grads, want) -> float | str:
    """The one factor c with grads == c * want on every rank and parameter (to 1e-12 relative), else "part"."""
    got = np.concatenate([np.asarray(grads[name]).reshape(len(np.asarray(grads[name])), -1) for name in want], 1)
    expected = np.concatenate([np.asarray(want[name]).reshape(-1) for name in want])
    scales = got @ expected / (expected @ expected)
    residual = np.abs(got - scales[:, None] * expected).max() / np.abs(expected).max()
    if residual > 1e-12 or np.ptp(scales) > 1e-12:
        return "part"
    return round(float(scales[0]), 12)


@pytest.mark.parametrize(("way", "mode"), list(FACTORS), ids=[f"{way}-{mode}" for way, mode in FACTORS])
def test_factor(way, mode):
    want = jax.grad(_unsharded)(PARAMS)
    if FACTORS[way, mode] == "refused":
        with pytest.raises(ValueError, match="out_specs which require replication which can't be statically"):
            _outside(mode, way)
        return
    grads = _inside(mode, way) if "inside" in way else _outside(mode, way)
    assert factor(grads, want) == FACTORS[way, mode]
