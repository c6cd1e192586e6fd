"""The ring of ring attention and USP: its schedule (`ring_plan` -> `RingPlan`) and the one walk of it,
forward and backward (`forward`, `backward`), over a small `RingBackend` that torch, JAX and the numpy
reference implement.

The schedule: the `permute` pairs of one ring step (rank r sends its current k/v block to r+1, so at step t
rank r holds ring block ``(r - t) % W``), and for each step and rank the *case* of the (q block, kv block)
pair: an index into a small table of static cases, each a tuple of `Piece`\\ s (q rows, kv rows, mask), the
pieces the causal mask hides entirely left out. At step 0 every rank attends its own block with case 0, one
piece over every row. The backward passes dk/dv with k/v the same way and one final hop brings them home.

With segment ids (``segment_ids=``, `commlib.masks`) every ring block's ids are all-gathered once per call (they
do not travel with k/v), every piece is masked by them as well, and a piece none of whose queries sees any of its
keys is skipped: `visible_pieces` decides it for every step and piece of a rank at once, from the gathered ids
(`RingBackend.when_visible` applies it; `pieces_computed` counts what is left).

With a rule on global positions (``mask=``, `commlib.masks.MaskRule`: frame-causal, a sliding window) the cases
come from the rule instead: every (q block, kv block) pair is cut into the runs of consecutive positions its
blocks hold (one each in the contiguous layout, two in zigzag), and each pair of runs is classified on the host
when the plan is built (`commlib.masks.classify_runs`): a pair the rule (and causal) masks entirely is no piece,
a pair it leaves whole a "full" piece, the rest a "positions" piece masked by the rule's dense mask of the two
blocks (`RingPlan.key_masks`). Step 0 (a rank's own block) is one "positions" piece over every row. Nothing is
decided on device, so the skip is static in torch and in JAX (`pieces_computed` counts it).

The walk decides nothing per framework: a backend attends a piece (and its VJP), writes rows, starts and waits
the send of a list of arrays one ring step (step t+1's k/v begun before step t's pieces and waited after them:
the DESIGN's Overlap; torch sends asynchronously, JAX and the reference complete at once), and picks the case of a step for its rank (torch and the reference know the rank; JAX
switches on the traced axis index). The step math is `commlib.blockwise`'s.

>>> plan = ring_plan((2, 4, 4, 3), (2, 4, 2, 3), (2, 4, 2, 3), 4, causal=True, layout="zigzag")
>>> [plan.case_names[case] for case in plan.case_table[1]]  # step 1: rank r holds ring block r - 1
['second-half', 'first-half', 'first-half', 'first-half']
>>> plan.shared_case  # the case every rank has at each step (None: it depends on the rank)
(0, None, None, None)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from commlib import layer_names
from commlib.blockwise import NUMPY, ArrayMath, SegmentedMask, delta, merge_masked, position_mask
from commlib.errors import comm_error, kind_error
from commlib.joint import JointPlan
from commlib.masks import MaskRule, check_mask, check_segment_ids, classify_runs, position_runs, rule_mask
from commlib.sequence import SEQUENCE_LAYOUTS, SequenceLayout, check_layout, positions
from commlib.validators import check_attention_options, check_int, check_qkv_shapes, shown

__all__ = [
    "RING_OP",
    "USP_OP",
    "Piece",
    "RingPlan",
    "ring_plan",
    "second_order",
    "RingBackend",
    "with_joint",
    "joint_masks",
    "forward",
    "backward",
    "visible_pieces",
    "pieces_computed",
]

RING_OP = layer_names.RING
USP_OP = layer_names.USP


def second_order(op_name: str) -> TypeError:
    """The error of differentiating ring / USP attention twice (torch: its backward is hand-written).

    >>> print(second_order("ring_attention"))  # doctest: +ELLIPSIS
    ring_attention: a second derivative is not supported: the backward is hand-written (first order); ...
    """
    message = (
        "a second derivative is not supported: the backward is hand-written (first order); take one "
        "gradient, or use ulysses_attention, whose backward is autograd's own"
    )
    return kind_error(op_name, message, order=2)


# ---------------------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of one (q block, kv block) step: q rows ``q[0]:q[1]`` attend to kv rows ``kv[0]:kv[1]`` (local rows of
    the blocks) under `mask` (one of `commlib.blockwise.MASKS`)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    mask: str


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """A validated `ring_attention` (or the ring of a `usp_attention`) call, the same on every rank; `forward`
    and `backward` walk it."""

    op_name: str
    ring_size: int  # W, ranks of the ring
    layout: str  # one of SEQUENCE_LAYOUTS
    causal: bool
    scale: float
    batch: int
    rows: int  # rows of q, k, v the ring walks on each rank (USP: the gathered ring block, S / W)
    heads: int  # q heads on each rank (USP: H / U)
    kv_heads: int  # k/v heads on each rank (USP: H_kv / U); they travel unrepeated
    head_dim: int
    value_dim: int
    dtype: str
    ulysses_size: int  # U (1: plain ring attention)
    cases: tuple[tuple[Piece, ...], ...]  # the static cases; () where the mask hides the whole pair
    case_names: tuple[str, ...]
    case_index: tuple[tuple[int, ...], ...]  # [step][rank] -> index into `cases`
    shared_case: tuple[int | None, ...]  # [step] -> the case of every rank at that step; None where ranks differ
    # The uneven layout the ring walks (None: an even one, `layout` names it). Then every shard is held padded
    # to `sequence.max_size` rows, ring block r is shards r*U .. r*U+U-1 end to end, and one piece over every
    # row per step takes its mask from global positions (`key_masks`); padding rows see and are seen by nothing.
    sequence: SequenceLayout | None = None
    # Segment ids given (``segment_ids=``): every ring block's ids gathered once, every piece masked by them too,
    # and a piece none of whose queries sees any of its keys skipped (`visible_pieces`; `pieces_computed`).
    segmented: bool = False
    # A rule on global positions (``mask=``): the cases are the rule's (`_rule_cases`), every "positions" piece
    # masked by `key_masks` (the rule's and causal's mask of the two blocks' positions, sliced to the piece).
    mask: MaskRule | None = None
    # Joint attention (``joint_q=``, `commlib.joint`; `with_joint`): the joint tokens' position and count. The walk
    # then attends this rank's q rows to the (replicated) joint k/v as one more piece, the joint q to this rank's
    # k/v block and to the joint k/v, and merges the joint q's partials of every ring rank (`forward`).
    joint: JointPlan | None = None

    @property
    def keyed(self) -> bool:
        """Whether "positions" pieces take their mask from `key_masks` (an uneven layout or a mask rule)."""
        return self.sequence is not None or self.mask is not None

    @property
    def perm(self) -> tuple[tuple[int, int], ...]:
        """The `permute` pairs of one ring step: rank r sends to rank r + 1."""
        return tuple((rank, (rank + 1) % self.ring_size) for rank in range(self.ring_size))

    @property
    def case_table(self) -> np.ndarray:
        """int32 ``[W, W]``: ``case_table[t, r]`` is the case of rank r at step t (JAX indexes it with the traced
        axis index and switches over `cases`)."""
        return np.asarray(self.case_index, dtype=np.int32).reshape(self.ring_size, self.ring_size)

    @property
    def compute_dtype(self) -> str:
        """Scores, the softmax and its LSE, the accumulated output and dk/dv: float64 for float64, else float32."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def group(self) -> int:
        """q heads per kv head."""
        return self.heads // self.kv_heads

    def kv_block(self, step: int, rank: int) -> int:
        """The ring block whose k/v rank `rank` holds at step `step`."""
        return (rank - step) % self.ring_size

    @property
    def ulysses_exchanges(self) -> tuple[tuple[str, ...], ...]:
        """USP's all-to-alls before the ring (heads scattered, sequence gathered: ``[B, S_r, H, D] -> [B, U S_r,
        H / U, D]``), each the inputs it carries: none for ring attention (U = 1); q, k and v in one where v's
        head dim is q's (each input's heads cut into U destinations and stacked per destination, one local
        pass), else one each.

        >>> plan = ring_plan((1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 8), 2, ulysses_size=2, op_name=USP_OP)
        >>> plan.ulysses_exchanges, dataclasses.replace(plan, value_dim=16).ulysses_exchanges
        ((('q', 'k', 'v'),), (('q',), ('k',), ('v',)))
        """
        if self.ulysses_size == 1:
            return ()
        return (("q", "k", "v"),) if self.value_dim == self.head_dim else (("q",), ("k",), ("v",))

    @property
    def masked(self) -> bool:
        """Whether the walk masks by global positions (an uneven `SequenceLayout`)."""
        return self.sequence is not None

    def positions(self, block: int) -> np.ndarray:
        """Global positions of ring block `block`'s rows, in the order its rows hold them (uneven layouts: -1
        for a padding row)."""
        if self.sequence is None:
            return positions(self.rows * self.ring_size, self.ring_size, self.layout, 1)[block]
        return self.block_positions[block]

    @property
    def block_positions(self) -> np.ndarray:
        """int64 ``[W, rows]``, every ring block's global positions as the ring walks them (masked plans: shards
        r*U .. r*U+U-1, each padded to ``max_size``, -1 for padding). The frontends build the masks from it."""
        if self.sequence is None:
            return _even_positions(self.rows * self.ring_size, self.ring_size, self.layout)
        return _block_positions(self.sequence)

    def valid_rows(self) -> np.ndarray:
        """bool ``[W, rows]``: which rows of each rank's ring block hold a position (not padding)."""
        return np.stack([self.positions(block) >= 0 for block in range(self.ring_size)])

    def key_masks(self, step: int) -> np.ndarray:
        """bool ``[W, rows, rows]``: ``[r, i, j]`` whether q row i of rank r sees kv row j of the block it holds at
        `step` (`position_mask` of the two blocks' positions; O(W rows^2), built when asked)."""
        held = self.block_positions
        blocks = [self.kv_block(step, rank) for rank in range(self.ring_size)]
        return self.position_mask(held, held[blocks])

    def position_mask(self, q_positions: Any, k_positions: Any) -> Any:
        """bool ``[..., Sq, Sk]`` of a "positions" piece from its rows' global positions (any array module):
        both real (not padding), causal when the plan is, and the mask rule's (`commlib.masks.rule_mask`)."""
        if self.mask is None:
            return position_mask(q_positions, k_positions, self.causal)
        return rule_mask(q_positions, k_positions, self.causal, self.mask)

    @property
    def joint_head_starts(self) -> np.ndarray:
        """int32 ``[U, 2]``: the first joint q head and the first joint kv head Ulysses rank u attends with (its
        ``heads`` q heads and ``kv_heads`` kv heads from there: the heads its all-to-all delivers)."""
        return np.asarray([(u * self.heads, u * self.kv_heads) for u in range(self.ulysses_size)], dtype=np.int32)

    def wire_elements(self) -> int:
        """Elements of k and v one rank sends per forward step: ``B * rows * H_kv * (D + D_v)`` (GQA: unrepeated)."""
        return self.batch * self.rows * self.kv_heads * (self.head_dim + self.value_dim)


