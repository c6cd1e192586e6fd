"""Seeded cases of joint attention (``joint_q``, ``joint_k``, ``joint_v``; numpy only) and their float64 reference
per rank, shared by tests/spec/test_joint.py, tests/torch/test_joint.py and tests/jax/test_joint.py.

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


def arrays(case: JointCase) -> dict:
    """Inputs (per rank: q, k, v, cotangent, joint_cotangent; replicated: joint_q, joint_k, joint_v) and the
    expected results per rank: out, joint_out, dq, dk, dv, djoint_q, djoint_k, djoint_v."""
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
