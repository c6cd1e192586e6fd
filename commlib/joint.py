"""Joint attention (MMDiT: SD3, Flux; DESIGN.md "Video DiTs"): the rules of ``joint_q``, ``joint_k``, ``joint_v``
on the attention layers, the heads each rank takes of them (the float64 reference: `commlib.reference.joint`).

A DiT's video tokens are sharded over the sequence group as the layers' q, k, v; its text tokens ``joint_q``,
``joint_k``, ``joint_v`` (``[B, S_j, H, D]``, ``[B, S_j, H_kv, D]``, ``[B, S_j, H_kv, D_v]``: the main tensors'
head counts and head dims) are the same on every rank. The layer computes attention over the concatenation of
the joint tokens with the FULL sequence -- ``joint_position="front"``: ``[joint | sequence]`` (SD3, Flux: text
first), ``"rear"``: ``[sequence | joint]`` -- and returns ``(out, joint_out)``: this rank's rows of the
sequence's output and the joint tokens' output ``[B, S_j, H, D_v]``, replicated, bit for bit the same on every
rank. ``causal=True`` masks by the positions of that concatenation (front: the joint tokens are positions
``0 .. S_j - 1`` and every sequence query sees them; rear: they follow the sequence and see all of it).

Ulysses (`ulysses_joint`): after the all-to-all a rank holds the full sequence of its q heads (and the kv
heads those use), so it takes THE SAME heads of the joint tensors locally (no communication: they are
replicated), concatenates them at `position` along the sequence, attends once, cuts the joint rows off its
output and all-gathers them over the group along heads (``split_sizes(H, W)``, rank order), so every rank
holds the same ``[B, S_j, H, D_v]``.

Gradients (``convention="sum"``, every rank's loss its own, as every op): the result is the exact VJP of the
layer as a function of every rank's inputs, each rank's copy of the joint tensors being its own input. So
the joint output's cotangents of every rank are summed (the all_gather's VJP, a reduce-scatter), and rank r's
``d joint_q`` is the gradient of the summed loss in the joint q heads rank r attends with, 0 in the others;
its ``d joint_k``, ``d joint_v`` are what its q heads give the kv heads they use. Summed over the ranks they
are the full gradient (``sync_gradients`` of the replicated text branch does it in torch; in JAX a joint
tensor given once, ``in_specs=P()``, is summed by JAX itself). dq, dk, dv of the sequence are exact.

>>> plan = joint_plan("ulysses_attention", (1, 4, 6, 8), (1, 4, 2, 8), (1, 4, 2, 8),
...                   ((1, 3, 6, 8), (1, 3, 2, 8), (1, 3, 2, 8)), ("float32",) * 6, "rear", False)
>>> plan.seq, plan.position
(3, 'rear')
>>> try:
...     joint_plan("ulysses_attention", (1, 4, 6, 8), (1, 4, 2, 8), (1, 4, 2, 8),
...                ((1, 3, 6, 8), (1, 3, 3, 8), (1, 3, 2, 8)), ("float32",) * 6, "front", False)
... except ValueError as error:
...     print(str(error).split(". Received")[0])
ulysses_attention: joint_k heads (3) must equal k heads (2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from commlib.errors import comm_error, kind_error
from commlib.frontend_errors import wrong_type
from commlib.validators import shown

__all__ = ["POSITIONS", "JointPlan", "JointHeads", "check_joint_inputs", "joint_plan"]

#: Where the joint tokens stand in the concatenation: before the sequence or after it.
POSITIONS = ("front", "rear")
_NAMES = ("joint_q", "joint_k", "joint_v")


@dataclasses.dataclass(frozen=True)
class JointHeads:
    """The joint heads one head group takes (`ulysses_joint`): per rank, the joint q heads it attends with and
    the joint kv heads those use (the heads its all-to-all delivers). Exact layout: one row, this rank's;
    padded layout: a row per rank, padded to the group's largest count with an index one past the last head
    (a head of zeros, as the exchange's padding)."""

    q: tuple[tuple[int, ...], ...]  # indices into joint_q's heads
    kv: tuple[tuple[int, ...], ...]  # indices into joint_k's (and joint_v's) heads
    out_gather_sizes: tuple[int, ...] | None  # the group's q heads each rank contributes to joint_out (None: even)


@dataclasses.dataclass(frozen=True)
class JointPlan:
    """A validated joint call: where the joint tokens go, how many, and (Ulysses) the heads each group takes."""

    position: str  # one of POSITIONS
    seq: int  # S_j, the joint tokens
    groups: tuple[JointHeads, ...] = ()  # Ulysses: one per head group of the plan, in walk order

    @property
    def front(self) -> bool:
        return self.position == "front"


def check_joint_inputs(
    layer: str, joint: Sequence[object], position: object, array_types: tuple[type, ...], expected: str
) -> bool:
    """Whether the joint tensors are given (all three) -- else none -- and their kinds: `TypeError` for one
    that is not a frontend array, `CommError` when some but not all are given; `position` checked with or
    without them (a bogus one is refused, never ignored). First of all, with q, k, v's.

    >>> import numpy as np
    >>> try:
    ...     check_joint_inputs("ulysses_attention", (np.zeros(1), None, None), "front", (np.ndarray,), "numpy.ndarray")
    ... except ValueError as error:
    ...     print(str(error).split(". Received")[0])
    ulysses_attention: joint_q, joint_k and joint_v must be given together (joint_k, joint_v are None)
    """
    _check_position(layer, position, {"joint_position": position})
    given = [value is not None for value in joint]
    if not any(given):
        return False
    if not all(given):
        missing = ", ".join(name for name, present in zip(_NAMES, given, strict=True) if not present)
        state = {name: "given" if present else None for name, present in zip(_NAMES, given, strict=True)}
        message = (
            f"joint_q, joint_k and joint_v must be given together ({missing} {'is' if sum(given) == 2 else 'are'} None)"
        )
        raise comm_error(layer, message, **state)
    for name, value in zip(_NAMES, joint, strict=True):
        if not isinstance(value, array_types):
            raise wrong_type(layer, name, value, expected)
    return True


def joint_plan(
    layer: str,
    q: Sequence[int],
    k: Sequence[int],
    v: Sequence[int],
    joint_shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str],
    position: object,
    segmented: bool,
) -> JointPlan:
    """The `JointPlan` of `layer` called on q, k, v (`q`, `k`, `v`: their checked shapes) with joint tensors of
    `joint_shapes` (q, k, v's), `dtypes` (q, k, v's then the joint tensors'), `position`; `segmented`: segment
    ids given (refused: the joint tokens have none). `CommError` / `TypeError` naming `layer`, before any
    communication."""
    shapes = [shown(shape) for shape in joint_shapes]
    received: dict[str, object] = {f"{name}_shape": shape for name, shape in zip(_NAMES, shapes, strict=True)}
    received["joint_position"] = position
    _check_position(layer, position, received)
    main = dict(zip(_NAMES, (q, k, v), strict=True))
    for name, shape in zip(_NAMES, shapes, strict=True):
        _check_shape(layer, name, shape, main[name], received)
    rows = {name: shape[1] for name, shape in zip(_NAMES, shapes, strict=True)}  # type: ignore[index]
    for name in _NAMES[1:]:
        if rows[name] != rows["joint_q"]:
            raise comm_error(layer, f"{name} seq ({rows[name]}) must equal joint_q seq ({rows['joint_q']})", **received)
    if len(set(dtypes)) != 1:
        raise comm_error(
            layer,
            f"joint_q, joint_k, joint_v dtypes ({', '.join(dtypes[3:])}) must equal q's ({dtypes[0]})",
            **received,
        )
    if segmented:
        raise comm_error(
            layer, "segment_ids cannot be given with joint_q (the joint tokens have no segment ids)", **received
        )
    return JointPlan(str(position), int(rows["joint_q"]))


def _check_position(layer: str, position: object, received: dict) -> None:
    if not isinstance(position, str):
        raise kind_error(layer, f"joint_position must be a str, not {type(position).__name__}", **received)
    if position not in POSITIONS:
        raise comm_error(layer, f"joint_position ({position!r}) must be one of 'front', 'rear'", **received)


def _check_shape(layer: str, name: str, shape: object, main: Sequence[int], received: dict) -> None:
    """`shape` 4-D with the main tensor's batch, heads and head dim (its seq is S_j)."""
    if not isinstance(shape, tuple) or len(shape) != 4:
        ndim = len(shape) if isinstance(shape, tuple) else shape
        raise comm_error(layer, f"{name} ndim ({ndim}) must be 4 ([batch, seq, heads, head_dim])", **received)
    main_name = name.removeprefix("joint_")
    for axis, quantity in ((0, "batch"), (2, "heads"), (3, "head_dim")):
        if shape[axis] != main[axis]:
            message = f"{name} {quantity} ({shape[axis]}) must equal {main_name} {quantity} ({main[axis]})"
            raise comm_error(layer, message, **received)