@functools.lru_cache(maxsize=64)
def _even_positions(seq_len: int, ring_size: int, layout: str) -> np.ndarray:
    """int64 ``[W, S / W]``: ring block r's global positions in a layout string's even cut."""
    held = np.asarray(positions(seq_len, ring_size, layout, 1), dtype=np.int64)
    held.setflags(write=False)
    return held


def _rule_cases(
    held: np.ndarray, causal: bool, rule: MaskRule
) -> tuple[tuple[tuple[str, tuple[Piece, ...]], ...], tuple[tuple[int, ...], ...]]:
    """The cases of a mask rule and ``case_index[step][rank]``, from every ring block's positions `held`
    (``[W, rows]``, -1 padding): step 0 one "positions" piece over every row (it starts the accumulators);
    later steps a piece for each pair of position runs (`commlib.masks.position_runs`) the rule does not mask
    entirely -- "full" where it masks nothing, else "positions"."""
    ring_size, rows = held.shape
    runs = [position_runs(block) for block in held]
    named: dict[tuple[Piece, ...], int] = {(Piece((0, rows), (0, rows), "positions"),): 0}
    index = []
    for step in range(ring_size):
        row = []
        for rank in range(ring_size):
            pieces: tuple[Piece, ...] = (Piece((0, rows), (0, rows), "positions"),)
            if step:
                found = []
                for q_run in runs[rank]:
                    for k_run in runs[(rank - step) % ring_size]:
                        state = classify_runs(q_run, k_run, causal, rule)
                        if state != "none":
                            mask = "full" if state == "all" else "positions"
                            found.append(Piece(q_run[:2], k_run[:2], mask))
                pieces = tuple(found)
            row.append(named.setdefault(pieces, len(named)))
        index.append(tuple(row))
    names = ("positions", *(f"rule-{number}" for number in range(1, len(named))))
    return tuple(zip(names, named, strict=True)), tuple(index)


