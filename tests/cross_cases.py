"""Seeded cases of ``cross_attention`` (numpy only) and their float64 reference per rank, shared by
tests/torch/test_cross_attention.py and tests/jax/test_cross_attention.py.

A case holds every rank's q rows (any count, some ranks empty), the whole kv (replicated: every rank's copy;
sharded: cut by ``kv_sizes``), the ids and a cotangent per rank. The expected values come from
`commlib.reference.cross_attention.reference` on the unsharded arrays: rank r's output and dq are its rows of the full
result; a sharded kv's dk, dv on rank r are its rows of the full gradient (every rank's queries summed); a
replicated kv's dk, dv on rank r are the gradient of rank r's own loss (its share).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from commlib.reference import cross_attention as spec
from commlib.uneven import split_sizes


@dataclasses.dataclass(frozen=True)
class CrossCase:
    name: str
    world_size: int
    kv: str
    q_sizes: tuple[int, ...]
    kv_sizes: tuple[int, ...] | None  # sharded: every rank's rows (None: even)
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 3
    v_dim: int = 3
    batch: int = 2
    text: tuple[int, ...] | None = None  # real kv tokens per batch row (the rest padding): kv ids
    q_padding: bool = False  # q ids: the last query row of every rank's shard is padding
    seed: int = 0

    @property
    def kv_len(self) -> int:
        return sum(self.kv_sizes) if self.kv_sizes is not None else 5 * (self.world_size if self.kv == "sharded" else 1)

    @property
    def rank_kv_sizes(self) -> tuple[int, ...]:
        return self.kv_sizes if self.kv_sizes is not None else (self.kv_len // self.world_size,) * self.world_size


def cases(world_size: int) -> list[CrossCase]:
    """The cases at `world_size`: both kv modes, uneven and empty shards, GQA and MQA, batch 2, padded text."""
    uneven = (3, 0, 2, 6)[:world_size] if world_size > 1 else (4,)
    q_sizes = split_sizes(7, world_size)
    found = [
        CrossCase("replicated", world_size, "replicated", q_sizes, None),
        CrossCase("replicated-text", world_size, "replicated", q_sizes, None, text=(5, 2), q_padding=True),
        CrossCase("replicated-mqa", world_size, "replicated", (2, 0, 3, 1)[:world_size], None, kv_heads=1, v_dim=2),
        CrossCase("sharded-even", world_size, "sharded", q_sizes, None),
        CrossCase("sharded-uneven", world_size, "sharded", q_sizes, uneven, v_dim=5),
        CrossCase(
            "sharded-text", world_size, "sharded", (2, 0, 3, 1)[:world_size], uneven, text=(4, 1), q_padding=True
        ),
        CrossCase("sharded-all-padding", world_size, "sharded", q_sizes, uneven, kv_heads=4, text=(0, 3)),
    ]
    return found


def _ids(case: CrossCase) -> tuple[list[np.ndarray] | None, np.ndarray | None]:
    """q ids per rank (``[B, Sq_r]``) and the whole kv ids ``[B, S_kv]``, or None."""
    kv_ids = None
    if case.text is not None:
        kv_ids = np.full((case.batch, case.kv_len), -1, dtype=np.int32)
        for row, real in enumerate(case.text):
            kv_ids[row, : min(real, case.kv_len)] = 0
    q_ids = None
    if case.q_padding:
        q_ids = [np.zeros((case.batch, rows), dtype=np.int64) for rows in case.q_sizes]
        for ids in q_ids:
            ids[:, -1:] = -1
    return q_ids, kv_ids


def arrays(case: CrossCase) -> dict:
    """Inputs and expected results, per rank: q, k, v, cotangent, q_ids, kv_ids (as the rank holds them), out,
    dq, dk, dv."""
    rng = np.random.default_rng(case.seed)
    batch, heads, kv_heads = case.batch, case.heads, case.kv_heads
    q_full = rng.standard_normal((batch, sum(case.q_sizes), heads, case.head_dim))
    cot_full = rng.standard_normal((batch, sum(case.q_sizes), heads, case.v_dim))
    k = rng.standard_normal((batch, case.kv_len, kv_heads, case.head_dim))
    v = rng.standard_normal((batch, case.kv_len, kv_heads, case.v_dim))
    q_ids, kv_ids = _ids(case)
    q_cuts = np.cumsum((0, *case.q_sizes))
    rows = [slice(q_cuts[r], q_cuts[r + 1]) for r in range(case.world_size)]
    q_full_ids = None if q_ids is None else np.concatenate(q_ids, axis=1)
    out, (dq, dk, dv) = spec.reference(q_full, k, v, cot_full, q_ids=q_full_ids, kv_ids=kv_ids)  # type: ignore[misc]
    found: dict = {name: [] for name in ("q", "k", "v", "cotangent", "q_ids", "kv_ids", "out", "dq", "dk", "dv")}
    kv_cuts = np.cumsum((0, *case.rank_kv_sizes))
    for r, own in enumerate(rows):
        found["q"].append(q_full[:, own])
        found["cotangent"].append(cot_full[:, own])
        found["q_ids"].append(None if q_ids is None else q_ids[r])
        found["out"].append(out[:, own])
        found["dq"].append(dq[:, own])
        if case.kv == "sharded":
            kv_rows = slice(kv_cuts[r], kv_cuts[r + 1])
            found["k"].append(k[:, kv_rows])
            found["v"].append(v[:, kv_rows])
            found["kv_ids"].append(None if kv_ids is None else kv_ids[:, kv_rows])
            found["dk"].append(dk[:, kv_rows])
            found["dv"].append(dv[:, kv_rows])
        else:  # this rank's share: the gradient of its own loss
            ids = None if q_ids is None else q_ids[r]
            _, (_, share_k, share_v) = spec.reference(q_full[:, own], k, v, cot_full[:, own], q_ids=ids, kv_ids=kv_ids)  # type: ignore[misc]
            found["k"].append(k)
            found["v"].append(v)
            found["kv_ids"].append(kv_ids)
            found["dk"].append(share_k)
            found["dv"].append(share_v)
    return found


def kwargs(case: CrossCase) -> dict:
    """The keywords of the call (ids passed separately)."""
    return dict(kv=case.kv, kv_sizes=case.kv_sizes)
