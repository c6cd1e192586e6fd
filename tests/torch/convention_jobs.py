"""Job functions for tests/torch/test_conventions.py (the claims of docs/gradients.md); module-level so the
pool's worker processes can import them by name. Each returns this rank's results as numpy arrays."""

import numpy as np
import torch
import torch.distributed.nn.functional as dist_nn

import commlib_torch as ct
from commlib_torch.attention import ulysses_attention


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
