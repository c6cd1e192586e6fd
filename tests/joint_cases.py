"""Seeded cases of joint attention (``joint_q``, ``joint_k``, ``joint_v``; numpy only) and their float64 reference
per rank, shared by tests/spec/test_joint.py, tests/torch/test_joint.py and tests/jax/test_joint.py: Ulysses'
(`cases`, `arrays`) and ring attention's and USP's (`ring_cases`, `ring_arrays`).

The expected values come from `commlib.reference.joint.reference` (attention of the concatenation) on the unsharded
arrays, with the cotangent of the sequence's output concatenated over the ranks and the joint output's cotangent
summed over them (``convention="sum"``: every rank's loss is its own, and each rank's joint_out feeds it). Rank r's
out, dq, dk, dv are its rows of the full result; joint_out is the same on every rank; rank r's d joint_q is the full
d joint_q in the q heads rank r attends with (``split_sizes(H, W)``) and 0 elsewhere, its d joint_k, d joint_v the
part of the full gradient its q heads give (from a reference whose kv heads are expanded to one per q head).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from commlib.attention import head_split
from commlib.reference import joint as joint_reference
from commlib.sequence import shard_positions
from commlib.uneven import split_sizes


@dataclasses.dataclass(frozen=True)
class JointCase:
    name: str
    world_size: int
    position: str = "front"
    causal: bool = False
    heads: int = 6
    kv_heads: int = 2
    seq: int = 7  # the full sequence, cut by split_sizes(seq, W)
    joint_seq: int = 3
    head_dim: int = 3
    v_dim: int = 3
    batch: int = 2
    chunks: int = 1
    seed: int = 0

    @property
    def seq_sizes(self) -> tuple[int, ...]:
        return split_sizes(self.seq, self.world_size)

    def kwargs(self) -> dict:
        """The layer's keywords (the tensors passed separately)."""
        sizes = None if len(set(self.seq_sizes)) == 1 else self.seq_sizes
        return dict(causal=self.causal, seq_sizes=sizes, chunks=self.chunks, joint_position=self.position)


def cases(world_size: int) -> list[JointCase]:
    """At `world_size`: front and rear, causal, GQA with uneven heads (H = 6 over H_kv = 2), MHA, MQA (H = 5),
    an uneven sequence, batch 2, v's own head dim (two exchanges), two head groups, one joint token."""
    found = [
        JointCase("front", world_size),
        JointCase("rear", world_size, position="rear"),
        JointCase("front-causal", world_size, causal=True, seed=1),
        JointCase("rear-causal", world_size, position="rear", causal=True, seed=2),
        JointCase("mha-v-dim", world_size, heads=4, kv_heads=4, v_dim=5, seed=3),
        JointCase("mqa-one-token", world_size, position="rear", heads=5, kv_heads=1, joint_seq=1, seq=9, seed=4),
    ]
    if world_size <= 3:  # ceil(6 / W) >= 2 q heads on some rank: two groups
        found.append(JointCase("chunks-2", world_size, causal=True, chunks=2, seed=5))
    return found


def _rows(case: JointCase) -> list[slice]:
    cuts = np.cumsum((0, *case.seq_sizes))
    return [slice(cuts[r], cuts[r + 1]) for r in range(case.world_size)]


def _draw(case: JointCase) -> tuple[dict, np.ndarray, list]:
    """The seeded float64 inputs of `case`: the whole q, k, v and joint tensors, the sequence's cotangent and
    every rank's cotangent of joint_out."""
    rng = np.random.default_rng(case.seed)
    b, s, sj, h, hkv = case.batch, case.seq, case.joint_seq, case.heads, case.kv_heads
    shapes = dict(
        q=(b, s, h, case.head_dim),
        k=(b, s, hkv, case.head_dim),
        v=(b, s, hkv, case.v_dim),
        joint_q=(b, sj, h, case.head_dim),
        joint_k=(b, sj, hkv, case.head_dim),
        joint_v=(b, sj, hkv, case.v_dim),
    )
    full = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    cot = rng.standard_normal((b, s, h, case.v_dim))
    joint_cots = [rng.standard_normal((b, sj, h, case.v_dim)) for _ in range(case.world_size)]
    return full, cot, joint_cots


