"""Cross-attention for sequence-sharded queries (DESIGN.md "Video DiTs"): the plan and its one walk, both
frontends' ``cross_attention`` walking them (the float64 reference: `commlib.reference.cross_attention`).

A DiT's video tokens are sharded over the sequence group (q ``[B, Sq_r, H, D]``, as the layers' q); the keys and
values come from elsewhere (a text encoder's states, an audio stream) and are either

- ``kv="replicated"``: the same ``[B, S_kv, H_kv, D]`` on every rank. Each rank attends its own rows to every key:
  local attention, no communication at all;
- ``kv="sharded"``: sharded over the same group at any per-rank length (``kv_sizes``; a shard may be empty).
  k and v are concatenated along the head dim and all-gathered ONCE (commlib's differentiable ``all_gather``,
  whose VJP is the dual reduce-scatter, so dk and dv come back to the rank that holds those rows), with their
  segment ids (integers, no gradient) in a second gather; then local attention as above.

There are no positions between a query and a key (no causal mask), so q's rows may be any count on any rank and
need no sizes. Masks: ``segment_ids`` (q's, ``[B, Sq_r]``) and ``kv_segment_ids`` (``[B, S_kv]`` replicated, or
``[B, S_kv_r]`` laid out as k): a query sees a key when neither id is negative (padding) and, when both are given,
they are equal; a side left out matches every non-negative id of the other. A row that sees no key outputs 0 with
gradient 0 (the layers' rule), and a padding key's k and v rows get gradient exactly 0 (they are zeroed before the
kernel, so a NaN in padded text reaches nothing).

>>> plan = cross_attention_plan((1, 3, 4, 8), (1, 2, 2, 8), (1, 2, 2, 8), 3, kv="sharded", kv_sizes=(2, 0, 5),
...                             rank=0)
>>> plan.gather_sizes, plan.kv_len, plan.head_dim
((2, 0, 5), 7, 8)
>>> try:
...     cross_attention_plan((1, 3, 4, 8), (1, 2, 2, 8), (1, 2, 2, 8), 3, kv="sharded", kv_sizes=(3, 0, 5), rank=0)
... except ValueError as error:
...     print(str(error).split(". Received")[0])
cross_attention: k seq (2) must equal kv_sizes[0] (3) on rank 0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from commlib.errors import comm_error, kind_error
from commlib.frontend_errors import wrong_type
from commlib.masks import integer_dtype
from commlib.uneven import Sizes, check_sizes
from commlib.validators import check_attention_options

__all__ = ["OP_NAME", "KV_MODES", "CrossPlan", "CrossBackend", "cross_attention_plan", "walk", "visible"]

OP_NAME = "cross_attention"
#: "replicated": kv the same on every rank (local attention); "sharded": kv sharded over the group (gathered once).
KV_MODES = ("replicated", "sharded")


@dataclasses.dataclass(frozen=True)
class CrossPlan:
    """One rank's ``cross_attention`` call, validated."""

    kv: str  # one of KV_MODES
    world_size: int  # the group's size
    scale: float  # the softmax scale
    gather_sizes: tuple[int, ...] | None  # "sharded": the all_gather's sizes= (None: every rank's rows equal)
    kv_len: int  # keys each query may see: the full kv's rows
    head_dim: int  # k's head dim: where the gathered [k | v] splits
    out_shape: tuple[int, ...]  # [B, Sq_r, H, D_v]

    @property
    def gathers(self) -> bool:
        """Whether the walk communicates (``kv="sharded"`` at W > 1)."""
        return self.kv == "sharded" and self.world_size > 1


def _check_kinds(kv: object, received: dict) -> str:
    if not isinstance(kv, str):
        raise kind_error(OP_NAME, f"kv must be a str, not {type(kv).__name__}", **received)
    if kv not in KV_MODES:
        raise comm_error(OP_NAME, f"kv ({kv!r}) must be one of {', '.join(map(repr, KV_MODES))}", **received)
    return kv


