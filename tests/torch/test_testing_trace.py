"""`commlib_torch.testing_trace.record()` on real gloo ranks, W = 1-4: every forward commlib call in order with
its module and every rank's input and output (against the float64 numpy reference), no backward call, nothing
after the block; an attention layer through a `parallel` context is one call (q, k, v), not its all-to-alls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import commlib
from commlib import attention as attention_spec
from commlib import reference
from commlib.testing.trace import Trace
from commlib_torch import all_gather, all_reduce, reduce_scatter
from commlib_torch.integrations import transformers as integration
from commlib_torch.sequence import parallel
from commlib_torch.testing_trace import record

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------
# Each job returns this rank's `Trace` and what it fed and got.


def tree_inputs(rank: int, world_size: int, seed: int) -> list[np.ndarray]:
    """Rank `rank`'s seeded float64 inputs of `Tree`: odd shapes ``[3, 5]`` and ``[2 W, 3]``."""
    rng = np.random.default_rng(seed + rank)
    return [rng.standard_normal((3, 5)), rng.standard_normal((2 * world_size, 3))]


class Inner(torch.nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(y, dim=0)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return all_gather(all_reduce(x, convention="replicated"), dim=0), self.inner(y)


class Tree(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Identity(), Block()])

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.layers[1](self.layers[0](x), y)


def tree(ctx, seed: int):
    """This rank's trace of `Tree` forward and backward (inside the block), and then a call after it."""
    x, y = (torch.tensor(value, requires_grad=True) for value in tree_inputs(ctx.rank, ctx.world_size, seed))
    with record() as trace:
        gathered, scattered = Tree()(x, y)
        (gathered.sum() + scattered.square().sum()).backward()
        with torch.no_grad():
            all_reduce(x * 2)
    all_reduce(x)  # after the block: not recorded
    return trace, gathered.detach().numpy(), scattered.detach().numpy()


def under_grad(ctx, seed: int):
    """This rank's trace of ``torch.func.grad`` through an all_gather of its x (recorded by value)."""
    x = torch.tensor(tree_inputs(ctx.rank, ctx.world_size, seed)[0])
    with record() as trace:
        gradient = torch.func.grad(lambda x: all_gather(x, dim=0).square().sum())(x)
    return trace, gradient.numpy()


class SelfAttention(torch.nn.Module):
    """Calls the transformers integration as a transformers attention module does."""

    is_causal = True

    def forward(self, q, k, v, position_ids):
        return integration.attention_forward(self, q, k, v, None, scaling=0.25, position_ids=position_ids)[0]


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = SelfAttention()


class Stack(torch.nn.Module):
    """Two layers, each with its ``self_attn``: the attention call's module is ``layers.i.self_attn``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, q, k, v, position_ids):
        return [layer.self_attn(q, k, v, position_ids) for layer in self.layers]


def attention(ctx, seq_len: int):
    """This rank's trace of two causal GQA attention calls through a Ulysses `parallel` context (modules
    ``layers.0.self_attn`` and ``layers.1.self_attn``), and its outputs ``[B, S_r, H, D]``."""
    layout = commlib.SequenceLayout(seq_len, ulysses_size=ctx.world_size)
    shards = [torch.tensor(layout.shard(x, 1)[ctx.rank]) for x in attention_inputs(seq_len)]
    positions = torch.as_tensor(layout.positions(ctx.rank))[None]
    with parallel(layout), record() as trace:
        outputs = Stack()(*(x.transpose(1, 2) for x in shards), positions)
    return trace, [out.numpy() for out in outputs]


def attention_inputs(seq_len: int) -> list[np.ndarray]:
    """The whole q ``[2, S, 4, 8]``, k and v ``[2, S, 2, 8]`` (float64, seeded)."""
    rng = np.random.default_rng(7)
    return [rng.standard_normal((2, seq_len, heads, 8)) for heads in (4, 2, 2)]


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_forward_call_in_order_with_its_module_and_arrays(pool, world_size):
    replies = pool(world_size).run(tree, 5)
    trace = Trace.merge([reply[0] for reply in replies])
    assert [(call.op, call.module) for call in trace] == [
        ("all_reduce", "layers.1"),
        ("all_gather", "layers.1"),
        ("reduce_scatter", "layers.1.inner"),
        ("all_reduce", ""),
    ]
    assert trace[0].plan["convention"] == "replicated" and trace[3].plan["in_shape"] == "(3, 5)"
    xs, ys = zip(*(tree_inputs(rank, world_size, 5) for rank in range(world_size)), strict=True)
    summed = reference.all_reduce(list(xs), "sum")
    gathered = reference.all_gather(summed, 0)
    scattered = reference.reduce_scatter(list(ys), 0)
    want = [(xs, summed), (summed, gathered), (ys, scattered), ([2 * x for x in xs], [2 * s for s in summed])]
    for call, (inputs, outputs) in zip(trace, want, strict=True):
        assert call.ranks == tuple(range(world_size))
        for rank in range(world_size):
            np.testing.assert_allclose(call.inputs["x"][rank], inputs[rank], rtol=1e-12)
            np.testing.assert_allclose(call.outputs["out"][rank], outputs[rank], rtol=1e-12)
    for rank, (_, got_gathered, got_scattered) in enumerate(replies):  # the recorded outputs are what ran
        np.testing.assert_array_equal(trace[1].outputs["out"][rank], got_gathered)
        np.testing.assert_array_equal(trace[2].outputs["out"][rank], got_scattered)


def test_calls_under_torch_func_grad_are_recorded_by_value(pool):
    replies = pool(2).run(under_grad, 5)
    trace = Trace.merge([trace for trace, _ in replies])
    xs = [tree_inputs(rank, 2, 5)[0] for rank in range(2)]
    assert [call.op for call in trace] == ["all_gather"]
    for rank in range(2):
        np.testing.assert_array_equal(trace[0].inputs["x"][rank], xs[rank])
        np.testing.assert_array_equal(trace[0].outputs["out"][rank], np.concatenate(xs))
        # each rank's loss is |all_gather(x)|^2: 2 x_r from each of the W = 2 ranks' losses (convention "sum")
        np.testing.assert_allclose(replies[rank][1], 2 * 2 * xs[rank], rtol=1e-12)


@pytest.mark.parametrize(("world_size", "seq_len"), [(1, 5), (2, 6), (4, 8)])
def test_an_attention_layer_is_one_call_with_q_k_v(pool, world_size, seq_len):
    replies = pool(world_size).run(attention, seq_len)
    trace = Trace.merge([trace for trace, _ in replies])
    assert [(call.op, call.module, list(call.inputs)) for call in trace] == [
        ("ulysses_attention", f"layers.{i}.self_attn", ["q", "k", "v"]) for i in range(2)
    ]
    whole = attention_inputs(seq_len)
    want = attention_spec.attention(*whole, causal=True, scale=0.25)
    rows = np.array_split(np.arange(seq_len), world_size)
    for call in trace:
        assert call.plan["causal"] == "True" and call.plan["dtype"] == "float64"
        for rank in range(world_size):
            for name, x in zip("qkv", whole, strict=True):
                np.testing.assert_array_equal(call.inputs[name][rank], x[:, rows[rank]])
            np.testing.assert_allclose(call.outputs["out"][rank], want[:, rows[rank]], rtol=1e-10, atol=1e-12)
