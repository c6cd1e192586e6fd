"""Checked mode for the layers: the options the user passed, compared once per call before the first collective.

An attention layer, a sequence helper or an MoE op builds one `LayerCall` of its options (`attention_call`,
`sequence_call`, `moe_call`, `layer_call`); the frontend all-gathers `LayerCall.fingerprint` -- the same
fixed-size int64 row as a collective's (`commlib.check`), holding a hash per option -- and, only where the rows
differ, each rank's options as text (`LayerCall.encode`), so that the message names the layer and the argument,
not an internal buffer::

    ulysses_attention: ranks disagree on seq_sizes: ranks 0, 1, 2 have (10, 10, 10, 10), rank 3 has None. Received: ...

The collectives' half (`commlib.check`) owns the row format and its primitives; this module adds the layers' row.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from commlib.check import FINGERPRINT_SIZE, LAYER_MAGIC, NAME_SLOT, NONE, VERSION_SLOT, by_value, name_code, text_hash
from commlib.errors import comm_error

if TYPE_CHECKING:
    from commlib.moe import RoutePlan

__all__ = [
    "DERIVED",
    "LayerCall",
    "attention_call",
    "compare_layers",
    "layer_call",
    "layers_differ",
    "moe_call",
    "sequence_call",
]

_OPTION_COUNT, _OPTIONS_HASH, _OPTIONS = 2, 3, 4  # slots of a layer's row after its name; (name, value) pairs from 4
_OPTION_SLOTS = (FINGERPRINT_SIZE - _OPTIONS) // 2  # options hashed one by one (all of them in _OPTIONS_HASH)
#: Options that follow from others (a layer's `rows`: q's rows, which every rank must share only where neither
#: `seq_sizes` nor a `SequenceLayout` says otherwise): named only when no other option differs.
DERIVED = frozenset({"rows"})


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
        row = np.full(FINGERPRINT_SIZE, NONE, dtype=np.int64)
        row[[VERSION_SLOT, NAME_SLOT, _OPTION_COUNT, _OPTIONS_HASH]] = [
            LAYER_MAGIC,
            name_code(self.layer),
            len(self.options),
            text_hash([f"{n}={t}" for n, t in self.options]),
        ]
        codes = [name_code(part) for option in self.options[:_OPTION_SLOTS] for part in option]
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
    return bool((rows != rows[0]).any() and (rows[:, VERSION_SLOT] == LAYER_MAGIC).all())


def _option_differences(calls: Sequence[LayerCall], ranks: Sequence[int]) -> dict[str, str]:
    """{option: "rank 0 has X, rank 1 has Y"} for each option the ranks differ on (`DERIVED` ones only where
    nothing else differs)."""
    values = [dict(call.options) for call in calls]
    names = dict.fromkeys(name for call in calls for name, _ in call.options)
    found = {}
    for name in names:
        texts = [value.get(name, "(not passed)") for value in values]
        if len(set(texts)) > 1:
            found[name] = by_value(texts, ("has", "have"), ranks)
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
        runs = by_value([call.layer for call in calls], ("runs", "run"), ranks)
        raise comm_error(own.layer, f"ranks disagree on the collective: {runs}", rank=rank)
    found = _option_differences(calls, ranks)
    if not found:
        return
    message = "ranks disagree on " + "; on ".join(f"{name}: {text}" for name, text in found.items())
    mine = dict(own.options)
    raise comm_error(own.layer, message, rank=rank, **{name: _Shown(mine.get(name, "(not passed)")) for name in found})
