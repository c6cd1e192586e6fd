"""The Ulysses walk on W simulated numpy ranks (float64): `simulate_ulysses` runs the spec's own walk
(`commlib.ulysses.walk`) once per rank, each in a thread, over a `UlyssesBackend` whose collectives meet at a
barrier -- so the plan and the walk the frontends take are tested without a framework (as `commlib.reference.ring`
does for the ring), and no second copy of the walk exists to drift from it.

Each simulated collective is the op's definition: every rank posts what it sends to each destination, waits for
the others, and takes what every source sent it (`_Wire`). The walk calls the same collectives in the same order
on every rank (the plans agree on their groups and exchanges), so the ranks meet at each one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from commlib.attention import Exchange, HeadGroup, UlyssesPlan, _offsets
from commlib.reference.attention import attention
from commlib.ulysses import Finished, walk

__all__ = ["simulate_ulysses"]

_TIMEOUT = 60.0  # seconds a simulated rank waits for the others at a collective (a walk that diverged raises)


class _Wire:
    """The simulated group's all-to-all: ``exchange(rank, blocks)`` with ``blocks[d]`` what `rank` sends rank d
    gives what every source sent `rank`, in source order, once every rank has posted."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=_TIMEOUT)
        self.posted: list[list[np.ndarray]] = [[] for _ in range(world_size)]

    def exchange(self, rank: int, blocks: list[np.ndarray]) -> list[np.ndarray]:
        self.posted[rank] = blocks
        self.barrier.wait()  # every rank has posted
        received = [sent[rank] for sent in self.posted]
        self.barrier.wait()  # every rank has taken its blocks: the next collective may post
        return received


def _bounds(sizes: Sequence[int]) -> list[slice]:
    starts = (*_offsets(sizes), sum(sizes))
    return [slice(starts[index], starts[index + 1]) for index in range(len(sizes))]