@functools.lru_cache(maxsize=64)
def _block_positions(sequence: SequenceLayout) -> np.ndarray:
    """int64 ``[R, U * max_size]``: ring block r's rows as the ring walks them (shards r*U .. r*U+U-1, each
    padded to `max_size`), -1 for padding."""
    held = np.full((sequence.world_size, sequence.max_size), -1, dtype=np.int64)
    for index in range(sequence.world_size):
        shard = sequence.positions(index)
        held[index, : len(shard)] = shard
    held = held.reshape(sequence.ring_size, -1)
    held.setflags(write=False)
    return held


def _cases(rows: int, causal: bool, layout: str) -> tuple[tuple[str, tuple[Piece, ...]], ...]:
    """(name, pieces) of every static case of the layout; the index of each is what `case_table` holds. Case 0
    (a rank's own block) is one piece over every row."""
    every, half = (0, rows), rows // 2
    full = ("full", (Piece(every, every, "full"),))
    if not causal:
        return (full,)
    diagonal = ("diagonal", (Piece(every, every, "causal-diagonal"),))
    if layout == "contiguous":
        return diagonal, full, ("skip", ())
    # zigzag: q chunks (r, 2W-1-r) against kv chunks (s, 2W-1-s)
    return (
        diagonal,
        ("first-half", (Piece(every, (0, half), "full"),)),  # s < r: every q row sees kv chunk s only
        ("second-half", (Piece((half, rows), every, "full"),)),
    )  # s > r: q chunk 2W-1-r sees both kv chunks


def _case_of(causal: bool, rank: int, block: int) -> int:
    """Index into `_cases`: 0 for the own block (and every non-causal pair), 1 for an earlier block, 2 later."""
    if not causal or block == rank:
        return 0
    return 1 if block < rank else 2


def _check_heads(op_name: str, heads: int, kv_heads: int, ulysses_size: int, received: dict) -> None:
    if ulysses_size > heads:
        raise comm_error(op_name, f"ulysses_size ({ulysses_size}) must be <= heads ({heads})", **received)
    for name, count in (("heads", heads), ("kv heads", kv_heads)):
        if count % ulysses_size:
            raise comm_error(
                op_name, f"{name} ({count}) must be divisible by ulysses_size ({ulysses_size})", **received
            )