def arrays(case: JointCase) -> dict:
    """Inputs (per rank: q, k, v, cotangent, joint_cotangent; replicated: joint_q, joint_k, joint_v) and the
    expected results per rank: out, joint_out, dq, dk, dv, djoint_q, djoint_k, djoint_v."""
    full, cot, joint_cots = _draw(case)
    b, sj, h, hkv = case.batch, case.joint_seq, case.heads, case.kv_heads
    total = (sum(joint_cots), cot)[::-1]
    main = (full["q"], full["k"], full["v"])
    tensors = (full["joint_q"], full["joint_k"], full["joint_v"])
    out, joint_out, grads = joint_reference.reference(
        *main, tensors, case.position, causal=case.causal, cotangents=total
    )
    group = h // hkv
    expanded = [np.repeat(x, group, axis=2) for x in (full["k"], full["v"], full["joint_k"], full["joint_v"])]
    _, _, per_head = joint_reference.reference(
        full["q"], *expanded[:2], (full["joint_q"], *expanded[2:]), case.position, causal=case.causal, cotangents=total
    )
    split = head_split(h, hkv, case.world_size)
    found: dict = {name: [] for name in ("q", "k", "v", "cotangent", "joint_cotangent", "out", "dq", "dk", "dv")}
    found |= {name: [] for name in ("djoint_q", "djoint_k", "djoint_v")}
    found |= {name: full[name] for name in ("joint_q", "joint_k", "joint_v")}
    found["joint_out"] = joint_out
    for rank, rows in enumerate(_rows(case)):
        for index, name in enumerate("qkv"):
            found[name].append(full[name][:, rows])
            found[f"d{name}"].append(grads[index][:, rows])
        found["cotangent"].append(cot[:, rows])
        found["joint_cotangent"].append(joint_cots[rank])
        found["out"].append(out[:, rows])
        start, stop = split.q_ranges[rank]
        mine = np.zeros(h, dtype=bool)
        mine[start:stop] = True
        found["djoint_q"].append(np.where(mine[:, None], grads[3], 0.0))
        for name, grad in (("djoint_k", per_head[4]), ("djoint_v", per_head[5])):
            share = np.where(mine[:, None], grad, 0.0)  # [B, S_j, H, D]: q head i's part, rank r's heads only
            found[name].append(share.reshape(b, sj, hkv, group, -1).sum(axis=3))
    return found


# ---------------------------------------------------------------------------------------------------------
# Ring attention and USP (`commlib.ring`: the joint pieces of the ring walk)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RingJointCase:
    """A joint call of ``ring_attention`` (``ulysses_size == 1``) or ``usp_attention`` on ``ring_size`` x
    ``ulysses_size`` ranks; rank ``r * U + u`` (ring index r, Ulysses index u) holds shard ``r * U + u``
    (`commlib.shard_positions`)."""

    name: str
    ring_size: int
    ulysses_size: int = 1
    layout: str = "contiguous"
    position: str = "front"
    causal: bool = False
    heads: int = 6
    kv_heads: int = 2
    rows: int = 2  # S_r, each rank's rows (zigzag: even)
    joint_seq: int = 3
    head_dim: int = 4
    v_dim: int = 4
    batch: int = 2
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def op(self) -> str:
        return "ring_attention" if self.ulysses_size == 1 else "usp_attention"

    @property
    def seq(self) -> int:
        return self.rows * self.world_size

    def kwargs(self) -> dict:
        """The layer's keywords (the tensors and groups passed separately)."""
        return dict(causal=self.causal, layout=self.layout, joint_position=self.position)


def ring_cases(world_size: int) -> list[RingJointCase]:
    """At `world_size`: ring attention front and rear, causal, contiguous and zigzag, GQA (H = 6 over H_kv = 2),
    MQA with one joint token, MHA with v's own head dim, batch 2; USP (U = 2) where W is even."""
    found = [
        RingJointCase("ring-front", world_size),
        RingJointCase("ring-rear-causal-zigzag", world_size, layout="zigzag", position="rear", causal=True, seed=1),
        RingJointCase("ring-front-causal-mqa", world_size, causal=True, heads=4, kv_heads=1, joint_seq=1, seed=2),
        RingJointCase(
            "ring-rear-v-dim-zigzag", world_size, 1, "zigzag", "rear", heads=3, kv_heads=3, v_dim=5, rows=4, batch=1
        ),
    ]
    if world_size % 2 == 0:
        ring = world_size // 2
        found += [
            RingJointCase("usp-front-causal-zigzag", ring, 2, layout="zigzag", causal=True, heads=4, seed=4),
            RingJointCase("usp-rear", ring, 2, position="rear", heads=4, kv_heads=2, rows=3, seed=5),
        ]
    return found


def _concatenated_positions(case: RingJointCase) -> tuple[np.ndarray, np.ndarray]:
    """The concatenation's index of every sequence position and of every joint token."""
    sequence, joint = np.arange(case.seq), np.arange(case.joint_seq)
    return (sequence + case.joint_seq, joint) if case.position == "front" else (sequence, joint + case.seq)


