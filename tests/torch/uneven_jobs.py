"""Pool jobs for tests/torch/test_uneven.py: the handed Ulysses case, two calls with other sizes in one process,
and the exact layout's own error (a sharded dim that is not this rank's size)."""

from __future__ import annotations

import numpy as np
import torch

import commlib_torch as cl
from commlib import CommError, split_sizes

W, B, S, H, D = 4, 2, 63, 6, 3  # the handed uneven case


def _rows(full: torch.Tensor, sizes, dim: int, rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return full.narrow(dim, start, sizes[rank])


def handed_case(ctx, seed: int = 9):
    """Rank r holds X[:, s_r]: (2, 1) must return X[:, :, h_r], (1, 2) the input, and the gradient of
    sum(out * C[:, :, h_r]) must be C[:, s_r] (the reverse all-to-all of the cotangents). float64; returns this
    rank's max errors (output, round trip, gradient) and the output shape."""
    rng = np.random.default_rng(seed)
    X, C = (torch.from_numpy(rng.standard_normal((B, S, H, D))) for _ in range(2))
    seq, heads = split_sizes(S, W), split_sizes(H, W)
    x = _rows(X, seq, 1, ctx.rank).clone().requires_grad_()
    out = cl.all_to_all_4d(x, 2, 1, scatter_sizes=heads, gather_sizes=seq)
    back = cl.all_to_all_4d(out, 1, 2, scatter_sizes=seq, gather_sizes=heads)
    (out * _rows(C, heads, 2, ctx.rank)).sum().backward()
    errors = [
        (out - _rows(X, heads, 2, ctx.rank)).abs().max(),
        (back - x).abs().max(),
        (x.grad - _rows(C, seq, 1, ctx.rank)).abs().max(),
    ]
    return [float(error) for error in errors], tuple(out.shape)


def two_sizes_in_one_process(ctx):
    """The same ops twice in one process with other sizes (and shapes) each time: nothing is kept between
    calls. Returns, per call, whether this rank's result equals the slice of the whole tensor."""
    rank, equal = ctx.rank, []
    for seq_len, heads_n in ((10, 6), (7, 5), (10, 6)):
        seq, heads = split_sizes(seq_len, ctx.world_size), (0, *split_sizes(heads_n, ctx.world_size - 1))
        whole = torch.arange(2.0 * seq_len * heads_n * 3, dtype=torch.float64).reshape(2, seq_len, heads_n, 3)
        out = cl.all_to_all_4d(_rows(whole, seq, 1, rank), 2, 1, scatter_sizes=heads, gather_sizes=seq)
        equal.append(torch.equal(out, _rows(whole, heads, 2, rank)))
        equal.append(torch.equal(cl.all_gather(_rows(whole, seq, 1, rank), 1, sizes=seq), whole))
    return equal


def wrong_rows(ctx):
    """Every rank passes 2 rows where gather_sizes says otherwise: this rank's error text."""
    try:
        cl.all_to_all_4d(torch.zeros(1, 2, 4, 2), 2, 1, gather_sizes=(3, 3, 1, 1))
    except CommError as error:
        return str(error)
    return None


def _strided(rows: int, columns: int, rng, view: bool) -> torch.Tensor:
    """A float64 [rows, columns] tensor: a stride-2 view (``base[:, ::2]``) when `view`, else contiguous."""
    base = torch.from_numpy(rng.standard_normal((rows, 2 * columns)))
    return base[:, ::2] if view else base[:, ::2].contiguous()


def strided_views(ctx, views: tuple[int, ...], seed: int = 23):
    """``all_gather(x[:, ::2], dim=0, sizes=...)`` on the ranks in `views` (a contiguous x
    elsewhere) and ``reduce_scatter(..., sizes=...)`` whose backward gets a stride-2 cotangent there. Every rank
    draws every rank's tensors from one seed, so it knows the reference; returns this rank's max errors
    (all_gather value, its gradient, reduce_scatter value, its gradient)."""
    sizes, columns, rank = split_sizes(2 * ctx.world_size + 1, ctx.world_size), 3, ctx.rank
    rng = np.random.default_rng(seed)
    inputs = [_strided(n, columns, rng, r in views) for r, n in enumerate(sizes)]
    cotangents = [torch.from_numpy(rng.standard_normal((sum(sizes), columns))) for _ in sizes]
    wholes = [torch.from_numpy(rng.standard_normal((sum(sizes), columns))) for _ in sizes]
    small = [_strided(n, columns, rng, r in views) for r, n in enumerate(sizes)]
    x = inputs[rank].requires_grad_()
    gathered = cl.all_gather(x, 0, sizes=sizes)
    gathered.backward(cotangents[rank])
    start = sum(sizes[:rank])
    expected_grad = sum(c[start : start + sizes[rank]] for c in cotangents)
    whole = wholes[rank].clone().requires_grad_()
    scattered = cl.reduce_scatter(whole, 0, sizes=sizes)
    scattered.backward(small[rank])
    errors = [
        (gathered - torch.cat(inputs)).abs().max(),
        (x.grad - expected_grad).abs().max(),
        (scattered - sum(wholes)[start : start + sizes[rank]]).abs().max(),
        (whole.grad - torch.cat(small)).abs().max(),
    ]
    return [float(error) for error in errors]
