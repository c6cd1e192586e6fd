"""Torch bench cases of uneven sizes (issue 9), registered in `commlib_torch.tools.bench_cases.CASES`.

``all_to_all_4d (2, 1) B=1 uneven``: the exact layout's Ulysses all-to-all, ``[1, S_r, H, 64] -> [1, S, H_r, 64]``
with S = W n - 1 and H = 2W - 2 (`commlib.tools.bench.uneven_ulysses`: S = 63 and H = 6 at W = 4 in shape, not
in size), against the even one on the padded size ``[1, n, 2W, 64]`` -- alone, and as a user writes it by hand
(heads and rows scattered into zeros of the padded shape, the even op, the valid rows and heads taken back).

``all_gather (dim 0) uneven``: how the exact layout gathers on gloo, which has no uneven all_gather -- commlib
(eager: the input sent as it is to every rank, ``batch_isend_irecv``), against one ``all_to_all_single`` of a
W-fold send buffer (commlib's form under ``torch.compile``) and against padding to the largest size for gloo's
all_gather. Rows: ``split_sizes(W n - 1, W)`` of 256 floats.

Bytes on the wire per variant come from the spec's plans (`commlib.tools.bench.wire_bytes`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import commlib_torch
from commlib import plans, split_sizes
from commlib.tools.bench import UNEVEN_HEAD_DIM, uneven_ulysses, wire_bytes
from commlib_torch._compat import all_gather_single
from commlib_torch.tools.bench_cases import _input, _numel, bench_case

__all__: list[str] = []

_EVEN, _BY_HAND = "even on the padded size", "pad + even + unpad"


def _wire(world_size: int, nbytes: int) -> dict[str, int]:
    seq, heads, rows, padded_heads = uneven_ulysses(world_size, nbytes)
    exact = plans.all_to_all_4d(
        (1, seq[0], sum(heads), UNEVEN_HEAD_DIM), world_size, scatter_sizes=heads, gather_sizes=seq, rank=0
    )
    even = wire_bytes(plans.all_to_all_4d((1, rows, padded_heads, UNEVEN_HEAD_DIM), world_size))
    return {"commlib": wire_bytes(exact), _EVEN: even, _BY_HAND: even}


@bench_case("all_to_all_4d (2, 1) B=1 uneven", baselines=(_EVEN, _BY_HAND), wire=_wire)
def _uneven_ulysses(ctx, nbytes):
    W, rank = ctx.world_size, ctx.rank
    seq, heads, rows, padded_heads = uneven_ulysses(W, nbytes)
    x = _input(ctx, (1, seq[rank], sum(heads), UNEVEN_HEAD_DIM))
    padded = _input(ctx, (1, rows, padded_heads, UNEVEN_HEAD_DIM))
    per_rank = padded_heads // W
    slots = torch.tensor([j * per_rank + i for j, count in enumerate(heads) for i in range(count)])
    valid = torch.cat([torch.arange(j * rows, j * rows + count) for j, count in enumerate(seq)])

    def even():
        commlib_torch.all_to_all_4d(padded)  # a different shape: not compared with the others

    def by_hand():
        filled = x.new_zeros(padded.shape)
        filled[:, : seq[rank]].index_copy_(2, slots, x)
        return commlib_torch.all_to_all_4d(filled).index_select(1, valid)[:, :, : heads[rank]]

    return {
        "commlib": lambda: commlib_torch.all_to_all_4d(x, scatter_sizes=heads, gather_sizes=seq),
        _EVEN: even,
        _BY_HAND: by_hand,
    }


_COLUMNS = 256
_W_FOLD, _PADDED = "all_to_all_single (W-fold buffer)", "padded all_gather"


def _gather_rows(world_size: int, nbytes: int) -> tuple[int, ...]:
    return split_sizes(world_size * max(2, _numel(nbytes) // _COLUMNS) - 1, world_size)


def _gather_wire(world_size: int, nbytes: int) -> dict[str, int]:
    rows = _gather_rows(world_size, nbytes)
    exact = wire_bytes(plans.all_gather((rows[0], _COLUMNS), world_size, 0, sizes=rows, rank=0))
    return {
        "commlib": exact,
        _W_FOLD: exact,
        _PADDED: wire_bytes(plans.all_gather((max(rows), _COLUMNS), world_size, 0)),
    }


@bench_case("all_gather (dim 0) uneven", baselines=(_W_FOLD, _PADDED), wire=_gather_wire)
def _uneven_all_gather(ctx, nbytes):
    W, rank = ctx.world_size, ctx.rank
    rows = _gather_rows(W, nbytes)
    x = _input(ctx, (rows[rank], _COLUMNS))
    counts = [size * _COLUMNS for size in rows]

    def w_fold():
        out = torch.empty(sum(counts))
        dist.all_to_all_single(
            out, x.reshape(1, -1).expand(W, -1).reshape(-1), counts, [x.numel()] * W, group=ctx.group
        )
        return out.view(-1, _COLUMNS)

    def padded():
        filled = x.new_zeros(max(rows), _COLUMNS)
        filled[: rows[rank]] = x
        out = torch.empty(W, max(rows), _COLUMNS)
        all_gather_single(out.view(-1), filled.view(-1), group=ctx.group)
        return torch.cat([out[peer, :size] for peer, size in enumerate(rows)])

    return {"commlib": lambda: commlib_torch.all_gather(x, 0, sizes=rows), _W_FOLD: w_fold, _PADDED: padded}