def ring_plan(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    v_shape: Sequence[int],
    ring_size: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str | SequenceLayout = "contiguous",
    dtypes: Sequence[str] = ("float32",) * 3,
    ulysses_size: int = 1,
    op_name: str = RING_OP,
    shard: int | None = None,
    segment_ids: tuple[Sequence[int], str] | None = None,
    mask: object = None,
) -> RingPlan:
    """The `RingPlan` of ``ring_attention(q, k, v, causal, scale, layout)`` over `ring_size` ranks, or of
    ``usp_attention`` (``op_name=USP_OP``, `ulysses_size` U) -- or `CommError` / `TypeError`.

    Shapes are one rank's inputs as the user holds them: q ``[B, S_r, H, D]``, k ``[B, S_r, H_kv, D]``, v
    ``[B, S_r, H_kv, D_v]``. A `layout` string: ``S = S_r * W * U`` and the ring walks ``rows = S_r * U`` rows
    with ``H / U`` q and ``H_kv / U`` kv heads (USP: after the Ulysses all-to-all). A `SequenceLayout` (any
    length; its ring_size and ulysses_size must be the groups' sizes): ``S_r`` is ``layout.sizes[shard]`` (torch,
    exact: `shard` the caller's shard index ``r * U + u``) or ``layout.max_size`` (JAX: `shard` None, padded);
    where the length is one the layout string cuts evenly the plan is that string's, else the ring walks ``U *
    max_size`` rows (every shard padded) with masks from global positions (`RingPlan.key_masks`).
    `segment_ids`: ``(shape, dtype name)`` of the segment ids this rank holds (``[B, S_r]``, integers: checked
    here, `commlib.masks.check_segment_ids`), None: none. `mask`: a `commlib.masks.MaskRule` (ANDed with
    `causal` and the segment ids; its cases are `_rule_cases`'), None: none.

    >>> ring_plan((1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4), 2, layout="zigzag")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: ring_attention: seq (6) must be divisible by 2 * ring_size * ulysses_size (4) for layout 'zigzag'. Received: q_shape=(1, 3, 2, 4), k_shape=(1, 3, 2, 4), v_shape=(1, 3, 2, 4), ring_size=2, layout='zigzag', ulysses_size=1
    >>> uneven = SequenceLayout(5, ring_size=2)  # shards of 3 and 2 rows
    >>> ring_plan((1, 2, 2, 4), (1, 2, 2, 4), (1, 2, 2, 4), 2, layout=uneven, shard=1).rows  # padded to 3
    3
    """
    shapes: dict[str, object] = dict(q=q_shape, k=k_shape, v=v_shape)
    received: dict[str, object] = {f"{name}_shape": shown(shape) for name, shape in shapes.items()}
    received.update(ring_size=ring_size, layout=layout, ulysses_size=ulysses_size)
    ring_size = check_int(op_name, "ring_size", ring_size, received)
    ulysses_size = check_int(op_name, "ulysses_size", ulysses_size, received)
    sequence = layout if isinstance(layout, SequenceLayout) else None
    if sequence is not None:
        _check_sequence(op_name, sequence, ring_size, ulysses_size, received)
        layout = sequence.layout
    if layout not in SEQUENCE_LAYOUTS:
        raise comm_error(op_name, f"layout ({layout!r}) must be one of {', '.join(SEQUENCE_LAYOUTS)}", **received)
    checked = check_qkv_shapes(op_name, shapes, received)
    q, k, v = checked["q"], checked["k"], checked["v"]
    _check_heads(op_name, q[2], k[2], ulysses_size, received)
    if sequence is not None:
        _check_shard_rows(op_name, sequence, shard, q[1], received)
        if sequence.names_even:
            sequence = None  # the string's plan: the same positions, no padding, no masks
    if sequence is None:
        check_layout(op_name, q[1] * ring_size * ulysses_size, ring_size, layout, ulysses_size, received)
    scale = check_attention_options(op_name, tuple(dtypes), causal, scale, q[3], received)
    if segment_ids is not None:
        check_segment_ids(op_name, shown(segment_ids[0]), str(segment_ids[1]), q, received)
    rule = check_mask(op_name, mask, received)
    if rule is not None:
        rows = q[1] * ulysses_size if sequence is None else ulysses_size * sequence.max_size
        held = _even_positions(rows * ring_size, ring_size, layout) if sequence is None else _block_positions(sequence)
        named, index = _rule_cases(held, causal, rule)
    elif sequence is None:
        rows = q[1] * ulysses_size
        named = _cases(rows, causal, layout)
        index = tuple(
            tuple(_case_of(causal, rank, (rank - step) % ring_size) for rank in range(ring_size))
            for step in range(ring_size)
        )
    else:
        rows = ulysses_size * sequence.max_size
        named = (("positions", (Piece((0, rows), (0, rows), "positions"),)),)
        index = ((0,) * ring_size,) * ring_size
    shared = tuple(step[0] if len(set(step)) == 1 else None for step in index)
    return RingPlan(
        op_name,
        ring_size,
        layout,
        causal,
        scale,
        q[0],
        rows,
        q[2] // ulysses_size,
        k[2] // ulysses_size,
        q[3],
        v[3],
        str(dtypes[0]),
        ulysses_size,
        tuple(pieces for _, pieces in named),
        tuple(name for name, _ in named),
        index,
        shared,
        sequence,
        segment_ids is not None,
        rule,
    )