def _parts(full: dict, case: RingJointCase, cotangent: np.ndarray, keys: np.ndarray) -> tuple:
    """float64 ``(dq, dk, dv)`` per q head (kv heads expanded) of the concatenation's attention with cotangent
    `cotangent` (``[B, N, H, D_v]`` over the concatenation's rows), only the scores of the key columns `keys`
    (bool ``[N]``) taken: the part of the VJP those keys (and the rows `cotangent` is nonzero on) give."""
    q, k, v = full["q"], full["k"], full["v"]
    scale = 1.0 / np.sqrt(case.head_dim)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if case.causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], dtype=bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v)
    d_probs = np.einsum("bqhd,bkhd->bhqk", cotangent, v)
    rowsums = np.einsum("bqhd,bqhd->bhq", cotangent, out)
    d_scores = probs * (d_probs - rowsums[..., None]) * keys
    dq = np.einsum("bhqk,bkhd->bqhd", d_scores, k) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", d_scores, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", probs * keys, cotangent)
    return dq, dk, dv


def ring_arrays(case: RingJointCase) -> dict:
    """As `arrays`, for a ring or USP case: per rank q, k, v (its shard), cotangent, joint_cotangent; the joint
    tensors; the expected out, dq, dk, dv (its rows of the reference of the concatenation, the joint outputs'
    cotangents summed), joint_out, and rank (r, u)'s d joint_q, d joint_k, d joint_v: its part, in its heads
    only -- the joint q's attention to ring block r's keys with every rank's cotangent summed, plus the joint
    q's attention to the joint keys and ring block r's queries' attention to them with the cotangents of
    ring index r (joint_out's summed over its Ulysses group, the sequence's its rows')."""
    full, cot, joint_cots = _draw(case)
    b, s, sj, h, hkv = case.batch, case.seq, case.joint_seq, case.heads, case.kv_heads
    total = sum(joint_cots)
    main = (full["q"], full["k"], full["v"])
    tensors = (full["joint_q"], full["joint_k"], full["joint_v"])
    out, joint_out, grads = joint_reference.reference(
        *main, tensors, case.position, causal=case.causal, cotangents=(cot, total)
    )
    group = h // hkv
    concatenated = {
        name: joint_reference.concatenated(np.repeat(full[name], h // full[name].shape[2], axis=2),
                                           np.repeat(full[f"joint_{name}"], h // full[name].shape[2], axis=2),
                                           case.position)
        for name in "qkv"
    }  # fmt: skip
    seq_at, joint_at = _concatenated_positions(case)
    size = s + sj
    held = shard_positions(s, case.ring_size, case.layout, case.ulysses_size)
    found: dict = {name: [] for name in ("q", "k", "v", "cotangent", "joint_cotangent", "out", "dq", "dk", "dv")}
    found |= {name: [] for name in ("djoint_q", "djoint_k", "djoint_v")}
    found |= {name: full[name] for name in ("joint_q", "joint_k", "joint_v")}
    found["joint_out"] = joint_out
    u_size = case.ulysses_size
    for rank in range(case.world_size):
        ring_index, ulysses_index = divmod(rank, u_size)
        rows = held[rank]
        for index, name in enumerate("qkv"):
            found[name].append(full[name][:, rows])
            found[f"d{name}"].append(grads[index][:, rows])
        found["cotangent"].append(cot[:, rows])
        found["joint_cotangent"].append(joint_cots[rank])
        found["out"].append(out[:, rows])
        block = held[ring_index * u_size : (ring_index + 1) * u_size].reshape(-1)  # ring block r's positions
        ring_cot = sum(joint_cots[ring_index * u_size : (ring_index + 1) * u_size])
        block_keys, joint_keys = np.zeros(size, dtype=bool), np.zeros(size, dtype=bool)
        block_keys[seq_at[block]], joint_keys[joint_at] = True, True
        to_block = np.zeros((b, size, h, case.v_dim))
        to_block[:, joint_at] = total
        from_ring = np.zeros((b, size, h, case.v_dim))
        from_ring[:, joint_at] = ring_cot
        from_ring[:, seq_at[block]] = cot[:, block]
        dq_block = _parts(concatenated, case, to_block, block_keys)[0]
        dq_joint, dk_joint, dv_joint = _parts(concatenated, case, from_ring, joint_keys)
        heads = np.zeros(h, dtype=bool)
        per_rank = h // u_size
        heads[ulysses_index * per_rank : (ulysses_index + 1) * per_rank] = True
        found["djoint_q"].append(np.where(heads[:, None], (dq_block + dq_joint)[:, joint_at], 0.0))
        for name, grad in (("djoint_k", dk_joint), ("djoint_v", dv_joint)):
            share = np.where(heads[:, None], grad[:, joint_at], 0.0)
            found[name].append(share.reshape(b, sj, hkv, group, -1).sum(axis=3))
    return found
