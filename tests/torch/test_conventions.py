"""docs/gradients.md, torch side: every worked example, the Megatron f/g MLP, data parallel and Ulysses,
on real gloo process groups (each job returns this rank's results as numpy arrays). tests/jax/test_conventions.py
computes the same examples with commlib_jax."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

import commlib_torch as ct
from commlib import attention as reference_attention
from commlib_torch.attention import ulysses_attention
from tests.gradient_examples import EXAMPLES

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------


def _leaf(array) -> torch.Tensor:
    return torch.tensor(np.asarray(array, dtype=np.float64), requires_grad=True)


def example_gradient(ctx, op, kwargs, xs, cotangents):
    """Rank r's loss is ``sum(cotangents[r] * op(xs[r]))``; returns the gradient of xs[r]."""
    x = _leaf(xs[ctx.rank])
    y = getattr(ct, op)(x, **kwargs)
    (y * torch.as_tensor(np.asarray(cotangents[ctx.rank], dtype=np.float64))).sum().backward()
    return x.grad.numpy()


def torch_nn_all_reduce_gradient(ctx, op, xs):
    """The same loss (sum of the output) through torch.distributed.nn.functional.all_reduce."""
    x = _leaf(xs[ctx.rank])
    dist_nn.all_reduce(x, op=op, group=ctx.group).sum().backward()
    return x.grad.numpy()


def _mlp_shards(ctx, A, B):
    """Column block r of A ([d, h] -> [d, h/W]) and row block r of B ([h, d] -> [h/W, d])."""
    width = A.shape[1] // ctx.world_size
    block = slice(ctx.rank * width, (ctx.rank + 1) * width)
    return _leaf(A[:, block]), _leaf(B[block, :])


def megatron_mlp(ctx, x, A, B, g_convention):
    """``0.5 * sum((tanh(x @ A) @ B) ** 2)`` with A column-parallel and B row-parallel: f = sum_grad on the
    input, g = all_reduce(convention=g_convention) on the output; every rank computes the same loss.
    Returns (loss, dx, dA block, dB block)."""
    x = _leaf(x)
    A_r, B_r = _mlp_shards(ctx, A, B)
    partial = torch.tanh(ct.sum_grad(x) @ A_r) @ B_r  # [b, d], this rank's share of the output
    y = ct.all_reduce(partial, convention=g_convention)
    loss = 0.5 * (y**2).sum()
    loss.backward()
    return loss.item(), x.grad.numpy(), A_r.grad.numpy(), B_r.grad.numpy()


def _local_loss(w, features, targets):
    return ((features @ w - targets) ** 2).mean()


def data_parallel(ctx, w, features, targets, mode):
    """Linear least squares; rank r holds batch block r of (features [n, d], targets [n]) and a copy of w.

    "grad_all_reduce": local loss, backward, then all_reduce(avg) of w.grad outside autograd (DDP);
    "f_g": loss all_reduce(avg, convention="replicated") of the local loss on sum_grad(w);
    "loss_all_reduce": all_reduce(avg) of the local loss (default convention), nothing else.
    Returns (loss, w gradient)."""
    rows = len(targets) // ctx.world_size
    block = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    w_leaf = _leaf(w)
    features, targets = torch.as_tensor(features[block]), torch.as_tensor(targets[block])
    if mode == "grad_all_reduce":
        loss = _local_loss(w_leaf, features, targets)
        loss.backward()
        with torch.no_grad():
            gradient = ct.all_reduce(w_leaf.grad, "avg")
            loss = ct.all_reduce(loss, "avg")
        return loss.item(), gradient.numpy()
    if mode == "f_g":
        loss = ct.all_reduce(_local_loss(ct.sum_grad(w_leaf), features, targets), "avg", convention="replicated")
    else:
        loss = ct.all_reduce(_local_loss(w_leaf, features, targets), "avg")
    loss.backward()
    return loss.item(), w_leaf.grad.numpy()


def ulysses(ctx, q, k, v, cotangent):
    """Sequence block r of q, k, v ([B, S, H, D] -> [B, S/W, H, D]) through Ulysses attention; rank r's loss is
    ``sum(cotangent block r * output)``. Returns the gradients of this rank's q, k, v blocks."""
    rows = q.shape[1] // ctx.world_size
    block = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    leaves = [_leaf(t[:, block]) for t in (q, k, v)]
    out = ulysses_attention(*leaves, group=ctx.group)
    (out * torch.as_tensor(cotangent[:, block])).sum().backward()
    return [t.grad.numpy() for t in leaves]


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "kwargs", "xs", "cotangents", "expected"), [e[1:] for e in EXAMPLES], ids=[e[0] for e in EXAMPLES]
)
def test_example(pool, op, kwargs, xs, cotangents, expected):
    gradients = pool(len(xs)).run(example_gradient, op, kwargs, xs, cotangents)
    np.testing.assert_array_equal(np.stack(gradients), np.asarray(expected))


