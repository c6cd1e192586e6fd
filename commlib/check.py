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

An attention layer (or a sequence helper) is checked once more, before its first collective, on the options
the user passed (`LayerCall`, made by `attention_call` / `layer_call`): the same fixed-size row, holding a
hash per option, and -- only where the rows differ -- each rank's options as text (`LayerCall.encode`), so
the message names the layer and the argument, not an internal buffer::

    ulysses_attention: ranks disagree on seq_sizes: ranks 0, 1, 2 have (10, 10, 10, 10), rank 3 has None. Received: ...
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import re
import zlib
from collections.abc import Sequence
from typing import assert_never

import numpy as np

from commlib import steps
from commlib.attention import OP_NAME as ULYSSES_OP
from commlib.dtypes import KINDS
from commlib.errors import comm_error
from commlib.layout import Convention, Plan
from commlib.moe import COMBINE_OP, DISPATCH_OP, ROUTE_OP, RoutePlan
from commlib.plans import OP_NAMES
from commlib.reduce_op import ReduceOp
from commlib.ring import RING_OP, USP_OP
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
    "Call",
    "LayerCall",
    "agreed_call",
    "attention_call",
    "compare",
    "compare_layers",
    "decode",
    "fingerprint",
    "layer_call",
    "layers_differ",
    "moe_call",
    "says_checked",
    "sequence_call",
]

#: The call's phase: the forward collective, or the collective(s) of its backward.
PHASES = ("forward", "backward")
_MAGIC = 0x636F6D6C_0002  # "coml", format 2 (the call's number added): tells a fingerprint from other int64 data
_SHAPE_SLOTS = 8  # sizes stored exactly up to this ndim (a hash of the whole shape always)
_PAIR_SLOTS = 4  # permute pairs stored exactly up to this many (a hash of all of them always)
_SIZE_SLOTS = 8  # uneven sizes stored exactly up to this world size (a hash of all of them always)
_NONE = -1

# Slot layout of a fingerprint (int64 each).
_VERSION, _OP, _PHASE, _WORLD, _NDIM = range(5)
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


#: The layers whose options checked mode compares (`LayerCall`); a row of another layer still compares.
LAYER_NAMES = (
    ULYSSES_OP,
    RING_OP,
    USP_OP,
    "gather_sequence",
    "cross_entropy",
    "sync_gradients",
    ROUTE_OP,
    DISPATCH_OP,
    COMBINE_OP,
)
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


def _name(code: int) -> str | None:
    return None if code == _NONE else _NAMES.get(code, f"<unknown #{code:08x}>")


def _hash(values: Sequence[object]) -> int:
    return zlib.crc32(",".join(map(str, values)).encode())


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
    strangers = [ranks[r] for r in range(len(rows)) if rows[r, _VERSION] not in (_MAGIC, _LAYER_MAGIC)]
    op_name = own.op_name if own is not None and own.op_name is not None else _runs(rows[index])
    if strangers:
        raise comm_error(
            op_name,
            f"{_ranks(strangers)} sent no commlib fingerprint: checked mode must be on on "
            f"every rank of the group, and every rank must call the same collectives",
            rank=rank,
        )
    if own is None or (rows[:, _VERSION] == _LAYER_MAGIC).any():  # a layer on some rank, a collective on another
        runs = _by_value([_runs(row) for row in rows], ("runs", "run"), ranks)
        raise comm_error(op_name, f"ranks disagree on the collective: {runs}", rank=rank)
    calls = [decode(row) for row in rows]
    assert own is not None
    name = own.collective
    message = "ranks disagree on " + "; on ".join(_differences(rows, calls, ranks))
    raise comm_error(name, message, **_received(own, rank))


# --- Layers: the options the user passed ---------------------------------------------------------------------

_LAYER_MAGIC = 0x636F6D6C_4C01  # "coml" "L", format 1: a layer's options (`LayerCall.fingerprint`)
_LAYER, _OPTION_COUNT, _OPTIONS_HASH, _OPTIONS = 1, 2, 3, 4  # slots of a layer's row; (name, value) pairs from 4
_OPTION_SLOTS = (FINGERPRINT_SIZE - _OPTIONS) // 2  # options hashed one by one (all of them in _OPTIONS_HASH)
#: Options that follow from others (a layer's `rows`: q's rows, which every rank must share only where neither
#: `seq_sizes` nor a `SequenceLayout` says otherwise): named only when no other option differs.
DERIVED = frozenset({"rows"})


