"""Checked mode, the spec side (numpy + stdlib only).

Before each collective every rank encodes its call -- op, forward/backward, shape, dtype,
dims, reduce op, convention, root, perm, accum_dtype, uneven sizes, the call's number -- into a fixed-size int64
`fingerprint` (the same size for every op, so the exchange itself cannot mismatch), the frontend all-gathers them
over the group, and `compare` raises the same `CommError` on every rank if any rank differs::

    all_to_all_4d: ranks disagree on shape: ranks 0, 1, 3 have (2, 8, 8, 4), rank 2 has (2, 8, 12, 4). Received: ...

The call's number tells two calls of the same shape apart in their backward: a forward row carries this rank's
own number for the call (not compared), and the ranks adopt group rank 0's (`agreed_call`, unique among rank 0's
calls); each collective of the call's backward carries that agreed number, so ranks whose backwards meet
different forward calls (async handles waited in different orders, which begin the duals in different orders)
all raise rather than mix their gradients::

    all_to_all backward: ranks disagree on the forward call: rank 0 has call 7, rank 1 has call 6 (...). Received: ...

With uneven sizes held exactly (torch), ranks' shapes differ by design: the fingerprint holds the shape every
rank agrees on (`Plan.shared_in_shape`, the sharded dim at its largest size) and the sizes themselves.

The frontend sends `fingerprint` and calls `compare`; what a failed collective becomes is
`commlib.failures`.

A layer's call (the options the user passed) travels in the same fixed-size rows
(`commlib.layer_check`): slot 0 `LAYER_MAGIC`, slot 1 the layer's name code. This module knows only that much of
them, so that a rank running a collective where another runs a layer is told so; it imports no layer.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import assert_never

import numpy as np

from commlib import steps
from commlib.dtypes import KINDS
from commlib.errors import comm_error
from commlib.layer_names import LAYER_NAMES
from commlib.layout import Convention, Plan
from commlib.plans import OP_NAMES
from commlib.reduce_op import ReduceOp
from commlib.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Gather,
    Identity,
    Pad,
    Permute,
    Reduce,
    ReduceScatter,
    Scatter,
    Slice,
    Step,
)

__all__ = [
    "CALL_SLOT",
    "FINGERPRINT_SIZE",
    "PHASES",
    "ENV_VARIABLE",
    "LAYER_MAGIC",
    "NAME_SLOT",
    "NONE",
    "VERSION_SLOT",
    "Call",
    "agreed_call",
    "by_value",
    "compare",
    "decode",
    "fingerprint",
    "name_code",
    "says_checked",
    "text_hash",
]

#: The call's phase: the forward collective, or the collective(s) of its backward.
PHASES = ("forward", "backward")
_MAGIC = 0x636F6D6C_0002  # "coml", format 2 (the call's number added): tells a fingerprint from other int64 data
#: Slot 0 of a layer's row (`commlib.layer_check.LayerCall.fingerprint`): "coml" "L", format 1.
LAYER_MAGIC = 0x636F6D6C_4C01
_SHAPE_SLOTS = 8  # sizes stored exactly up to this ndim (a hash of the whole shape always)
_PAIR_SLOTS = 4  # permute pairs stored exactly up to this many (a hash of all of them always)
_SIZE_SLOTS = 8  # uneven sizes stored exactly up to this world size (a hash of all of them always)
#: An empty slot (a None, a size past the last).
NONE = _NONE = -1

# Slot layout of a fingerprint (int64 each).
_VERSION, _OP, _PHASE, _WORLD, _NDIM = range(5)
#: Slot 0 of every row, a collective's or a layer's: which format it is (`_MAGIC`, `LAYER_MAGIC`).
VERSION_SLOT = _VERSION
#: Slot 1 of a layer's row: its name's code (`name_code`).
NAME_SLOT = 1
_SHAPE = 5
_SHAPE_HASH = _SHAPE + _SHAPE_SLOTS
_DTYPE, _DIM0, _DIM1, _REDUCE, _CONVENTION, _ROOT, _ACCUM, _PAIR_COUNT, _PAIR_HASH = range(
    _SHAPE_HASH + 1, _SHAPE_HASH + 10
)
_PAIRS = _PAIR_HASH + 1
_SCATTER_SIZES = _PAIRS + _PAIR_SLOTS  # hash, then the first _SIZE_SLOTS sizes
_GATHER_SIZES = _SCATTER_SIZES + 1 + _SIZE_SLOTS
_GRAD_SCALE = _GATHER_SIZES + 1 + _SIZE_SLOTS  # the float64's bits (shard's scale_grad: 1/W)
#: The slot of the call's number (forward: this rank's own, not compared; backward: the forward's agreed one).
CALL_SLOT = _GRAD_SCALE + 1
#: Number of int64 values every rank sends, whatever the op.
FINGERPRINT_SIZE = 48
assert CALL_SLOT + 1 <= FINGERPRINT_SIZE

# Names a fingerprint's codes decode back to (any other name still compares, shown by its code).
#: The environment variable that turns checked mode on (both frontends; torch also has `set_checked` / `checked`).
ENV_VARIABLE = "COMMLIB_CHECK"


def says_checked(value: str | bytes | None) -> bool:
    """Whether a value of ``COMMLIB_CHECK`` turns checked mode on: set, and not empty, 0, false, no or off.

    >>> says_checked("1"), says_checked(" Off "), says_checked(None)
    (True, False, False)
    """
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return text is not None and text.strip().lower() not in ("", "0", "false", "no", "off")


_KNOWN_NAMES = (
    *OP_NAMES,
    "send/recv",
    *(op.value for op in ReduceOp),
    *(convention.value for convention in Convention),
    *KINDS,
    *LAYER_NAMES,
)


def _code(name: str | None) -> int:
    """A stable code for a name or a str enum's value (crc32; the same on every rank and version), -1 for None."""
    return _NONE if name is None else zlib.crc32(str.encode(name))


