"""`commlib_jax.testing_trace.record()` on 4 simulated CPU devices, W = 1-4: every forward commlib call in program
order with its nnx module and every device's input and output (against the float64 numpy reference), under
``jax.jit`` of a gradient (callbacks tagged with call and device: their run order does not matter; the backward's
collectives are not recorded), eagerly, and an attention layer through a `parallel` context as one call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib
from commlib import attention as attention_spec
from commlib import reference
from commlib_jax import all_gather, all_reduce, reduce_scatter
from commlib_jax.sequence import dot_product_attention, parallel
from commlib_jax.testing_trace import record

nnx = pytest.importorskip("flax.nnx", reason="the [flax] extra (CI installs it)")


class Inner(nnx.Module):
    def __call__(self, y):
        return reduce_scatter(y, "x", dim=0)


class Block(nnx.Module):
    def __init__(self):
        self.inner = Inner()

    def __call__(self, x, y):
        return all_gather(all_reduce(x, "x", convention="replicated"), "x", dim=0), self.inner(y)


class Tree(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([Block(), Block()])

    def __call__(self, x, y):
        return self.layers[1](x, y)


def _inputs(world_size: int, seed: int = 3):
    """Every rank's x ``[3, 5]`` and y ``[2 W, 3]`` (float64), stacked along dim 0 as the shard_map takes them."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((3, 5)) for _ in range(world_size)], [
        rng.standard_normal((2 * world_size, 3)) for _ in range(world_size)
    ]


def _tree_step(world_size: int, jit: bool):
    """Every rank's loss gradient through `Tree` (the outputs ride along as aux), in a shard_map over "x"."""
    model = Tree()

    def loss(x, y):
        gathered, scattered = model(x, y)
        return gathered.sum() + jnp.square(scattered).sum(), (gathered, scattered)

    body = jax.grad(loss, argnums=(0, 1), has_aux=True)
    mapped = jax.shard_map(
        body, mesh=Mesh(np.array(jax.devices()[:world_size]), ("x",)), in_specs=P("x"), out_specs=P("x")
    )
    return jax.jit(mapped) if jit else mapped


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_forward_call_in_order_with_its_module_and_arrays(world_size, jit):
    xs, ys = _inputs(world_size)
    step = _tree_step(world_size, jit)
    with record() as trace:
        _, (_, scattered) = step(np.concatenate(xs), np.concatenate(ys))
    assert [(call.op, call.module) for call in trace] == [
        ("all_reduce", "layers.1"),
        ("all_gather", "layers.1"),
        ("reduce_scatter", "layers.1.inner"),
    ]
    summed = reference.all_reduce(xs, "sum")
    want = [(xs, summed), (summed, reference.all_gather(summed, 0)), (ys, reference.reduce_scatter(ys, 0))]
    for call, (inputs, outputs) in zip(trace, want, strict=True):
        assert call.ranks == tuple(range(world_size))
        for rank in range(world_size):
            np.testing.assert_allclose(call.inputs["x"][rank], inputs[rank], rtol=1e-12)
            np.testing.assert_allclose(call.outputs["out"][rank], outputs[rank], rtol=1e-12)
    np.testing.assert_array_equal(
        np.concatenate([trace[2].outputs["out"][r] for r in range(world_size)]), np.asarray(scattered)
    )


def test_a_jitted_program_keeps_its_first_run_and_one_traced_before_is_not_recorded():
    xs, ys = _inputs(2)
    step = _tree_step(2, jit=True)
    with record() as trace:
        step(np.concatenate(xs), np.concatenate(ys))
        step(np.concatenate(xs) * 2, np.concatenate(ys))
    assert len(trace) == 3
    np.testing.assert_allclose(trace[0].inputs["x"][1], xs[1], rtol=1e-12)  # the first run's values
    with record() as later:
        step(np.concatenate(xs), np.concatenate(ys))  # compiled already: no callbacks for this block
    assert len(later) == 0


@pytest.mark.parametrize(("world_size", "seq_len"), [(2, 6), (4, 8), (4, 7)])
def test_an_attention_layer_is_one_call_with_q_k_v(world_size, seq_len):
    """Two causal GQA layers through a Ulysses context (rows past a shard's own: JAX holds them padded)."""
    layout = commlib.SequenceLayout(seq_len, ulysses_size=world_size)
    rng = np.random.default_rng(0)
    whole = [rng.standard_normal((2, seq_len, heads, 4)) for heads in (4, 2, 2)]

    class Layer(nnx.Module):
        def __call__(self, q, k, v):
            return dot_product_attention(q, k, v, is_causal=True, scale=0.3)

    class Layers(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([Layer(), Layer()])

        def __call__(self, q, k, v):
            return [layer(q, k, v) for layer in self.layers]

    padded = [np.concatenate(layout.shard(x, 1, padded=True), axis=1) for x in whole]
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("x",))
    model = Layers()
    f = jax.jit(jax.shard_map(model, mesh=mesh, in_specs=P(None, "x"), out_specs=P(None, "x")))
    with parallel(layout, "x"), record() as trace:
        f(*padded)
    assert [(call.op, call.module, list(call.inputs)) for call in trace] == [
        ("ulysses_attention", f"layers.{i}", ["q", "k", "v"]) for i in range(2)
    ]
    want = attention_spec.attention(*whole, causal=True, scale=0.3)
    for call in trace:
        for rank in range(world_size):
            size = layout.sizes[rank]
            for name, x in zip("qkv", whole, strict=True):
                np.testing.assert_array_equal(call.inputs[name][rank][:, :size], x[:, layout.positions(rank)])
            np.testing.assert_allclose(
                call.outputs["out"][rank][:, :size], want[:, layout.positions(rank)], rtol=1e-10, atol=1e-12
            )
