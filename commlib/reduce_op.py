"""Reduction operators and the dtype rules that go with them."""

from __future__ import annotations

import enum

from commlib.errors import comm_error, kind_error

__all__ = ["ReduceOp", "parse_reduce_op", "FLOAT_BITS", "FLOAT_FORMATS", "FLOAT_DTYPES", "is_floating"]

#: Bits of each floating dtype (numpy / torch / jax spelling without the module prefix).
FLOAT_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
#: (exponent bits, mantissa bits) of each floating dtype (IEEE 754 binary16/32/64; bfloat16: Google Brain's
#: truncated binary32). One dtype holds every value of another exactly iff it has at least as many of both.
FLOAT_FORMATS = {"float16": (5, 10), "bfloat16": (8, 7), "float32": (8, 23), "float64": (11, 52)}
#: dtype names that carry gradients.
FLOAT_DTYPES = frozenset(FLOAT_BITS)


class ReduceOp(str, enum.Enum):
    """The reductions of `all_reduce` / `reduce_scatter`; the value is the accepted string spelling."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    def __repr__(self) -> str:  # error messages show what a string would: op='sum'
        return repr(self.value)


def is_floating(dtype: str) -> bool:
    """True for the floating dtypes that carry gradients (`FLOAT_DTYPES`)."""
    return dtype in FLOAT_DTYPES


def parse_reduce_op(op: object, *, op_name: str, received: dict | None = None) -> ReduceOp:
    """Normalise `op` to a `ReduceOp`.

    Accepts a `ReduceOp`, its string value in any case (``"sum"``, ``"MAX"``), or any object with a
    string ``name`` attribute such as ``torch.distributed.ReduceOp.SUM`` (read by duck typing: the spec
    never imports torch).

    Raises:
        CommError: an unknown name (e.g. ``torch.distributed.ReduceOp.BAND``).
        TypeError: `op` is neither a string nor has a ``name``.

    >>> parse_reduce_op("MAX", op_name="all_reduce")
    'max'
    >>> parse_reduce_op("band", op_name="all_reduce")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: all_reduce: op ('band') must be one of sum, avg, max, min, product. Received: op='band'
    """
    if isinstance(op, ReduceOp):
        return op
    received = received if received is not None else {"op": op}
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if not isinstance(name, str):
        raise kind_error(op_name, f"op must be a string or a ReduceOp, not {type(op).__name__}", **received)
    try:
        return ReduceOp(name.lower())
    except ValueError:
        known = ", ".join(member.value for member in ReduceOp)
        raise comm_error(op_name, f"op ({name!r}) must be one of {known}", **received) from None