_NAMES = {_code(name): name for name in _KNOWN_NAMES}
#: A name's code in a row (crc32 of its UTF-8; -1 for None): the same on every rank and version.
name_code = _code


def _name(code: int) -> str | None:
    return None if code == _NONE else _NAMES.get(code, f"<unknown #{code:08x}>")


def _hash(values: Sequence[object]) -> int:
    return zlib.crc32(",".join(map(str, values)).encode())


#: The code of a sequence's texts (crc32 of their comma-joined strings).
text_hash = _hash


def _slots(values: Sequence[int], count: int) -> list[int]:
    return [*values[:count], *[_NONE] * (count - len(values[:count]))]


def _sizes_slots(sizes: tuple[int, ...] | None) -> list[int]:
    """The hash of uneven sizes (-1: even), then the first `_SIZE_SLOTS` of them."""
    return [_NONE, *[_NONE] * _SIZE_SLOTS] if sizes is None else [_hash(sizes), *_slots(sizes, _SIZE_SLOTS)]


def _step_slots(step: Step) -> tuple[ReduceOp | None, int | None, tuple[tuple[int, int], ...]]:
    """What a step adds to its dims: (reduce op, root, pairs), None / () where it has none."""
    match step:
        case AllReduce(op=op) | ReduceScatter(op=op):
            return op, None, ()
        case Reduce(op=op, root=root):
            return op, root, ()
        case Broadcast(root=root) | Gather(root=root) | Scatter(root=root):
            return None, root, ()
        case Permute(pairs=pairs):
            return None, None, pairs
        case AllGather() | AllToAll() | Identity() | Slice() | Pad():
            return None, None, ()
        case _:
            assert_never(step)


