"""Ulysses sequence-parallel attention over `torch.distributed`: any sequence length, any head count, GQA/MQA;
ring attention and USP (`commlib_torch.ring`) past the head count.

The spec decides everything: `commlib.layer_call.ulysses_call` checks the call and plans it (the heads each
rank attends with, the kv heads it receives, the sizes of the collectives), `commlib.ulysses.walk` walks the
head groups in pipeline order. This module is the walk's backend (`_Backend`): a send buffer in one local
pass, the all-to-alls begun with ``async_op=True`` where the walk overlaps (``chunks > 1``: a
`commlib_torch.Handle`, whose backward is asynchronous too), SDPA for the attention.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commlib import attention as spec
from commlib.layer_call import ulysses_call
from commlib.masks import MaskRule, rule_mask, segment_mask
from commlib.sequence import SequenceLayout
from commlib.ulysses import Finished, Pending, walk
from commlib_torch import _kernels
from commlib_torch._checked import LayerFrontend
from commlib_torch._dtypes import dtype_name
from commlib_torch._groups import GroupArgument, ResolvedGroup, resolve_group, world_size
from commlib_torch._op import transforms_active
from commlib_torch.cross_attention import cross_attention
from commlib_torch.functional import all_gather, all_to_all, all_to_all_4d
from commlib_torch.ring import nan_free, nan_rows, ring_attention, usp_attention

__all__ = ["attention", "ulysses_attention", "ring_attention", "usp_attention", "cross_attention"]

AttentionFn = Callable[..., torch.Tensor]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
    mask: MaskRule | None = None,
) -> torch.Tensor:
    """SDPA (``torch.nn.functional.scaled_dot_product_attention``) on ``[B, S, H, D]``: q ``[B, S, H, D]``,
    k ``[B, S, H_kv, D]``, v ``[B, S, H_kv, D_v]`` -> ``[B, S, H, D_v]``, q head i using kv head
    ``i // (H // H_kv)`` (SDPA's ``enable_gqa``); `causal`: position i sees positions <= i; `scale` defaults
    to ``1 / sqrt(D)``; `segment_ids` (integers ``[B, S]``): position i sees position j only when their ids are
    equal, a negative id (padding) sees and is seen by nothing, and a row that sees nothing outputs 0 with
    gradient 0; `mask` (a `commlib.masks.MaskRule`: `commlib.masks.BlockCausal`, `SlidingWindow`) masks by
    the positions ``0 .. S - 1`` as well (ANDed). A NaN in q, or in a key a row sees, makes that row NaN
    (SDPA's CPU flash kernel alone would give a row whose every score is NaN 0); a NaN in a key no row of it
    sees (padding, masked) changes nothing: the kernel never sees it. The default `attn_fn` of
    `ulysses_attention`. On CUDA, segment ids without a `mask` rule run query block by query block on the
    memory-efficient kernel (`commlib_torch._kernels.segment_attention`: one block's mask ``[B, rows, S]`` at a
    time, never ``[B, S, S]``); elsewhere SDPA with the ``[B, S, S]`` mask.

    Example:
        >>> q, k, v = torch.ones(1, 4, 8, 16), torch.ones(1, 4, 2, 16), torch.ones(1, 4, 2, 32)  # 4 q heads per kv
        >>> attention(q, k, v, causal=True).shape
        torch.Size([1, 4, 8, 32])
        >>> attention(q, k, v, segment_ids=torch.tensor([[0, 0, 1, -1]]))[0, :, 0, 0].tolist()  # padding: 0
        [1.0, 1.0, 1.0, 0.0]
        >>> from commlib.masks import SlidingWindow
        >>> attention(q, k, v, mask=SlidingWindow(2)).shape  # position i sees i - 1 and i
        torch.Size([1, 4, 8, 32])
    """
    if segment_ids is not None and mask is None:
        kernel = _kernels.choose(q.device.type, dtype_name(q.dtype), q.shape[-1], v.shape[-1], "array")
        if kernel in ("flash", "efficient"):  # CUDA: query blocks on the efficient kernel, never a [B, S, S] mask
            return _segmented(q, k, v, segment_ids, causal, scale, kernel)
    query, key, value = (x.transpose(1, 2) for x in (*nan_free(q, k), v))  # NaNs put back by `nan_rows`
    gqa = q.shape[2] != k.shape[2]
    if segment_ids is None and mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale, enable_gqa=gqa)
        return nan_rows(q, k, "causal-diagonal" if causal else "full", out.transpose(1, 2))[0]
    positions = torch.arange(q.shape[1], device=q.device)
    visible = rule_mask(positions, positions, causal, mask)[None]  # [1, S, S]
    if segment_ids is not None:
        visible = visible & segment_mask(segment_ids, segment_ids)  # [B, S, S]
    allowed = visible
    seen = allowed.any(-1)  # a row that sees nothing is given every key (finite, harmless), then zeroed
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=(allowed | ~seen[..., None])[:, None], scale=scale, enable_gqa=gqa
    )
    return nan_rows(q, k, allowed, torch.where(seen[:, :, None, None], out.transpose(1, 2), 0.0))[0]


def _segmented(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor,
    causal: bool,
    scale: float | None,
    kernel: _kernels.Kernel,
    rows: int | None = None,
) -> torch.Tensor:
    """`attention` with segment ids on a fused kernel, query block by query block
    (`commlib_torch._kernels.segment_attention`), the NaN rule applied per block too: what it holds is one
    block's mask ``[B, rows, S]``, never ``[B, S, S]`` (the CUDA path; the CPU tests run it on the CPU kernel)."""
    query, key = nan_free(q, k)
    out = _kernels.segment_attention(query, key, v, segment_ids, causal=causal, scale=scale, kernel=kernel, rows=rows)
    rows = _kernels.block_rows(q.shape[0], q.shape[1]) if rows is None else rows
    blocks = [slice(start, start + rows) for start in range(0, q.shape[1], rows)]
    seen = (_kernels.block_seen(segment_ids, block, causal) for block in blocks)
    return torch.cat([nan_rows(q[:, b], k, s, out[:, b])[0] for b, s in zip(blocks, seen, strict=True)], 1)


def _select(runs: tuple[tuple[int, int, int], ...], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows ``[start, stop)`` of input ``index`` for each run, concatenated (one local pass)."""
    return torch.cat([inputs[index][start:stop] for index, start, stop in runs], dim=0)


class _SelectHeads(torch.autograd.Function):
    """The send buffer of a `commlib.attention.Exchange`: slices of the heads-first inputs concatenated (one
    local pass). Backward: each slice's cotangent added back into the heads it came from."""

    @staticmethod
    def forward(ctx: Any, runs: tuple[tuple[int, int, int], ...], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.runs, ctx.shapes = runs, [tuple(x.shape) for x in inputs]
        return _select(runs, inputs)

    @staticmethod
    def backward(ctx: Any, cotangent: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # zeros laid out as the user's [B, S_r, n, D] tensors, seen heads first: the gradients come out contiguous
        grads = [cotangent.new_zeros((*shape[1:3], shape[0], *shape[3:])).permute(2, 0, 1, 3) for shape in ctx.shapes]
        offset = 0
        for index, start, stop in ctx.runs:
            grads[index][start:stop] += cotangent[offset : offset + stop - start]
            offset += stop - start
        return None, *grads


class _FunctorchSelectHeads(_SelectHeads):
    """`_SelectHeads` in the form torch.func's transforms require (see `commlib_torch._op.FunctorchPlanFunction`)."""

    @staticmethod
    def forward(runs: tuple[tuple[int, int, int], ...], *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _select(runs, inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        runs, *tensors = inputs
        ctx.runs, ctx.shapes = runs, [tuple(x.shape) for x in tensors]


def _sizes(scatter_sizes: tuple[int, ...] | None, gather_sizes: tuple[int, ...] | None) -> dict:
    """The uneven keywords of a collective (left out where the spec says even)."""
    sizes = dict(scatter_sizes=scatter_sizes, gather_sizes=gather_sizes)
    return {key: value for key, value in sizes.items() if value is not None}


def _start(collective: Callable[..., Any], x: torch.Tensor, *args: Any, overlap: bool, **kwargs: Any) -> Pending:
    """Start ``collective(x, *args, **kwargs)`` (a differentiable all-to-all): with `overlap` begun with
    ``async_op=True`` (a `commlib_torch.Handle`, whose backward begins the dual all-to-all when the cotangent
    arrives and waits for it where the input's gradient is needed); without it run here."""
    if overlap:
        return collective(x, *args, async_op=True, **kwargs)
    return Finished(collective(x, *args, **kwargs))


class _Backend(LayerFrontend):
    """`commlib.ulysses.UlyssesBackend` over a process group (and the call path's `LayerFrontend`)."""

    def __init__(self, group: ResolvedGroup, q: object, attn_fn: AttentionFn | None) -> None:
        super().__init__((group,), q)
        self.group, self.attn_fn = group, attn_fn

    def start_exchange(self, exchange: spec.Exchange, inputs: Mapping[str, torch.Tensor], overlap: bool) -> Pending:
        sizes = _sizes(exchange.scatter_sizes, exchange.gather_sizes)
        return _start(all_to_all, _send_buffer(exchange, inputs), 0, 2, self.group, overlap=overlap, **sizes)

    def gather_segments(self, segment_ids: torch.Tensor, sizes: tuple[int, ...] | None) -> torch.Tensor:
        return all_gather(segment_ids, 1, self.group, sizes=sizes)

    def attend(
        self, plan: spec.UlyssesPlan, group: spec.HeadGroup, local: Mapping[str, torch.Tensor], masks: Mapping
    ) -> torch.Tensor:
        if group.local_heads == 0:  # no heads here: an empty output that reads every received block (`HeadGroup`)
            empty = [x.permute(1, 2, 0, 3) for x in (local["q"], local["k"], local["v"])]
            return empty[2] + empty[0].sum(-1, keepdim=True) + empty[1].sum(-1, keepdim=True)
        keys, values = local["k"], local["v"]
        if group.kv_index is not None:  # this rank's q heads do not group evenly over its kv heads
            index = torch.tensor(group.kv_index[0], device=keys.device)
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        bshd = [x.permute(1, 2, 0, 3) for x in (local["q"], keys, values)]
        return (self.attn_fn or attention)(*bshd, causal=plan.causal, scale=plan.scale, **masks)

    def start_output(
        self,
        out: torch.Tensor,
        scatter_sizes: tuple[int, ...] | None,
        gather_sizes: tuple[int, ...] | None,
        overlap: bool,
    ) -> Pending:
        return _start(all_to_all_4d, out, 1, 2, self.group, overlap=overlap, **_sizes(scatter_sizes, gather_sizes))

    def concat_heads(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(outputs, dim=2)

    def joint_heads(self, x: torch.Tensor, heads: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        row = heads[0]  # the exact layout: this rank's heads, a contiguous run
        return x.narrow(2, row[0] if row else 0, len(row)).permute(2, 0, 1, 3)

    def concat_seq(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=2)

    def gather_heads(self, x: torch.Tensor, sizes: tuple[int, ...] | None) -> torch.Tensor:
        return all_gather(x, 2, self.group, sizes=sizes)


def _send_buffer(exchange: spec.Exchange, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The exchange's send buffer ``[C, B, S_r, D]``: the heads-first inputs' runs concatenated (one local pass)."""
    position = {name: index for index, name in enumerate(exchange.inputs)}
    runs = tuple((position[name], start, stop) for name, start, stop in exchange.send_runs)
    select = _FunctorchSelectHeads if transforms_active() else _SelectHeads
    return select.apply(runs, *(inputs[name].permute(2, 0, 1, 3) for name in exchange.inputs))


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupArgument = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    seq_sizes: Sequence[int] | None = None,
    attn_fn: AttentionFn | None = None,
    layout: str | SequenceLayout = "contiguous",
    segment_ids: torch.Tensor | None = None,
    chunks: int = 1,
    joint_q: torch.Tensor | None = None,
    joint_k: torch.Tensor | None = None,
    joint_v: torch.Tensor | None = None,
    joint_position: str = "front",
    mask: MaskRule | None = None,
) -> Any:
    """Attention over the full sequence for sequence-sharded inputs (Ulysses): q ``[B, S_r, H, D]``, k ``[B, S_r,
    H_kv, D]``, v ``[B, S_r, H_kv, D_v]`` -> ``[B, S_r, H, D_v]``, q's dtype; equal to `attention` on the inputs
    concatenated along seq, cut back the same way. With `joint_q`, `joint_k`, `joint_v`: ``(out, joint_out)``.

    Args:
        q, k, v: this rank's rows of the sequence, rank r holding rows ``seq_sizes[r]`` (exactly: torch keeps a
            sharded dim at this rank's size). ``H % H_kv == 0`` (MHA, GQA, MQA); any H, H_kv and world size W.
        group: the process group (None: WORLD), a 1-D DeviceMesh or ``(mesh, dim_name)``; W is its size.
        causal: a query sees the keys at global positions <= its own.
        scale: the softmax scale (default ``1 / sqrt(D)``).
        seq_sizes: W ints, every rank's row count (e.g. ``commlib.split_sizes(S, W)``); None: all equal.
        attn_fn: ``attn_fn(q, k, v, *, causal, scale) -> out`` on ``[B, S, h, D]`` / ``[B, S, h_kv, D]`` (q head i
            using kv head ``i // (h // h_kv)``), e.g. a flash-attention wrapper; default `attention` (SDPA).
        layout: "contiguous" (rank order, `seq_sizes` as given), or a `commlib.SequenceLayout` of W shards
            holding the sequence in rank order (``ring_size == 1`` or contiguous): ``seq_sizes=layout.sizes``.
        segment_ids: integers ``[B, S_r]`` laid out as q (``commlib.segment_ids`` builds a row): a query sees a
            key only when their ids are equal; a negative id is padding (sees and is seen by nothing: output 0,
            gradient 0). All-gathered over the group (integers, no gradient) and given to `attn_fn` as
            ``segment_ids=`` (``[B, S]``), which must then accept it.
        chunks: head groups, pipelined (DESIGN "Overlap"): an int from 1 to ``ceil(H / W)`` (the most q heads
            a rank attends with). Group c holds piece c of ``commlib.split_sizes(h_r, chunks)`` of rank r's
            ``h_r`` q heads and exactly the kv heads those use; it has its own all-to-all in (``[B, S_r, *, D]``
            heads -> ``[B, S, h_rc + 2 kv_rc, D]``), attention and all-to-all out (``[B, S, h_rc, D_v] ->
            [B, S_r, sum_r h_rc, D_v]``). Group c + 1's all-to-all is started before group c's attention and
            group c's output all-to-all before group c + 1's attention. A head's attention is the same
            arithmetic in any group, so the output equals ``chunks=1``'s bit for bit; so do dq, dk and dv where
            the attention's backward computes a head alike whatever the head count (SDPA on CPU: float32, not
            float64) and no kv head serves q heads of two groups (MHA; GQA whose groups keep a kv head's q
            heads together), else they equal it to rounding. With MQA / GQA a kv head is sent once per group
            that uses it.
        joint_q, joint_k, joint_v: joint attention (MMDiT: SD3, Flux; `commlib.joint`): ``[B, S_j, H, D]``,
            ``[B, S_j, H_kv, D]``, ``[B, S_j, H_kv, D_v]`` (the main tensors' heads and head dims), the same on
            every rank (the text tokens), all three or none. The joint tokens attend and are attended as if
            concatenated with the full sequence at `joint_position`; the call returns ``(out, joint_out)``,
            ``joint_out`` ``[B, S_j, H, D_v]`` bit for bit the same on every rank. Each rank takes its q heads of
            them (and the kv heads those use) locally after the all-to-all, attends over the concatenation and
            all-gathers the joint rows of its heads (``commlib.split_sizes(H, W)``, rank order). Gradient
            (``convention="sum"``): the cotangents of every rank's joint_out are summed; rank r's d joint_q is
            the gradient in the q heads rank r attends with (0 in the others), its d joint_k, d joint_v what
            those heads give their kv heads: summed over the ranks, the full gradient (``sync_gradients``).
            Not with `segment_ids` or `mask`.
        joint_position: "front" (``[joint | sequence]``, text first as SD3 and Flux) or "rear"
            (``[sequence | joint]``); with `causal` the mask follows the concatenation's positions.
        mask: a rule on global positions (`commlib.masks.BlockCausal`: frame-causal; `SlidingWindow`: a causal
            window, transformers' ``sliding_window``), ANDed with `causal` and `segment_ids`; the gathered
            sequence holds the positions ``0 .. S - 1`` and `attn_fn` is given it as ``mask=``. Nothing of it
            is sent.

    Rank r attends with the q heads ``commlib.split_sizes(H, W)`` gives it and receives exactly the kv heads
    those use (a kv head shared by two ranks' q heads goes to both). q, k and v travel in one all-to-all (two
    when v's head dim differs from q's), the output in one (per head group). Gradient: exact, through both
    all-to-alls (their VJPs are the reverse all-to-alls; a kv head sent to two ranks gets both cotangents).

    Raises:
        CommError: ndim != 4, q/k/v batch, seq or head_dim that disagree, H not divisible by H_kv, bad
            `seq_sizes` (length, negative, this rank's seq not ``seq_sizes[rank]``), a `layout` of another world
            size, "zigzag" or not in rank order, or whose sizes are not `seq_sizes`, unequal dtypes, segment_ids
            not ``[B, S_r]``, a rank outside `group`, a mesh dim that does not exist, `chunks` below 1 or above
            the most q heads a rank attends with (the message gives the head counts), a mask rule's block_size
            or window below 1; joint tensors given without the others, whose batch, heads or head_dim differ
            from q, k, v's or whose seq differ, whose dtype is not q's, with segment_ids or mask, a
            `joint_position` not "front" or "rear".
        TypeError: wrong kinds (q, k, v, joint tensors, segment_ids not tensors, segment_ids not integers, causal
            not a bool, scale not a number, group, chunks not an int, mask not a `commlib.masks.MaskRule`,
            joint_position not a str).

    Example:
        >>> q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)  # this rank's rows
        >>> out = ulysses_attention(q, k, v, causal=True)  # WORLD (W = 1 here): the full sequence is these rows
        >>> torch.allclose(out, attention(q, k, v, causal=True), atol=1e-6)
        True
        >>> torch.equal(ulysses_attention(q, k, v, causal=True, chunks=2), out)  # heads 0-1, then 2-3
        True
        >>> text = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)  # replicated
        >>> out, joint_out = ulysses_attention(q, k, v, joint_q=text[0], joint_k=text[1], joint_v=text[2])
        >>> whole = attention(*(torch.cat([t, x], dim=1) for t, x in zip(text, (q, k, v))))  # text first
        >>> torch.allclose(joint_out, whole[:, :3], atol=1e-6), torch.allclose(out, whole[:, 3:], atol=1e-6)
        (True, True)
    """
    group = resolve_group(spec.OP_NAME, group)
    backend = _Backend(group, q, attn_fn)
    plan = ulysses_call(
        backend,
        q,
        k,
        v,
        segment_ids,
        world_size=world_size(spec.OP_NAME, group),
        rank=dist.get_rank(group),
        causal=causal,
        scale=scale,
        seq_sizes=seq_sizes,
        attn_fn=attn_fn,
        layout=layout,
        chunks=chunks,
        joint_qkv=(joint_q, joint_k, joint_v),
        joint_position=joint_position,
        mask=mask,
    )
    inputs: dict[str, torch.Tensor | None] = {"q": q, "k": k, "v": v}
    if plan.joint is not None:
        inputs |= {"joint_q": joint_q, "joint_k": joint_k, "joint_v": joint_v}
    return walk(backend, plan, inputs, segment_ids)
