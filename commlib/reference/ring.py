"""The float64 references of ring attention and USP: the unsharded attention cut into shards (`reference`), and
the ring walked on W simulated numpy ranks (`simulate_ring`: `commlib.ring`'s walk over `SimulatedRanks`), so
the schedule is tested without a framework.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from commlib import ring
from commlib.blockwise import NUMPY, attend, attend_vjp
from commlib.reference.attention import attention, attention_vjp
from commlib.sequence import SequenceLayout, shard_sequence, unshard_sequence

__all__ = ["reference", "SimulatedRanks", "simulate_ring"]


def reference(
    qs: Sequence[Any],
    ks: Sequence[Any],
    vs: Sequence[Any],
    cotangents: Sequence[Any],
    ring_size: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str | SequenceLayout = "contiguous",
    ulysses_size: int = 1,
    segment_ids: Sequence[Any] | None = None,
    mask: Any = None,
) -> tuple[list[np.ndarray], ...]:
    """float64: every shard's output and ``(dq, dk, dv)`` of attention on the whole sequence (shards in the
    layout: shard ``r * U + u`` at index ``r * U + u``): ``(outs, dqs, dks, dvs)``, lists of W * U arrays.
    `layout` a `SequenceLayout` (any length): shards of exactly ``layout.sizes`` rows. `segment_ids`: every
    shard's ids ``[B, S_r]`` (as q), the segment masks of `commlib.reference.attention.attention`; `mask` a
    `commlib.masks.MaskRule` on the global positions."""
    if isinstance(layout, SequenceLayout):
        unshard = lambda xs: layout.unshard(xs, 1)  # noqa: E731
    else:
        unshard = lambda xs: unshard_sequence(xs, 1, ring_size, layout, ulysses_size)  # noqa: E731
    whole = [unshard(xs).astype(np.float64) for xs in (qs, ks, vs, cotangents)]
    ids = None if segment_ids is None else unshard([np.asarray(x)[..., None, None] for x in segment_ids])[..., 0, 0]
    out = attention(*whole[:3], causal=causal, scale=scale, q_segments=ids, mask=mask)
    grads = attention_vjp(*whole, causal=causal, scale=scale, q_segments=ids, mask=mask)
    if isinstance(layout, SequenceLayout):
        return tuple(layout.shard(x, 1) for x in (out, *grads))
    return tuple(shard_sequence(x, 1, ring_size, layout, ulysses_size) for x in (out, *grads))


class SimulatedRanks:
    """`commlib.ring.RingBackend` for the W ranks of a ring at once, in float64: rank r's arrays are rows
    ``[r B, (r + 1) B)`` of the batch dim (W * B rows in all)."""

    math = NUMPY
    blocked_masks = False

    def __init__(self, plan: ring.RingPlan) -> None:
        self.plan = plan
        self.computed = np.zeros(plan.ring_size, dtype=np.int64)  # pieces each rank computed (segmented plans)
        self.rank: int | None = None  # the rank `switch` is running (its arrays are that rank's alone)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)

    def restore(self, x: np.ndarray, like: np.ndarray) -> np.ndarray:
        return x

    def zeros(self, like: np.ndarray) -> np.ndarray:
        return np.zeros(like.shape, dtype=np.float64)

    def attend(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: str | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        return attend(NUMPY, q, k, v, self.plan.scale, mask)

    def attend_vjp(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        out: np.ndarray,
        d_out: np.ndarray,
        lse: np.ndarray,
        delta: np.ndarray,
        mask: str | np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return attend_vjp(NUMPY, q, k, v, d_out, lse, delta, self.plan.scale, mask)

    def set_rows(self, x: np.ndarray, rows: slice, value: np.ndarray) -> np.ndarray:
        x[:, rows] = value
        return x

    def add_rows(self, x: np.ndarray, rows: slice, value: np.ndarray) -> np.ndarray:
        x[:, rows] += value
        return x

    def split(self, x: np.ndarray) -> list[np.ndarray]:
        """The W ranks' arrays of `x`."""
        return np.split(x, self.plan.ring_size)

    def start(self, arrays: list) -> list:
        """`permute` over `plan.perm`, complete at once: rank dst gets rank src's rows (new arrays)."""
        moved = []
        for x in arrays:
            ranks = self.split(x)
            received = list(ranks)
            for src, dst in self.plan.perm:
                received[dst] = ranks[src]
            moved.append(np.concatenate(received))
        return moved

    def wait(self, pending: list) -> list:
        """What `start` sent: received already."""
        return pending

    def gather_ring(self, x: np.ndarray) -> np.ndarray:
        """Every rank's `x` stacked in rank order (``[W, B, ...]``), on every rank's batch rows: ``[W, W B, ...]``."""
        stacked = np.stack(self.split(x))
        return np.concatenate([stacked] * self.plan.ring_size, axis=1)

    def sum_ring(self, x: np.ndarray) -> np.ndarray:
        """The ranks' `x` summed, on every rank's batch rows."""
        return np.concatenate([sum(self.split(x))] * self.plan.ring_size)

    def key_mask(self, step: int) -> np.ndarray:
        """Every rank's mask of `step`, rank r's on its batch rows: ``[W * B, 1, 1, rows, rows]``."""
        return np.repeat(self.plan.key_masks(step), self.plan.batch, axis=0)[:, None, None]

    def real_rows(self, x: np.ndarray) -> np.ndarray:
        real = np.repeat(self.plan.valid_rows(), self.plan.batch, axis=0)[:, :, None, None]
        return np.where(real, x, 0.0)

    def block_ids(self, segments: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's ids of its q rows (`segments`, ``[W * B, rows]``: rank r's ring block on its batch rows)
        and of the kv block it holds at `step` (read from the gathered ids, not sent)."""
        blocks = self.split(segments)
        return segments, np.concatenate([blocks[self.plan.kv_block(step, rank)] for rank in range(len(blocks))])

    def when_visible(
        self, step: int, index: int, mask: np.ndarray, function: Callable[..., Any], *operands: np.ndarray
    ) -> Any:
        """Every rank computes the piece (where a rank's queries see none of its keys that changes nothing,
        exactly); `computed` counts it for the ranks whose queries see some key (`commlib.ring.visible_pieces`'
        rule, the piece's mask any)."""
        if self.rank is None:
            self.computed += np.asarray(mask).reshape(self.plan.ring_size, -1).any(axis=1)
        else:
            self.computed[self.rank] += bool(np.any(mask))
        return function(*operands)

    def switch(self, step: int, function: Callable[..., Any], *operands: np.ndarray) -> tuple[np.ndarray, ...]:
        """Each rank's case on its own rows, the results stacked back."""
        results = []
        for rank, arrays in enumerate(zip(*(self.split(x) for x in operands), strict=True)):
            self.rank = rank
            results.append(function(self.plan.cases[self.plan.case_index[step][rank]], *arrays))
        self.rank = None
        return tuple(np.concatenate(parts) for parts in zip(*results, strict=True))


def simulate_ring(
    plan: ring.RingPlan,
    qs: Sequence[Any],
    ks: Sequence[Any],
    vs: Sequence[Any],
    cotangents: Sequence[Any] | None = None,
    segment_ids: Sequence[Any] | None = None,
) -> list[np.ndarray] | tuple[list[np.ndarray], ...]:
    """The ring walked on W simulated numpy ranks (float64), as the frontends walk it: ``outs`` (and, with
    `cotangents`, ``(outs, dqs, dks, dvs)``), lists of W arrays in the ring layout. A masked plan (an uneven
    `SequenceLayout`) takes the ``R * U`` shards of ``layout.sizes`` rows (or of ``max_size`` rows, as JAX holds
    them: what the padding holds is ignored) and gives shards of ``layout.sizes`` rows, walking them padded to
    ``max_size`` as the frontends do. `segment_ids`: every shard's ids ``[B, S_r]`` (a segmented plan; padding
    rows get -1)."""
    ranks = SimulatedRanks(plan)
    q, k, v = (_ring_blocks(plan, xs) for xs in (qs, ks, vs))
    ids = None if segment_ids is None else _ring_ids(plan, segment_ids)
    out, lse = ring.forward(plan, ranks, q, k, v, ids)
    if cotangents is None:
        return _shards(plan, ranks.split(out))
    grads = ring.backward(plan, ranks, q, k, v, out, lse, _ring_blocks(plan, cotangents), ids)
    return _shards(plan, ranks.split(out)), *(_shards(plan, ranks.split(x)) for x in grads)


def _ring_blocks(plan: ring.RingPlan, xs: Sequence[Any]) -> np.ndarray:
    """The W ranks' arrays end to end on the batch dim (masked plans: from the shards, each padded to
    ``max_size`` rows, ring block r = shards r*U .. r*U+U-1)."""
    xs = [np.asarray(x, dtype=np.float64) for x in xs]
    if plan.sequence is None:
        return np.concatenate(xs)
    size = plan.sequence.max_size
    padded = [np.pad(x, [(0, 0), (0, size - x.shape[1]), (0, 0), (0, 0)]) for x in xs]
    return np.concatenate(
        [
            np.concatenate(padded[r * plan.ulysses_size : (r + 1) * plan.ulysses_size], axis=1)
            for r in range(plan.ring_size)
        ]
    )


def _ring_ids(plan: ring.RingPlan, segment_ids: Sequence[Any]) -> np.ndarray:
    """int64 ``[W * B, rows]``: every rank's segment ids of its ring block (`_ring_blocks`; padding rows -1)."""
    shifted = [np.asarray(x, dtype=np.int64)[..., None, None] + 1 for x in segment_ids]  # padding: 0 -> -1
    return _ring_blocks(plan, shifted)[..., 0, 0].astype(np.int64) - 1


def _shards(plan: ring.RingPlan, blocks: list) -> list:
    """The inverse of `_ring_blocks` on the W ranks' blocks: masked plans, the shards of ``layout.sizes`` rows."""
    if plan.sequence is None:
        return blocks
    sizes = plan.sequence.sizes
    pieces = [piece for block in blocks for piece in np.split(block, plan.ulysses_size, axis=1)]
    return [piece[:, :rows] for piece, rows in zip(pieces, sizes, strict=True)]
