"""`assert_parity`: two frameworks' results, per rank and per pytree path, within per-dtype tolerances.

The default tolerance is `commlib parity`'s (`TOLERANCES`, the table its case rows use): the largest absolute
difference over an array must be at most ``TOLERANCES[dtype] * max(1, max |a|, max |b|)``; integers and bools
must be equal. With ``rtol`` / ``atol`` given, every element must satisfy ``|a - b| <= atol + rtol * max(|a|,
|b|)`` instead (numpy's ``allclose`` made symmetric; the one not given is 0). Non-finite values compare by
equality, whatever the tolerance: an inf must meet the same inf (same sign), a NaN a NaN; they take no part in
the scale, so one inf cannot make the tolerance infinite (`beyond_tolerance`, also `first_divergence`'s rule).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from commlib.errors import comm_error, kind_error
from commlib.testing.trees import children, join, shown

__all__ = ["TOLERANCES", "assert_parity", "beyond_tolerance", "check_tolerances", "tolerance"]

#: Max abs error allowed relative to max(1, max |value|), by dtype (`commlib parity`'s table; other dtypes:
#: exact). Complex dtypes use their component's entry.
TOLERANCES = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-3}
_COMPONENT = {"complex128": "float64", "complex64": "float32"}
_MAX_ROWS = 40  # rows of the failure table; the header counts them all
_NUMERIC = "biufc"  # numpy dtype kinds a leaf may have: bool, integers, floats, complex


def tolerance(*dtypes: Any) -> float:
    """The default tolerance for comparing arrays of `dtypes`: the loosest of their entries in `TOLERANCES`
    (0.0, exact, for integers, bools and dtypes not in the table).

    >>> tolerance("float32", "float64")
    2e-05
    >>> tolerance(np.dtype("int64"))
    0.0
    """
    names = [np.dtype(dtype).name if not isinstance(dtype, str) else dtype for dtype in dtypes]
    return max((TOLERANCES.get(_COMPONENT.get(name, name), 0.0) for name in names), default=0.0)


def check_tolerances(caller: str, rtol: object, atol: object) -> None:
    """Refuse an `rtol` / `atol` that is not None or a finite number >= 0, before anything is compared: a NaN
    tolerance would pass every element (``d > nan`` is False), an infinite one would pass a NaN against a
    number, a negative one would fail equal arrays.

    Raises TypeError (not a number; a bool) or `commlib.CommError` (a ``ValueError``: NaN, inf, negative),
    naming `caller` and the argument.

    >>> check_tolerances("assert_parity", 1e-6, None)
    >>> check_tolerances("assert_parity", "1e-3", None)
    Traceback (most recent call last):
    ...
    TypeError: assert_parity: rtol must be a number or None, not str. Received: rtol='1e-3'
    """
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise kind_error(caller, f"{name} must be a number or None, not {type(value).__name__}", **{name: value})
        if not math.isfinite(value) or value < 0:
            why = (
                "nan would pass any values"
                if math.isnan(value)
                else "inf would pass a NaN against a number"
                if math.isinf(value)
                else "a negative tolerance fails equal values"
            )
            raise comm_error(caller, f"{name} must be a finite number >= 0 ({why})", **{name: value})


def beyond_tolerance(
    a: np.ndarray, b: np.ndarray, default: float, rtol: float | None = None, atol: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Elementwise ``(beyond, difference, magnitude)`` of arrays `a` and `b` (one shape) under the module's rule.

    Where both elements are finite: ``difference = |a - b|`` and ``magnitude = max(|a|, |b|)``, and an element is
    beyond tolerance when its difference exceeds ``default * max(1, max magnitude)`` (`rtol` and `atol` both
    None; `default` is `tolerance` of the dtypes) or ``atol + rtol * magnitude``. Elsewhere (an inf or a NaN on
    either side) the two must be equal (a NaN meets a NaN, complex values component by component): difference
    0 and magnitude 0 where they are, an infinite difference where they are not.

    >>> beyond, difference, _ = beyond_tolerance(np.array([np.inf, 1.0]), np.array([np.inf, -1e6]), 1e-10)
    >>> beyond.tolist(), difference.tolist()
    ([False, True], [0.0, 1000001.0])
    >>> beyond_tolerance(np.array([np.inf]), np.array([-np.inf]), 0.0, rtol=1.0)[0].tolist()
    [True]
    """
    wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    x, y = np.asarray(a).astype(wide), np.asarray(b).astype(wide)
    finite = np.isfinite(x) & np.isfinite(y)
    parts = (np.real, np.imag) if wide is np.complex128 else (np.real,)
    equal = np.ones(x.shape, dtype=bool)
    for part in parts:
        equal &= (part(x) == part(y)) | (np.isnan(part(x)) & np.isnan(part(y)))
    with np.errstate(invalid="ignore", over="ignore"):
        difference = np.where(finite, np.abs(np.where(finite, x - y, 0)), np.where(equal, 0.0, np.inf))
    magnitude = np.where(finite, np.maximum(np.abs(np.where(finite, x, 0)), np.abs(np.where(finite, y, 0))), 0.0)
    if rtol is None and atol is None:
        allowed: np.ndarray | float = default * max(1.0, float(np.max(magnitude, initial=0.0)))
    else:
        allowed = (atol or 0.0) + (rtol or 0.0) * magnitude
    return difference > allowed, difference, magnitude