def fingerprint(plan: Plan, dtype: str, phase: str = "forward", call: int | None = None) -> np.ndarray:
    """This rank's call as `FINGERPRINT_SIZE` int64 values (`plan` is the forward plan in both phases;
    `dtype` the tensor's, which a backward's cotangent may change; `call` the call's number, None: unnumbered:
    in a forward this rank's own number, in a backward the forward call's `agreed_call`).

    >>> from commlib import plans
    >>> call = decode(fingerprint(plans.all_gather((2, 3), 4, dim=0), "bfloat16", "backward"))
    >>> call.collective, call.shape, call.dtype, call.dims
    ('all_gather backward', (2, 3), 'bfloat16', (0,))
    """
    row = np.zeros(FINGERPRINT_SIZE, dtype=np.int64)
    shape, (reduce_op, root, pairs) = plan.shared_in_shape, _step_slots(plan.step)
    dims, sized = _slots(steps.dims(plan.step), 2), plan.uneven
    row[[_VERSION, _OP, _PHASE, _WORLD, _NDIM]] = [
        _MAGIC,
        _code(plan.op_name),
        PHASES.index(phase),
        plan.world_size,
        len(shape),
    ]
    row[_SHAPE:_SHAPE_HASH] = _slots(shape, _SHAPE_SLOTS)
    row[_SHAPE_HASH] = _hash(shape)
    row[[_DTYPE, _DIM0, _DIM1, _REDUCE, _CONVENTION, _ROOT, _ACCUM, _PAIR_COUNT, _PAIR_HASH]] = [
        _code(dtype),
        *dims,
        _code(reduce_op),
        _code(plan.convention),
        _NONE if root is None else root,
        _code(plan.arithmetic.accum_dtype),
        len(pairs),
        _hash(pairs),
    ]
    row[_PAIRS : _PAIRS + _PAIR_SLOTS] = _slots(
        [(source << 32) | destination for source, destination in pairs], _PAIR_SLOTS
    )
    row[_SCATTER_SIZES:_GATHER_SIZES] = _sizes_slots(None if sized is None else sized.scatter_sizes)
    row[_GATHER_SIZES : _GATHER_SIZES + 1 + _SIZE_SLOTS] = _sizes_slots(None if sized is None else sized.gather_sizes)
    row[_GRAD_SCALE] = np.float64(plan.arithmetic.grad_scale).view(np.int64)
    row[CALL_SLOT] = _NONE if call is None else call
    return row


def agreed_call(fingerprints: np.ndarray) -> int | None:
    """The number the ranks of a forward exchange adopt for the call (`compare`'d rows, in group order): group
    rank 0's own, unique among its calls and the same on every rank whatever each rank counted. None: unnumbered.

    >>> from commlib import plans
    >>> plan = plans.all_reduce((3,), 2)
    >>> agreed_call(np.stack([fingerprint(plan, "float32", call=7), fingerprint(plan, "float32", call=3)]))
    7
    """
    number = int(np.asarray(fingerprints, dtype=np.int64).reshape(-1, FINGERPRINT_SIZE)[0, CALL_SLOT])
    return None if number == _NONE else number


@dataclasses.dataclass(frozen=True)
class Call:
    """A decoded fingerprint: what one rank was about to run. Fields print as they appear in messages."""

    op_name: str | None
    phase: str
    world_size: int
    shape: tuple[int, ...] | str  # a str when over 8 dims (only the first 8 are known)
    dtype: str | None
    dims: tuple[int, ...]
    reduce_op: str | None
    convention: str | None
    root: int | None
    accum_dtype: str | None
    perm: tuple[tuple[int, int], ...] | str  # a str when over 4 pairs (only the first 4 are known)
    scatter_sizes: tuple[int, ...] | str | None = None  # uneven sizes; a str when over 8 ranks
    gather_sizes: tuple[int, ...] | str | None = None
    grad_scale: float = 1.0  # the VJP's extra factor (shard's scale_grad)
    call: int | None = None  # the call's number (forward: this rank's own; backward: the forward's agreed one)

    @property
    def collective(self) -> str:
        return f"{self.op_name}" if self.phase == "forward" else f"{self.op_name} backward"


def _shape(row: np.ndarray) -> tuple[int, ...] | str:
    ndim = int(row[_NDIM])
    sizes = tuple(int(size) for size in row[_SHAPE : _SHAPE + min(ndim, _SHAPE_SLOTS)])
    if ndim <= _SHAPE_SLOTS:
        return sizes
    return f"({', '.join(map(str, sizes))}, ...) [{ndim}-d, hash {int(row[_SHAPE_HASH]):08x}]"


def _perm(row: np.ndarray) -> tuple[tuple[int, int], ...] | str:
    count = int(row[_PAIR_COUNT])
    pairs = tuple((int(code) >> 32, int(code) & 0xFFFFFFFF) for code in row[_PAIRS : _PAIRS + min(count, _PAIR_SLOTS)])
    if count <= _PAIR_SLOTS:
        return pairs
    text = ", ".join(f"({source}, {destination})" for source, destination in pairs)
    return f"({text}, ...) [{count} pairs, hash {int(row[_PAIR_HASH]):08x}]"


