"""Pool jobs for tests/torch/test_testing_trace.py: `commlib_torch.testing_trace.record()` on every rank around
a small module tree that calls commlib ops (forward and backward), and around transformers-style attention calls
through a `parallel` context. Each job returns this rank's `Trace` and what it fed and got."""

from __future__ import annotations

import numpy as np
import torch

import commlib
from commlib_torch import all_gather, all_reduce, reduce_scatter
from commlib_torch.integrations import transformers as integration
from commlib_torch.sequence import parallel
from commlib_torch.testing_trace import record


def inputs(rank: int, world_size: int, seed: int) -> list[np.ndarray]:
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
    x, y = (torch.tensor(value, requires_grad=True) for value in inputs(ctx.rank, ctx.world_size, seed))
    with record() as trace:
        gathered, scattered = Tree()(x, y)
        (gathered.sum() + scattered.square().sum()).backward()
        with torch.no_grad():
            all_reduce(x * 2)
    all_reduce(x)  # after the block: not recorded
    return trace, gathered.detach().numpy(), scattered.detach().numpy()


def under_grad(ctx, seed: int):
    """This rank's trace of ``torch.func.grad`` through an all_gather of its x (recorded by value)."""
    x = torch.tensor(inputs(ctx.rank, ctx.world_size, seed)[0])
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
