"""The float64 references of ring attention and USP: the unsharded attention cut into shards (`reference`), and
the ring walked on W simulated numpy ranks (`simulate_ring`: `commlib.ring`'s walk over `SimulatedRanks`), so
the schedule is tested without a framework.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from commlib import ring
from commlib.attention import attention, attention_vjp
from commlib.blockwise import NUMPY, attend, attend_vjp
from commlib.sequence import SequenceLayout, shard_sequence, unshard_sequence

__all__ = ["reference", "SimulatedRanks", "simulate_ring"]


def reference(qs, ks, vs, cotangents, ring_size: int, *, causal=False, scale=None, layout="contiguous",
              ulysses_size: int = 1):
    """float64: every shard's output and ``(dq, dk, dv)`` of attention on the whole sequence (shards in the
    layout: shard ``r * U + u`` at index ``r * U + u``): ``(outs, dqs, dks, dvs)``, lists of W * U arrays.
    `layout` a `SequenceLayout` (any length): shards of exactly ``layout.sizes`` rows."""
    if isinstance(layout, SequenceLayout):
        whole = [layout.unshard(xs, 1).astype(np.float64) for xs in (qs, ks, vs, cotangents)]
    else:
        whole = [unshard_sequence(xs, 1, ring_size, layout, ulysses_size).astype(np.float64)
                 for xs in (qs, ks, vs, cotangents)]
    out = attention(*whole[:3], causal=causal, scale=scale)
    grads = attention_vjp(*whole, causal=causal, scale=scale)
    if isinstance(layout, SequenceLayout):
        return tuple(layout.shard(x, 1) for x in (out, *grads))
    return tuple(shard_sequence(x, 1, ring_size, layout, ulysses_size) for x in (out, *grads))


class SimulatedRanks:
    """`commlib.ring.RingBackend` for the W ranks of a ring at once, in float64: rank r's arrays are rows
    ``[r B, (r + 1) B)`` of the batch dim (W * B rows in all)."""

    math = NUMPY

    def __init__(self, plan: ring.RingPlan) -> None:
        self.plan = plan

    def compute(self, x):
        return np.asarray(x, dtype=np.float64)

    def restore(self, x, like):
        return x

    def zeros(self, like):
        return np.zeros(like.shape, dtype=np.float64)

    def attend(self, q, k, v, mask: str):
        return attend(NUMPY, q, k, v, self.plan.scale, mask)

    def attend_vjp(self, q, k, v, out, d_out, lse, delta, mask: str):
        return attend_vjp(NUMPY, q, k, v, d_out, lse, delta, self.plan.scale, mask)

    def set_rows(self, x, rows: slice, value):
        x[:, rows] = value
        return x

    def add_rows(self, x, rows: slice, value):
        x[:, rows] += value
        return x

    def split(self, x) -> list:
        """The W ranks' arrays of `x`."""
        return np.split(x, self.plan.ring_size)

    def send(self, arrays: list) -> list:
        """`permute` over `plan.perm`: rank dst gets rank src's rows."""
        moved = []
        for x in arrays:
            ranks = self.split(x)
            received = list(ranks)
            for src, dst in self.plan.perm:
                received[dst] = ranks[src]
            moved.append(np.concatenate(received))
        return moved

    def key_mask(self, step: int):
        """Every rank's mask of `step`, rank r's on its batch rows: ``[W * B, 1, 1, rows, rows]``."""
        return np.repeat(self.plan.key_masks(step), self.plan.batch, axis=0)[:, None, None]

    def real_rows(self, x):
        real = np.repeat(self.plan.valid_rows(), self.plan.batch, axis=0)[:, :, None, None]
        return np.where(real, x, 0.0)

    def switch(self, step: int, function: Callable[..., Any], *operands):
        """Each rank's case on its own rows, the results stacked back."""
        results = []
        for rank, arrays in enumerate(zip(*(self.split(x) for x in operands), strict=True)):
            results.append(function(self.plan.cases[self.plan.case_index[step][rank]], *arrays))
        return tuple(np.concatenate(parts) for parts in zip(*results, strict=True))


def simulate_ring(plan: ring.RingPlan, qs, ks, vs, cotangents=None):
    """The ring walked on W simulated numpy ranks (float64), as the frontends walk it: ``outs`` (and, with
    `cotangents`, ``(outs, dqs, dks, dvs)``), lists of W arrays in the ring layout. A masked plan (an uneven
    `SequenceLayout`) takes the ``R * U`` shards of ``layout.sizes`` rows (or of ``max_size`` rows, as JAX holds
    them: what the padding holds is ignored) and gives shards of ``layout.sizes`` rows, walking them padded to
    ``max_size`` as the frontends do."""
    ranks = SimulatedRanks(plan)
    q, k, v = (_ring_blocks(plan, xs) for xs in (qs, ks, vs))
    out, lse = ring.forward(plan, ranks, q, k, v)
    if cotangents is None:
        return _shards(plan, ranks.split(out))
    grads = ring.backward(plan, ranks, q, k, v, out, lse, _ring_blocks(plan, cotangents))
    return _shards(plan, ranks.split(out)), *(_shards(plan, ranks.split(x)) for x in grads)


def _ring_blocks(plan: ring.RingPlan, xs):
    """The W ranks' arrays end to end on the batch dim (masked plans: from the shards, each padded to
    ``max_size`` rows, ring block r = shards r*U .. r*U+U-1)."""
    xs = [np.asarray(x, dtype=np.float64) for x in xs]
    if plan.sequence is None:
        return np.concatenate(xs)
    size = plan.sequence.max_size
    padded = [np.pad(x, [(0, 0), (0, size - x.shape[1]), (0, 0), (0, 0)]) for x in xs]
    return np.concatenate([np.concatenate(padded[r * plan.ulysses_size:(r + 1) * plan.ulysses_size], axis=1)
                           for r in range(plan.ring_size)])


def _shards(plan: ring.RingPlan, blocks: list) -> list:
    """The inverse of `_ring_blocks` on the W ranks' blocks: masked plans, the shards of ``layout.sizes`` rows."""
    if plan.sequence is None:
        return blocks
    sizes = plan.sequence.sizes
    pieces = [piece for block in blocks for piece in np.split(block, plan.ulysses_size, axis=1)]
    return [piece[:, :rows] for piece, rows in zip(pieces, sizes, strict=True)]
