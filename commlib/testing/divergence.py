"""`first_divergence`: where two traces of the same program (two frameworks, or a port and its original) part
ways (numpy + stdlib only).

Two traces (`commlib.testing.trace.Trace`, recorded by ``commlib_torch.testing_trace.record()`` and
``commlib_jax.testing_trace.record()``) are walked call by call. The first call where they differ is reported:
a different op, input names, ranks, shapes or dtypes ("signature"), one trace ending first ("length"), inputs
beyond tolerance ("inputs": the code before this call computed something else), or equal inputs giving outputs
beyond tolerance ("outputs": the call itself differs). The report names the call on both sides (op and module),
every input and rank beyond tolerance (max abs and relative error, the first index, both values there) and
what still agrees: rank 0 agreeing where the other ranks do not is the mark of a position that is local where
it should be global.

Tolerance (`commlib parity`'s rule): the largest absolute difference over an array at most ``tolerance[dtype] *
max(1, max |a|, max |b|)`` (float64 1e-10, float32 2e-5, bfloat16 2e-2, float16 2e-3; other dtypes exact); with
`rtol` / `atol` given, every element within ``atol + rtol * max(|a|, |b|)`` (the one not given is 0). Non-finite
values compare by equality (an inf meets the same inf, a NaN a NaN) and take no part in the scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from commlib.testing.parity import TOLERANCES, beyond_tolerance, check_tolerances, tolerance
from commlib.testing.trace import Arrays, Call

__all__ = ["Difference", "Divergence", "TOLERANCES", "first_divergence"]

#: Max abs error allowed relative to max(1, max |value|), by dtype (`commlib parity`'s table); other dtypes exact.


@dataclasses.dataclass(frozen=True)
class Difference:
    """One array (an input or output of the call, on one rank) beyond tolerance."""

    name: str  # the input or output: "x", "q", ...
    rank: int
    max_abs: float
    max_rel: float  # max_abs / max(max |a|, max |b|)
    index: tuple[int, ...]  # the first element beyond tolerance (C order)
    value_a: float
    value_b: float


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first call where two traces differ, and why (`reason`: "signature", "length", "inputs", "outputs")."""

    index: int  # the call's place in both traces
    reason: str
    call_a: Call | None  # None: trace a ended before this call
    call_b: Call | None
    differences: tuple[Difference, ...]  # the arrays beyond tolerance ("inputs" and "outputs")
    agreeing: tuple[str, ...]  # the arrays of the same role within tolerance: "v on ranks 0-3", "q on rank 0"
    detail: str  # what differs, for "signature" and "length"
    names: tuple[str, str]  # what the two traces are called in the report ("torch", "jax")
    lengths: tuple[int, int]

    def report(self) -> str:
        """The divergence as a few readable lines (also ``str(divergence)``)."""
        a, b = self.names
        lines = [
            f"first divergence at call {self.index} ({a}: {self.lengths[0]} calls, {b}: {self.lengths[1]} "
            f"calls; the {self.index} before it agree within tolerance)"
        ]
        width = max(len(a), len(b)) + 1
        for name, call in ((a, self.call_a), (b, self.call_b)):
            lines.append(f"  {name + ':':{width}} " + (call.site() if call else "(no call: the trace ended)"))
        if self.reason in ("signature", "length"):
            return "\n".join([*lines, f"  {self.detail}"])
        role = "inputs" if self.reason == "inputs" else "outputs (its inputs agree)"
        lines.append(f"  {role} beyond tolerance:")
        lines += _table(self.differences, a, b)
        if self.agreeing:
            lines.append("  within tolerance: " + "; ".join(self.agreeing))
        if self.call_a is not None:
            lines.append("  call: " + ", ".join(f"{key}={value}" for key, value in self.call_a.plan.items()))
        return "\n".join(lines + [f"  hint: {hint}" for hint in self.hints()])

    def hints(self) -> list[str]:
        """What the pattern of an "inputs" divergence usually means (the two patterns of a sequence-parallel
        port: RoPE, and positions computed per shard)."""
        if self.reason != "inputs" or self.call_a is None:
            return []
        hints, differing = [], {difference.name for difference in self.differences}
        if self.call_a.op.endswith("_attention") and differing == {"q", "k"}:
            hints.append(
                "q and k differ and v agrees: the rotary embedding (RoPE) and the positions it is fed are "
                "what q and k get and v does not"
            )
        ranks = sorted({difference.rank for difference in self.differences})
        if 0 in self.call_a.ranks and len(self.call_a.ranks) > 1 and 0 not in ranks:
            hints.append(
                f"rank 0 agrees and {_ranks(ranks)} not: something computed from each rank's own shard "
                "(positions, offsets, labels) where it should be global; a contiguous layout's rank 0 "
                "holds positions that are both"
            )
        return hints

    __str__ = report


