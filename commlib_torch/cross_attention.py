"""`cross_attention` over `torch.distributed`: sequence-sharded queries attending replicated or sharded keys and
values. The spec (`commlib.cross_attention`) validates, plans and walks; this module is the walk's backend:
commlib's differentiable ``all_gather`` for a sharded kv, SDPA for the local attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commlib import cross_attention as spec
from commlib_torch._dtypes import dtype_name
from commlib_torch._groups import GroupArgument, ResolvedGroup, resolve_group, world_size
from commlib_torch.functional import all_gather

__all__ = ["cross_attention"]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA of q ``[B, Sq, H, D]`` over k, v ``[B, S_kv, H_kv, D]`` with `spec.visible`'s mask: padding keys
    zeroed first (gradient 0), rows that see no key given every key (finite) and then zeroed (gradient 0)."""
    if kv_ids is not None:
        keep = (kv_ids >= 0)[:, :, None, None]
        k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    group = q.shape[2] // k.shape[2]
    if k.shape[1] == 0:  # no key anywhere: zeros, still a function of q, k and v (gradients 0, not None)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2))
        return torch.einsum("bhqk,bkhd->bqhd", scores, v.repeat_interleave(group, 2))
    query, key, value = (x.transpose(1, 2) for x in (q, k, v))
    mask = spec.visible(q_ids, kv_ids)
    if mask is None:
        return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=group > 1).transpose(1, 2)
    mask = mask.expand(q.shape[0], q.shape[1], k.shape[1])
    seen = mask.any(-1)
    attn_mask = (mask | ~seen[..., None])[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=group > 1)
    return torch.where(seen[:, :, None, None], out.transpose(1, 2), 0.0)


class _Backend:
    """`commlib.cross_attention.CrossBackend` over a process group."""

    def __init__(self, group: ResolvedGroup) -> None:
        self.group = group

    def gather(self, x: torch.Tensor, sizes: tuple[int, ...] | None) -> torch.Tensor:
        return all_gather(x, 1, self.group, sizes=sizes)

    def concat(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([k, v], dim=-1)

    def split(self, kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return kv[..., :head_dim], kv[..., head_dim:]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        q_ids: torch.Tensor | None,
        kv_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        return _attend(q, k, v, scale, q_ids, kv_ids)


def _ids(ids: torch.Tensor | None) -> tuple[tuple[int, ...], str] | None:
    return None if ids is None else (tuple(ids.shape), dtype_name(ids.dtype))


def cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupArgument = None,
    *,
    kv: str = "replicated",
    scale: float | None = None,
    kv_sizes: Sequence[int] | None = None,
    segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-attention of this rank's sequence-sharded queries to keys and values from elsewhere (a DiT's text
    encoder states): q ``[B, Sq_r, H, D]``, k ``[B, S_kv(_r), H_kv, D]``, v ``[B, S_kv(_r), H_kv, D_v]`` ->
    ``[B, Sq_r, H, D_v]``, q's dtype; every query row attends the FULL kv, so the result is `attention` of this
    rank's rows to the whole kv, and q's rows may be any count on any rank (no positions, no causal mask).

    Args:
        q: this rank's query rows, as the layers' q (e.g. a shard of the video tokens). ``H % H_kv == 0``.
        k, v: ``kv="replicated"``: the whole kv, the same on every rank. ``kv="sharded"``: this rank's rows of
            it (exactly ``kv_sizes[rank]`` rows; a shard may be empty), in rank order.
        group: the process group (None: WORLD), a 1-D DeviceMesh or ``(mesh, dim_name)``; W is its size.
        kv: "replicated": local attention, NO communication. "sharded": ``[k | v]`` (concatenated along the head
            dim) all-gathered once with commlib's ``all_gather(..., sizes=kv_sizes)`` along seq, and the kv
            segment ids (integers, no gradient) in a second gather; then local attention.
        scale: the softmax scale (default ``1 / sqrt(D)``).
        kv_sizes: ``kv="sharded"``: W ints, every rank's kv rows; None: every rank holds as many as this one.
        segment_ids: integers ``[B, Sq_r]`` (q's): a negative id is a padding query (output 0, gradient 0).
        kv_segment_ids: integers ``[B, S_kv]`` (replicated) or ``[B, S_kv_r]`` (sharded, laid out as k): a
            negative id is a padding key (padded text): seen by nothing, its dk, dv exactly 0. With both ids a query
            sees a key only when they are equal; a side left out matches every non-negative id of the other.

    A row that sees no key (every key padding, or S_kv = 0) outputs 0 with gradient 0. Gradient (the layers'
    ``convention="sum"``: rank r's loss is its own): dq exact on every rank; "sharded": dk, dv of this rank's rows
    are the sum over ranks of the cotangents of those rows (the all_gather's VJP, a reduce-scatter);
    "replicated": dk, dv are this rank's share (summed over the ranks they are the full gradient: the replicated
    parameters' ``sync_gradients`` does it, or ``sum_grad(k, group)`` gives it on every rank).

    Raises:
        CommError: q, k, v not 4-D, batch / head counts / head dims that disagree (H not divisible by H_kv), k and
            v rows unequal, `kv` not "replicated" or "sharded", kv_sizes with ``kv="replicated"``, bad kv_sizes
            (length, negative, this rank's k rows not ``kv_sizes[rank]``), segment ids not ``[B, Sq_r]`` /
            ``[B, S_kv(_r)]``, unequal or non-floating dtypes, non-finite scale. Before any communication.
        TypeError: q, k, v or ids not tensors, ids not integers, kv not a str, scale not a number.

    Example:
        >>> import commlib
        >>> q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)  # 3 text tokens
        >>> text = torch.tensor([[0, 0, -1], [0, -1, -1]])  # padded text: 2 and 1 real tokens
        >>> out = cross_attention(q, k, v, kv_segment_ids=text)  # WORLD (W = 1 here), kv="replicated"
        >>> out.shape
        torch.Size([2, 5, 4, 8])
        >>> torch.allclose(out[1], cross_attention(q[1:], k[1:, :1], v[1:, :1])[0], atol=1e-6)  # padding unseen
        True
        >>> try:  # bad input: the spec's error, before any communication
        ...     cross_attention(q, k, v, kv="sharded", kv_sizes=[2])
        ... except commlib.CommError as error:
        ...     print(str(error).split(". Received")[0])
        cross_attention: k seq (3) must equal kv_sizes[0] (2) on rank 0
    """
    ids = {"segment_ids": segment_ids, "kv_segment_ids": kv_segment_ids}
    spec.check_inputs(q, k, v, ids, (torch.Tensor,), "torch.Tensor")
    resolved = resolve_group(spec.OP_NAME, group)
    plan = spec.cross_attention_plan(
        q.shape,
        k.shape,
        v.shape,
        world_size(spec.OP_NAME, resolved),
        kv=kv,
        scale=scale,
        kv_sizes=kv_sizes,
        rank=dist.get_rank(resolved),
        dtypes=[dtype_name(x.dtype) for x in (q, k, v)],
        segment_ids=_ids(segment_ids),
        kv_segment_ids=_ids(kv_segment_ids),
    )
    return spec.walk(_Backend(resolved), plan, q, k, v, segment_ids, kv_segment_ids)
