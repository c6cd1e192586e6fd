"""Job functions for tests/torch/test_joint.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import numpy as np
import torch

from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from commlib_torch.tools.parity_jobs import usp_groups
from tests import joint_cases
from tests.torch.attention_jobs import _counting

NAMES = ("q", "k", "v", "joint_q", "joint_k", "joint_v")


def joint_call(ctx, case: joint_cases.JointCase, arrays: dict, dtype: str = "float64"):
    """This rank's out, joint_out, {name: gradient} of q, k, v and the joint tensors (as float64 numpy), and the
    c10d calls of the forward."""
    own = {name: arrays[name][ctx.rank] for name in "qkv"} | {name: arrays[name] for name in NAMES[3:]}
    leaves = {name: torch.tensor(own[name], dtype=getattr(torch, dtype)).requires_grad_() for name in NAMES}
    forward: list = []
    with _counting(forward):
        out, joint_out = ulysses_attention(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            joint_q=leaves["joint_q"],
            joint_k=leaves["joint_k"],
            joint_v=leaves["joint_v"],
            **case.kwargs(),
        )
    cotangents = [torch.tensor(arrays[name][ctx.rank], dtype=out.dtype) for name in ("cotangent", "joint_cotangent")]
    ((out * cotangents[0]).sum() + (joint_out * cotangents[1]).sum()).backward()
    grads = {
        name: np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.double().numpy() for name, leaf in leaves.items()
    }
    as_numpy = [x.detach().double().numpy() for x in (out, joint_out)]
    return *as_numpy, grads, [name for name, _ in forward]


def joint_error(ctx, joint_shapes, options: dict) -> str:
    """The error text of a bad joint call on this rank (q [1, 4, 6, 8], k, v [1, 4, 2, 8])."""
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 4, 2, 8)
    tensors = [None if shape is None else torch.zeros(shape) for shape in joint_shapes]
    try:
        ulysses_attention(q, k, k, joint_q=tensors[0], joint_k=tensors[1], joint_v=tensors[2], **options)
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def ring_joint_call(ctx, case: joint_cases.RingJointCase, arrays: dict, dtype: str = "float64"):
    """`joint_call` for a ring or USP case (tests/joint_cases.py's `ring_cases`): this rank's out, joint_out,
    {name: gradient} (float64 numpy) and the c10d calls of the forward."""
    own = {name: arrays[name][ctx.rank] for name in "qkv"} | {name: arrays[name] for name in NAMES[3:]}
    leaves = {name: torch.tensor(own[name], dtype=getattr(torch, dtype)).requires_grad_() for name in NAMES}
    joint = dict(joint_q=leaves["joint_q"], joint_k=leaves["joint_k"], joint_v=leaves["joint_v"])
    groups = usp_groups(case.world_size, case.ulysses_size) if case.op == "usp_attention" else ()
    layer = usp_attention if case.op == "usp_attention" else ring_attention
    forward: list = []
    with _counting(forward):
        out, joint_out = layer(leaves["q"], leaves["k"], leaves["v"], *groups, **joint, **case.kwargs())
    cotangents = [torch.tensor(arrays[name][ctx.rank], dtype=out.dtype) for name in ("cotangent", "joint_cotangent")]
    ((out * cotangents[0]).sum() + (joint_out * cotangents[1]).sum()).backward()
    grads = {
        name: np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.double().numpy() for name, leaf in leaves.items()
    }
    as_numpy = [x.detach().double().numpy() for x in (out, joint_out)]
    return *as_numpy, grads, [name for name, _ in forward]


def ring_joint_error(ctx, op: str, joint_shapes, options: dict) -> str:
    """The error text of a bad joint call of ring or USP attention on this rank (q [1, 4, 6, 8], k, v [1, 4, 2,
    8]; USP: a Ulysses group of every rank)."""
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 4, 2, 8)
    tensors = [None if shape is None else torch.zeros(shape) for shape in joint_shapes]
    joint = dict(joint_q=tensors[0], joint_k=tensors[1], joint_v=tensors[2])
    try:
        if op == "usp_attention":
            usp_attention(q, k, k, *usp_groups(ctx.world_size, ctx.world_size), **joint, **options)
        else:
            ring_attention(q, k, k, **joint, **options)
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def checked_ring_joint(ctx, op: str) -> list[str]:
    """In checked mode, a ring (USP) joint call every rank agrees on (its error text: "ok"), then one where rank 0's
    joint tokens are 3 and the others' 2 (every rank's error text)."""
    from commlib_torch import checked

    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 2, 8)
    groups = usp_groups(ctx.world_size, ctx.world_size) if op == "usp_attention" else ()
    layer = usp_attention if op == "usp_attention" else ring_attention
    texts = []
    for joint_seq in (3, 3 if ctx.rank else 2):
        text = dict(joint_q=torch.randn(1, joint_seq, 4, 8), joint_k=torch.randn(1, joint_seq, 2, 8))
        try:
            with checked():
                layer(q, k, k, *groups, **text, joint_v=text["joint_k"], causal=True)
            texts.append("ok")
        except ValueError as error:
            texts.append(f"{type(error).__name__}: {error}")
    return texts


def compiled_ring_joint(ctx, op: str) -> bool:
    """Whether `op` with joint tensors (rear, causal: the joint partials gathered) under ``torch.compile(fullgraph=
    True, backend="aot_eager")`` gives eager's out, joint_out and every gradient bit for bit on this rank."""
    generator = torch.Generator().manual_seed(ctx.rank)
    shapes = [(1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 8), (1, 3, 4, 8), (1, 3, 2, 8), (1, 3, 2, 8)]
    inputs = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    text = [torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) for shape in shapes[3:]]
    inputs[3:] = text  # the same on every rank
    groups = usp_groups(ctx.world_size, 2) if op == "usp_attention" else ()
    layer = usp_attention if op == "usp_attention" else ring_attention

    def call(q, k, v, joint_q, joint_k, joint_v):
        joint = dict(joint_q=joint_q, joint_k=joint_k, joint_v=joint_v)
        return layer(q, k, v, *groups, causal=True, joint_position="rear", **joint)

    def value_and_grads(fn) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in inputs]
        out, joint_out = fn(*leaves)
        (out.sum() + (joint_out * (ctx.rank + 1)).sum()).backward()
        return [out.detach(), joint_out.detach(), *(leaf.grad for leaf in leaves)]

    torch._dynamo.reset()
    got = value_and_grads(torch.compile(call, fullgraph=True, backend="aot_eager"))
    want = value_and_grads(call)
    torch._dynamo.reset()
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