def _check_sequence(op_name: str, sequence: SequenceLayout, ring_size: int, ulysses_size: int, received: dict) -> None:
    """A `SequenceLayout`'s ring and Ulysses sizes are the groups' (or mesh axes') sizes."""
    for name, want in (("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        got = getattr(sequence, name)
        if got != want:
            group = "ring" if name == "ring_size" else "Ulysses"
            raise comm_error(
                op_name, f"layout.{name} ({got}) must be the {group} group's world size ({want})", **received
            )


def _check_shard_rows(op_name: str, sequence: SequenceLayout, shard: int | None, rows: int, received: dict) -> None:
    """This rank's seq is ``sequence.sizes[shard]`` (exact) or, with `shard` None, ``sequence.max_size`` (padded)."""
    if shard is None:
        want, name = sequence.max_size, "layout.max_size"
    else:
        want, name = sequence.sizes[shard], f"layout.sizes[{shard}]"
    if rows != want:
        raise comm_error(op_name, f"seq ({rows}) must be {name} ({want})", **received)


def with_joint(plan: RingPlan, joint: JointPlan, *, mask: object = None) -> RingPlan:
    """`plan` with the joint tensors of `joint` (`commlib.joint.joint_plan`, checked against the user's q, k, v):
    `CommError` naming the layer where the ring cannot take them -- with a mask rule (its positions would be the
    concatenation's), or a `SequenceLayout` whose shards are uneven (padding rows: not supported with them).

    >>> plan = ring_plan((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8), 2, causal=True)
    >>> joint_masks(with_joint(plan, JointPlan("rear", 3)))  # the sequence sees no joint key; joint q sees it all
    (None, 'full', 'causal-diagonal')
    """
    received: dict[str, object] = dict(joint_position=joint.position, joint_seq=joint.seq)
    if mask is not None:
        message = "mask cannot be given with joint_q (a rule's positions would be the concatenation's: not supported)"
        raise comm_error(plan.op_name, message, mask=mask, **received)
    if plan.masked:
        assert plan.sequence is not None
        message = (
            f"joint_q cannot be given with a SequenceLayout whose shards are uneven (sizes {plan.sequence.sizes}): "
            "cut the sequence evenly"
        )
        raise comm_error(plan.op_name, message, layout=plan.sequence, **received)
    return dataclasses.replace(plan, joint=joint)


def joint_masks(plan: RingPlan) -> tuple[str | None, str | None, str]:
    """The masks of the joint pieces of a joint plan (None: the piece is hidden entirely, never computed):
    (this rank's q rows -> the joint k/v, the joint q -> a ring block's k/v, the joint q -> the joint k/v). With
    `causal` the concatenation's positions decide: front, the joint tokens come first (every query sees them,
    they see only each other); rear, they come last (they see everything, nothing of the sequence sees them)."""
    assert plan.joint is not None
    if not plan.causal:
        return "full", "full", "full"
    return ("full", None, "causal-diagonal") if plan.joint.front else (None, "full", "causal-diagonal")


# ---------------------------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------------------------


class RingBackend(Protocol):
    """What a walker of the ring implements, on one rank's arrays (a frontend's tensors, or the numpy
    reference's W ranks at once). Arrays are ``[B, rows, heads, dim]`` (the LSE ``[B, rows, H]``); `rows` slices
    dim 1. A backend may update an array in place and return it."""

    #: True: with segment ids, `attend`, `attend_vjp` and `when_visible` get a piece's mask as its parts (a
    #: `commlib.blockwise.SegmentedMask`: the name or key mask and the rows' ids), which the backend masks one
    #: key block at a time (JAX); False: the dense bool ``[B, 1, 1, Sq, Sk]`` of them (torch, the reference).
    blocked_masks: bool

    @property
    def math(self) -> ArrayMath:
        """The array namespace of `commlib.blockwise.merge` / `delta`."""

    def compute(self, x: Any) -> Any:
        """`x` in the plan's compute dtype."""

    def restore(self, x: Any, like: Any) -> Any:
        """`x` (compute dtype) back in the dtype of `like` (the walk's outputs)."""

    def zeros(self, like: Any) -> Any:
        """Zeros of `like`'s shape in the compute dtype (the dq, dk, dv accumulators)."""

    def attend(self, q: Any, k: Any, v: Any, mask: str) -> tuple[Any, Any]:
        """One piece's ``(out, lse)`` (`commlib.blockwise.attend` at the plan's scale)."""

    def attend_vjp(
        self, q: Any, k: Any, v: Any, out: Any, d_out: Any, lse: Any, delta: Any, mask: str
    ) -> tuple[Any, Any, Any]:
        """One piece's ``(dq, dk, dv)`` from the final `out` and `lse` (`commlib.blockwise.attend_vjp`)."""

    def set_rows(self, x: Any, rows: slice, value: Any) -> Any:
        """`x` with ``x[:, rows] = value``."""

    def add_rows(self, x: Any, rows: slice, value: Any) -> Any:
        """`x` with ``x[:, rows] += value``."""

    def start(self, arrays: list[Any]) -> Any:
        """Begin one ring step: every array of `arrays` from rank r to rank r + 1 (`RingPlan.perm`); the walk
        computes a step meanwhile and never writes `arrays` before `wait`. A backend may complete it at once."""

    def wait(self, pending: Any) -> list[Any]:
        """The arrays a `start` sent, received (as `start` got them, in order)."""

    def switch(self, step: int, function: Callable[..., Any], *operands: Any) -> Any:
        """``function(pieces, *operands)`` with the pieces of this rank's case at `step`."""

    def key_mask(self, step: int) -> Any:
        """Masked plans: this rank's ``RingPlan.key_masks(step)[rank]`` (bool ``[rows, rows]``, or anything that
        broadcasts against the scores ``[B, H_kv, G, rows, rows]`` as it)."""

    def real_rows(self, x: Any) -> Any:
        """Masked plans: `x` with the padding rows of this rank's ring block set to 0 (what a padded shard
        holds there is ignored)."""

    def block_ids(self, segments: Any, step: int) -> tuple[Any, Any]:
        """Segmented plans: ``(ids of this rank's q rows, ids of the kv block it holds at step)`` from
        `segments`, every ring block's ids as the frontend gathered them once (the backend's own layout)."""

    def gather_ring(self, x: Any) -> Any:
        """Joint plans: ``[W, *x.shape]``, every ring rank's `x` stacked in rank order (an all-gather over the
        ring; forward only, inside the walk). The same array on every rank."""

    def sum_ring(self, x: Any) -> Any:
        """Joint plans: `x` summed over the ring's ranks (an all-reduce; inside the backward walk)."""

    def when_visible(self, step: int, index: int, mask: Any, function: Callable[..., Any], *operands: Any) -> Any:
        """Segmented plans: ``function(*operands)`` where piece `index` of this rank's case at `step` is visible
        (`visible_pieces`: some entry of its bool `mask` is True), else `operands` unchanged (the skip rule; a
        backend may compute a piece that sees nothing and discard it, or keep it: it changes nothing, exactly)."""


def _at_step(
    plan: RingPlan,
    backend: RingBackend,
    step: int,
    function: Callable[..., Any],
    *operands: Any,
    segments: tuple[Any, Any] | None = None,
) -> Any:
    """`function` (a case rule) on this rank's case at `step`: static where every rank has the same case (masked
    plans: always, with this rank's mask of the step). `segments`: the ids of this rank's q rows and of the kv
    block it holds (segmented plans)."""
    shared = plan.shared_case[step]
    key_mask = backend.key_mask(step) if plan.keyed else None
    if shared is not None:
        return function(backend, plan.cases[shared], *operands, key_mask=key_mask, segments=segments, step=step)
    if segments is None and key_mask is None:
        return backend.switch(step, lambda pieces, *arrays: function(backend, pieces, *arrays), *operands)
    # the key mask and ids go in as operands: a backend may split every operand by rank (the reference's
    # simulated ranks)
    extra = ([] if key_mask is None else [key_mask]) + ([] if segments is None else list(segments))
    count = len(operands)

    def rule(pieces, *arrays):
        mask = arrays[count] if key_mask is not None else None
        ids = arrays[count + (key_mask is not None) :] or None
        return function(backend, pieces, *arrays[:count], key_mask=mask, segments=ids, step=step)

    return backend.switch(step, rule, *operands, *extra)


def _named(piece: Piece, key_mask: Any, rows: slice, keys: slice) -> Any:
    """A piece's mask before segment ids: its name, or for a "positions" piece its rows and keys of the step's
    key mask (``[..., rows, rows]``)."""
    return key_mask[..., rows, keys] if piece.mask == "positions" else piece.mask


def _piece_mask(
    math_: ArrayMath, mask: Any, segments: tuple[Any, Any] | None, rows: slice, keys: slice, blocked: bool = False
) -> Any:
    """A piece's mask: its name (or the key mask of a "positions" piece) and, with segment ids, the bool array
    ``[B, 1, 1, Sq, Sk]`` of the name's mask and `commlib.masks.segment_mask` of the piece's rows (`blocked`:
    the `SegmentedMask` of them, never made dense)."""
    if segments is None:
        return mask
    parts = SegmentedMask(mask, segments[0][:, rows], segments[1][:, keys])
    return parts if blocked else parts.dense(math_)


def _forward_case(
    backend: RingBackend,
    pieces: tuple[Piece, ...],
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    key_mask: Any = None,
    segments: tuple[Any, Any] | None = None,
    step: int = 0,
) -> tuple[Any, Any]:
    """Merge the pieces of one case into this rank's (out, lse); `out` None: the first piece (step 0's own
    block, every row) is the start. `key_mask`: the mask of a "positions" piece (masked plans); `segments`: the
    ids of the q rows and kv rows (segmented plans: a later piece that no query of it sees is skipped)."""
    for index, piece in enumerate(pieces):
        rows, keys = slice(*piece.q), slice(*piece.kv)
        mask = _piece_mask(
            backend.math, _named(piece, key_mask, rows, keys), segments, rows, keys, backend.blocked_masks
        )

        def merged(out: Any, lse: Any, rows: slice = rows, keys: slice = keys, mask: Any = mask) -> tuple[Any, Any]:
            part_out, part_lse = backend.attend(q[:, rows], k[:, keys], v[:, keys], mask)
            merged_out, merged_lse = merge_masked(backend.math, out[:, rows], lse[:, rows], part_out, part_lse)
            return backend.set_rows(out, rows, merged_out), backend.set_rows(lse, rows, merged_lse)

        if out is None:
            out, lse = backend.attend(q[:, rows], k[:, keys], v[:, keys], mask)
        elif segments is None:
            out, lse = merged(out, lse)
        else:
            out, lse = backend.when_visible(step, index, mask, merged, out, lse)
    return out, lse


def _start(plan: RingPlan, backend: RingBackend, step: int, arrays: list[Any], overlap: bool) -> Any:
    """Step `step`'s send of `arrays` (the blocks of step + 1), begun before the step computes (`overlap`),
    else sent and received at once (the sequential order); None at the last step, which sends nothing."""
    if step == plan.ring_size - 1:
        return None
    pending = backend.start(arrays)
    return pending if overlap else backend.wait(pending)


def _received(backend: RingBackend, pending: Any, overlap: bool, held: list[Any]) -> list[Any]:
    """What `_start` began, received after the step computed (`held` at the last step)."""
    if pending is None:
        return held
    return backend.wait(pending) if overlap else pending


def forward(
    plan: RingPlan,
    backend: RingBackend,
    q: Any,
    k: Any,
    v: Any,
    segments: Any = None,
    *,
    overlap: bool = True,
    joint: tuple[Any, Any, Any] | None = None,
) -> tuple[Any, ...]:
    """``(out [B, rows, H, D_v] in q's dtype, lse [B, rows, H] in the compute dtype)``: W steps of online
    softmax, W - 1 sends of k/v (in their own dtype: ``plan.wire_elements()`` a step). `segments` (segmented
    plans): every ring block's segment ids, gathered once by the frontend, laid out as its backend's
    `RingBackend.block_ids` reads them (torch and JAX: ``[W, B, rows]``); nothing of them is sent. `overlap`: step t+1's
    k/v send begins before step t's pieces and is waited after them (`RingBackend.start` / `wait`); False: sent
    and received before them (the sequential order; the same values bit for bit: only the order of the
    communication differs).

    `joint` (joint plans, `RingPlan.joint`): this rank's ``(joint_q, joint_k, joint_v)`` (``[B, S_j, *, D]``, the
    heads the ring walks; the same on every ring rank), and the result is ``(out, lse, joint_out [B, S_j, H,
    D_v] in joint_q's dtype, joint_lse [B, S_j, H])``: `_joint_forward`."""
    if plan.masked:
        q, k, v = (backend.real_rows(x) for x in (q, k, v))
    query = backend.compute(q)
    out = lse = None
    held = [k, v]
    for step in range(plan.ring_size):
        pending = _start(plan, backend, step, held, overlap)
        keys, values = backend.compute(held[0]), backend.compute(held[1])
        ids = None if segments is None else backend.block_ids(segments, step)
        out, lse = _at_step(plan, backend, step, _forward_case, query, keys, values, out, lse, segments=ids)
        held = _received(backend, pending, overlap, held)
    if joint is None:
        return backend.restore(out, q), lse
    keys, values = backend.compute(k), backend.compute(v)
    out, lse, joint_out, joint_lse = _joint_forward(plan, backend, query, keys, values, out, lse, joint)
    return backend.restore(out, q), lse, backend.restore(joint_out, joint[0]), joint_lse


def _joint_forward(
    plan: RingPlan, backend: RingBackend, query: Any, keys: Any, values: Any, out: Any, lse: Any, joint: Sequence[Any]
) -> tuple[Any, Any, Any, Any]:
    """The joint pieces (`joint_masks`; compute dtype): this rank's q rows attend the joint k/v, merged into its
    (out, lse) like a ring step; the joint q attends the joint k/v, then this rank's own k/v block (`keys`,
    `values`), whose partial ``(out, lse)`` is all-gathered over the ring (`RingBackend.gather_ring`: no
    other communication) and merged in rank order after the joint piece -- the same arrays in the same order on
    every rank, so the joint output is bit for bit the same on all of them."""
    to_joint, to_sequence, among = joint_masks(plan)
    joint_q, joint_k, joint_v = (backend.compute(x) for x in joint)
    if to_joint is not None:
        out, lse = merge_masked(backend.math, out, lse, *backend.attend(query, joint_k, joint_v, to_joint))
    joint_out, joint_lse = backend.attend(joint_q, joint_k, joint_v, among)
    if to_sequence is not None:
        part_out, part_lse = backend.attend(joint_q, keys, values, to_sequence)
        outs, lses = backend.gather_ring(part_out), backend.gather_ring(part_lse)
        for rank in range(plan.ring_size):
            joint_out, joint_lse = merge_masked(backend.math, joint_out, joint_lse, outs[rank], lses[rank])
    return out, lse, joint_out, joint_lse


def _backward_case(
    backend: RingBackend,
    pieces: tuple[Piece, ...],
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    d_out: Any,
    lse: Any,
    delta: Any,
    dq: Any,
    dk: Any,
    dv: Any,
    key_mask: Any = None,
    segments: tuple[Any, Any] | None = None,
    step: int = 0,
) -> tuple[Any, Any, Any]:
    """Add the pieces of one case to this rank's dq and the travelling dk, dv (segmented plans: the pieces the
    forward computed)."""
    for index, piece in enumerate(pieces):
        rows, keys = slice(*piece.q), slice(*piece.kv)
        mask = _piece_mask(
            backend.math, _named(piece, key_mask, rows, keys), segments, rows, keys, backend.blocked_masks
        )

        def added(
            dq: Any, dk: Any, dv: Any, rows: slice = rows, keys: slice = keys, mask: Any = mask
        ) -> tuple[Any, Any, Any]:
            grads = backend.attend_vjp(
                q[:, rows], k[:, keys], v[:, keys], out[:, rows], d_out[:, rows], lse[:, rows], delta[:, rows], mask
            )
            dq = backend.add_rows(dq, rows, grads[0])
            return dq, backend.add_rows(dk, keys, grads[1]), backend.add_rows(dv, keys, grads[2])

        if segments is None:
            dq, dk, dv = added(dq, dk, dv)
        else:
            dq, dk, dv = backend.when_visible(step, index, mask, added, dq, dk, dv)
    return dq, dk, dv


def backward(
    plan: RingPlan,
    backend: RingBackend,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    d_out: Any,
    segments: Any = None,
    *,
    overlap: bool = True,
    joint: tuple[Any, ...] | None = None,
) -> tuple[Any, ...]:
    """``(dq, dk, dv)`` in q's, k's, v's dtypes: the forward's walk again from the saved `out` and `lse`, dk/dv
    (compute dtype) travelling behind k/v (`segments` as `forward`'s), one more send of dk/dv at the end to bring them
    home. Masked plans: what padding rows hold (of q, k, v and the cotangent) is ignored, and their gradients
    are 0. `overlap` as in `forward`: step t+1's k/v (and ids) are sent while step t computes; the dk/dv of a
    step are its pieces' sums, so their send begins after them.

    `joint` (joint plans): ``(joint_q, joint_k, joint_v, joint_out, joint_lse, d_joint_out)`` as the forward
    took and gave them, with this rank's cotangent of joint_out; the result is then ``(dq, dk, dv, d joint_q,
    d joint_k, d joint_v)`` (`_joint_backward`: ``convention="sum"``)."""
    if plan.masked:
        q, k, v, d_out = (backend.real_rows(x) for x in (q, k, v, d_out))
    query, d_out_c, out_c = backend.compute(q), backend.compute(d_out), backend.compute(out)
    rowsums = delta(backend.math, out_c, d_out_c)
    dq, dk, dv = backend.zeros(q), backend.zeros(k), backend.zeros(v)
    held = [k, v]
    for step in range(plan.ring_size):
        pending = _start(plan, backend, step, held, overlap)
        keys, values = backend.compute(held[0]), backend.compute(held[1])
        ids = None if segments is None else backend.block_ids(segments, step)
        dq, dk, dv = _at_step(
            plan,
            backend,
            step,
            _backward_case,
            query,
            keys,
            values,
            out_c,
            d_out_c,
            lse,
            rowsums,
            dq,
            dk,
            dv,
            segments=ids,
        )
        dk, dv = backend.wait(backend.start([dk, dv]))
        held = _received(backend, pending, overlap, held)
    if joint is None:
        return backend.restore(dq, q), backend.restore(dk, k), backend.restore(dv, v)
    keys, values = backend.compute(k), backend.compute(v)
    final = (out_c, d_out_c, lse, rowsums)
    dq, dk, dv, joint_grads = _joint_backward(plan, backend, query, keys, values, final, dq, dk, dv, joint)
    restored = [backend.restore(x, like) for x, like in zip(joint_grads, joint[:3], strict=True)]
    return backend.restore(dq, q), backend.restore(dk, k), backend.restore(dv, v), *restored


def _joint_backward(
    plan: RingPlan,
    backend: RingBackend,
    query: Any,
    keys: Any,
    values: Any,
    final: tuple[Any, Any, Any, Any],
    dq: Any,
    dk: Any,
    dv: Any,
    joint: Sequence[Any],
) -> tuple[Any, Any, Any, tuple[Any, Any, Any]]:
    """The joint pieces' VJPs from the final outputs and LSEs (`final`: this rank's out, d_out, lse and rowsums
    of its q rows), the exact VJP of `_joint_forward` with every rank's copy of the joint tensors its own input
    (``convention="sum"``): the piece of this rank's q rows against the joint k/v adds to dq and to this rank's
    d joint_k, d joint_v; the joint q against the joint k/v (computed on every rank from its own copy) takes
    this rank's cotangent of joint_out; the joint q against this rank's k/v block (every rank's merge reads it,
    through the all-gather) takes the cotangents of every ring rank summed (`RingBackend.sum_ring`, the one
    collective) and adds to this rank's dk, dv (home after the ring's last hop). Summed over the ranks, the
    joint tensors' gradients are the full ones."""
    to_joint, to_sequence, among = joint_masks(plan)
    math_, every = backend.math, slice(None)
    joint_q, joint_k, joint_v, joint_out, joint_lse, d_joint = joint
    joint_q, joint_k, joint_v, joint_out, d_joint = (
        backend.compute(x) for x in (joint_q, joint_k, joint_v, joint_out, d_joint)
    )
    grads = [backend.zeros(x) for x in (joint_q, joint_k, joint_v)]
    if to_joint is not None:
        out, d_out, lse, rowsums = final
        part = backend.attend_vjp(query, joint_k, joint_v, out, d_out, lse, rowsums, to_joint)
        dq = backend.add_rows(dq, every, part[0])
        grads[1], grads[2] = backend.add_rows(grads[1], every, part[1]), backend.add_rows(grads[2], every, part[2])
    rowsums = delta(math_, joint_out, d_joint)
    part = backend.attend_vjp(joint_q, joint_k, joint_v, joint_out, d_joint, joint_lse, rowsums, among)
    grads = [backend.add_rows(grad, every, value) for grad, value in zip(grads, part, strict=True)]
    if to_sequence is not None:
        total = backend.sum_ring(d_joint)
        rowsums = delta(math_, joint_out, total)
        part = backend.attend_vjp(joint_q, keys, values, joint_out, total, joint_lse, rowsums, to_sequence)
        grads[0] = backend.add_rows(grads[0], every, part[0])
        dk, dv = backend.add_rows(dk, every, part[1]), backend.add_rows(dv, every, part[2])
    return dq, dk, dv, (grads[0], grads[1], grads[2])


def visible_pieces(
    plan: RingPlan, math_: ArrayMath, blocks: Any, rank: int, key_mask: Callable[[int], Any] | None = None
) -> list[list[Any]]:
    """The ring's skip rule for `rank`, decided once per call: ``[step][piece]`` a 0-d bool array of `math_`
    (computed where the ids live: no host read) saying whether piece ``piece`` of the rank's case at ``step``
    is computed -- some query of it sees some key of it (causal, positions and segments); step 0's first piece
    always is (it starts the accumulators). `blocks`: every ring block's segment ids, ``blocks[b]`` ``[B, rows]``
    (gathered once); `key_mask(step)`: the rank's mask of a "positions" piece (masked plans; default
    ``plan.key_masks(step)[rank]``). The forward and the backward walk compute exactly these pieces.

    >>> plan = ring_plan((1, 4, 1, 2), (1, 4, 1, 2), (1, 4, 1, 2), 2, causal=True, segment_ids=((1, 4), "int32"))
    >>> [[bool(x) for x in step] for step in visible_pieces(plan, NUMPY, np.array([[[0] * 4], [[1] * 4]]), 1)]
    [[True], [False]]
    """
    if key_mask is None:
        key_mask = lambda step: plan.key_masks(step)[rank]  # noqa: E731
    table: list[list[Any]] = []
    for step in range(plan.ring_size):
        ids = (blocks[rank], blocks[plan.kv_block(step, rank)])
        mask_of_step = key_mask(step) if plan.keyed else None
        row = []
        for index, piece in enumerate(plan.cases[plan.case_index[step][rank]]):
            rows, keys = slice(*piece.q), slice(*piece.kv)
            mask = _piece_mask(math_, _named(piece, mask_of_step, rows, keys), ids, rows, keys)
            seen = math_.xp.any(mask)
            row.append(seen | True if step == 0 and index == 0 else seen)
        table.append(row)
    return table


def pieces_computed(plan: RingPlan, segments: Any) -> tuple[int, int]:
    """The ring's skip rule counted (numpy, `visible_pieces`): ``(computed, scheduled)``, the pieces the forward
    walk computes over every step and rank and the pieces its schedule holds. `segments`: every rank's segment
    ids of its ring block as the ring walks it, int ``[W, B, rows]`` (None: no segment ids, nothing skipped).
    The backward computes the same pieces.

    >>> plan = ring_plan((1, 4, 1, 2), (1, 4, 1, 2), (1, 4, 1, 2), 2, causal=True, segment_ids=((1, 4), "int32"))
    >>> pieces_computed(plan, np.array([[[0, 0, 0, 0]], [[1, 1, 1, 1]]]))  # rank 1's step 1 (block 0) skipped
    (2, 3)
    """
    scheduled = sum(
        len(plan.cases[plan.case_index[step][rank]]) for step in range(plan.ring_size) for rank in range(plan.ring_size)
    )
    if segments is None:
        return scheduled, scheduled
    blocks = np.asarray(segments)
    computed = sum(
        int(bool(entry))
        for rank in range(plan.ring_size)
        for row in visible_pieces(plan, NUMPY, blocks, rank)
        for entry in row
    )
    return computed, scheduled