class _SimulatedRank:
    """`commlib.ulysses.UlyssesBackend` of one simulated rank (float64 numpy arrays ``[B, S_r, n, D]``)."""

    def __init__(self, wire: _Wire, rank: int, plan: UlyssesPlan) -> None:
        self.wire, self.rank, self.plan = wire, rank, plan
        self.world_size = len(plan.seq_sizes)

    def start_exchange(self, exchange: Exchange, inputs: Mapping[str, Any], overlap: bool) -> Finished:
        """The send buffer ``stacked[send_index]`` (a zero head past the last), its heads cut by `scatter_sizes`;
        the blocks received concatenated along seq, each source's valid rows (`seq_sizes`) only."""
        stacked = np.concatenate([np.moveaxis(inputs[name], 2, 0) for name in exchange.inputs])
        stacked = np.concatenate([stacked, np.zeros((1, *stacked.shape[1:]))])
        send = stacked[list(exchange.send_index)]
        sizes = exchange.scatter_sizes or (len(exchange.send_index) // self.world_size,) * self.world_size
        received = self.wire.exchange(self.rank, [send[rows] for rows in _bounds(sizes)])
        valid = self.plan.seq_sizes
        return Finished(np.concatenate([block[:, :, : valid[source]] for source, block in enumerate(received)], 2))

    def gather_segments(self, segment_ids: Any, sizes: tuple[int, ...] | None) -> np.ndarray:
        own = np.asarray(segment_ids)[:, : self.plan.seq_sizes[self.rank]]
        return np.concatenate(self.wire.exchange(self.rank, [own] * self.world_size), axis=1)

    def attend(self, plan: UlyssesPlan, group: HeadGroup, local: Mapping[str, Any], masks: Mapping) -> np.ndarray:
        keys, values = local["k"], local["v"]
        if group.kv_index is not None:  # this rank's q heads do not group evenly over its kv heads
            index = list(group.kv_index[0 if plan.layout == "exact" else self.rank])
            keys, values = keys[index], values[index]
        q, k, v = (np.moveaxis(x, 0, 2) for x in (local["q"], keys, values))
        segments = masks.get("segment_ids")
        ids = {} if segments is None else {"q_segments": segments, "k_segments": segments}
        return attention(q, k, v, causal=plan.causal, scale=plan.scale, **ids)

    def start_output(
        self, out: Any, scatter_sizes: tuple[int, ...] | None, gather_sizes: tuple[int, ...] | None, overlap: bool
    ) -> Finished:
        """Rank d's rows (`seq_sizes`) of this rank's heads to rank d; every source's heads concatenated."""
        blocks = [out[:, rows] for rows in _bounds(self.plan.seq_sizes)]
        received = self.wire.exchange(self.rank, blocks)
        if gather_sizes is not None:  # each source's heads of the group (a rank may hold none)
            received = [block[:, :, :size] for block, size in zip(received, gather_sizes, strict=True)]
        return Finished(np.concatenate(received, axis=2))

    def concat_heads(self, outputs: list[Any]) -> np.ndarray:
        return np.concatenate(outputs, axis=2)

    def joint_heads(self, x: Any, heads: tuple[tuple[int, ...], ...]) -> np.ndarray:
        padded = np.concatenate([np.moveaxis(x, 2, 0), np.zeros((1, *np.moveaxis(x, 2, 0).shape[1:]))])
        return padded[list(heads[0 if self.plan.layout == "exact" else self.rank])]

    def concat_seq(self, parts: list[Any]) -> np.ndarray:
        return np.concatenate(parts, axis=2)

    def gather_heads(self, x: Any, sizes: tuple[int, ...] | None) -> np.ndarray:
        own = x if sizes is None else x[:, :, : sizes[self.rank]]
        return np.concatenate(self.wire.exchange(self.rank, [own] * self.world_size), axis=2)


def simulate_ulysses(
    plans: Sequence[UlyssesPlan],
    qs: Sequence[Any],
    ks: Sequence[Any],
    vs: Sequence[Any],
    segment_ids: Sequence[Any] | None = None,
    joint: Sequence[Any] | None = None,
) -> list[Any]:
    """Every rank's output of `commlib.ulysses.walk` on W simulated numpy ranks (float64). ``plans[r]`` is rank
    r's plan (the padded layout: the same plan W times; inputs then hold ``max(seq_sizes)`` rows and rows past a
    rank's size are never read); `segment_ids` every rank's ``[B, S_r]`` ids, or None; `joint` (plans with a
    ``joint``): ``(joint_q, joint_k, joint_v)``, the same on every rank. Outputs: exact ``[B, seq_sizes[r], H,
    D_v]``; with `joint`, ``(out, joint_out)`` per rank.

    >>> from commlib.attention import ulysses_plan
    >>> q = np.random.default_rng(0).normal(size=(1, 6, 4, 8))
    >>> plans = [ulysses_plan(*[(1, 3, 4, 8)] * 3, 2, rank=rank, causal=True, chunks=2) for rank in range(2)]
    >>> outs = simulate_ulysses(plans, [q[:, :3], q[:, 3:]], [q[:, :3], q[:, 3:]], [q[:, :3], q[:, 3:]])
    >>> np.allclose(np.concatenate(outs, axis=1), attention(q, q, q, causal=True))
    True
    """
    world_size = len(plans)
    wire = _Wire(world_size)

    def run(rank: int) -> Any:
        inputs = {name: np.asarray(x[rank], dtype=np.float64) for name, x in (("q", qs), ("k", ks), ("v", vs))}
        if joint is not None:
            inputs |= {f"joint_{name}": np.asarray(x, dtype=np.float64) for name, x in zip("qkv", joint, strict=True)}
        try:
            ids = None if segment_ids is None else segment_ids[rank]
            return walk(_SimulatedRank(wire, rank, plans[rank]), plans[rank], inputs, ids)
        except BaseException:
            wire.barrier.abort()  # the other ranks raise BrokenBarrierError instead of waiting
            raise

    with ThreadPoolExecutor(max_workers=world_size) as pool:
        futures = [pool.submit(run, rank) for rank in range(world_size)]
    errors = [future.exception() for future in futures]
    first = next((error for error in errors if not isinstance(error, threading.BrokenBarrierError)), errors[0])
    if first is not None:  # the rank that failed first, not the ones the abort released
        raise first
    return [future.result() for future in futures]