def _sizes(row: np.ndarray, slot: int, world_size: int) -> tuple[int, ...] | str | None:
    if row[slot] == _NONE:
        return None
    sizes = tuple(int(size) for size in row[slot + 1 : slot + 1 + min(world_size, _SIZE_SLOTS)])
    if world_size <= _SIZE_SLOTS:
        return sizes
    return f"({', '.join(map(str, sizes))}, ...) [{world_size} sizes, hash {int(row[slot]):08x}]"


def decode(row: np.ndarray) -> Call:
    """The `Call` a fingerprint describes (shapes over 8 dims and perms over 4 pairs are shown in part)."""
    dims = tuple(int(dim) for dim in row[[_DIM0, _DIM1]] if dim != _NONE)
    phase = int(row[_PHASE])
    return Call(
        op_name=_name(int(row[_OP])),
        phase=PHASES[phase] if 0 <= phase < len(PHASES) else f"<phase {phase}>",
        world_size=int(row[_WORLD]),
        shape=_shape(row),
        dtype=_name(int(row[_DTYPE])),
        dims=dims,
        reduce_op=_name(int(row[_REDUCE])),
        convention=_name(int(row[_CONVENTION])),
        root=None if row[_ROOT] == _NONE else int(row[_ROOT]),
        accum_dtype=_name(int(row[_ACCUM])),
        perm=_perm(row),
        scatter_sizes=_sizes(row, _SCATTER_SIZES, int(row[_WORLD])),
        gather_sizes=_sizes(row, _GATHER_SIZES, int(row[_WORLD])),
        grad_scale=float(row[_GRAD_SCALE : _GRAD_SCALE + 1].view(np.float64)[0]),
        call=None if row[CALL_SLOT] == _NONE else int(row[CALL_SLOT]),
    )


# What ranks may disagree on, in the order reported: (label, slots compared, how a Call shows it).
_ASPECTS = (
    ("world_size", [_WORLD], lambda call: str(call.world_size)),
    ("shape", [_NDIM, *range(_SHAPE, _SHAPE_HASH + 1)], lambda call: str(call.shape)),
    ("dtype", [_DTYPE], lambda call: str(call.dtype)),
    ("dims", [_DIM0, _DIM1], lambda call: str(call.dims)),
    ("reduce op", [_REDUCE], lambda call: str(call.reduce_op)),
    ("convention", [_CONVENTION], lambda call: str(call.convention)),
    ("root", [_ROOT], lambda call: str(call.root)),
    ("accum_dtype", [_ACCUM], lambda call: str(call.accum_dtype)),
    ("perm", [_PAIR_COUNT, _PAIR_HASH, *range(_PAIRS, _PAIRS + _PAIR_SLOTS)], lambda call: str(call.perm)),
    ("scatter_sizes", list(range(_SCATTER_SIZES, _GATHER_SIZES)), lambda call: str(call.scatter_sizes)),
    ("gather_sizes", list(range(_GATHER_SIZES, _GATHER_SIZES + 1 + _SIZE_SLOTS)), lambda call: str(call.gather_sizes)),
    ("grad_scale", [_GRAD_SCALE], lambda call: str(call.grad_scale)),
    ("the forward call", [CALL_SLOT], lambda call: f"call {call.call}"),  # (compared in a backward only)
)
#: Why the forward calls of a backward differ (the message's hint).
_CALL_HINT = (
    "every rank must run the backward of its collectives in the same order; with async_op=True, wait the "
    "handles in the same order on every rank: the backward begins the duals in the reverse order of the waits"
)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _by_value(values: list[str], verb: tuple[str, str], ranks: Sequence[int]) -> str:
    """``"ranks 0, 1, 3 have X, rank 2 has Y"``: ranks grouped by value, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for rank, value in zip(ranks, values, strict=True):
        groups.setdefault(value, []).append(rank)
    return ", ".join(f"{_ranks(members)} {verb[len(members) > 1]} {value}" for value, members in groups.items())


by_value = _by_value


def _differences(rows: np.ndarray, calls: list[Call], ranks: Sequence[int]) -> list[str]:
    if len({call.collective for call in calls}) > 1:  # op or phase: the other aspects don't compare
        return [f"the collective: {_by_value([call.collective for call in calls], ('runs', 'run'), ranks)}"]
    found: list[str] = []
    for label, slots, show in _ASPECTS:
        if len({tuple(row) for row in rows[:, slots].tolist()}) > 1:
            if label == "root":
                label = "dst" if calls[0].op_name == "gather" else "src"
            if slots == [CALL_SLOT] and found:  # (the last aspect) named only where nothing else differs
                break
            found.append(f"{label}: {_by_value([show(call) for call in calls], ('has', 'have'), ranks)}")
            found[-1] += f" ({_CALL_HINT})" if slots == [CALL_SLOT] else ""
    return found or ["the call (their fingerprints differ)"]


def _received(call: Call, rank: int) -> dict[str, object]:
    """This rank's own call, for the message's "Received:" part (defaults left out)."""
    # keys are the user's keyword names: the reduction is `op` in every public signature
    received = dict(
        rank=rank,
        phase=call.phase,
        shape=call.shape,
        dtype=call.dtype,
        op=call.reduce_op,
        dims=call.dims,
        convention=None if call.convention == "sum" else call.convention,
        root=call.root,
        accum_dtype=call.accum_dtype,
        perm=call.perm if call.op_name in ("permute", "send/recv") else None,
        scatter_sizes=call.scatter_sizes,
        gather_sizes=call.gather_sizes,
        grad_scale=None if call.grad_scale == 1.0 else call.grad_scale,
        call=call.call if call.phase == "backward" else None,
    )
    return {key: value for key, value in received.items() if value is not None and value != ()}


def _runs(row: np.ndarray) -> str:
    """What a row's rank was about to run: a collective (and its phase) or a layer."""
    if row[_VERSION] == LAYER_MAGIC:
        return f"{_name(int(row[NAME_SLOT]))}"
    return decode(row).collective if row[_VERSION] == _MAGIC else "no commlib call"