def _numeric(leaf: Any, path: str, side: str) -> np.ndarray:
    """`leaf` as an array; TypeError for a leaf numpy does not hold as numbers (a str, bytes, an object)."""
    value = np.asarray(leaf)
    if value.dtype.kind not in _NUMERIC:
        shown_leaf = repr(leaf) if len(repr(leaf)) <= 40 else repr(leaf)[:37] + "..."
        raise TypeError(
            f"assert_parity: the leaf at {shown(path)} of {side} is not numeric (dtype "
            f"{value.dtype}); compare arrays, numbers or None. Received: {type(leaf).__name__} "
            f"{shown_leaf}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class _Difference:
    """One (path, rank) whose arrays differ beyond tolerance: a row of the failure table."""

    path: str
    rank: int | None
    max_abs: float
    max_rel: float
    index: tuple[int, ...]  # the first element beyond tolerance, in C order
    value_a: object
    value_b: object


def assert_parity(
    a: Any, b: Any, *, rtol: float | None = None, atol: float | None = None, names: tuple[str, str] = ("a", "b")
) -> None:
    """Assert that pytrees `a` and `b` hold the same structure and, leaf by leaf, close values.

    `a`, `b`: pytrees (dicts, lists, tuples) of arrays (numpy arrays, numbers, anything ``np.asarray`` takes; a
    None leaf must be None on both sides), or at the top a ``list`` of such pytrees, one per rank (what
    ``commlib_torch.testing.run`` and ``commlib_jax.testing.run`` return). A single pytree compared with a
    per-rank list is compared with every rank's. Shapes must be equal; dtypes may differ (a float32 result
    against a float64 reference) and the default tolerance is the looser dtype's (`tolerance`).

    Raises AssertionError: a structure that differs (naming the path and what each side has), a rank count or
    shape that differs, or values beyond tolerance, with a table of every such (path, rank): the largest
    absolute and relative error, the first index beyond tolerance and both values there.

    >>> import numpy as np
    >>> assert_parity({"out": np.float32([1.0, 2.0])}, {"out": np.float64([1.0, 2.0 + 1e-6])})
    >>> assert_parity([{"out": 1.0}, {"out": 2.0}], [{"out": 1.0}, {"out": 2.5}], names=("torch", "jax"))
    Traceback (most recent call last):
    ...
    AssertionError: assert_parity: 1 of 2 arrays differ between torch and jax (tolerance per dtype as commlib parity's)
    path   rank  max abs  max rel  first index  torch  jax
    'out'  1     5.0e-01  2.0e-01  ()           2.0    2.5
    >>> assert_parity({"out": 1.0}, {"output": 1.0})
    Traceback (most recent call last):
    ...
    AssertionError: assert_parity: structures differ at (root): keys only in a: ['out']; keys only in b: ['output']
    """
    check_tolerances("assert_parity", rtol, atol)
    differences: list[_Difference] = []
    count = 0
    for rank, tree_a, tree_b in _ranks(a, b, names):
        for path, leaf_a, leaf_b in _leaves(tree_a, tree_b, "", names):
            count += 1
            found = _compare(path, rank, leaf_a, leaf_b, rtol, atol, names)
            if found is not None:
                differences.append(found)
    if differences:
        raise AssertionError(_report(differences, count, rtol, atol, names))


def _ranks(a: Any, b: Any, names: tuple[str, str]) -> list[tuple[int | None, Any, Any]]:
    """(rank, a's tree, b's tree): per rank when either side is a top-level list, else one pair (rank None)."""
    if not isinstance(a, list) and not isinstance(b, list):
        return [(None, a, b)]
    if isinstance(a, list) and isinstance(b, list) and len(a) != len(b):
        raise AssertionError(f"assert_parity: {names[0]} has {len(a)} ranks, {names[1]} has {len(b)}")
    ranks = len(a) if isinstance(a, list) else len(b)
    per_rank_a = a if isinstance(a, list) else [a] * ranks
    per_rank_b = b if isinstance(b, list) else [b] * ranks
    return [(rank, per_rank_a[rank], per_rank_b[rank]) for rank in range(ranks)]


def _kind(tree: Any) -> str:
    if isinstance(tree, Mapping):
        return "a dict"
    if isinstance(tree, list | tuple):
        return f"a {type(tree).__name__} of {len(tree)}"
    return "None" if tree is None else "a leaf"


def _leaves(a: Any, b: Any, path: str, names: tuple[str, str]) -> Iterator[tuple[str, Any, Any]]:
    """(path, a's leaf, b's leaf) in order; AssertionError at the first path whose structure differs."""
    nodes_a, nodes_b = children(a), children(b)
    if nodes_a is None and nodes_b is None and (a is None) == (b is None):
        yield path, a, b
        return
    if _kind(a) != _kind(b) and not (isinstance(a, Mapping) and isinstance(b, Mapping)):
        raise AssertionError(
            f"assert_parity: structures differ at {shown(path)}: {names[0]} has {_kind(a)}, {names[1]} has {_kind(b)}"
        )
    if isinstance(a, Mapping):
        _same_keys(a, b, path, names)
        for key in a:
            yield from _leaves(a[key], b[key], join(path, key), names)
        return
    for index, (child_a, child_b) in enumerate(zip(a, b, strict=True)):
        yield from _leaves(child_a, child_b, join(path, index), names)


def _same_keys(a: Mapping, b: Mapping, path: str, names: tuple[str, str]) -> None:
    only_a, only_b = [key for key in a if key not in b], [key for key in b if key not in a]
    if only_a or only_b:
        raise AssertionError(
            f"assert_parity: structures differ at {shown(path)}: keys only in {names[0]}: "
            f"{only_a}; keys only in {names[1]}: {only_b}"
        )


def _compare(
    path: str,
    rank: int | None,
    leaf_a: Any,
    leaf_b: Any,
    rtol: float | None,
    atol: float | None,
    names: tuple[str, str],
) -> _Difference | None:
    """The failure row of one pair of leaves, None when they agree; AssertionError for shapes that differ."""
    if leaf_a is None:
        return None
    value_a, value_b = _numeric(leaf_a, path, names[0]), _numeric(leaf_b, path, names[1])
    if value_a.shape != value_b.shape:
        where = "" if rank is None else f", rank {rank}"
        raise AssertionError(
            f"assert_parity: shapes differ at {shown(path)}{where}: {names[0]} has "
            f"{value_a.shape}, {names[1]} has {value_b.shape}"
        )
    beyond, difference, magnitude = beyond_tolerance(
        value_a, value_b, tolerance(value_a.dtype, value_b.dtype), rtol, atol
    )
    if not beyond.any():
        return None
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(beyond)), beyond.shape))
    relative = np.divide(difference, magnitude, out=np.where(difference > 0, np.inf, 0.0), where=magnitude > 0)
    return _Difference(
        path, rank, float(difference.max()), float(relative.max()), first, value_a[first].item(), value_b[first].item()
    )


def _report(
    differences: Sequence[_Difference], count: int, rtol: float | None, atol: float | None, names: tuple[str, str]
) -> str:
    rule = "tolerance per dtype as commlib parity's" if rtol is None and atol is None else f"rtol={rtol}, atol={atol}"
    header = f"assert_parity: {len(differences)} of {count} arrays differ between {names[0]} and {names[1]} ({rule})"
    rows = [["path", "rank", "max abs", "max rel", "first index", names[0], names[1]]]
    order = {path: index for index, path in reversed(list(enumerate(row.path for row in differences)))}
    shown_rows = sorted(differences, key=lambda row: order[row.path])[:_MAX_ROWS]  # by path, then rank
    for row in shown_rows:
        rows.append(
            [
                shown(row.path),
                "-" if row.rank is None else str(row.rank),
                f"{row.max_abs:.1e}",
                f"{row.max_rel:.1e}",
                str(row.index),
                repr(row.value_a),
                repr(row.value_b),
            ]
        )
    widths = [max(len(cells[column]) for cells in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip() for cells in rows]
    more = [f"... and {len(differences) - _MAX_ROWS} more"] if len(differences) > _MAX_ROWS else []
    return "\n".join([header, *lines, *more])