def _check_shapes(q: tuple, k: tuple, v: tuple, received: dict) -> None:
    """4-D q, k, v; kv batch, head counts and head dims as the layers' (GQA); k and v rows equal."""
    for name, shape in (("q", q), ("k", k), ("v", v)):
        if len(shape) != 4:
            raise comm_error(
                OP_NAME, f"{name} ndim ({len(shape)}) must be 4 ([batch, seq, heads, head_dim])", **received
            )
    for name, shape in (("k", k), ("v", v)):
        if shape[0] != q[0]:
            raise comm_error(OP_NAME, f"{name} batch ({shape[0]}) must equal q batch ({q[0]})", **received)
    if v[1] != k[1]:
        raise comm_error(OP_NAME, f"v seq ({v[1]}) must equal k seq ({k[1]})", **received)
    if v[2] != k[2]:
        raise comm_error(OP_NAME, f"v heads ({v[2]}) must equal k heads ({k[2]})", **received)
    if k[3] != q[3]:
        raise comm_error(OP_NAME, f"k head_dim ({k[3]}) must equal q head_dim ({q[3]})", **received)
    if k[2] < 1 or q[2] < 1:
        raise comm_error(OP_NAME, f"heads ({q[2]}) and kv heads ({k[2]}) must be >= 1", **received)
    if q[2] % k[2]:
        raise comm_error(OP_NAME, f"heads ({q[2]}) must be divisible by kv heads ({k[2]})", **received)


def _check_kv_sizes(
    kv: str, kv_sizes: object, world_size: int, rank: int | None, rows: int, received: dict
) -> tuple[int, ...] | None:
    """Every rank's kv rows ("sharded"); `rows` is this rank's k seq (exact layout: ``kv_sizes[rank]``, padded:
    the max). None: replicated, or sharded with every rank's rows equal."""
    if kv == "replicated":
        if kv_sizes is not None:
            raise comm_error(OP_NAME, 'kv_sizes must be None with kv="replicated" (kv is not sharded)', **received)
        return None
    if kv_sizes is None:
        return None
    sizes = check_sizes(OP_NAME, Sizes("kv_sizes", kv_sizes, "k seq"), world_size, received)
    if rank is not None and rows != sizes[rank]:
        message = f"k seq ({rows}) must equal kv_sizes[{rank}] ({sizes[rank]}) on rank {rank}"
        raise comm_error(OP_NAME, message, **received)
    if rank is None and rows != max(sizes):
        message = f"k seq ({rows}) must equal max(kv_sizes) ({max(sizes)}) in the padded layout"
        raise comm_error(OP_NAME, message, **received)
    return sizes


def _check_segments(name: str, segments: tuple[tuple[int, ...], str] | None, want: tuple, received: dict) -> None:
    if segments is None:
        return
    shape, dtype = segments
    if not integer_dtype(dtype):
        raise kind_error(OP_NAME, f"{name} dtype ({dtype}) must be an integer dtype", **received)
    if tuple(shape) != want:
        raise comm_error(OP_NAME, f"{name} shape {tuple(shape)} must be {want}", **received)