@pytest.mark.parametrize(
    ("op", "xs", "expected"),
    [
        (dist.ReduceOp.SUM, [[1.0], [2.0]], [[2.0], [2.0]]),
        (dist.ReduceOp.MAX, [[1.0], [5.0], [2.0], [3.0]], [[1.0], [1.0], [1.0], [1.0]]),
    ],
    ids=["sum", "max"],
)
def test_torch_distributed_nn(pool, op, xs, expected):
    """torch.distributed.nn.functional.all_reduce's backward is all_reduce of the gradient with the same op:
    convention="sum" for sum, the max of the gradients (not the VJP [0, 4, 0, 0]) for max."""
    gradients = pool(len(xs)).run(torch_nn_all_reduce_gradient, op, xs)
    np.testing.assert_array_equal(np.stack(gradients), np.asarray(expected))


def _mlp_problem(world_size):
    rng = np.random.default_rng(0)
    hidden = 2 * world_size
    x, A, B = rng.standard_normal((3, 4)), rng.standard_normal((4, hidden)), rng.standard_normal((hidden, 4))
    leaves = [torch.tensor(t, requires_grad=True) for t in (x, A, B)]
    loss = 0.5 * ((torch.tanh(leaves[0] @ leaves[1]) @ leaves[2]) ** 2).sum()
    loss.backward()
    return (x, A, B), loss.item(), [t.grad.numpy() for t in leaves]


@pytest.mark.parametrize(("g_convention", "factor"), [("replicated", 1.0), ("sum", 4.0)])
def test_megatron_mlp(pool, g_convention, factor):
    """f = sum_grad, g = all_reduce(convention="replicated"): every rank's dx and its blocks of dA, dB equal the
    unsharded MLP's. With the default convention for g every gradient is W times too large."""
    world_size = 4
    (x, A, B), loss, (dx, dA, dB) = _mlp_problem(world_size)
    results = pool(world_size).run(megatron_mlp, x, A, B, g_convention)
    np.testing.assert_allclose([r[0] for r in results], loss, rtol=1e-12)
    for _, dx_r, _, _ in results:
        np.testing.assert_allclose(dx_r, factor * dx, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([r[2] for r in results], axis=1), factor * dA, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([r[3] for r in results], axis=0), factor * dB, rtol=1e-12)


def _least_squares(world_size):
    rng = np.random.default_rng(1)
    rows = 2 * world_size
    w, features, targets = rng.standard_normal(3), rng.standard_normal((rows, 3)), rng.standard_normal(rows)
    leaf = torch.tensor(w, requires_grad=True)
    loss = _local_loss(leaf, torch.as_tensor(features), torch.as_tensor(targets))
    loss.backward()
    return (w, features, targets), loss.item(), leaf.grad.numpy()


@pytest.mark.parametrize("mode", ["grad_all_reduce", "f_g", "loss_all_reduce"])
def test_data_parallel(pool, mode):
    """DDP (all_reduce avg of the gradients outside autograd) and f/g on the loss give the full-batch gradient on
    every rank; all_reduce(avg) of the loss alone gives the full-batch loss but each rank's local gradient."""
    world_size = 4
    (w, features, targets), loss, gradient = _least_squares(world_size)
    results = pool(world_size).run(data_parallel, w, features, targets, mode)
    rows = len(targets) // world_size
    for r, (loss_r, gradient_r) in enumerate(results):
        np.testing.assert_allclose(loss_r, loss, rtol=1e-12)
        if mode == "loss_all_reduce":
            block = slice(r * rows, (r + 1) * rows)
            local = torch.tensor(w, requires_grad=True)
            _local_loss(local, torch.as_tensor(features[block]), torch.as_tensor(targets[block])).backward()
            np.testing.assert_allclose(gradient_r, local.grad.numpy(), rtol=1e-12)
            assert not np.allclose(gradient_r, gradient)
        else:
            np.testing.assert_allclose(gradient_r, gradient, rtol=1e-12)


def test_ulysses(pool):
    """Ulysses attention (all_to_all_4d both ways, convention "sum"), rank r's loss on its sequence block: the
    gradients of every rank's q, k, v blocks equal the unsharded attention's."""
    world_size = 4
    rng = np.random.default_rng(2)
    q, k, v, cotangent = (rng.standard_normal((2, 8, 4, 3)) for _ in range(4))  # [B, S, H, D]
    results = pool(world_size).run(ulysses, q, k, v, cotangent)
    expected_gradients = reference_attention.attention_vjp(q, k, v, cotangent)
    for name, got, expected in zip("qkv", zip(*results, strict=True), expected_gradients, strict=True):
        np.testing.assert_allclose(np.concatenate(got, axis=1), expected, rtol=1e-10, atol=1e-12, err_msg=name)
