"""Attention layers: the head and position bookkeeping both frontends walk.

Ulysses (DeepSpeed-Ulysses) shards attention by sequence: rank r holds rows ``seq_sizes[r]`` of q, k, v
(``[B, S_r, H, D]``, ``[B, S_r, H_kv, D]``), one all-to-all gives every rank the full sequence for a subset
of heads, each rank attends with its heads, and a second all-to-all returns ``[B, S_r, H, D]``. This module
decides everything about that except the arithmetic:

- `HeadSplit`: the q heads each rank attends with (``split_sizes(H, W)``, contiguous, in order) and exactly
  the kv heads those q heads use. q head i uses kv head ``i // (H // H_kv)`` (the model's GQA grouping, as
  SDPA's ``enable_gqa`` and ``jax.nn.dot_product_attention`` group), so a rank needs a contiguous range of
  kv heads, and a kv head whose q heads fall on two ranks is sent to both. On the wire each rank receives
  exactly those kv heads (torch) -- the minimum -- or them padded to the largest rank's count (JAX).
- `UlyssesPlan` (built by `ulysses_plan`, which validates first): the `Exchange` that carries q, k and v in
  ONE all-to-all (stacked along heads, one block per destination), the receive offsets, the local kv index
  where a rank's q heads do not group evenly over its kv heads, and the sizes of both collectives -- per head
  group (`HeadGroup`): with ``chunks`` > 1 each rank's q heads are cut into `head_groups`, each group with its
  own exchange in, attention and all-to-all out, so a frontend can run group c + 1's communication during
  group c's attention (DESIGN.md "Overlap"); ``chunks=1`` is one group of every head.
- Positions: `contiguous_positions(seq_sizes)` gives the global positions of each rank's shard; causal masks
  compare global positions (`causal_mask`), so a layout that is not in sequence order (zigzag, USP) only
  changes the positions, not the rule.
- The reference lives in `commlib.reference`: `commlib.reference.attention` (`attention` / `attention_vjp`,
  float64 GQA attention with masks over global positions, forward and VJP; `causal_mask`), re-exported here,
  and `commlib.reference.ulysses.simulate_ulysses`, which walks a plan on W simulated numpy ranks.

Layouts (the "Uneven sizes" rule of DESIGN.md): torch holds a sharded dim exactly (``layout="exact"``:
rank r's q has ``seq_sizes[r]`` rows; the plan is per rank), JAX holds it padded to the maximum
(``layout="padded"``: every rank has ``max(seq_sizes)`` rows, and rank-dependent head counts are padded to
the largest; the plan is the same on every rank and rank-dependent choices are tables indexed by rank).

>>> split = head_split(6, 2, 4)
>>> split.q_ranges, split.kv_ranges
(((0, 2), (2, 4), (4, 5), (5, 6)), ((0, 1), (0, 2), (1, 2), (1, 2)))
>>> plan = ulysses_plan((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, rank=0, seq_sizes=(3, 3, 2, 2))
>>> plan.exchanges[0].scatter_sizes  # q, k, v heads each destination receives (the one all-to-all)
(4, 6, 3, 3)
>>> plan.exchanges[0].send_runs[:3]  # destination 0: q heads 0-1, k head 0, v head 0
(('q', 0, 2), ('k', 0, 1), ('v', 0, 1))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from commlib import layer_names
from commlib.errors import comm_error
from commlib.frontend_errors import wrong_type
from commlib.joint import JointHeads, JointPlan
from commlib.masks import MaskRule, check_mask, check_segment_ids
from commlib.reference.attention import attention, attention_vjp, causal_mask  # re-exported: their documented path
from commlib.uneven import Sizes, check_sizes, split_sizes
from commlib.validators import check_attention_options, check_int, check_qkv_shapes, shown

__all__ = [
    "OP_NAME",
    "LAYOUTS",
    "HeadSplit",
    "HeadGroup",
    "Exchange",
    "UlyssesPlan",
    "head_split",
    "head_groups",
    "ulysses_plan",
    "ulysses_joint",
    "check_layer_inputs",
    "contiguous_positions",
    "causal_mask",
    "attention",
    "attention_vjp",
]

OP_NAME = layer_names.ULYSSES
#: "exact": a sharded dim holds this rank's size (torch); "padded": it holds the maximum (JAX).
LAYOUTS = ("exact", "padded")
_INPUTS = ("q", "k", "v")


def _offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Start of each block when blocks of `sizes` are laid end to end."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return tuple(starts)


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """Which heads each rank attends with: q heads ``q_ranges[r]`` and the kv heads ``kv_ranges[r]`` they use
    (``[start, stop)``, global head indices). Built by `head_split`."""

    heads: int  # H, query heads
    kv_heads: int  # H_kv, key/value heads (H % H_kv == 0)
    world_size: int
    q_ranges: tuple[tuple[int, int], ...]  # rank r's q heads: split_sizes(H, W), contiguous, in rank order
    kv_ranges: tuple[tuple[int, int], ...]  # rank r's kv heads: those its q heads use (empty if it has none)

    @property
    def group(self) -> int:
        """q heads per kv head (1: MHA, H: MQA)."""
        return self.heads // self.kv_heads

    @property
    def q_sizes(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.q_ranges)

    @property
    def kv_sizes(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.kv_ranges)

    def local_kv(self, rank: int) -> tuple[int, ...]:
        """For each of rank's q heads, the index of its kv head among rank's kv heads.

        >>> head_split(8, 2, 3).local_kv(1)  # q heads 3, 4, 5 use kv heads 0, 1, 1
        (0, 1, 1)
        """
        (start, stop), kv_start = self.q_ranges[rank], self.kv_ranges[rank][0]
        return tuple(head // self.group - kv_start for head in range(start, stop))

    def local_group(self, rank: int) -> int | None:
        """g when rank's q head i uses its kv head ``i // g`` (SDPA's / JAX's GQA grouping applies to the
        received heads as they are), else None (the kv heads must be indexed per q head first). 1 for a rank
        with no heads."""
        local = self.local_kv(rank)
        return _grouping(local, len(local), self.kv_sizes[rank])

    @property
    def min_kv_heads(self) -> int:
        """kv heads (of k, and as many of v) all ranks receive together when each receives exactly the ones
        its q heads use: the minimum the wire can carry."""
        return sum(self.kv_sizes)


def _grouping(local: Sequence[int], heads: int, kv_heads: int) -> int | None:
    """g if ``local[i] == i // g`` for every entry of `local` with ``heads == g * kv_heads``, else None."""
    if heads == 0:
        return 1
    if kv_heads == 0 or heads % kv_heads:
        return None
    group = heads // kv_heads
    return group if all(kv == head // group for head, kv in enumerate(local)) else None


@functools.lru_cache(maxsize=1024)
def head_split(heads: int, kv_heads: int, world_size: int) -> HeadSplit:
    """The `HeadSplit` of H q heads over H_kv kv heads (H % H_kv == 0, checked by `ulysses_plan`) at W ranks."""
    q_ranges = tuple(
        (start, start + size)
        for start, size in zip(_offsets(split_sizes(heads, world_size)), split_sizes(heads, world_size), strict=True)
    )
    return _with_kv(heads, kv_heads, world_size, q_ranges)


def _with_kv(heads: int, kv_heads: int, world_size: int, q_ranges: tuple[tuple[int, int], ...]) -> HeadSplit:
    """The `HeadSplit` of the q heads `q_ranges` and exactly the kv heads they use."""
    group = heads // kv_heads
    kv_ranges = tuple((start // group, (stop - 1) // group + 1) if stop > start else (0, 0) for start, stop in q_ranges)
    return HeadSplit(heads, kv_heads, world_size, q_ranges, kv_ranges)


@functools.lru_cache(maxsize=1024)
def head_groups(split: HeadSplit, chunks: int) -> tuple[HeadSplit, ...]:
    """`chunks` head groups of `split` (``ulysses_attention(..., chunks=)``): group c holds piece c of
    ``split_sizes(h_r, chunks)`` of every rank r's q heads (contiguous, in order; a rank with fewer than
    `chunks` heads has empty groups) and exactly the kv heads those use. Group c's heads of every rank,
    concatenated in group order, are the rank's heads.

    >>> [group.q_ranges for group in head_groups(head_split(6, 2, 4), 2)]
    [((0, 1), (2, 3), (4, 5), (5, 6)), ((1, 2), (3, 4), (5, 5), (6, 6))]
    >>> [group.kv_ranges for group in head_groups(head_split(6, 2, 4), 2)]
    [((0, 1), (0, 1), (1, 2), (1, 2)), ((0, 1), (1, 2), (0, 0), (0, 0))]
    """
    pieces = []
    for start, stop in split.q_ranges:
        sizes = split_sizes(stop - start, chunks)
        pieces.append(
            [(start + offset, start + offset + size) for offset, size in zip(_offsets(sizes), sizes, strict=True)]
        )
    return tuple(
        _with_kv(split.heads, split.kv_heads, split.world_size, tuple(ranges)) for ranges in zip(*pieces, strict=True)
    )


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One all-to-all that carries some of q, k, v, stacked along heads, heads first.

    Each input is viewed heads first (``[B, S_r, n, D] -> [n, B, S_r, D]``); the send buffer is
    ``stacked[send_index]`` where ``stacked`` is the inputs concatenated along heads (``[q | k | v]``), laid
    out destination by destination: block j holds destination j's q heads, then its k heads, then its v heads.
    The collective is ``all_to_all(send, scatter_dim=0, gather_dim=2)`` with `scatter_sizes` and
    `gather_sizes` (None: the even op): ``[C, B, S_r, D] -> [c_r, B, S, D]``. On the receiver, input ``name``
    is ``recv[start:stop]`` for ``(name, start, stop)`` in `receive`.

    The selection is linear; its VJP adds each block's cotangent back into the heads it came from (a kv head
    sent to two ranks gets the sum of both cotangents).
    """

    inputs: tuple[str, ...]  # names travelling together, in block order: ("q", "k", "v") or ("q", "k")
    heads: tuple[int, ...]  # heads of each input (H or H_kv), in `inputs` order
    send_index: tuple[int, ...]  # destination-major; an index into [q | k | v] heads; `zero_head` = zeros
    scatter_sizes: tuple[int, ...] | None  # heads destination j receives; None when all equal (even op)
    gather_sizes: tuple[int, ...] | None  # seq rows rank r contributes (= seq_sizes); None when even
    receive: tuple[tuple[str, int, int], ...]  # (input, start, stop) of each input in this rank's received block

    @property
    def zero_head(self) -> int:
        """The index in `send_index` that stands for a head of zeros (padded layout): one past the last."""
        return sum(self.heads)

    @property
    def send_runs(self) -> tuple[tuple[str, int, int], ...]:
        """`send_index` as runs ``(input, start, stop)`` of consecutive heads of one input (exact layout:
        the send buffer is the concatenation of these slices, one local pass)."""
        starts = dict(zip(self.inputs, _offsets(self.heads), strict=True))
        runs: list[tuple[str, int, int]] = []
        for index in self.send_index:
            name = next(name for name in reversed(self.inputs) if starts[name] <= index)
            head = index - starts[name]
            if runs and runs[-1][0] == name and runs[-1][2] == head:
                runs[-1] = (name, runs[-1][1], head + 1)
            else:
                runs.append((name, head, head + 1))
        return tuple(runs)


@dataclasses.dataclass(frozen=True)
class HeadGroup:
    """One head group of a `UlyssesPlan` (all of the call's heads when ``chunks == 1``): its exchanges in,
    the attention of its heads, its all-to-all out. Groups share nothing but the inputs, so a frontend may run
    group c + 1's exchanges during group c's attention.

    A rank with no heads in the group (``local_heads == 0``: fewer heads than ranks, or fewer than ``chunks``)
    still sends its rows of the group's heads and receives an empty block from every exchange; its (empty)
    output must read every received block, so that it joins every exchange's backward too -- the other ranks'
    gradients of the heads it sent arrive through it (with two exchanges, q/k and v, an output built from v
    alone left the q/k all-to-all's backward waiting on this rank)."""

    heads: HeadSplit  # the group's q heads and the kv heads they use, on every rank (`head_groups`)
    exchanges: tuple[Exchange, ...]  # one if q, k, v share a head dim, else two
    local_heads: int  # q heads this rank attends with in this group (padded: the most any rank has)
    local_kv_heads: int  # kv heads it receives for them (padded: the most any rank has)
    kv_index: tuple[tuple[int, ...], ...] | None  # per rank: the received kv head of each local q head;
    #   None where the received heads group evenly (GQA as they are). Exact layout: one row (this rank).
    out_gather_sizes: tuple[int, ...] | None  # the group's q heads each rank returns (None: even)

    @property
    def out_heads(self) -> int:
        """Heads of the group's output all-to-all's result: every rank's q heads of the group."""
        return sum(self.heads.q_sizes)


@dataclasses.dataclass(frozen=True)
class UlyssesPlan:
    """A validated `ulysses_attention` call on one rank (exact layout) or on every rank (padded layout).

    Walk, for each of the `groups` (one unless ``chunks > 1``): each `Exchange` (q, k, v in one all-to-all
    where their head dims allow, else q, k in one and v in another); index the received k, v by `kv_index`
    where given; attention over the full sequence (global positions `positions`: causal masks compare them);
    ``all_to_all_4d(out, 1, 2, scatter_sizes=out_scatter_sizes, gather_sizes=group.out_gather_sizes)`` back to
    ``[B, S_r, h_c, D_v]``. With several groups, the result is the groups' outputs cut by `out_runs` and
    concatenated along heads: ``[B, S_r, H, D_v]`` in head order.
    """

    world_size: int
    rank: int | None  # the rank this plan is for (exact layout); None: every rank (padded layout)
    layout: str  # "exact" or "padded" (LAYOUTS)
    batch: int
    seq_sizes: tuple[int, ...]  # rows of every rank's shard, in rank order (global rows in that order)
    head_dim: int  # D of q and k
    value_dim: int  # D_v of v (and of the output)
    dtype: str
    causal: bool
    scale: float  # the softmax scale (1 / sqrt(D) unless given)
    heads: HeadSplit  # every head of the call
    groups: tuple[HeadGroup, ...]  # `chunks` head groups, walked in order
    out_scatter_sizes: tuple[int, ...] | None  # the output all-to-alls' seq sizes (None: even)
    out_runs: tuple[tuple[int, int, int], ...] | None  # (group, start, stop): the heads of the groups' outputs
    #   that, concatenated in this order, make the result (source rank by source rank); None: one group
    segmented: bool = False  # segment ids given: all-gathered over the group (``seq_sizes``), the mask of attn_fn
    joint: JointPlan | None = None  # joint_q, joint_k, joint_v given: where they go, the heads each group takes
    mask: MaskRule | None = None  # a rule on global positions (``mask=``), given to attn_fn as ``mask=``

    @property
    def chunks(self) -> int:
        """The number of head groups."""
        return len(self.groups)

    @property
    def seq(self) -> int:
        """S, the full sequence length."""
        return sum(self.seq_sizes)

    @property
    def positions(self) -> tuple[int, ...]:
        """Global positions of the gathered sequence's rows, in order (the shards concatenated in rank order)."""
        return tuple(position for shard in contiguous_positions(self.seq_sizes) for position in shard)

    @property
    def exchanges(self) -> tuple[Exchange, ...]:
        """Every group's exchanges in, in walk order."""
        return tuple(exchange for group in self.groups for exchange in group.exchanges)

    @property
    def fused(self) -> bool:
        """True when q, k and v travel in one all-to-all (per group)."""
        return len(self.groups[0].exchanges) == 1

    def kv_wire_heads(self) -> int:
        """kv heads (of k; v the same) all ranks receive together on the wire, over every group: the groups'
        `HeadSplit.min_kv_heads` in the exact layout, ``W * max(kv_sizes)`` per group in the padded one."""
        if self.layout == "exact":
            return sum(group.heads.min_kv_heads for group in self.groups)
        return sum(self.world_size * max(group.heads.kv_sizes) for group in self.groups)


def contiguous_positions(seq_sizes: Sequence[int]) -> tuple[range, ...]:
    """Global positions of each rank's shard when the sequence is cut in order (rank r holds the
    ``seq_sizes[r]`` rows after those of ranks < r): Ulysses' layout.

    >>> contiguous_positions((3, 3, 2, 2))
    (range(0, 3), range(3, 6), range(6, 8), range(8, 10))
    """
    return tuple(range(start, start + size) for start, size in zip(_offsets(seq_sizes), seq_sizes, strict=True))


def _check_seq_sizes(
    seq_sizes: object, world_size: int, rank: int | None, rows: int, received: dict
) -> tuple[int, ...]:
    """Every rank's shard length (`commlib.uneven.check_sizes`); `rows` is this rank's seq dim (exact:
    ``seq_sizes[rank]``, padded: the max)."""
    if seq_sizes is None:
        return (rows,) * world_size
    sizes = check_sizes(OP_NAME, Sizes("seq_sizes", seq_sizes, "seq"), world_size, received)
    if rank is not None and rows != sizes[rank]:
        raise comm_error(
            OP_NAME, f"seq ({rows}) must equal seq_sizes[{rank}] ({sizes[rank]}) on rank {rank}", **received
        )
    if rank is None and rows != max(sizes):
        raise comm_error(
            OP_NAME, f"seq ({rows}) must equal max(seq_sizes) ({max(sizes)}) in the padded layout", **received
        )
    return sizes


def _even(sizes: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if len(set(sizes)) <= 1 else sizes


def _exchange(
    split: HeadSplit, names: tuple[str, ...], rank: int | None, gather_sizes: tuple[int, ...] | None
) -> Exchange:
    """The all-to-all of `names` (a prefix-closed subset of q, k, v) for `rank` (None: padded layout)."""
    counts = {"q": split.heads, "k": split.kv_heads, "v": split.kv_heads}
    ranges = {"q": split.q_ranges, "k": split.kv_ranges, "v": split.kv_ranges}
    starts = dict(zip(names, _offsets([counts[name] for name in names]), strict=True))
    widths = {name: max(stop - start for start, stop in ranges[name]) for name in names}
    zero = sum(counts[name] for name in names)
    index: list[int] = []
    for destination in range(split.world_size):
        for name in names:
            start, stop = ranges[name][destination]
            heads = list(range(starts[name] + start, starts[name] + stop))
            index += heads if rank is not None else heads + [zero] * (widths[name] - len(heads))
    if rank is None:
        sizes = {name: widths[name] for name in names}
    else:
        sizes = {name: ranges[name][rank][1] - ranges[name][rank][0] for name in names}
    blocks = tuple(zip(names, _offsets([sizes[name] for name in names]), strict=True))
    receive = tuple((name, start, start + sizes[name]) for name, start in blocks)
    per_destination = [sum(ranges[name][j][1] - ranges[name][j][0] for name in names) for j in range(split.world_size)]
    scatter_sizes = None if rank is None else _even(tuple(per_destination))
    return Exchange(names, tuple(counts[name] for name in names), tuple(index), scatter_sizes, gather_sizes, receive)


def _kv_index(split: HeadSplit, rank: int | None) -> tuple[tuple[int, ...], ...] | None:
    """Per-q-head kv indices where the received kv heads do not group evenly (GQA as they are), else None."""
    if rank is not None:
        return None if split.local_group(rank) is not None else (split.local_kv(rank),)
    width, kv_width = max(split.q_sizes), max(split.kv_sizes)
    locals_ = [split.local_kv(r) for r in range(split.world_size)]
    if all(_grouping(local, width, kv_width) is not None for local in locals_):
        return None
    return tuple(local + (0,) * (width - len(local)) for local in locals_)


def ulysses_plan(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    v_shape: Sequence[int],
    world_size: int,
    *,
    rank: int | None = None,
    seq_sizes: object = None,
    dtypes: Sequence[str] = ("float32",) * 3,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "exact",
    segment_ids: tuple[Sequence[int], str] | None = None,
    chunks: int = 1,
    mask: object = None,
) -> UlyssesPlan:
    """The `UlyssesPlan` of ``ulysses_attention(q, k, v, ..., causal, scale, seq_sizes, chunks)`` on `rank`
    (exact layout, torch) or on every rank (``layout="padded"``, JAX; `rank` unused), or `CommError` /
    `TypeError`.

    q ``[B, S_r, H, D]``, k and v ``[B, S_r, H_kv, D]`` (v may have its own head dim ``D_v``), H % H_kv == 0;
    S_r = ``seq_sizes[rank]`` (exact) or ``max(seq_sizes)`` (padded); `seq_sizes` None: every rank S_r.
    `segment_ids`: ``(shape, dtype name)`` of the segment ids given (``[B, S_r]``, integers), None: none.
    `chunks`: head groups (`head_groups`), an int from 1 to the most q heads a rank attends with
    (``ceil(H / W)``); 1 is one group of every head. `mask`: a `commlib.masks.MaskRule` on the gathered
    sequence's positions (`UlyssesPlan.positions`, ``0 .. S - 1``), None: none.

    >>> ulysses_plan((1, 3, 6, 4), (1, 3, 4, 4), (1, 3, 4, 4), 4, rank=0)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: ulysses_attention: heads (6) must be divisible by kv heads (4). Received: q_shape=(1, 3, 6, 4), k_shape=(1, 3, 4, 4), v_shape=(1, 3, 4, 4), seq_sizes=None
    >>> plan = ulysses_plan((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, rank=0, chunks=2)
    >>> [group.heads.q_ranges[0] for group in plan.groups], plan.out_runs[:2]  # rank 0's heads 0 and 1
    ([(0, 1), (1, 2)], ((0, 0, 1), (1, 0, 1)))
    """
    shapes: dict[str, object] = dict(q=q_shape, k=k_shape, v=v_shape)
    received: dict[str, object] = {f"{name}_shape": shown(shape) for name, shape in shapes.items()}
    received["seq_sizes"] = seq_sizes
    if layout not in LAYOUTS:
        raise comm_error(OP_NAME, f"layout ({layout!r}) must be one of {', '.join(LAYOUTS)}", **received)
    world_size = check_int(OP_NAME, "world_size", world_size, received)
    if world_size < 1:
        raise comm_error(OP_NAME, f"world_size ({world_size}) must be >= 1", **received)
    checked = check_qkv_shapes(OP_NAME, shapes, received)
    q, v = checked["q"], checked["v"]
    rank = None if layout == "padded" else check_int(OP_NAME, "rank", rank, received)
    sizes = _check_seq_sizes(seq_sizes, world_size, rank, q[1], received)
    scale = check_attention_options(OP_NAME, tuple(dtypes), causal, scale, q[3], received)
    if segment_ids is not None:
        check_segment_ids(OP_NAME, shown(segment_ids[0]), str(segment_ids[1]), q, received)
    rule = check_mask(OP_NAME, mask, received)
    split = head_split(q[2], checked["k"][2], world_size)
    chunks = _check_chunks(chunks, split, received)
    names = _INPUTS if v[3] == q[3] else ("q", "k")
    groups = tuple(
        _group(group, (names, _INPUTS[len(names) :]), rank, _even(sizes)) for group in head_groups(split, chunks)
    )
    return UlyssesPlan(
        world_size,
        rank,
        layout,
        q[0],
        sizes,
        q[3],
        v[3],
        str(dtypes[0]),
        causal,
        scale,
        split,
        groups,
        _even(sizes),
        _out_runs(groups),
        segment_ids is not None,
        mask=rule,
    )


def check_layer_inputs(
    op_name: str, q: object, k: object, v: object, segment_ids: object, array_types: tuple[type, ...], expected: str
) -> None:
    """The kinds of an attention layer's inputs, checked first by every frontend (before any communication and
    before checked mode reads a shape): q, k, v and `segment_ids` (unless None) must be instances of
    `array_types`, the frontend's arrays (`expected` names them); else the spec's `TypeError` naming the layer,
    the argument and the type received (`commlib.frontend_errors.wrong_type`). A Python list is refused
    everywhere, never converted.

    >>> import numpy as np
    >>> check_layer_inputs("ring_attention", np.zeros(1), np.zeros(1), np.zeros(1), [0, 0], (np.ndarray,),
    ...                    "numpy.ndarray")
    Traceback (most recent call last):
    ...
    TypeError: ring_attention: segment_ids must be a numpy.ndarray, not list. Received: type='list'
    """
    for name, value in (("q", q), ("k", k), ("v", v), ("segment_ids", segment_ids)):
        if not isinstance(value, array_types) and not (name == "segment_ids" and value is None):
            raise wrong_type(op_name, name, value, expected)


def _check_chunks(chunks: object, split: HeadSplit, received: dict) -> int:
    """`chunks` as an int from 1 to the most q heads a rank attends with (more would leave a group empty on
    every rank)."""
    received = {**received, "chunks": chunks}
    chunks = check_int(OP_NAME, "chunks", chunks, received)
    if chunks < 1:
        raise comm_error(OP_NAME, f"chunks ({chunks}) must be >= 1", **received)
    most = max(split.q_sizes)
    if chunks > most:
        raise comm_error(
            OP_NAME,
            f"chunks ({chunks}) must be <= the most q heads a rank attends with ({most}: "
            f"split_sizes(heads={split.heads}, world_size={split.world_size}) = {split.q_sizes})",
            **received,
        )
    return chunks


def _group(
    split: HeadSplit, names: tuple[tuple[str, ...], ...], rank: int | None, gather_sizes: tuple[int, ...] | None
) -> HeadGroup:
    """The `HeadGroup` of the heads `split` for `rank` (None: padded layout); `names`: the inputs of each
    exchange (an empty tuple: no exchange)."""
    exchanges = tuple(_exchange(split, inputs, rank, gather_sizes) for inputs in names if inputs)
    if rank is not None:
        local = (split.q_sizes[rank], split.kv_sizes[rank])
    else:
        local = (max(split.q_sizes), max(split.kv_sizes))
    return HeadGroup(split, exchanges, local[0], local[1], _kv_index(split, rank), _even(split.q_sizes))


def _out_runs(groups: tuple[HeadGroup, ...]) -> tuple[tuple[int, int, int], ...] | None:
    """(group, start, stop) of each source rank's heads in each group's output, rank by rank then group by
    group: the head order of the result. None for one group (its output is the result)."""
    if len(groups) == 1:
        return None
    starts = [_offsets(group.heads.q_sizes) for group in groups]
    return tuple(
        (index, starts[index][source], starts[index][source] + group.heads.q_sizes[source])
        for source in range(groups[0].heads.world_size)
        for index, group in enumerate(groups)
        if group.heads.q_sizes[source]
    )


def ulysses_joint(joint: JointPlan, plan: UlyssesPlan) -> JointPlan:
    """A joint attention plan (`commlib.joint`) `joint` with the heads each of `plan`'s head groups takes (`JointHeads`): the group's q heads of this
    rank (exact layout) or of every rank (padded), and the kv heads those use -- the heads the group's
    all-to-all delivers, so the joint heads line up with the received ones.

    >>> plan = ulysses_plan((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, layout="padded")
    >>> heads = ulysses_joint(JointPlan("front", 2), plan).groups[0]
    >>> heads.q, heads.kv, heads.out_gather_sizes  # heads 6 (q) and 2 (kv): zeros
    (((0, 1), (2, 3), (4, 6), (5, 6)), ((0, 2), (0, 1), (1, 2), (1, 2)), (2, 2, 1, 1))
    """
    return dataclasses.replace(joint, groups=tuple(_group_heads(group, plan) for group in plan.groups))


def _group_heads(group: HeadGroup, plan: UlyssesPlan) -> JointHeads:
    split = group.heads
    ranks = range(split.world_size) if plan.rank is None else (plan.rank,)
    widths = (group.local_heads, group.local_kv_heads)
    fills = (split.heads, split.kv_heads)
    rows: list[tuple[tuple[int, ...], ...]] = []
    for ranges, width, fill in zip((split.q_ranges, split.kv_ranges), widths, fills, strict=True):
        heads = [tuple(range(*ranges[rank])) for rank in ranks]
        rows.append(tuple(row + (fill,) * (width - len(row)) for row in heads))
    return JointHeads(rows[0], rows[1], group.out_gather_sizes)