def _runs(row: np.ndarray) -> str:
    """What a row's rank was about to run: a collective (and its phase) or a layer."""
    if row[_VERSION] == _LAYER_MAGIC:
        return f"{_name(int(row[_LAYER]))}"
    return decode(row).collective if row[_VERSION] == _MAGIC else "no commlib call"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _text(value: object) -> str:
    """How an option is compared and shown: numbers by value (``1 == 1.0`` as a scale), sequences item by item,
    an array or tensor by its presence (its rows may differ by design), a function by its qualified name."""
    match value:
        case None | bool() | str():
            return repr(value)
        case numbers.Integral():
            return str(int(value))
        case numbers.Real():
            number = float(value)
            return str(int(number)) if number.is_integer() else repr(number)
        case tuple() | list():
            items = [_text(item) for item in value]
            return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {type(value).__name__}"
    if callable(value):  # a function by its name; a partial or a callable object by its type's
        named = value if hasattr(value, "__qualname__") else type(value)
        return f"{getattr(named, '__module__', None) or '?'}.{named.__qualname__}"
    return _ADDRESS.sub("", repr(value))  # (an object's default repr holds its address, another on every rank)


class _Shown(str):
    """An option's text as it stands in a message's "Received: ..." part (not quoted again)."""

    def __repr__(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One rank's call of a layer as checked mode compares it: the layer's name and each option as
    ``(name, text)`` (`_text`: what a message shows, and what the fingerprint hashes), in the layer's order.

    >>> call = layer_call("ring_attention", causal=True, scale=None, layout="zigzag")
    >>> call.options
    (('causal', 'True'), ('scale', 'None'), ('layout', "'zigzag'"))
    >>> LayerCall.decode(call.encode()) == call
    True
    """

    layer: str
    options: tuple[tuple[str, str], ...]

    def fingerprint(self) -> np.ndarray:
        """`FINGERPRINT_SIZE` int64 values: the layer, the option count, a hash of all options, then (name,
        value) codes of the first options -- the same size as a collective's, so a rank that runs a collective
        where another runs a layer is told so (`compare`)."""
        row = np.full(FINGERPRINT_SIZE, _NONE, dtype=np.int64)
        row[[_VERSION, _LAYER, _OPTION_COUNT, _OPTIONS_HASH]] = [
            _LAYER_MAGIC,
            _code(self.layer),
            len(self.options),
            _hash([f"{n}={t}" for n, t in self.options]),
        ]
        codes = [_code(part) for option in self.options[:_OPTION_SLOTS] for part in option]
        row[_OPTIONS : _OPTIONS + len(codes)] = codes
        return row

    def encode(self) -> bytes:
        """The call as UTF-8 JSON: what ranks whose fingerprints differ exchange to name the options."""
        return json.dumps([self.layer, self.options]).encode()

    @staticmethod
    def decode(data: bytes) -> LayerCall:
        layer, options = json.loads(bytes(data).decode())
        return LayerCall(layer, tuple((name, text) for name, text in options))


def layer_call(layer: str, /, **options: object) -> LayerCall:
    """The `LayerCall` of `layer` called with `options` (any values: `_text` turns each into its text). A new
    option of a layer is one more keyword here, at the layer's checked-mode hook.

    >>> layer_call("ring_attention", scale=1, segment_ids=np.zeros((2, 5), dtype=np.int32)).options
    (('scale', '1'), ('segment_ids', 'a ndarray'))
    """
    return LayerCall(layer, tuple((name, _text(value)) for name, value in options.items()))


def attention_call(layer: str, shapes: Sequence[Sequence[int]], dtype: str, /, **options: object) -> LayerCall:
    """The `LayerCall` of an attention layer on q, k, v of `shapes` (``[B, S_r, H, D]``: S_r is shown as
    ``S_r``, the rows a rank holds being `seq_sizes`' and `layout`'s to say) and q's `dtype`, with `options` as
    the user passed them; ``rows`` (`DERIVED`): q's rows where every rank must hold as many (no `seq_sizes`,
    a `layout` string).

    >>> call = attention_call("ulysses_attention", [(2, 10, 8, 16)] * 3, "float32", world_size=4, seq_sizes=None)
    >>> dict(call.options)["q shape"], dict(call.options)["rows"]
    ('(2, S_r, 8, 16)', '10')
    """
    shown = {f"{name} shape": _seq_free(shape) for name, shape in zip("qkv", shapes, strict=True)}
    even = isinstance(options.get("layout", "contiguous"), str) and options.get("seq_sizes") is None
    rows = shapes[0][1] if even and len(shapes[0]) > 1 else None
    return layer_call(layer, **shown, dtype=_Shown(dtype), **options, rows=rows)


def _seq_free(shape: Sequence[int], rows: object = 1) -> _Shown:
    """``(2, 10, 8, 16) -> (2, S_r, 8, 16)``: a shape without its rows (dim `rows`, negative from the end; a
    `rows` out of range or not an int: the whole shape)."""
    index = rows + len(shape) if isinstance(rows, int) and rows < 0 else rows
    sizes = ["S_r" if dim == index else str(int(size)) for dim, size in enumerate(shape)]
    return _Shown(f"({', '.join(sizes)}{',' if len(sizes) == 1 else ''})")


def sequence_call(layer: str, shape: Sequence[int], dim: object, dtype: str, /, **options: object) -> LayerCall:
    """The `LayerCall` of a sequence helper on a tensor of `shape` whose dim `dim` holds this rank's rows (shown
    as ``S_r``), of `dtype`, with `options` as the user passed them.

    >>> sequence_call("gather_sequence", (2, 5, 64), -2, "bfloat16", dim=-2).options
    (('shape', '(2, S_r, 64)'), ('dtype', 'bfloat16'), ('dim', '-2'))
    """
    return layer_call(layer, shape=_seq_free(shape, dim), dtype=_Shown(dtype), **options)


def moe_call(op_name: str, plan: RoutePlan, shape: Sequence[int], dtype: str, /) -> LayerCall:
    """The `LayerCall` of an MoE op (``route``, ``dispatch``, ``combine``) on a tensor of `shape` (rows first:
    T or R, which differ by rank, so only the feature shape is compared) and `dtype`: E, K, capacity,
    placement, layout, feature shape and dtype, and T in the `padded` layout (its static rows hold T). Split
    sizes are runtime values and are not part of it.

    >>> from commlib.moe import route_plan
    >>> dict(moe_call("dispatch", route_plan((4, 2), "int64", 4, 2), (4, 8), "float32").options)["feature shape"]
    '(8,)'
    """
    return layer_call(
        op_name,
        num_experts=plan.num_experts,
        top_k=plan.top_k,
        capacity=plan.capacity,
        experts_per_rank=plan.experts_per_rank,
        layout=plan.layout,
        **{"feature shape": tuple(shape)[1:]},
        dtype=_Shown(dtype),
        **({"tokens": plan.tokens} if plan.layout == "padded" else {}),
    )


def layers_differ(fingerprints: np.ndarray) -> bool:
    """Whether the rows differ and every rank ran a layer: then the ranks exchange their `LayerCall.encode`
    texts and call `compare_layers` (otherwise `compare` tells what differs from the rows alone).

    >>> rows = np.stack([layer_call("ring_attention", causal=causal).fingerprint() for causal in (True, False)])
    >>> layers_differ(rows), layers_differ(rows[[0, 0]])
    (True, False)
    """
    rows = np.asarray(fingerprints, dtype=np.int64).reshape(-1, FINGERPRINT_SIZE)
    return bool((rows != rows[0]).any() and (rows[:, _VERSION] == _LAYER_MAGIC).all())


def _option_differences(calls: Sequence[LayerCall], ranks: Sequence[int]) -> dict[str, str]:
    """{option: "rank 0 has X, rank 1 has Y"} for each option the ranks differ on (`DERIVED` ones only where
    nothing else differs)."""
    values = [dict(call.options) for call in calls]
    names = dict.fromkeys(name for call in calls for name, _ in call.options)
    found = {}
    for name in names:
        texts = [value.get(name, "(not passed)") for value in values]
        if len(set(texts)) > 1:
            found[name] = _by_value(texts, ("has", "have"), ranks)
    primary = {name: text for name, text in found.items() if name not in DERIVED}
    return primary or found


def compare_layers(calls: Sequence[LayerCall], rank: int, ranks: Sequence[int] | None = None) -> None:
    """Raise `CommError` if the ranks' `LayerCall`\\ s differ (one per rank, in the group's order; `rank` this
    rank's index), naming the layer, each option the ranks differ on with every rank's value, and this rank's
    values of those options.

    >>> calls = [layer_call("ring_attention", layout=layout) for layout in ("zigzag", "contiguous")]
    >>> compare_layers(calls, rank=1)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: ring_attention: ranks disagree on layout: rank 0 has 'zigzag', rank 1 has 'contiguous'. Received: rank=1, layout='contiguous'
    """
    ranks = list(range(len(calls))) if ranks is None else list(ranks)
    own = calls[ranks.index(rank)]
    if len({call.layer for call in calls}) > 1:
        runs = _by_value([call.layer for call in calls], ("runs", "run"), ranks)
        raise comm_error(own.layer, f"ranks disagree on the collective: {runs}", rank=rank)
    found = _option_differences(calls, ranks)
    if not found:
        return
    message = "ranks disagree on " + "; on ".join(f"{name}: {text}" for name, text in found.items())
    mine = dict(own.options)
    raise comm_error(own.layer, message, rank=rank, **{name: _Shown(mine.get(name, "(not passed)")) for name in found})