def cross_attention_plan(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    v_shape: Sequence[int],
    world_size: int,
    *,
    kv: object = "replicated",
    scale: object = None,
    kv_sizes: object = None,
    rank: int | None = None,
    dtypes: Sequence[str] = ("float64",) * 3,
    segment_ids: tuple[tuple[int, ...], str] | None = None,
    kv_segment_ids: tuple[tuple[int, ...], str] | None = None,
) -> CrossPlan:
    """The validated `CrossPlan` of ``cross_attention`` on `world_size` ranks, for `rank` (torch: a sharded kv holds
    exactly ``kv_sizes[rank]`` rows) or None (JAX: every rank holds ``max(kv_sizes)``). `segment_ids` /
    `kv_segment_ids`: ``(shape, dtype name)`` of the ids, or None. Raises the spec's `CommError` / ``TypeError``
    naming ``cross_attention``, the argument and both numbers, before any communication."""
    q, k, v = (tuple(int(size) for size in shape) for shape in (q_shape, k_shape, v_shape))
    received = dict(q_shape=q, k_shape=k, v_shape=v, world_size=world_size, kv=kv, kv_sizes=kv_sizes)
    mode = _check_kinds(kv, received)
    _check_shapes(q, k, v, received)
    scale_value = check_attention_options(OP_NAME, dtypes, False, scale, q[3], {**received, "scale": scale})
    sizes = _check_kv_sizes(mode, kv_sizes, world_size, rank, k[1], received)
    _check_segments("segment_ids", segment_ids, q[:2], received)
    _check_segments("kv_segment_ids", kv_segment_ids, k[:2], received)
    kv_len = k[1] if mode == "replicated" else (sum(sizes) if sizes is not None else k[1] * world_size)
    even = sizes is not None and len(set(sizes)) == 1
    gather_sizes = None if sizes is None or even else sizes
    return CrossPlan(mode, world_size, scale_value, gather_sizes, kv_len, k[3], (*q[:3], v[3]))


def check_inputs(q: object, k: object, v: object, ids: Mapping[str, object], array_types: tuple, expected: str) -> None:
    """The kinds of ``cross_attention``'s arrays (q, k, v, and the segment ids unless None), first of all."""
    for name, value in (("q", q), ("k", k), ("v", v), *ids.items()):
        if not isinstance(value, array_types) and not (name.endswith("segment_ids") and value is None):
            raise wrong_type(OP_NAME, name, value, expected)


class CrossBackend(Protocol):
    """What the walk needs of a frontend."""

    def gather(self, x: Any, sizes: tuple[int, ...] | None) -> Any:
        """``all_gather(x, dim=1, sizes=sizes)`` over the group, differentiable (VJP: the reduce-scatter)."""

    def concat(self, k: Any, v: Any) -> Any:
        """``[B, S, H_kv, D + D_v]``: k and v side by side along the head dim."""

    def split(self, kv: Any, head_dim: int) -> tuple[Any, Any]:
        """The inverse of `concat`: ``kv[..., :head_dim], kv[..., head_dim:]``."""

    def attend(self, q: Any, k: Any, v: Any, scale: float, q_ids: Any, kv_ids: Any) -> Any:
        """Local GQA attention ``[B, Sq, H, D_v]`` with the `visible` rule of the ids (either may be None); keys
        whose kv id is negative zeroed first; rows that see no key 0 (gradient 0)."""


def walk(backend: CrossBackend, plan: CrossPlan, q: Any, k: Any, v: Any, q_ids: Any, kv_ids: Any) -> Any:
    """The one walk: for a sharded kv, one gather of ``[k | v]`` (and one of the kv ids), then local attention."""
    if plan.gathers:
        k, v = backend.split(backend.gather(backend.concat(k, v), plan.gather_sizes), plan.head_dim)
        kv_ids = None if kv_ids is None else backend.gather(kv_ids, plan.gather_sizes)
    return backend.attend(q, k, v, plan.scale, q_ids, kv_ids)


def visible(q_ids: Any, kv_ids: Any) -> Any:
    """bool ``[B, Sq, S_kv]`` of any array module (numpy, torch, jax.numpy), or None when both ids are None: a
    query sees a key when neither id is negative and, when both are given, they are equal.

    >>> import numpy as np
    >>> visible(np.array([[0, 1, -1]]), None).astype(int).tolist()  # q's padding row sees nothing
    [[[1], [1], [0]]]
    >>> visible(np.array([[0, 1]]), np.array([[1, -1, 0]])).astype(int).tolist()
    [[[0, 0, 1], [1, 0, 0]]]
    """
    if q_ids is None and kv_ids is None:
        return None
    if kv_ids is None:
        return (q_ids >= 0)[..., :, None]
    if q_ids is None:
        return (kv_ids >= 0)[..., None, :]
    query = q_ids[..., :, None]
    return (query == kv_ids[..., None, :]) & (query >= 0)