def first_divergence(
    trace_a: Sequence[Call],
    trace_b: Sequence[Call],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    names: tuple[str, str] = ("a", "b"),
) -> Divergence | None:
    """The first call where `trace_a` and `trace_b` differ, or None where every call agrees within tolerance.

    Args:
        trace_a, trace_b: `commlib.testing.trace.Trace`s (or sequences of `Call`), e.g. a torch trace merged
            over its ranks and a JAX trace of the same program.
        rtol, atol: elementwise tolerances (``|a - b| <= atol + rtol * max(|a|, |b|)``); both None: the
            per-dtype rule of `commlib parity` (module docstring).
        names: what the report calls the two traces.

    Returns:
        A `Divergence` (its `report()` is the readable text), or None.

    Example:
        >>> from commlib.testing.trace import Call
        >>> x = {"x": {0: np.zeros(3), 1: np.arange(3.0)}}
        >>> call = Call(0, "all_reduce", "model.layers.0.mlp", {"in_shape": "(3,)"}, x, {})
        >>> moved = {"x": {0: np.array([0.0, 0.0, 0.5]), 1: np.arange(3.0)}}
        >>> divergence = first_divergence([call], [call.replace(inputs=moved)], names=("torch", "jax"))
        >>> print(divergence.report())
        first divergence at call 0 (torch: 1 calls, jax: 1 calls; the 0 before it agree within tolerance)
          torch: all_reduce at model.layers.0.mlp
          jax:   all_reduce at model.layers.0.mlp
          inputs beyond tolerance:
            input  rank  max abs  max rel  first index  torch  jax
            x      0     5.0e-01  1.0e+00  (2,)         0      0.5
          within tolerance: x on rank 1
          call: in_shape=(3,)
        >>> first_divergence([call], [call]) is None
        True
    """
    check_tolerances("first_divergence", rtol, atol)
    lengths = (len(trace_a), len(trace_b))
    for index in range(max(lengths)):
        call_a = trace_a[index] if index < lengths[0] else None
        call_b = trace_b[index] if index < lengths[1] else None
        found = _diverges(index, call_a, call_b, rtol, atol)
        if found is not None:
            reason, differences, agreeing, detail = found
            return Divergence(index, reason, call_a, call_b, differences, agreeing, detail, names, lengths)
    return None


def _diverges(
    index: int, call_a: Call | None, call_b: Call | None, rtol: float | None, atol: float | None
) -> tuple[str, tuple[Difference, ...], tuple[str, ...], str] | None:
    """``(reason, differences, agreeing, detail)`` where the two calls differ, else None."""
    if call_a is None or call_b is None:
        ended = "a" if call_a is None else "b"
        return "length", (), (), f"trace {ended} has no call {index}: the other trace makes more calls"
    detail = _signature(call_a, call_b)
    if detail:
        return "signature", (), (), detail
    for role in ("inputs", "outputs"):
        differences, agreeing = _compare(getattr(call_a, role), getattr(call_b, role), rtol, atol)
        if differences:
            return role, differences, agreeing, ""
    return None


def _signature(a: Call, b: Call) -> str:
    """What makes the two calls different calls (op, input and output names, ranks, shapes, dtypes), or ""."""
    if a.op != b.op:
        return f"different ops: {a.op} and {b.op}"
    for role in ("inputs", "outputs"):
        arrays_a, arrays_b = getattr(a, role), getattr(b, role)
        if list(arrays_a) != list(arrays_b):
            return f"different {role}: {list(arrays_a)} and {list(arrays_b)}"
        for name in arrays_a:
            if sorted(arrays_a[name]) != sorted(arrays_b[name]):
                return f"{name} recorded on ranks {sorted(arrays_a[name])} and {sorted(arrays_b[name])}"
            for rank, value in arrays_a[name].items():
                other = arrays_b[name][rank]
                if value.shape != other.shape or value.dtype != other.dtype:
                    return f"{name} on rank {rank}: shape {value.shape} {value.dtype} and {other.shape} {other.dtype}"
    return ""


def _compare(
    a: Arrays, b: Arrays, rtol: float | None, atol: float | None
) -> tuple[tuple[Difference, ...], tuple[str, ...]]:
    """The arrays beyond tolerance, and the others by name ("v on ranks 0-3")."""
    differences, agreeing = [], []
    for name, ranks in a.items():
        within = []
        for rank, value in sorted(ranks.items()):
            difference = _difference(name, rank, value, b[name][rank], rtol, atol)
            if difference is None:
                within.append(rank)
            else:
                differences.append(difference)
        if within:
            agreeing.append(f"{name} on {_ranks(within)}")
    return tuple(differences), tuple(agreeing)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _difference(
    name: str, rank: int, a: np.ndarray, b: np.ndarray, rtol: float | None, atol: float | None
) -> Difference | None:
    """`a` against `b` by the module's rule (`commlib.testing.parity.beyond_tolerance`): None within tolerance."""
    if a.size == 0:
        return None
    exact = a.dtype.kind not in "fc"  # integers, bools: exact
    wrong, error, magnitude = beyond_tolerance(
        a, b, 0.0 if exact else tolerance(a.dtype.name), *((None, None) if exact else (rtol, atol))
    )
    if not wrong.any():
        return None
    wide = np.complex128 if "c" in (a.dtype.kind, b.dtype.kind) else np.float64
    scale = max(float(np.max(magnitude, initial=0.0)), 1e-300)
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(wrong)), wrong.shape))
    return Difference(
        name,
        rank,
        float(error.max()),
        float(error.max()) / scale,
        index,
        a.astype(wide)[index].item(),
        b.astype(wide)[index].item(),
    )


def _table(differences: Sequence[Difference], a: str, b: str) -> list[str]:
    """The differences as aligned rows (the first 12; a count of the rest)."""
    rows = [("input", "rank", "max abs", "max rel", "first index", a, b)]
    rows += [
        (
            d.name,
            str(d.rank),
            f"{d.max_abs:.1e}",
            f"{d.max_rel:.1e}",
            str(d.index),
            f"{d.value_a:.6g}",
            f"{d.value_b:.6g}",
        )
        for d in differences[:12]
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "    " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return lines + ([f"    ... and {len(differences) - 12} more"] if len(differences) > 12 else [])
