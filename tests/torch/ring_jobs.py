"""Job functions for tests/torch/test_ring.py (module-level: the pool's workers import them by name)."""

from __future__ import annotations

import numpy as np
import torch

from commlib.tools import cases
from commlib_torch import _compat
from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from commlib_torch.tools.parity_jobs import usp_groups
from tests.torch.attention_jobs import _counting


def _leaves(ctx, case: cases.Case, arrays, transposed: bool = False) -> list[torch.Tensor]:
    """This rank's q, k, v as leaves that require grad; `transposed`: non-contiguous views of [B, H, S, D]."""
    dtype = getattr(torch, case.dtype)
    leaves = []
    for name in case.inputs:
        array = arrays[name][ctx.rank]
        leaf = (
            torch.tensor(np.swapaxes(array, 1, 2), dtype=dtype).transpose(1, 2)
            if transposed
            else torch.tensor(array, dtype=dtype)
        )
        leaves.append(leaf.requires_grad_())
    return leaves


def _call(case: cases.Case, q, k, v) -> torch.Tensor:
    if case.op == "usp_attention":
        groups = usp_groups(case.world_size, cases.context_layout(case)[1])
        return usp_attention(q, k, v, *groups, **cases.context_kwargs(case))
    return ring_attention(q, k, v, **cases.context_kwargs(case))


def counted_call(ctx, case: cases.Case, arrays, transposed: bool = False):
    """Output, {input: gradient} and the c10d calls ``(name, received bytes)`` of the forward and of the
    backward on this rank."""
    leaves = _leaves(ctx, case, arrays, transposed)
    forward: list = []
    backward: list = []
    with _counting(forward):
        out = _call(case, *leaves)
    cotangent = torch.tensor(arrays["cotangent"][ctx.rank], dtype=out.dtype)
    with _counting(backward):
        (out * cotangent).sum().backward()
    gradients = {name: leaf.grad.double().numpy() for name, leaf in zip(case.inputs, leaves, strict=True)}
    return out.detach().double().numpy(), gradients, forward, backward


def saved_for_backward(ctx, case: cases.Case, arrays):
    """What autograd saves for backward during the call (``torch.autograd.graph.saved_tensors_hooks``):
    ``(shape, dtype name, bytes)`` of each saved tensor, and the same for q, k, v, the output and the LSE's
    shape ``[B, S/W, H]`` in the compute dtype."""
    q, k, v = _leaves(ctx, case, arrays)
    saved: list = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(tensor.shape), str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = _call(case, q, k, v)
    out.sum().backward()  # the saved tensors are what the backward needs
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(q.shape[:3], dtype=compute)
    expected = [(tuple(x.shape), str(x.dtype), x.numel() * x.element_size()) for x in (q, k, v, out, lse)]
    return saved, expected


def forward_only(ctx, case: cases.Case, arrays, mode: str):
    """Output under ``torch.no_grad()`` ("no_grad") or for inputs that don't require grad ("constant"), and
    whether it carries autograd state."""
    q, k, v = (leaf.detach() for leaf in _leaves(ctx, case, arrays))
    if mode == "no_grad":
        with torch.no_grad():
            out = _call(case, q, k, v)
    else:
        out = _call(case, q, k, v)
    return out.double().numpy(), out.requires_grad or out.grad_fn is not None


def spec_rules_call(ctx, case: cases.Case, arrays):
    """`counted_call` with every piece on the spec's einsum rules (the path CUDA and ``D_v != D`` take), not on
    torch's CPU flash kernels."""
    saved = _compat.FLASH_CPU
    _compat.FLASH_CPU = None  # `commlib_torch._kernels.choose` then says "einsum" for every piece
    try:
        return counted_call(ctx, case, arrays)
    finally:
        _compat.FLASH_CPU = saved


_MESHES: dict = {}


