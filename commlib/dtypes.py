"""What the spec knows about dtypes beyond the floating ones (numpy + stdlib only): each name's kind and size,
and the rule for a dtype the backend cannot carry (`wire_dtypes`).

A frontend tells a plan builder which dtypes its backend carries (``backend_dtypes=``: torch's gloo lacks int16,
uint16, uint32, uint64, every float8 and the bit/sub-byte dtypes; its NCCL lacks the same but float8); None
means the backend carries every dtype (jax.lax). The spec then picks how the data travels:

- data movement (gather, scatter, broadcast, all_to_all, permute, no arithmetic): the same bits viewed as a
  same-size dtype the backend carries (int16 -> float16, uint32 -> int32, float8 -> uint8): exact for any bits;
- integer sum and product: a same-size integer (two's complement and unsigned arithmetic agree modulo
  2**bits) viewed, else a wider integer cast (the result cast back keeps the low bits: exact modulo 2**bits,
  as the dtype's own wrapping arithmetic);
- integer max and min: a wider signed integer that holds every value, cast (uint64 has none: refused);
- float8 on every backend: max and min in float32 (holds every float8 value exactly); sum, avg and product
  are refused: no carrier rounds them the same way on every backend (cast to a wider float first).

>>> wire_dtypes("all_gather", "int16", None, frozenset({"float16", "int32"}))
('float16', None)
>>> wire_dtypes("all_reduce", "uint16", ReduceOp.MAX, frozenset({"float16", "int32"}))
(None, 'int32')
"""

from __future__ import annotations

from collections.abc import Collection

from commlib.errors import comm_error
from commlib.reduce_op import FLOAT_BITS, ReduceOp

__all__ = ["KINDS", "bits", "has_nan", "is_complex", "kind", "wire_dtypes"]

_FLOAT8 = (
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
)
_OPAQUE = (
    "bits8",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "float4_e2m1fn_x2",
    *(f"int{n}" for n in range(1, 8)),
    *(f"uint{n}" for n in range(1, 8)),
)

#: dtype name -> (kind, bits per element in memory). Kinds: bool, int, uint, float (carries gradients),
#: float8 (narrow floats: no gradients), complex, opaque (packed or bit types: data movement only).
KINDS: dict[str, tuple[str, int]] = {
    "bool": ("bool", 8),
    **{f"int{n}": ("int", n) for n in (8, 16, 32, 64)},
    **{f"uint{n}": ("uint", n) for n in (8, 16, 32, 64)},
    **{name: ("float", size) for name, size in FLOAT_BITS.items()},
    **dict.fromkeys(_FLOAT8, ("float8", 8)),
    "complex32": ("complex", 32),
    "complex64": ("complex", 64),
    "complex128": ("complex", 128),
    **dict.fromkeys(_OPAQUE, ("opaque", 8)),
    "bits16": ("opaque", 16),
}

# Carriers in order of preference: integers first (a view keeps integer bits intact on any backend).
_SAME_SIZE_ORDER = (
    "int8",
    "uint8",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
)
_WIDER_INTEGERS = ("int32", "int64")


def kind(dtype: str) -> str | None:
    """The kind of a dtype name (see `KINDS`), None for a name the spec does not know."""
    entry = KINDS.get(dtype)
    return None if entry is None else entry[0]


def bits(dtype: str) -> int | None:
    """Bits per element of a dtype name, None for a name the spec does not know."""
    entry = KINDS.get(dtype)
    return None if entry is None else entry[1]


def has_nan(dtype: str) -> bool:
    """True for the real dtypes with a NaN (floating and float8): max/min's NaN rule applies to them."""
    return kind(dtype) in ("float", "float8")


def is_complex(dtype: str) -> bool:
    return kind(dtype) == "complex"


def _same_size(dtype: str, backend_dtypes: Collection[str], kinds: tuple[str, ...] | None = None) -> str | None:
    size = bits(dtype)
    for name in _SAME_SIZE_ORDER:
        if name in backend_dtypes and bits(name) == size and (kinds is None or kind(name) in kinds):
            return name
    return None


def _float8(op_name: str, dtype: str, reduce_op: ReduceOp, received: dict) -> tuple[None, str]:
    if reduce_op in (ReduceOp.MAX, ReduceOp.MIN):
        return None, "float32"
    message = (
        f"op ({reduce_op.value!r}) on {dtype} is not supported: its rounding differs between backends; "
        f"cast x to float32 or bfloat16 first"
    )
    raise comm_error(op_name, message, **received, dtype=dtype)


def _integer(
    op_name: str, dtype: str, reduce_op: ReduceOp, backend_dtypes: Collection[str], received: dict
) -> tuple[str | None, str | None]:
    if reduce_op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        view = _same_size(dtype, backend_dtypes, ("int", "uint"))
        if view is not None:
            return view, None
    size = bits(dtype) or 0
    for name in _WIDER_INTEGERS:  # signed and wider: holds every value of a narrower int or uint
        if name in backend_dtypes and (bits(name) or 0) > size:
            return None, name
    message = (
        f"op ({reduce_op.value!r}) on {dtype} has no exact carrier: the backend lacks {dtype} and any "
        f"wider integer that holds every {dtype} value; cast x to a dtype it carries first"
    )
    raise comm_error(op_name, message, **received, dtype=dtype)


def wire_dtypes(
    op_name: str,
    dtype: str,
    reduce_op: ReduceOp | None,
    backend_dtypes: Collection[str] | None,
    received: dict | None = None,
) -> tuple[str | None, str | None]:
    """``(view, cast)``: how `dtype` travels through a backend that carries the dtypes in `backend_dtypes`.

    `view`: a same-size dtype the bits are reinterpreted as (None: no view); `cast`: a wider dtype the
    reduction runs in, cast back after (None: no cast). At most one is set. ``(None, None)`` when the
    backend carries `dtype` (or `backend_dtypes` is None) and no spec rule applies. `reduce_op` None: pure data
    movement.

    Raises:
        CommError: no exact carrier (uint64 max/min without uint64, a reduction of a bit type, a dtype whose
            size no dtype of the backend has), and float8 sum/avg/product on any backend.
    """
    received = dict(received or {})
    if reduce_op is not None and kind(dtype) == "float8":
        return _float8(op_name, dtype, reduce_op, received)
    if backend_dtypes is None or dtype in backend_dtypes:
        return None, None
    if reduce_op is not None and kind(dtype) in ("int", "uint"):
        return _integer(op_name, dtype, reduce_op, backend_dtypes, received)
    view = _same_size(dtype, backend_dtypes) if reduce_op is None and bits(dtype) is not None else None
    if view is not None:
        return view, None
    if reduce_op is None:
        message = f"data movement of {dtype} has no carrier: the backend lacks {dtype} and every dtype of its size"
    else:
        message = (
            f"op ({reduce_op.value!r}) on {dtype} is not supported: the backend lacks {dtype}, and no other "
            f"dtype computes it exactly"
        )
    raise comm_error(op_name, message, **received, dtype=dtype)
