"""The checks every layer and op shares, raised before any communication with the caller's name: ints, q/k/v
shapes and the attention options. Each takes the name of the op or layer the user called first, and
``received`` (what the message's "Received: ..." part shows).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

from commlib.errors import comm_error, kind_error
from commlib.reduce_op import FLOAT_DTYPES, is_floating

__all__ = ["check_attention_options", "check_int", "check_qkv_shapes", "iterable", "shown"]


def iterable(value: object) -> Iterable[Any]:
    """`value` itself where it is iterable, else the TypeError iterating it would raise (the callers' kind
    checks catch it), so a user's shape, sizes or pairs are iterated typed.

    >>> list(iterable((2, 3)))
    [2, 3]
    >>> iterable(4)
    Traceback (most recent call last):
    ...
    TypeError: 'int' object is not iterable
    """
    if not isinstance(value, Iterable):
        raise TypeError(f"{type(value).__name__!r} object is not iterable")
    return value


def check_int(op_name: str, name: str, value: object, received: dict) -> int:
    """`value` as an int (`operator.index`), or `TypeError` naming `op_name` and `name` (a bool, a float, a
    traced JAX value: ranks and sizes are static).

    >>> check_int("all_gather", "dim", 1.0, {})
    Traceback (most recent call last):
    ...
    TypeError: all_gather: dim must be an int, not float.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise kind_error(op_name, f"{name} must be an int, not {type(value).__name__}", **received)
    try:
        return operator.index(value)
    except TypeError:  # an __index__ that refuses: a traced JAX value (ranks and sizes are static)
        traced = f"traced {type(value).__name__}"
        shown = {key: f"<{traced}>" if item is value else item for key, item in received.items()}
        raise kind_error(op_name, f"{name} must be a static int, not a {traced}", **shown) from None


#: Appended to a seq mismatch where q's dim 2 matches k's (or v's) seq or heads: q given in SDPA's order.
_SDPA_HINT = (
    " (q, k and v are [batch, seq, heads, head_dim]: SDPA's [batch, heads, seq, head_dim] needs .transpose(1, 2))"
)


def check_qkv_shapes(op_name: str, shapes: dict[str, object], received: dict) -> dict[str, tuple[int, ...]]:
    """q, k, v shapes checked (4-D, agreeing batch, seq, heads and head_dim, H % H_kv == 0) for `op_name`.

    >>> check_qkv_shapes("ring_attention", {"q": (1, 4, 8, 16), "k": (1, 4, 3, 16), "v": (1, 4, 3, 16)}, {})
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: ring_attention: heads (8) must be divisible by kv heads (3).
    """
    checked: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        try:
            dims = tuple(operator.index(size) for size in iterable(shape))
        except TypeError:
            raise kind_error(op_name, f"{name} shape must be a sequence of ints", **received) from None
        if len(dims) != 4:
            raise comm_error(
                op_name, f"{name} ndim ({len(dims)}) must be 4 ([batch, seq, heads, head_dim])", **received
            )
        checked[name] = dims
    q, k, v = checked["q"], checked["k"], checked["v"]
    for name, dims in (("k", k), ("v", v)):
        for axis, quantity in ((0, "batch"), (1, "seq")):
            if dims[axis] != q[axis]:
                hint = _SDPA_HINT if quantity == "seq" and q[2] in dims[1:3] else ""
                raise comm_error(
                    op_name, f"{name} {quantity} ({dims[axis]}) must equal q {quantity} ({q[axis]}){hint}", **received
                )
    if v[2] != k[2]:
        raise comm_error(op_name, f"v heads ({v[2]}) must equal k heads ({k[2]})", **received)
    if k[3] != q[3]:
        raise comm_error(op_name, f"k head_dim ({k[3]}) must equal q head_dim ({q[3]})", **received)
    if k[2] < 1 or q[2] < 1:
        raise comm_error(op_name, f"heads ({q[2]}) and kv heads ({k[2]}) must be >= 1", **received)
    if q[2] % k[2]:
        raise comm_error(op_name, f"heads ({q[2]}) must be divisible by kv heads ({k[2]})", **received)
    return checked


def check_attention_options(
    op_name: str, dtypes: Sequence[str], causal: object, scale: object, head_dim: int, received: dict
) -> float:
    """The softmax scale, after checking dtypes, `causal` and `scale` for `op_name`.

    >>> check_attention_options("ulysses_attention", ("float32",) * 3, False, None, 16, {})
    0.25
    """
    if len(set(dtypes)) != 1:
        raise comm_error(op_name, f"q, k, v dtypes ({', '.join(dtypes)}) must be equal", **received)
    if not is_floating(dtypes[0]):  # softmax of integer scores truncates (JAX gave zeros, SDPA raised late)
        message = f"q, k, v dtype ({dtypes[0]}) must be floating ({', '.join(sorted(FLOAT_DTYPES))})"
        raise comm_error(op_name, message, **received, dtype=dtypes[0])
    if not isinstance(causal, bool):
        raise kind_error(op_name, f"causal must be a bool, not {type(causal).__name__}", **received, causal=causal)
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or (not isinstance(scale, (int, float)) and not hasattr(scale, "__float__")):
        raise kind_error(op_name, f"scale must be a number, not {type(scale).__name__}", **received, scale=scale)
    value = float(scale)
    if not math.isfinite(value):
        raise comm_error(op_name, f"scale ({value}) must be finite", **received, scale=scale)
    return value


def shown(shape: object) -> object:
    """A shape as messages show it (a tuple of ints where it is one).

    >>> shown([2, 3]), shown("q")
    ((2, 3), 'q')
    """
    try:
        return tuple(int(size) for size in iterable(shape))
    except (TypeError, ValueError):
        return shape