def usp_on_mesh(ctx, case: cases.Case, arrays):
    """USP with its groups given as the dims of ``init_device_mesh("cpu", (W, U), mesh_dim_names=("ring",
    "ulysses"))`` (rank ``r * U + u`` at mesh coordinate (r, u)): output and gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    ring_size, ulysses_size, _ = cases.context_layout(case)
    if (ring_size, ulysses_size) not in _MESHES:
        _MESHES[ring_size, ulysses_size] = init_device_mesh(
            "cpu", (ring_size, ulysses_size), mesh_dim_names=("ring", "ulysses")
        )
    mesh = _MESHES[ring_size, ulysses_size]
    q, k, v = _leaves(ctx, case, arrays)
    out = usp_attention(q, k, v, (mesh, "ulysses"), (mesh, "ring"), **cases.context_kwargs(case))
    (out * torch.tensor(arrays["cotangent"][ctx.rank], dtype=out.dtype)).sum().backward()
    return out.detach().double().numpy(), {
        name: x.grad.double().numpy() for name, x in zip("qkv", (q, k, v), strict=True)
    }


def second_order(ctx, case: cases.Case, arrays, how: str) -> str:
    """A second derivative through the ring, by ``create_graph=True`` then ``torch.autograd.grad`` ("autograd")
    or by ``torch.func.grad`` of ``torch.func.grad`` ("func"): the error text."""
    q, k, v = _leaves(ctx, case, arrays)
    loss = lambda a: (_call(case, a, k, v) ** 2).sum()  # noqa: E731
    try:
        if how == "autograd":
            (d_q,) = torch.autograd.grad(loss(q), q, create_graph=True)
            torch.autograd.grad(d_q.sum(), (q, k, v), allow_unused=True)
        else:
            torch.func.grad(lambda a: torch.func.grad(loss)(a).sum())(q.detach())
    except TypeError as error:
        return f"TypeError: {error}"
    return "no error"


def func_grad(ctx, case: cases.Case, arrays):
    """``torch.func.grad`` of ``sum(out * cotangent)``: {input: gradient} on this rank."""
    q, k, v = (leaf.detach() for leaf in _leaves(ctx, case, arrays))
    cotangent = torch.tensor(arrays["cotangent"][ctx.rank], dtype=q.dtype)
    grads = torch.func.grad(lambda *xs: (_call(case, *xs) * cotangent).sum(), argnums=(0, 1, 2))(q, k, v)
    return {name: grad.double().numpy() for name, grad in zip(case.inputs, grads, strict=True)}


def any_length(ctx, layout, whole: dict, causal: bool, op: str = "ring_attention"):
    """This rank's output and dq/dk/dv (float64 numpy) of ring, USP or Ulysses attention (`op`) on its
    exact shard of the `SequenceLayout` `layout` (shard ``r * U + u`` at WORLD rank ``r * U + u``), cotangent the
    same shard of ``whole["cotangent"]``."""
    leaves = [torch.tensor(layout.shard(whole[name], 1)[ctx.rank]).requires_grad_() for name in ("q", "k", "v")]
    if op == "usp_attention":
        groups = usp_groups(layout.world_size, layout.ulysses_size)
        out = usp_attention(*leaves, *groups, causal=causal, layout=layout)
    elif op == "ulysses_attention":
        out = ulysses_attention(*leaves, causal=causal, layout=layout)
    else:
        out = ring_attention(*leaves, causal=causal, layout=layout)
    cotangent = torch.tensor(layout.shard(whole["cotangent"], 1)[ctx.rank])
    (out * cotangent).sum().backward()
    return out.detach().numpy(), *(leaf.grad.numpy() for leaf in leaves)


def any_length_error(ctx, layout, shape: tuple, op: str = "ring_attention") -> str:
    """The error text of a ring (USP) call on zeros of `shape` with `layout`, on this rank."""
    q = torch.zeros(shape, dtype=torch.float64)
    try:
        if op == "usp_attention":
            usp_attention(q, q, q, *usp_groups(ctx.world_size, 2), layout=layout)
        elif op == "ulysses_attention":
            ulysses_attention(q, q, q, layout=layout)
        else:
            ring_attention(q, q, q, layout=layout)
    except Exception as error:  # the text is what is checked
        return f"{type(error).__name__}: {error}"
    return "no error"


def _segmented_inputs(ctx, seq: int = 8) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """This rank's q, k, v ``[2, seq, 4, 8]`` / ``[2, seq, 2, 8]`` (float64), a cotangent and segment ids: two
    documents and padding in row 0, one document in row 1 (the ring skips some pieces at W >= 2)."""
    generator = torch.Generator().manual_seed(ctx.rank)
    shapes = [(2, seq, 4, 8), (2, seq, 2, 8), (2, seq, 2, 8), (2, seq, 4, 8)]
    *inputs, cotangent = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes)
    whole = torch.tensor([[0] * 3 + [1] * (seq * ctx.world_size - 4) + [-1], [2] * (seq * ctx.world_size)])
    return inputs, cotangent, whole[:, ctx.rank * seq : (ctx.rank + 1) * seq]


def _segmented_call(op: str, world_size: int):
    """``(q, k, v, ids) -> out`` of `op` (ring over WORLD; USP: Ulysses groups of one rank, the ring WORLD)."""
    if op == "usp_attention":
        groups = usp_groups(world_size, 1)
        return lambda q, k, v, ids: usp_attention(q, k, v, *groups, causal=True, segment_ids=ids)
    return lambda q, k, v, ids: ring_attention(q, k, v, causal=True, segment_ids=ids)


def compiled_with_segments(ctx, op: str) -> tuple[int, bool]:
    """(graph breaks, whether the output, dq, dk and dv equal eager's bit for bit) of `op` with segment ids,
    causal, under ``torch.compile(fullgraph=True, backend="aot_eager")``; compiled first."""
    from torch._dynamo.utils import counters

    inputs, cotangent, ids = _segmented_inputs(ctx)
    call = _segmented_call(op, ctx.world_size)

    def value_and_grads(fn) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves, ids)
        (out * cotangent).sum().backward()
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    torch._dynamo.reset()
    counters.clear()
    got = value_and_grads(torch.compile(call, fullgraph=True, backend="aot_eager"))
    breaks = sum(counters["graph_break"].values())
    want = value_and_grads(call)
    torch._dynamo.reset()
    return breaks, all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def host_reads(ctx, op: str) -> tuple[int, int]:
    """Host reads (``Tensor.__bool__``, ``item``, ``tolist``) of one eager call of `op` with segment ids: in its
    forward, in its backward."""
    inputs, cotangent, ids = _segmented_inputs(ctx)
    leaves = [x.requires_grad_() for x in inputs]
    call = _segmented_call(op, ctx.world_size)
    count = [0]
    saved = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist")}

    def counted(name: str):
        def read(self, *args, **kwargs):
            count[0] += 1
            return saved[name](self, *args, **kwargs)

        return read

    for name in saved:
        setattr(torch.Tensor, name, counted(name))
    try:
        out = call(*leaves, ids)
        forward = count[0]
        (out * cotangent).sum().backward()
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
    return forward, count[0] - forward
