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
from commlib.sequence import shard_sequence, unshard_sequence

__all__ = ["reference", "SimulatedRanks", "simulate_ring"]


def reference(qs, ks, vs, cotangents, ring_size: int, *, causal=False, scale=None, layout="contiguous",
              ulysses_size: int = 1):
    """float64: every shard's output and ``(dq, dk, dv)`` of attention on the whole sequence (shards in the
    layout: shard ``r * U + u`` at index ``r * U + u``): ``(outs, dqs, dks, dvs)``, lists of W * U arrays."""
    whole = [unshard_sequence(xs, 1, ring_size, layout, ulysses_size).astype(np.float64)
             for xs in (qs, ks, vs, cotangents)]
    out = attention(*whole[:3], causal=causal, scale=scale)
    grads = attention_vjp(*whole, causal=causal, scale=scale)
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

    def switch(self, step: int, function: Callable[..., Any], *operands):
        """Each rank's case on its own rows, the results stacked back."""
        results = []
        for rank, arrays in enumerate(zip(*(self.split(x) for x in operands), strict=True)):
            results.append(function(self.plan.cases[self.plan.case_index[step][rank]], *arrays))
        return tuple(np.concatenate(parts) for parts in zip(*results, strict=True))


def simulate_ring(plan: ring.RingPlan, qs, ks, vs, cotangents=None):
    """The ring walked on W simulated numpy ranks (float64), as the frontends walk it: ``outs`` (and, with
    `cotangents`, ``(outs, dqs, dks, dvs)``), lists of W arrays in the ring layout."""
    ranks = SimulatedRanks(plan)
    q, k, v = (np.concatenate([np.asarray(x, dtype=np.float64) for x in xs]) for xs in (qs, ks, vs))
    out, lse = ring.forward(plan, ranks, q, k, v)
    if cotangents is None:
        return ranks.split(out)
    d_out = np.concatenate([np.asarray(x, dtype=np.float64) for x in cotangents])
    grads = ring.backward(plan, ranks, q, k, v, out, lse, d_out)
    return ranks.split(out), *(ranks.split(x) for x in grads)