def compare(fingerprints: np.ndarray, rank: int, ranks: Sequence[int] | None = None) -> None:
    """Raise `CommError` if the rows of `fingerprints` differ: one per group rank in group-local order, or one
    per rank of `ranks` (the two ends of a send/recv); `rank` is this rank's group-local rank.

    Every rank gets the same array, so every rank raises; the message names the op (this rank's), each
    aspect the ranks disagree on with every rank's value, and ends with this rank's own call. A forward's call
    numbers (each rank's own) are not compared; a backward's (the forward's `agreed_call`) are.

    >>> from commlib import plans
    >>> rows = np.stack([fingerprint(plans.all_reduce(shape, 2), "float32") for shape in [(3,), (4,)]])
    >>> compare(rows, rank=0)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: all_reduce: ranks disagree on shape: rank 0 has (3,), rank 1 has (4,). Received: rank=0, phase='forward', shape=(3,), dtype='float32', op='sum'
    """
    rows = np.asarray(fingerprints, dtype=np.int64).reshape(-1, FINGERPRINT_SIZE)
    if (rows == rows[0]).all():  # (the common case first: ~3 us)
        return
    forward = (rows[:, _VERSION] == _MAGIC) & (rows[:, _PHASE] == PHASES.index("forward"))
    if forward.any():  # a forward's numbers are each rank's own: not compared (`agreed_call`)
        rows = rows.copy()
        rows[forward, CALL_SLOT] = _NONE
        if (rows == rows[0]).all():
            return
    ranks = list(range(len(rows))) if ranks is None else list(ranks)
    index = ranks.index(rank)
    own = decode(rows[index]) if rows[index, _VERSION] == _MAGIC else None
    strangers = [ranks[r] for r in range(len(rows)) if rows[r, _VERSION] not in (_MAGIC, LAYER_MAGIC)]
    op_name = own.op_name if own is not None and own.op_name is not None else _runs(rows[index])
    if strangers:
        raise comm_error(
            op_name,
            f"{_ranks(strangers)} sent no commlib fingerprint: checked mode must be on on "
            f"every rank of the group, and every rank must call the same collectives",
            rank=rank,
        )
    if own is None or (rows[:, _VERSION] == LAYER_MAGIC).any():  # a layer on some rank, a collective on another
        runs = _by_value([_runs(row) for row in rows], ("runs", "run"), ranks)
        raise comm_error(op_name, f"ranks disagree on the collective: {runs}", rank=rank)
    calls = [decode(row) for row in rows]
    assert own is not None
    name = own.collective
    message = "ranks disagree on " + "; on ".join(_differences(rows, calls, ranks))
    raise comm_error(name, message, **_received(own, rank))
