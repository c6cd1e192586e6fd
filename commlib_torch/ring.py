"""Ring attention and USP over `torch.distributed`: context parallelism past the head count.

The spec (`commlib.ring`) validates the call, owns the schedule (which k/v block each rank holds at each step,
which pieces of each (q block, kv block) pair the causal mask leaves, the permute pairs) and walks it, forward
and backward (`commlib.ring.forward` / `backward`); this module gives that walk its torch backend (`_RankBackend`:
torch's fused kernels where `commlib_torch._kernels.choose` says they serve, else `commlib.blockwise`'s einsum
rules) inside one autograd
Function whose backward is written by hand: dk/dv travel around the ring with k/v and the probabilities are
recomputed blockwise from the saved log-sum-exp, so a rank saves q, k, v, the output and the LSE for backward
-- O(S/W) -- and no k/v block or score matrix of any step. Every ring step sends one buffer per dtype of what
travels, asynchronously (`dist.batch_isend_irecv`, begun before the step's pieces and waited after them: the
DESIGN's Overlap; checked mode fingerprints each buffer's `permute` plan first, and a backend error is translated
as at commlib's boundary); under Dynamo it is one `permute` of commlib's own (the plan walked at commlib's
boundary).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from commlib import Plan, blockwise, frontend_errors, plans
from commlib import ring as spec
from commlib.layer_call import ring_call
from commlib.masks import MaskRule
from commlib.sequence import SequenceLayout
from commlib_torch import _kernels
from commlib_torch._c10d import Started
from commlib_torch._checked import LayerFrontend, exchange, is_checked
from commlib_torch._dtypes import dtype_name
from commlib_torch._failures import translate
from commlib_torch._groups import GroupArgument as Group
from commlib_torch._groups import backend_dtypes, global_rank, group_rank, resolve_group, world_size
from commlib_torch._op import at_boundary, transforms_active
from commlib_torch._walk import run
from commlib_torch.functional import all_gather, all_reduce, all_to_all, all_to_all_4d

__all__ = ["ring_attention", "usp_attention"]


class _TorchMath(blockwise.ArrayMath):
    """`commlib.blockwise.ArrayMath` on torch tensors: the causal mask built on the scores' device."""

    def __init__(self) -> None:
        super().__init__(torch)

    def causal_mask(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        index = torch.arange(rows, device=like.device)
        return index[:, None] >= index[None, :]


_MATH = _TorchMath()


def piece_kernel(device_type: str, plan: spec.RingPlan, mask: str | torch.Tensor) -> _kernels.Kernel:
    """The kernel of a piece of `plan` on `device_type` (`commlib_torch._kernels.choose`: torch's fused CPU
    flash kernels where ``D_v == D``, on CUDA flash or the memory-efficient kernel in the inputs' dtype, else the
    spec's einsum rules). The same math either way (`commlib.blockwise.attend` / `attend_vjp`: the kernels return
    and take the LSE, and their backward recomputes P from the LSE we pass, the final one), fused."""
    kind = _kernels.mask_kind(mask)
    return _kernels.choose(device_type, plan.dtype, plan.head_dim, plan.value_dim, kind)


def _heads_major(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """``[B, S, h, D] -> [B, h * group, S, D]`` (kv heads repeated for the q heads they serve: local only), a
    view where D is the innermost dim already (the kernels read D with stride 1: channels_last inputs copy)."""
    x = (x.repeat_interleave(group, dim=2) if group > 1 else x).transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


def nan_free(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` with their NaN entries 0: what a kernel is given, so that a NaN no query sees (a padding key, a
    key the causal or segment mask hides) never reaches a score -- torch's kernels add a -inf mask to a NaN score
    and get NaN -- and `nan_rows` puts back the NaN of the rows that do see one. Each copy keeps its tensor's
    strides (a piece's rows are a strided view), as `nan_rows` does."""
    return tuple(_strided_copy(x).masked_fill_(x.isnan(), 0.0) for x in tensors)


def _strided_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` with `x`'s strides (differentiable)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def nan_rows(
    q: torch.Tensor, k: torch.Tensor, mask: str | torch.Tensor, *outputs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`outputs` (``[B, Sq, H, ...]``) NaN in the rows that see a NaN, the spec's rule (the reference, JAX): a row
    that sees some key and whose q holds a NaN, or that sees a key whose k holds one (q ``[B, Sq, H, D]``, k
    ``[B, Sk, H_kv, D]`` as given, before `nan_free`). `mask`: "full", "causal-diagonal" (``Sq == Sk``) or a bool
    array whose last two dims are ``[Sq, Sk]`` (leading dims 1 or B). torch's CPU flash kernels (and SDPA through
    them, read on 2.11-2.13) give a row whose every score is NaN 0 and LSE 0 instead. No host read; the outputs'
    other rows and their gradients are untouched, and their strides (the walk's later sums round as before)."""
    bad_keys = k.isnan().any(-1).to(torch.float32)  # [B, Sk, H_kv]
    if isinstance(mask, str):
        seen = bad_keys.cumsum(1) if mask == "causal-diagonal" else bad_keys.sum(1, keepdim=True)
        sees_any = None
    else:
        visible = mask.reshape(-1, *mask.shape[-2:])  # [B or 1, Sq, Sk]
        seen, sees_any = visible.to(torch.float32) @ bad_keys, visible.any(-1)[..., None]  # [B, Sq, H_kv], [., Sq, 1]
    bad = (seen > 0).repeat_interleave(q.shape[2] // k.shape[2], dim=2) | q.isnan().any(-1)  # [B, Sq, H]
    bad = bad if sees_any is None else bad & sees_any
    rows = lambda x: bad.view(*bad.shape, *(1,) * (x.dim() - bad.dim()))  # noqa: E731
    return tuple(_strided_copy(x).masked_fill_(rows(x), float("nan")) for x in outputs)


def _kernel_dtype(plan: spec.RingPlan, kernel: _kernels.Kernel, x: torch.Tensor) -> torch.dtype:
    """The dtype a kernel runs in: the CPU kernel the compute dtype, the CUDA kernels the inputs' own (the
    compute dtype holds their values exactly)."""
    return x.dtype if kernel == "flash-cpu" else getattr(torch, plan.dtype)


def _attend(
    plan: spec.RingPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece's ``(out [B, Sq, H, D_v], lse [B, Sq, H])`` (`commlib.blockwise.attend`), on the fused kernel
    `piece_kernel` chooses (a bool array mask as an additive one; a row it hides entirely: output 0, LSE -inf).
    The kernels see no NaN of q or k (`nan_free`); the rows that see one are NaN (`nan_rows`)."""
    query, key = nan_free(q, k)
    kernel = piece_kernel(q.device.type, plan, mask)
    if kernel == "einsum":
        out, lse = nan_rows(q, k, mask, *blockwise.attend(_MATH, query, key, v, plan.scale, mask))
        return out, lse
    dtype, additive, seen = _kernel_dtype(plan, kernel, q), None, None
    if isinstance(mask, torch.Tensor):
        visible = mask.reshape(-1, *mask.shape[-2:])  # [B or 1, Sq, Sk]
        seen = visible.any(-1)[..., None]  # [B or 1, Sq, 1]
        if kernel != "flash-cpu":  # a row that sees nothing sees every key here (finite), and is set below
            visible = visible | ~seen
        additive = _kernels.bias(visible, dtype, kernel)
    query, key, value = (
        _heads_major(x, group).to(dtype) for x, group in ((query, 1), (key, plan.group), (v, plan.group))
    )
    out, lse = _kernels.forward(kernel, query, key, value, mask == "causal-diagonal", additive, plan.scale)
    out, lse = out.transpose(1, 2).to(q.dtype), lse.transpose(1, 2).to(q.dtype)
    if seen is not None:  # the CPU kernel gives a row that sees nothing LSE 0: the spec's rule is -inf
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out if kernel == "flash-cpu" else out.masked_fill(~seen[..., None], 0.0)
    out, lse = nan_rows(q, k, mask, out, lse)
    return out, lse


def _attend_vjp(
    plan: spec.RingPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    d_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: str | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One piece's ``(dq, dk, dv)`` from the final output and LSE (`commlib.blockwise.attend_vjp`), q and k as
    `_attend` gave them to the kernels (`nan_free`: a NaN no query sees adds nothing, 0 * NaN included)."""
    q, k = nan_free(q, k)
    kernel = piece_kernel(q.device.type, plan, mask)
    if kernel == "einsum":
        return blockwise.attend_vjp(_MATH, q, k, v, d_out, lse, delta, plan.scale, mask)
    dtype = _kernel_dtype(plan, kernel, q)
    additive = None if isinstance(mask, str) else _kernels.bias(mask, dtype, kernel)
    finite = lse.masked_fill(~lse.isfinite(), 0.0)  # a row that saw no key: P = exp(-inf - 0) = 0 there
    d_o, query, key, value, o = (
        _heads_major(x, group).to(dtype)
        for x, group in ((d_out, 1), (q, 1), (k, plan.group), (v, plan.group), (out, 1))
    )
    causal, lse_heads = mask == "causal-diagonal", finite.transpose(1, 2)
    dq, dk, dv = _kernels.backward(kernel, d_o, query, key, value, o, lse_heads, causal, additive, plan.scale)
    fold = lambda x: x.unflatten(1, (plan.kv_heads, plan.group)).sum(2).transpose(1, 2).to(q.dtype)  # noqa: E731
    return dq.transpose(1, 2).to(q.dtype), fold(dk), fold(dv)


def _by_dtype(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Per dtype among `tensors`, in order of first appearance: their indices and one buffer of their elements
    laid end to end (what a ring step sends)."""
    groups = []
    for dtype in dict.fromkeys(tensor.dtype for tensor in tensors):
        members = [index for index, tensor in enumerate(tensors) if tensor.dtype == dtype]
        groups.append((members, torch.cat([tensors[index].reshape(-1) for index in members])))
    return groups


def _unflattened(tensors: list[torch.Tensor], buffers: list[tuple[list[int], torch.Tensor]]) -> list[torch.Tensor]:
    """Every tensor of `tensors` as a view of its part of the received buffer of its dtype (`_by_dtype`'s order)."""
    moved = list(tensors)
    for members, received in buffers:
        for index, part in zip(members, received.split([tensors[i].numel() for i in members]), strict=True):
            moved[index] = part.view(tensors[index].shape)
    return moved


def _permute_plan(plan: spec.RingPlan, flat: torch.Tensor, group: dist.ProcessGroup | None) -> Plan:
    """The `permute` (rank r to rank r + 1, `plan.perm`) of one step's buffer `flat`."""
    return plans.permute(
        tuple(flat.shape),
        plan.ring_size,
        plan.perm,
        dtype=dtype_name(flat.dtype),
        backend_dtypes=backend_dtypes(group, flat),
    )


def _pass(plan: spec.RingPlan, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """One ring step: every tensor of `tensors` goes from rank r to rank r + 1 (`plan.perm`), one `permute`
    per dtype among them (their elements laid end to end)."""
    if plan.ring_size == 1:
        return tensors
    received = [
        (members, at_boundary(run, _permute_plan(plan, flat, group), flat, group, None))
        for members, flat in _by_dtype(tensors)
    ]
    return _unflattened(tensors, received)


def _received(moved: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """What a ring step's tensors hold once its works are done (`flat`, the last send buffer, is kept referenced
    until then and names the step in a translated error, `_wait`)."""
    return moved


def _start(
    plan: spec.RingPlan, tensors: list[torch.Tensor], group: dist.ProcessGroup | None, rank: int, checked: bool = False
) -> Started:
    """`_pass` begun, not waited: per dtype among `tensors` one buffer (their elements end to end) sent to rank
    r + 1 and one received from rank r - 1, all in one `dist.batch_isend_irecv` (asynchronous c10d work).
    `checked`: each buffer's `permute` plan fingerprinted first (checked mode's exchange, as `_pass` does)."""
    ops: list[dist.P2POp] = []
    received: list[tuple[list[int], torch.Tensor]] = []
    flat = tensors[0]
    peers = (global_rank(group, (rank + 1) % plan.ring_size), global_rank(group, (rank - 1) % plan.ring_size))
    try:
        for members, flat in _by_dtype(tensors):
            if checked:
                exchange(_permute_plan(plan, flat, group), flat, group)
            received.append((members, torch.empty_like(flat)))
            ops += [
                dist.P2POp(dist.isend, flat, peers[0], group),
                dist.P2POp(dist.irecv, received[-1][1], peers[1], group),
            ]
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as error:
        raise _translated(error, plan, flat, group) from error
    return Started(works, _received, _unflattened(tensors, received), flat)


def _wait(plan: spec.RingPlan, sending: Started, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The tensors `_start` sent, received: its works waited (a backend error as CommTimeout / CommFailure)."""
    try:
        return sending.wait()
    except RuntimeError as error:
        raise _translated(error, plan, sending.arguments[1], group) from error


def _translated(
    error: RuntimeError, plan: spec.RingPlan, tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> RuntimeError:
    """`error` as `translate` gives it for the ring's permute (`error` itself where it means no failure)."""
    return translate(error, plan.op_name, tensor, group, "forward")


class _RankBackend:
    """`commlib.ring.RingBackend` on this rank's tensors: the pieces on the fused kernels where they
    apply (`_attend`), rows written in place, a ring step one `permute` per dtype (`_pass`), the case picked
    by the rank."""

    math = _MATH
    blocked_masks = False

    def __init__(
        self,
        plan: spec.RingPlan,
        group: dist.ProcessGroup | None,
        rank: int,
        device: torch.device,
        visible: list[list[bool]] | None = None,
    ) -> None:
        self.plan, self.group, self.rank, self.device = plan, group, rank, device
        self.visible = visible  # `_visibility`: the skip decisions of the call (None: selected on device)
        self.dtype = getattr(torch, plan.compute_dtype)
        # asynchronous c10d sends (`_start` / `_wait`; checked mode fingerprints each first) but under Dynamo,
        # which traces the synchronous `permute` (`_pass`)
        self.asynchronous = plan.ring_size > 1 and not torch.compiler.is_compiling()
        self.checked = is_checked()

    def key_mask(self, step: int) -> torch.Tensor:
        held = (self.plan.positions(block) for block in (self.rank, self.plan.kv_block(step, self.rank)))
        query, key = (torch.from_numpy(positions.copy()).to(self.device) for positions in held)
        return self.plan.position_mask(query, key)

    def real_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x  # `_padded` pads with zeros, and autograd's cotangent of the padding is zeros

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def restore(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(like.dtype)

    def zeros(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=self.dtype, device=like.device)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _attend(self.plan, q, k, v, mask)

    def attend_vjp(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        d_out: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        mask: str | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _attend_vjp(self.plan, q, k, v, out, d_out, lse, delta, mask)

    def set_rows(self, x: torch.Tensor, rows: slice, value: torch.Tensor) -> torch.Tensor:
        x[:, rows] = value
        return x

    def add_rows(self, x: torch.Tensor, rows: slice, value: torch.Tensor) -> torch.Tensor:
        x[:, rows] += value
        return x

    def start(self, tensors: list[torch.Tensor]) -> Started | list[torch.Tensor]:
        """Asynchronous where it may be (`_start`), else `_pass` done at once."""
        if self.asynchronous:
            return _start(self.plan, tensors, self.group, self.rank, self.checked)
        return _pass(self.plan, tensors, self.group)

    def wait(self, pending: Any) -> list[torch.Tensor]:
        return _wait(self.plan, pending, self.group) if self.asynchronous else pending

    def switch(self, step: int, function: Callable[..., Any], *operands: Any) -> Any:
        return function(self.plan.cases[self.plan.case_index[step][self.rank]], *operands)

    def block_ids(self, segments: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ids and those of the kv block it holds at `step`, from every block's ``[W, B, rows]``."""
        return segments[self.rank], segments[self.plan.kv_block(step, self.rank)]

    def gather_ring(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x[None], 0, self.group)

    def sum_ring(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, "sum", self.group)

    def when_visible(
        self, step: int, index: int, mask: torch.Tensor, function: Callable[..., tuple], *operands: torch.Tensor
    ) -> tuple:
        """The piece where the call's decisions (`_visibility`, read once per call) say it is visible, else
        skipped. Under Dynamo, which traces no data-dependent branch, the piece is computed on copies of the
        accumulators and kept where its mask's any is True (``torch.where``): the same values bit for bit."""
        if self.visible is not None:
            return function(*operands) if self.visible[step][index] else operands
        seen = mask.any()
        updated = function(*(x.clone() for x in operands))
        return tuple(torch.where(seen, new, old) for new, old in zip(updated, operands, strict=True))


Visible = list[list[bool]] | None  # `_visibility`: the call's skip decisions, read once (None: none, or Dynamo)


def _forward(
    plan: spec.RingPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    segments: torch.Tensor | None = None,
    visible: Visible = None,
    overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, S_r, H, D_v] in q's dtype, lse [B, S_r, H] in the compute dtype)`` (`commlib.ring.forward`;
    `segments` every block's ids ``[W, B, rows]``; `overlap` False: the sequential order, which the tests and
    the bench compare with)."""
    return spec.forward(plan, _RankBackend(plan, group, rank, q.device, visible), q, k, v, segments, overlap=overlap)


def _backward(
    plan: spec.RingPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    segments: torch.Tensor | None = None,
    visible: Visible = None,
    overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (`commlib.ring.backward`; the forward's `visible`: the same pieces, no host read)."""
    return spec.backward(
        plan, _RankBackend(plan, group, rank, q.device, visible), q, k, v, out, lse, d_out, segments, overlap=overlap
    )


class _FirstOrderOnly(torch.autograd.Function):
    """``(dq, dk, dv)`` as they are, tied to q, k, v and the cotangent so that differentiating them again reaches
    this backward, which refuses with the spec's error (the ring's backward is hand-written, first order).
    Applied only where a graph is recorded (create_graph=True, torch.func's nested transforms): in the form
    torch.func requires, whose per-call cost does not matter there."""

    @staticmethod
    def forward(
        op_name: str, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.op_name = inputs[0]

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> NoReturn:
        raise spec.second_order(ctx.op_name)


class _Ring(torch.autograd.Function):
    """The ring walk (`_forward`); backward `_backward` from the saved q, k, v, output and LSE."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: spec.RingPlan,
        group: dist.ProcessGroup | None,
        rank: int,
        segments: torch.Tensor | None = None,
        visible: Visible = None,
    ) -> torch.Tensor:
        out, lse = _forward(plan, q, k, v, group, rank, segments, visible)
        ctx.plan, ctx.group, ctx.rank, ctx.visible = plan, group, rank, visible
        ctx.save_for_backward(q, k, v, out, lse, segments)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, segments = ctx.saved_tensors
        with torch.no_grad():  # the walk is not differentiated: its in-place sums need no graph
            grads = _backward(ctx.plan, q, k, v, out, lse, d_out, ctx.group, ctx.rank, segments, ctx.visible)
        if torch.is_grad_enabled():  # a graph of the gradient is recorded: a second order must not come out zero
            grads = _FirstOrderOnly.apply(ctx.plan.op_name, *grads, q, k, v, d_out)
        return (*grads, None, None, None, None, None)


class _FunctorchRing(_Ring):
    """`_Ring` in the form torch.func's transforms require (forward and setup_context apart; the LSE a second,
    non-differentiable output), applied only while one is active (see `commlib_torch._op.FunctorchPlanFunction`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: spec.RingPlan,
        group: dist.ProcessGroup | None,
        rank: int,
        segments: torch.Tensor | None = None,
        visible: Visible = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(plan, q, k, v, group, rank, segments, visible)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, plan, group, rank, segments, visible = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.plan, ctx.group, ctx.rank, ctx.visible = plan, group, rank, visible
        ctx.save_for_backward(q, k, v, out, lse, segments)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: spec.RingPlan,
        group: dist.ProcessGroup | None,
        rank: int,
        segments: torch.Tensor | None = None,
        visible: Visible = None,
    ) -> NoReturn:
        raise frontend_errors.no_vmap(plan.op_name)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, d_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return _Ring.backward(ctx, d_out)


class _JointRing(torch.autograd.Function):
    """The ring walk with joint tensors (`commlib.ring.forward`'s ``joint``): ``(out, lse, joint_out,
    joint_lse)``, the LSEs not differentiable; backward `commlib.ring.backward` from the saved inputs, outputs
    and LSEs (the form torch.func's transforms take, forward and setup_context apart)."""

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        joint_q: torch.Tensor,
        joint_k: torch.Tensor,
        joint_v: torch.Tensor,
        plan: spec.RingPlan,
        group: dist.ProcessGroup | None,
        rank: int,
    ) -> tuple[torch.Tensor, ...]:
        backend = _RankBackend(plan, group, rank, q.device)
        return spec.forward(plan, backend, q, k, v, joint=(joint_q, joint_k, joint_v))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        *tensors, plan, group, rank = inputs
        out, lse, joint_out, joint_lse = output
        ctx.mark_non_differentiable(lse, joint_lse)
        ctx.plan, ctx.group, ctx.rank = plan, group, rank
        ctx.save_for_backward(*tensors, out, lse, joint_out, joint_lse)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, d_lse: Any, d_joint_out: torch.Tensor, d_joint_lse: Any) -> tuple:
        q, k, v, joint_q, joint_k, joint_v, out, lse, joint_out, joint_lse = ctx.saved_tensors
        backend = _RankBackend(ctx.plan, ctx.group, ctx.rank, q.device)
        with torch.no_grad():  # the walk is not differentiated: its in-place sums need no graph
            joint = (joint_q, joint_k, joint_v, joint_out, joint_lse, d_joint_out)
            grads = spec.backward(ctx.plan, backend, q, k, v, out, lse, d_out, joint=joint)
        if torch.is_grad_enabled():  # a graph of the gradient is recorded: a second order must not come out zero
            inputs = (q, k, v, joint_q, joint_k, joint_v, d_out, d_joint_out)
            grads = (
                *_FirstOrderOnly.apply(ctx.plan.op_name, *grads[:3], *inputs),
                *_FirstOrderOnly.apply(ctx.plan.op_name, *grads[3:], *inputs),
            )
        return (*grads, None, None, None)


def _joint_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    plan: spec.RingPlan,
    group: dist.ProcessGroup | None,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, joint_out)`` of the ring over `group` with the joint tensors `joint` (the heads it walks)."""
    out, _, joint_out, _ = _JointRing.apply(q, k, v, *joint, plan, group, rank)
    return out, joint_out


def _visibility(
    plan: spec.RingPlan, segments: torch.Tensor | None, group: dist.ProcessGroup | None, rank: int
) -> list[list[bool]] | None:
    """The call's skip decisions (`commlib.ring.visible_pieces`, computed where the ids live) as Python bools:
    one host read per call, for the forward and the backward. None without segment ids, and under Dynamo
    (the walk then selects on device, `_RankBackend.when_visible`)."""
    if segments is None or torch.compiler.is_compiling():
        return None
    backend = _RankBackend(plan, group, rank, segments.device)
    table = spec.visible_pieces(plan, _MATH, segments, rank, key_mask=backend.key_mask)
    flat = [entry for row in table for entry in row]
    read = torch.stack(flat).tolist() if flat else []  # the one host read
    rows, start = [], 0
    for row in table:
        rows.append(read[start : start + len(row)])
        start += len(row)
    return rows


def _ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: spec.RingPlan,
    group: dist.ProcessGroup | None,
    rank: int,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ring over `group` (segments: this rank's ids ``[B, rows]``, all-gathered here once, for every block)."""
    if segments is not None:
        segments = all_gather(segments[None], 0, group)  # [W, B, rows]: integers, no gradient
    visible = _visibility(plan, segments, group, rank)
    if transforms_active():
        return _FunctorchRing.apply(q, k, v, plan, group, rank, segments, visible)[0]
    return _Ring.apply(q, k, v, plan, group, rank, segments, visible)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` ``[B, S_r, h, D]`` with zero rows appended up to `rows` (an uneven layout's shard, held padded to
    ``max_size`` while it walks; the gradient of the padding is dropped by autograd); segment ids ``[B, S_r]``
    padded with -1 (padding)."""
    if x.shape[1] == rows:
        return x
    if x.dim() == 2:
        return torch.nn.functional.pad(x, (0, rows - x.shape[1]), value=-1)
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, rows - x.shape[1]))


def _shard_index(layout: str | SequenceLayout, ring_rank: int, ulysses_rank: int = 0) -> int | None:
    """This rank's shard index ``r * U + u`` in a `SequenceLayout` (None for a layout string)."""
    return ring_rank * layout.ulysses_size + ulysses_rank if isinstance(layout, SequenceLayout) else None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str | SequenceLayout = "contiguous",
    segment_ids: torch.Tensor | None = None,
    mask: MaskRule | None = None,
    joint_q: torch.Tensor | None = None,
    joint_k: torch.Tensor | None = None,
    joint_v: torch.Tensor | None = None,
    joint_position: str = "front",
) -> Any:
    """Attention over the whole sequence for sequence-sharded inputs, k and v passed around a ring: q ``[B, S/W,
    H, D]``, k ``[B, S/W, H_kv, D]``, v ``[B, S/W, H_kv, D_v]`` -> ``[B, S/W, H, D_v]``, q's dtype. With
    `joint_q`, `joint_k`, `joint_v`: ``(out, joint_out)``.

    Args:
        q, k, v: this rank's shard of the sequence: rank r holds the global positions
            ``commlib.shard_positions(S, W, layout)[r]`` (``commlib.shard_sequence`` cuts a whole array so).
            ``H % H_kv == 0`` (MHA, GQA, MQA): q head i uses kv head ``i // (H // H_kv)``.
        group: the process group of the ring (None: WORLD), a 1-D DeviceMesh or ``(mesh, dim_name)``; W its size.
        causal: a query sees the keys at global positions <= its own.
        scale: the softmax scale (default ``1 / sqrt(D)``).
        layout: "contiguous" (rank r holds rows ``[r*S/W, (r+1)*S/W)``) or "zigzag" (chunks r and 2W-1-r of
            2W: every rank does the same causal work); or a `commlib.SequenceLayout` (``ring_size == W``) for
            any length: rank r holds exactly ``layout.sizes[r]`` rows (``layout.positions(r)``; some may hold
            none) and gets that many output rows. Uneven shards travel padded to the largest with the padding
            keys masked; a query row that sees no key outputs 0 with gradient 0.
        segment_ids: integers ``[B, S/W]`` laid out as q (this rank's rows; ``commlib.segment_ids`` builds a
            row): a query sees a key only when their ids are equal (and, with causal, its position is not
            after the query's); a negative id is padding, seeing and seen by nothing. Every ring block's ids are
            all-gathered once per call (``[W, B, S/W]``; nothing of them travels with k and v), the pieces
            none of whose queries sees any of its keys are decided from them once (`commlib.ring.visible_pieces`,
            on the ids' device, read to the host once per call: the backward reuses it) and skipped; under
            ``torch.compile`` such a piece is computed and discarded (``torch.where``: no graph break, the same
            values). No gradient.
        mask: a rule on global positions (`commlib.masks.BlockCausal`: frame-causal with a block size;
            `commlib.masks.SlidingWindow`: a causal window, transformers' ``sliding_window``), ANDed with
            `causal` and `segment_ids`. The plan classifies every pair of position runs of a (q block, kv block)
            pair on the host once (`commlib.ring.ring_plan`): the pairs it masks entirely are skipped, those it
            leaves whole run unmasked, the rest masked by the rule's dense mask of the pair (no host read per
            call, no graph break).
        joint_q, joint_k, joint_v: joint attention (MMDiT: SD3, Flux; `commlib.joint`): ``[B, S_j, H, D]``,
            ``[B, S_j, H_kv, D]``, ``[B, S_j, H_kv, D_v]`` (q, k, v's heads and head dims and dtype), the same on
            every rank (the text tokens), all three or none. The joint tokens attend and are attended as if
            concatenated with the full sequence at `joint_position`; the call returns ``(out, joint_out)``,
            ``joint_out`` ``[B, S_j, H, D_v]`` bit for bit the same on every rank. Each rank attends its q rows to
            the joint k/v locally (one more piece of the online softmax, nothing sent), and the joint q to its own
            k/v block and to the joint k/v; the joint q's partials ``(out, lse)`` are all-gathered over the group
            and merged in rank order, the same on every rank (`commlib.ring.forward`). Gradient
            (``convention="sum"``, rank r's loss its own): the cotangents of every rank's joint_out are summed
            (one all-reduce) for the joint q's attention to the k/v blocks; rank r's d joint_q, d joint_k,
            d joint_v are its part -- its q rows' attention to the joint k/v, and the joint q's attention to the
            joint k/v with rank r's own cotangent -- so summed over the ranks they are the full gradient
            (``sync_gradients`` of the replicated text branch). Not with `segment_ids`, `mask` or an uneven
            `commlib.SequenceLayout`.
        joint_position: "front" (``[joint | sequence]``, text first as SD3 and Flux) or "rear"
            (``[sequence | joint]``); with `causal` the mask follows the concatenation's positions (front: every
            query sees the joint tokens, which see only each other; rear: they see everything, the sequence
            none of them).

    W steps: at step t a rank attends with the k/v block of rank ``r - t`` (skipping the pieces the causal
    mask hides, `commlib.ring.ring_plan`) and merges with the log-sum-exp (in float32 for half inputs,
    float64 for float64); W - 1 sends of k and v, unrepeated (``B * S/W * H_kv * (D + D_v)`` elements a step),
    each begun before the step's pieces and waited after them (asynchronous c10d work; docs/attention.md,
    "Overlap"). Gradient: exact; the backward recomputes the scores blockwise from the saved LSE and passes dk/dv
    around the ring behind k/v (W sends, dk/dv in the compute dtype). Saved for backward: q, k, v, the
    output and the LSE (``[B, S/W, H]``).

    On one rank (WORLD of size 1) it is attention on the whole sequence; with W ranks each passes its shard
    ``commlib.shard_sequence(x, 1, W, layout)[rank]`` of q, k and v and gets those rows of it:

    >>> import torch
    >>> from commlib_torch.attention import attention, ring_attention
    >>> q, k, v = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)  # GQA: 2 kv heads
    >>> out = ring_attention(q, k, v, causal=True, layout="zigzag")
    >>> out.shape
    torch.Size([2, 8, 4, 16])
    >>> torch.allclose(out, attention(q, k, v, causal=True), atol=1e-5)
    True
    >>> import commlib  # any length: a SequenceLayout (on W ranks rank r passes layout.shard(x, 1)[r])
    >>> q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    >>> out = ring_attention(q, k, v, causal=True, layout=commlib.SequenceLayout(7, layout="zigzag"))
    >>> torch.allclose(out, attention(q, k, v, causal=True), atol=1e-5)
    True
    >>> ids = torch.tensor(commlib.segment_ids([4, 2], 7)).expand(2, 7)  # two documents, then a padding token
    >>> out = ring_attention(q, k, v, causal=True, segment_ids=ids)
    >>> torch.allclose(out, attention(q, k, v, causal=True, segment_ids=ids), atol=1e-5), bool((out[:, 6] == 0).all())
    (True, True)
    >>> text = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)  # replicated
    >>> out, joint_out = ring_attention(q, k, v, causal=True, joint_q=text[0], joint_k=text[1], joint_v=text[2])
    >>> whole = attention(*(torch.cat([t, x], dim=1) for t, x in zip(text, (q, k, v))), causal=True)  # text first
    >>> torch.allclose(joint_out, whole[:, :3], atol=1e-5), torch.allclose(out, whole[:, 3:], atol=1e-5)
    (True, True)

    Raises:
        CommError: ndim != 4, q/k/v batch, seq or head_dim that disagree, H not divisible by H_kv, an unknown
            layout, an odd shard in the zigzag layout, a `SequenceLayout` whose ring_size is not W or whose
            ``sizes[rank]`` is not this rank's seq, unequal dtypes, segment_ids not ``[B, S/W]``, a rank outside
            `group`, a mask rule's block_size or window below 1; joint tensors given without the others, whose
            batch, heads or head_dim differ from q, k, v's or whose seq differ, whose dtype is not q's, with
            segment_ids, mask or an uneven layout, a `joint_position` not "front" or "rear".
        TypeError: wrong kinds (q, k, v, joint tensors, segment_ids not tensors, segment_ids not integers, causal
            not a bool, scale not a number, group, mask not a `commlib.masks.MaskRule`, joint_position not a str).
    """
    group = resolve_group(spec.RING_OP, group)
    rank = group_rank(group)
    plan = ring_call(
        LayerFrontend((group,), q),
        q,
        k,
        v,
        segment_ids,
        ring_size=world_size(spec.RING_OP, group),
        causal=causal,
        scale=scale,
        layout=layout,
        shard=_shard_index(layout, rank),
        mask=mask,
        joint_qkv=(joint_q, joint_k, joint_v),
        joint_position=joint_position,
    )
    if plan.joint is not None:
        assert joint_q is not None and joint_k is not None and joint_v is not None
        return _joint_ring(q, k, v, (joint_q, joint_k, joint_v), plan, group, rank)
    if not plan.masked:
        return _ring(q, k, v, plan, group, rank, segment_ids)
    segments = None if segment_ids is None else _padded(segment_ids, plan.rows)
    padded_q, padded_k, padded_v = (_padded(x, plan.rows) for x in (q, k, v))
    out = _ring(padded_q, padded_k, padded_v, plan, group, rank, segments)
    return out[:, : q.shape[1]]


def _heads_out(
    plan: spec.RingPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, ...]:
    """The plan's Ulysses all-to-alls (`commlib.ring.RingPlan.ulysses_exchanges`) of q, k, v: ``[B, S_r, H, D] ->
    [B, U * S_r, H / U, D]`` (ring block r, Ulysses rank u's heads); several inputs in one all-to-all have their
    heads stacked per destination in one local pass."""
    inputs = {"q": q, "k": k, "v": v}
    heads = {"q": plan.heads, "k": plan.kv_heads, "v": plan.kv_heads}
    for names in plan.ulysses_exchanges:
        if len(names) == 1:
            inputs[names[0]] = all_to_all_4d(inputs[names[0]], 2, 1, group)
            continue
        per_destination = [
            inputs[name].view(*q.shape[:2], plan.ulysses_size, heads[name], -1).permute(2, 0, 1, 3, 4) for name in names
        ]
        received = all_to_all(torch.cat(per_destination, dim=3), 0, 2, group)  # [1, B, U * S_r, h + 2 h_kv, D]
        inputs.update(zip(names, received[0].split([heads[name] for name in names], dim=2), strict=True))
    return inputs["q"], inputs["k"], inputs["v"]


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: Group,
    ring_group: Group,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str | SequenceLayout = "contiguous",
    segment_ids: torch.Tensor | None = None,
    mask: MaskRule | None = None,
    joint_q: torch.Tensor | None = None,
    joint_k: torch.Tensor | None = None,
    joint_v: torch.Tensor | None = None,
    joint_position: str = "front",
) -> Any:
    """USP (yunchang's LongContextAttention): Ulysses inside `ulysses_group` (U ranks), ring attention across
    `ring_group` (W ranks): q ``[B, S/(W U), H, D]``, k ``[B, S/(W U), H_kv, D]``, v ``[B, S/(W U), H_kv, D_v]``
    -> ``[B, S/(W U), H, D_v]``, q's dtype.

    The rank at Ulysses index u and ring index r holds shard ``r * U + u``: the positions
    ``commlib.shard_positions(S, W, layout, ulysses_size=U)[r * U + u]`` (piece u of ring block r). An
    `all_to_all` over `ulysses_group` gathers ring block r for heads ``[u H/U, (u+1) H/U)`` (and their kv heads:
    ``H % U == 0`` and ``H_kv % U == 0``), `ring_attention`'s walk runs over `ring_group` on it, and
    ``all_to_all_4d(out, 1, 2)`` returns ``[B, S/(W U), H, D_v]``. `causal`, `scale`, `layout` as in
    `ring_attention`; the gradient is exact (the all-to-alls' VJPs and the ring's backward). A
    `commlib.SequenceLayout` (``ring_size == W``, ``ulysses_size == U``) for any length: this rank holds
    exactly ``layout.sizes[r * U + u]`` rows; the shards travel padded to ``layout.max_size`` (the all-to-all
    then gathers ring block r as U padded pieces) with the padding masked. `segment_ids` (integers ``[B, S/(W U)]``
    laid out as q) as in `ring_attention`: all-gathered over `ulysses_group` into ring block r's ids, then
    every ring block's over `ring_group` (once per call). `mask` as in `ring_attention` (on the global positions:
    the ring's blocks are classified as ring block r's positions). `joint_q`, `joint_k`, `joint_v` and
    `joint_position` as in `ring_attention` (``(out, joint_out)``): after the all-to-all Ulysses rank u takes
    the same heads of the replicated joint tensors (``[u H/U, (u+1) H/U)`` and their kv heads: no
    communication), the ring runs with them over `ring_group`, and the joint output's heads are all-gathered
    over `ulysses_group` (rank order; its VJP the reduce-scatter). Gradient (``convention="sum"``): rank (u, r)'s
    d joint_* is its part, 0 outside its heads; summed over every rank of both groups, the full gradient.

    On one rank (Ulysses group and ring both WORLD of size 1) it is attention on the whole sequence, gradients
    included:

    >>> import torch
    >>> from commlib_torch.attention import attention, usp_attention
    >>> q, k, v = (torch.randn(1, 8, 4, 16, requires_grad=True) for _ in range(3))
    >>> out = usp_attention(q, k, v, None, None, causal=True)
    >>> dq, = torch.autograd.grad(out.sum(), q)
    >>> want, = torch.autograd.grad(attention(q, k, v, causal=True).sum(), q)
    >>> torch.allclose(out, attention(q, k, v, causal=True), atol=1e-5), torch.allclose(dq, want, atol=1e-5)
    (True, True)

    Raises:
        CommError: as `ring_attention` (its joint refusals included), and a Ulysses group larger than H, or H or
            H_kv not divisible by U, a `SequenceLayout` whose ulysses_size is not U.
        TypeError: wrong kinds.
    """
    ulysses_group, ring_group = (resolve_group(spec.USP_OP, g) for g in (ulysses_group, ring_group))
    ring_rank = group_rank(ring_group)
    plan = ring_call(
        LayerFrontend((ulysses_group, ring_group), q),  # the ranks of both groups compare the options first
        q,
        k,
        v,
        segment_ids,
        ring_size=world_size(spec.USP_OP, ring_group),
        ulysses_size=world_size(spec.USP_OP, ulysses_group),
        causal=causal,
        scale=scale,
        layout=layout,
        shard=_shard_index(layout, ring_rank, group_rank(ulysses_group)),
        mask=mask,
        joint_qkv=(joint_q, joint_k, joint_v),
        joint_position=joint_position,
    )
    if plan.joint is not None:
        assert joint_q is not None and joint_k is not None and joint_v is not None
        return _joint_usp(plan, (q, k, v), (joint_q, joint_k, joint_v), ulysses_group, ring_group)
    segments = segment_ids
    rows = q.shape[1]
    if plan.masked:  # every shard padded to max_size: the all-to-all gathers ring block r as the plan walks it
        q, k, v = (_padded(x, plan.rows // plan.ulysses_size) for x in (q, k, v))
        segments = None if segments is None else _padded(segments, plan.rows // plan.ulysses_size)
    local_q, local_k, local_v = _heads_out(plan, q, k, v, ulysses_group)
    if segments is not None and plan.ulysses_size > 1:  # ring block r's ids: the U shards' in order (integers)
        segments = all_gather(segments, 1, ulysses_group)
    out = _ring(local_q, local_k, local_v, plan, ring_group, ring_rank, segments)
    out = out if plan.ulysses_size == 1 else all_to_all_4d(out, 1, 2, ulysses_group)
    return out[:, :rows] if plan.masked else out


def _joint_usp(
    plan: spec.RingPlan,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """USP with joint tensors: the all-to-all, this Ulysses rank's heads of the joint tensors
    (`commlib.ring.RingPlan.joint_head_starts`), the joint ring, the all-to-all back and the joint output's heads
    all-gathered over `ulysses_group`."""
    q_start, kv_start = plan.joint_head_starts[group_rank(ulysses_group)].tolist()
    heads = (plan.heads, plan.kv_heads, plan.kv_heads)
    starts = (q_start, kv_start, kv_start)
    joint_q, joint_k, joint_v = (x.narrow(2, start, n) for x, start, n in zip(joint, starts, heads, strict=True))
    mine = (joint_q, joint_k, joint_v)
    local_q, local_k, local_v = _heads_out(plan, *qkv, ulysses_group)
    out, joint_out = _joint_ring(local_q, local_k, local_v, mine, plan, ring_group, group_rank(ring_group))
    if plan.ulysses_size == 1:
        return out, joint_out
    return all_to_all_4d(out, 1, 2, ulysses_group), all_gather(joint_out, 2, ulysses_group)
