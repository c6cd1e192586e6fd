"""The seeded case table that `commlib parity` runs through the reference, torch and JAX.

A `Case` names an op, its keyword arguments and one rank's input shape; `make_arrays` draws every rank's
inputs and output cotangents from the seed; `expected` gives the reference outputs and input gradients
(``convention`` as the case says), or the `CommError` / `TypeError` text the spec raises for it. Frontend
runners read the same files (`write` / `read`), so the three sides see identical bytes.

bfloat16 values are drawn on the bfloat16 grid and stored as float32, so every side starts from the same
numbers without a bfloat16 type in numpy.

Uneven cases (``sizes`` / ``scatter_sizes`` / ``gather_sizes`` in the keywords) are stored in the padded layout
(the JAX one: `shape` has the largest size, the rows past a rank's size hold random values that must be ignored)
and compared there; torch, which holds them exactly, cuts its arrays with `exact_arrays` and pads its results
back with zeros with `padded_result`, so every side is compared on the valid rows.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from commlib import attention, plans, reference, ring, sequence, uneven
from commlib.errors import CommError
from commlib.reduce_op import is_floating
from commlib.reference import ring as ring_reference
from commlib.testing.parity import TOLERANCES
from commlib.uneven import split_sizes

__all__ = [
    "Case",
    "case_table",
    "make_arrays",
    "expected",
    "write",
    "read",
    "storage_dtype",
    "tolerance",
    "exact_arrays",
    "padded_result",
    "attention_case",
    "attention_kwargs",
    "attention_rows",
    "attention_shards",
    "attention_whole",
    "CONTEXT_OPS",
    "context_case",
    "context_kwargs",
    "context_table",
    "parity_table",
    "per_op",
]

#: Every rank's arrays by name (inputs, "cotangent"): `make_arrays`' result, what the runners read back.
Arrays = dict[str, list[np.ndarray]]

ATTENTION = "ulysses_attention"
#: Keywords of an attention case that shape its inputs (the others are `ulysses_attention`'s own).
ATTENTION_SHAPE_KEYS = ("kv_heads", "value_dim")

#: Context-parallel attention (`commlib.ring`): rows of `context_table`, not of `case_table` (whose readers
#: walk `case.plan()`); `commlib parity` runs both (`parity_table`).
CONTEXT_OPS = ("ring_attention", "usp_attention")

#: Max abs error allowed relative to max(1, max |reference|), by dtype (shared with `commlib.testing.assert_parity`).
_TOLERANCE = TOLERANCES


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table: `op` on every rank's input of `shape` with keyword arguments `kwargs`."""

    name: str  # unique, stable id
    op: str  # a public op name of both frontends, or "ulysses_attention"
    world_size: int
    shape: tuple[int, ...]  # one rank's input shape (attention: the global q shape [B, S, H, D])
    dtype: str = "float32"
    kwargs: tuple[tuple[str, object], ...] = ()  # keyword arguments of the op, JSON-able
    transposed: bool = False  # the frontend feeds inputs and cotangents as non-contiguous transposed views
    inputs: tuple[str, ...] = ("x",)  # names of the inputs
    draw: str = "normal"  # "normal"; "small" (integers in [-1, 2]: ties and zeros for max/min/product); "nan"
    # (small, a third of them NaN); "large" (inputs and cotangents in [0.6, 0.9] x the dtype's largest value: their
    # sum over ranks overflows the dtype, their average does not)

    @property
    def differentiable(self) -> bool:
        """Floating cases run backward too; integer and bool cases are forward-only."""
        return is_floating(self.dtype)

    @property
    def params(self) -> dict[str, Any]:
        """The keyword arguments by name (JSON values: what each one is, the op's keyword says)."""
        return dict(self.kwargs)

    def plan(self) -> plans.Plan:
        """The spec's plan for this case (raises the spec's error for invalid cases)."""
        return getattr(plans, self.op)(self.shape, self.world_size, dtype=self.dtype, **self.params)

    def out_shape(self) -> tuple[int, ...]:
        if self.op in CONTEXT_OPS:  # one rank's output: [B, S / W, H, D_v] (any length: [B, max_size, H, D_v])
            batch, seq, heads, head_dim = self.shape
            layout = context_sequence(self)
            rows = seq // self.world_size if layout is None else layout.max_size
            return batch, rows, heads, int(self.params.get("value_dim", head_dim))
        return self.plan().out_shape


def _case(op_name: str, world_size: int, shape: Sequence[int], tag: str = "", /, **kwargs: Any) -> Case:
    dtype = kwargs.pop("dtype", "float32")
    transposed = kwargs.pop("transposed", False)
    inputs = kwargs.pop("inputs", ("x",))
    draw = kwargs.pop("draw", "normal")
    tag += {"small": "~", "nan": "~nan", "large": "~large"}.get(draw, "")
    args = ",".join(f"{key}={value}" for key, value in kwargs.items())
    layout = ",T" if transposed else ""
    name = f"{op_name}{tag}[{'x'.join(map(str, shape))},{dtype}{layout}{',' + args if args else ''}]"
    return Case(name, op_name, world_size, tuple(shape), dtype, tuple(kwargs.items()), transposed, tuple(inputs), draw)


def attention_case(
    world_size: int, shape: Sequence[int], tag: str = "", /, *, kv_heads: int, dtype: str = "float64", **kwargs: Any
) -> Case:
    """A `ulysses_attention` row: global q of `shape` ``[B, S, H, D]``, k and v with `kv_heads` heads (v's head
    dim `value_dim` if given); `seq_sizes` "split" means ``split_sizes(S, W)``."""
    if kwargs.get("seq_sizes") == "split":
        kwargs["seq_sizes"] = split_sizes(shape[1], world_size)
    return _case(ATTENTION, world_size, shape, tag, kv_heads=kv_heads, dtype=dtype, inputs=("q", "k", "v"), **kwargs)


def attention_kwargs(case: Case) -> dict[str, Any]:
    """The keywords an attention case passes to ``ulysses_attention`` (seq_sizes as a tuple)."""
    kwargs = {key: value for key, value in case.kwargs if key not in ATTENTION_SHAPE_KEYS}
    sizes = kwargs.get("seq_sizes")
    if isinstance(sizes, list):
        kwargs["seq_sizes"] = tuple(sizes)
    return kwargs


def attention_rows(case: Case) -> tuple[int, ...]:
    """Rows of the sequence each rank holds: the case's `seq_sizes` where they are a valid split, else the
    balanced one (a row whose `seq_sizes` are wrong on purpose still needs inputs)."""
    sizes, W, seq = case.params.get("seq_sizes"), case.world_size, case.shape[1]
    if isinstance(sizes, (list, tuple)) and len(sizes) == W and min(sizes) >= 0 and sum(sizes) == seq:
        return tuple(int(size) for size in sizes)
    return split_sizes(seq, W)


def _attention_global_shapes(case: Case) -> dict[str, tuple[int, ...]]:
    batch, seq, heads, head_dim = case.shape
    kv_heads, value_dim = int(case.params["kv_heads"]), int(case.params.get("value_dim", head_dim))
    return {
        "q": case.shape,
        "k": (batch, seq, kv_heads, head_dim),
        "v": (batch, seq, kv_heads, value_dim),
        "cotangent": (batch, seq, heads, value_dim),
    }


def attention_whole(case: Case, arrays: Arrays) -> dict[str, np.ndarray]:
    """An attention case's whole arrays (`make_arrays` holds every rank's rows padded): the valid rows of every
    rank, concatenated along seq in rank order."""
    rows = attention_rows(case)
    return {
        name: np.concatenate([part[:, :size] for part, size in zip(ranks, rows, strict=True)], axis=1)
        for name, ranks in arrays.items()
    }


def attention_shards(case: Case, whole: np.ndarray) -> list[np.ndarray]:
    """A whole ``[B, S, ...]`` array cut into every rank's rows, padded with zeros to the longest shard (the
    layout `make_arrays` and the JAX frontend hold)."""
    rows = attention_rows(case)
    parts = np.split(whole, np.cumsum(rows)[:-1], axis=1)
    return [_pad(part, (1, size), max(rows)) for part, size in zip(parts, rows, strict=True)]


def _uneven_cases(W: int) -> list[Case]:
    """Uneven sizes in both Ulysses directions and every op that takes them, zero-size ranks included; at W = 4
    the first row is the handed uneven case (S = 63, H = 6: seq 16, 16, 16, 15 and heads 2, 2, 1, 1)."""
    S, H = 16 * W - 1, W + 2
    seq, heads = split_sizes(S, W), split_sizes(H, W)
    zeroed = (0, *split_sizes(2 * W - 1, W - 1)) if W > 1 else (3,)  # rank 0 holds nothing
    return [
        _case("all_to_all_4d", W, (2, max(seq), H, 3), scatter_sizes=heads, gather_sizes=seq),
        _case(
            "all_to_all_4d",
            W,
            (2, S, max(heads), 3),
            scatter_dim=1,
            gather_dim=2,
            scatter_sizes=seq,
            gather_sizes=heads,
        ),
        _case("all_to_all_4d", W, (1, max(zeroed), H, 2), scatter_sizes=heads, gather_sizes=zeroed, transposed=True),
        _case(
            "all_to_all",
            W,
            (sum(zeroed), 3, 2),
            scatter_dim=0,
            gather_dim=-1,
            scatter_sizes=zeroed,
            gather_sizes=split_sizes(W + 1, W),
            dtype="bfloat16",
        ),
        _case("all_gather", W, (max(seq), 3), dim=0, sizes=seq),
        _case("all_gather", W, (2, max(zeroed)), dim=-1, sizes=zeroed, convention="replicated", transposed=True),
        _case("reduce_scatter", W, (2, S, 3), dim=1, sizes=seq),
        _case("reduce_scatter", W, (sum(zeroed), 4), op="avg", sizes=zeroed, dtype="bfloat16", accum_dtype="float32"),
        _case("gather", W, (max(zeroed), 2), dst=W - 1, dim=0, sizes=zeroed),
        _case("scatter", W, (2, S), src=W - 1, dim=-1, sizes=seq),
        # invalid: the same text on every side and every rank
        _case("all_to_all_4d", W, (2, max(seq), H, 3), "!sizes", scatter_sizes=(*heads, 1), gather_sizes=seq),
        _case("reduce_scatter", W, (S + 1, 3), "!sum", sizes=seq),
        _case("all_gather", W, (3, 2), "!negative", sizes=(-1, *[3] * (W - 1))),
    ]


def case_table(world_size: int) -> list[Case]:
    """Every op, both conventions (and shard's scale_grad), odd shapes (batch > 1, size-1 dims,
    non-contiguous, negative dims, bfloat16), all_to_all on one dim, the Ulysses attention layer, and invalid
    calls whose error text must match."""
    W = world_size
    return [
        _case("all_reduce", W, (3, 5)),
        _case("all_reduce", W, (2, 3, 4), op="avg", transposed=True),
        _case("all_reduce", W, (4, 6), dtype="bfloat16", accum_dtype="float32"),
        _case("all_reduce", W, (3, 5), convention="replicated"),
        _case("all_gather", W, (3, 5)),
        _case("all_gather", W, (2, 3, 4), dim=0, transposed=True),
        _case("all_gather", W, (2, 1, 3), dim=-2, dtype="bfloat16"),
        _case("all_gather", W, (3, 4), dim=1, convention="replicated"),
        _case("reduce_scatter", W, (2, 4 * W, 3), dim=1),
        _case("reduce_scatter", W, (4 * W, 5), dim=-2, op="avg", transposed=True),
        _case("reduce_scatter", W, (3, 2 * W), dim=-1, dtype="bfloat16", accum_dtype="float32"),
        _case("all_to_all", W, (2 * W, 3, W), scatter_dim=0, gather_dim=2),
        _case("all_to_all", W, (5, 2 * W), scatter_dim=-1, gather_dim=0, transposed=True),
        _case("all_to_all", W, (W, 3, 1, 2), scatter_dim=0, gather_dim=-1, dtype="bfloat16"),
        _case("all_to_all_4d", W, (2, 8, 2 * W, 4)),
        _case("all_to_all_4d", W, (1, 8, 2 * W, 4)),
        _case("all_to_all_4d", W, (2, 4 * W, 3, 4), scatter_dim=1, gather_dim=2, transposed=True),
        _case("all_to_all_4d", W, (3, 5, 2 * W, 2), scatter_dim=-2, gather_dim=-3, dtype="bfloat16"),
        _case("all_reduce", W, (2, 3), op="max", draw="small"),
        _case("all_reduce", W, (2, 3), op="min", convention="replicated", draw="small"),
        _case("all_reduce", W, (3, 2), op="product", draw="small"),
        _case("all_reduce", W, (3, 4), op="max", transposed=True),
        _case("all_reduce", W, (2, 3), op="product", dtype="int32"),
        _case("all_reduce", W, (5,), op="max", dtype="int32"),
        # NaN under max/min: NaN wherever any rank holds one (numpy's maximum), its gradient to the NaN holders
        _case("all_reduce", W, (3, 4), op="max", draw="nan"),
        _case("all_reduce", W, (2, 5), op="min", convention="replicated", draw="nan"),
        # half-precision averages whose sum overflows: the average (and its backward's) fits
        _case("all_reduce", W, (2, 3), op="avg", dtype="float16", draw="large"),
        _case("reduce_scatter", W, (2 * W, 3), op="avg", dtype="float16", draw="large"),
        _case("all_reduce", W, (3, 2), op="avg", dtype="bfloat16", draw="large", transposed=True),
        _case("broadcast", W, (2, 3), src=W - 1),
        _case("broadcast", W, (3, 4), transposed=True),
        _case("gather", W, (2, 3), dst=W - 1, dim=-1),
        _case("gather", W, (2, 3, 2), dim=0, transposed=True),
        _case("scatter", W, (2, 2 * W), src=W - 1, dim=-1),
        _case("scatter", W, (3 * W, 2), transposed=True),
        _case("permute", W, (2, 3), perm=[[rank, (rank + 1) % W] for rank in range(W)]),
        _case("permute", W, (3, 2), perm=[[0, W - 1]], transposed=True),
        _case("sum_grad", W, (2, 3)),
        _case("sum_grad", W, (3, 4), transposed=True),
        _case("all_to_all", W, (2 * W, 3), scatter_dim=0, gather_dim=-2),
        _case("all_to_all", W, (3, 2 * W, 2), scatter_dim=-2, gather_dim=1, transposed=True, dtype="bfloat16"),
        _case("shard", W, (3, 2 * W)),
        _case("shard", W, (2 * W, 3, 2), dim=0, scale_grad=True, transposed=True),
        _case("shard", W, (2, 2 * W, 1), dim=-2, scale_grad=True, dtype="bfloat16"),
        _case("reduce", W, (2, 3)),
        _case("reduce", W, (3, 4), dst=W - 1, op="avg", transposed=True),
        _case("reduce", W, (4, 2), dst=W - 1, dtype="bfloat16"),
        # Ulysses attention: the handed GQA case (W=4: seq_sizes (3, 3, 2, 2), 6 heads), causal and not; MQA with
        # batch 2 and a scale; bfloat16 GQA, batch 2 (more shapes: tests/attention_cases.py)
        attention_case(W, (1, 10, 6, 4), kv_heads=2, seq_sizes="split"),
        attention_case(W, (1, 10, 6, 4), kv_heads=2, seq_sizes="split", causal=True),
        attention_case(W, (2, 9, 5, 3), kv_heads=1, seq_sizes="split", causal=True, scale=0.7),
        attention_case(W, (2, 13, 8, 8), kv_heads=2, dtype="bfloat16", seq_sizes="split", causal=True),
        # invalid calls: every side must raise the spec's text (only where the call is invalid at this W)
        _case("all_to_all_4d", W, (2, 8, 2 * W + 1, 4), "!heads"),
        _case("all_to_all_4d", W, (2, 8, 2 * W), "!ndim"),
        _case("shard", W, (3, 2 * W + 1), "!split"),
        _case("reduce", W, (3,), "!max", op="max"),
        _case("all_gather", W, (3, 5), "!range", dim=2),
        _case("all_reduce", W, (3,), "!op", op="band"),
        _case("reduce_scatter", W, (2 * W + 1, 3), "!split"),
        _case("reduce_scatter", W, (2 * W, 3), "!max", op="max"),
        _case("all_reduce", W, (3,), "!avg", op="avg", dtype="int32"),
        _case("broadcast", W, (3,), "!src", src=W),
        _case("gather", W, (3,), "!dst", dst=-1),
        _case("scatter", W, (2 * W + 1,), "!split"),
        _case("permute", W, (3,), "!repeat", perm=[[0, 0], [W - 1, 0]]),
        *_uneven_cases(W),
        attention_case(W, (1, 2 * W, 6, 4), "!kv", kv_heads=4),
        attention_case(W, (1, 2 * W, 4, 4), "!seq_sizes", kv_heads=2, seq_sizes=[2] * (W + 1)),
    ]


def context_case(
    ring_size: int,
    shape: Sequence[int],
    tag: str = "",
    /,
    *,
    kv_heads: int,
    dtype: str = "float64",
    ulysses_size: int | None = None,
    **kwargs: Any,
) -> Case:
    """A `ring_attention` row over `ring_size` ranks, or with `ulysses_size` U a `usp_attention` row over
    ``ring_size * U`` ranks (world rank ``r * U + u`` at ring index r, Ulysses index u): global q of `shape`
    ``[B, S, H, D]``, k and v with `kv_heads` heads (v's head dim `value_dim` if given); keywords `causal`,
    `scale`, `layout` are the call's."""
    if ulysses_size is None:
        return _case(
            CONTEXT_OPS[0], ring_size, shape, tag, kv_heads=kv_heads, dtype=dtype, inputs=("q", "k", "v"), **kwargs
        )
    return _case(
        CONTEXT_OPS[1],
        ring_size * ulysses_size,
        shape,
        tag,
        kv_heads=kv_heads,
        dtype=dtype,
        inputs=("q", "k", "v"),
        ulysses_size=ulysses_size,
        **kwargs,
    )


def context_layout(case: Case) -> tuple[int, int, str]:
    """(ring size, Ulysses size, layout) of a context row."""
    ulysses_size = int(case.params.get("ulysses_size", 1))
    return case.world_size // ulysses_size, ulysses_size, str(case.params.get("layout", "contiguous"))


def context_sequence(case: Case) -> sequence.SequenceLayout | None:
    """The `SequenceLayout` of an any-length row (``any_length=True``: the layout string's layout of the global
    length over the row's ring and Ulysses sizes), else None. Its arrays are stored padded to ``max_size`` (the
    JAX layout; torch cuts them with `exact_arrays`)."""
    if not case.params.get("any_length"):
        return None
    ring_size, ulysses_size, layout = context_layout(case)
    return sequence.SequenceLayout(case.shape[1], ring_size=ring_size, ulysses_size=ulysses_size, layout=layout)


def context_kwargs(case: Case) -> dict[str, Any]:
    """The keywords a context row passes to ``ring_attention`` / ``usp_attention`` (an any-length row: its
    `SequenceLayout` as ``layout``)."""
    kwargs = {
        key: value for key, value in case.kwargs if key not in (*ATTENTION_SHAPE_KEYS, "ulysses_size", "any_length")
    }
    layout = context_sequence(case)
    return kwargs if layout is None else {**kwargs, "layout": layout}


def context_plan(case: Case) -> ring.RingPlan:
    """The row's plan (every rank's is the same): the spec's error for an invalid row."""
    ring_size, ulysses_size, _ = context_layout(case)
    layout = context_sequence(case)
    rows = case.shape[1] // case.world_size if layout is None else layout.max_size
    shapes = _attention_global_shapes(case)
    q, k, v = ((*shapes[name][:1], rows, *shapes[name][2:]) for name in "qkv")
    return ring.ring_plan(
        q, k, v, ring_size, dtypes=(case.dtype,) * 3, ulysses_size=ulysses_size, op_name=case.op, **context_kwargs(case)
    )


def _context_shards(case: Case, whole: np.ndarray) -> list[np.ndarray]:
    """Every rank's shard of a whole ``[B, S, ...]`` array in the row's layout (an invalid layout or length:
    contiguous cuts, so that every rank still has inputs to be refused with)."""
    ring_size, ulysses_size, layout = context_layout(case)
    any_length = context_sequence(case)
    if any_length is not None:
        return any_length.shard(whole, 1, padded=True)
    try:
        return sequence.shard_sequence(whole, 1, ring_size, layout, ulysses_size)
    except CommError:
        return np.array_split(whole, case.world_size, axis=1)


def _fill_padding(case: Case, shards: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """An any-length row's padded shards with random values in the padding rows (which every side must
    ignore)."""
    layout = context_sequence(case)
    if layout is None:
        return shards
    for shard, size in zip(shards, layout.sizes, strict=True):
        shard[:, size:] = _draw(rng, shard[:, size:].shape, case.dtype)
    return shards


def context_table(world_size: int) -> list[Case]:
    """Ring rows at W = `world_size` (causal and not, contiguous and zigzag, GQA and MHA, batch 2, float64;
    float32 and bfloat16), any-length rows (a `SequenceLayout` at S = 37 and 5; at W = 4 S = 3, an empty shard),
    USP rows on 2 x 2 when W = 4 (S = 37 too), and invalid calls."""
    W = world_size
    rows = [
        context_case(W, (2, 4 * W, 4, 3), kv_heads=2, causal=True, layout="zigzag"),
        context_case(W, (2, 4 * W, 4, 3), kv_heads=2, layout="zigzag"),
        context_case(W, (2, 3 * W, 4, 3), kv_heads=2, causal=True),
        context_case(W, (1, 2 * W, 2, 4), kv_heads=2, value_dim=3, scale=0.6),
        context_case(W, (2, 4 * W, 4, 8), kv_heads=1, dtype="float32", causal=True, layout="zigzag"),
        context_case(W, (1, 4 * W, 4, 8), kv_heads=2, dtype="bfloat16", causal=True, layout="zigzag"),
        context_case(W, (2, 37, 8, 3), kv_heads=2, causal=True, layout="zigzag", any_length=True),
        context_case(W, (1, 37, 8, 3), kv_heads=2, layout="contiguous", any_length=True),
        context_case(W, (1, 5, 4, 3), kv_heads=2, causal=True, layout="zigzag", any_length=True),
        context_case(W, (1, 3 * W, 4, 3), "!zigzag", kv_heads=2, layout="zigzag"),  # odd shards
        context_case(W, (1, 2 * W, 4, 3), "!layout", kv_heads=2, layout="ring"),
        context_case(W, (1, 2 * W, 4, 3), "!kv", kv_heads=3),
    ]
    if W == 4:
        rows += [
            context_case(2, (2, 16, 4, 3), kv_heads=2, ulysses_size=2, causal=True, layout="zigzag"),
            context_case(2, (2, 8, 4, 3), kv_heads=2, ulysses_size=2),
            context_case(2, (1, 8, 4, 3), kv_heads=2, ulysses_size=2, value_dim=2, causal=True),
            context_case(1, (1, 8, 2, 3), "!ulysses", kv_heads=1, ulysses_size=4),
            context_case(2, (2, 37, 8, 3), kv_heads=2, ulysses_size=2, causal=True, layout="zigzag", any_length=True),
            context_case(2, (1, 37, 8, 3), kv_heads=2, ulysses_size=2, any_length=True),
            context_case(4, (1, 3, 8, 3), kv_heads=2, causal=True, any_length=True),  # an empty shard
        ]
    return rows


def parity_table(world_size: int) -> list[Case]:
    """What `commlib parity` runs: `case_table` and `context_table`."""
    return case_table(world_size) + context_table(world_size)


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a case's arrays are stored in (bfloat16 is stored as float32)."""
    if dtype == "bool":
        return np.dtype(bool)
    return np.dtype("float32" if dtype == "bfloat16" else dtype)


_LARGEST = {"float16": 65504.0, "bfloat16": 3.3895e38, "float32": 3.4028e38, "float64": 1.7976e308}


def _draw(rng: np.random.Generator, shape: Sequence[int], dtype: str, draw: str = "normal") -> np.ndarray:
    if draw in ("small", "nan") or not is_floating(dtype):
        values = rng.integers(-1, 3, size=shape).astype(storage_dtype(dtype))
        if draw == "nan":
            values[rng.random(shape) < 1 / 3] = np.nan
        return values
    if draw == "large":
        values = (rng.uniform(0.6, 0.9, size=shape) * _LARGEST[dtype]).astype(storage_dtype(dtype))
    else:
        values = rng.standard_normal(shape).astype(storage_dtype(dtype))
    if dtype == "bfloat16":  # round to the bfloat16 grid: keep the top 16 bits of each float32
        values = np.asarray((values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32))  # 0-d: not a scalar
    return values


def make_arrays(case: Case, seed: int) -> dict[str, list[np.ndarray]]:
    """Every rank's inputs (by input name) and output cotangents (key "cotangent"), from `seed`."""
    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode())])
    W = case.world_size
    if case.op in CONTEXT_OPS:  # the whole sequence drawn, every rank given its shard of the layout
        return {
            name: _fill_padding(case, _context_shards(case, _draw(rng, shape, case.dtype)), rng)
            for name, shape in _attention_global_shapes(case).items()
        }
    if case.op == ATTENTION:  # every rank's rows padded to the longest shard (rows past its own: ignored)
        rows = max(attention_rows(case))
        shapes = {name: (shape[0], rows, *shape[2:]) for name, shape in _attention_global_shapes(case).items()}
        return {name: [_draw(rng, shape, case.dtype) for _ in range(W)] for name, shape in shapes.items()}
    arrays = {name: [_draw(rng, case.shape, case.dtype, case.draw) for _ in range(W)] for name in case.inputs}
    try:
        out_shape = case.out_shape()
    except (CommError, TypeError):
        return arrays
    if not case.differentiable:
        return arrays
    cotangent_draw = "large" if case.draw == "large" else "normal"  # large: the backward's sum overflows too
    arrays["cotangent"] = [_draw(rng, out_shape, case.dtype, cotangent_draw) for _ in range(W)]
    return arrays


_SIZES = ("sizes", "scatter_sizes", "gather_sizes")


def _uneven_plan(case: Case) -> plans.Plan | None:
    """The case's (padded) plan when it has uneven sizes and the spec takes it, else None."""
    if case.op == ATTENTION or all(case.params.get(key) is None for key in _SIZES):
        return None
    try:
        plan = case.plan()
    except (CommError, TypeError):
        return None
    return plan if plan.is_uneven else None


def _cut(array: np.ndarray, cut: tuple[int, int] | None) -> np.ndarray:
    return array if cut is None else np.take(array, range(cut[1]), axis=cut[0])


def _pad(array: np.ndarray, cut: tuple[int, int] | None, size: int) -> np.ndarray:
    if cut is None:
        return array
    dim, rows = cut
    widths = [(0, 0)] * array.ndim
    widths[dim] = (0, size - rows)
    return np.pad(array, widths)


def exact_arrays(case: Case, arrays: Arrays, rank: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s arrays as torch holds them: a sharded dim cut to the rank's size (inputs on the gathered
    dim, the cotangent on the scattered one; attention: every array's seq rows); as stored where the case is
    even or invalid."""
    if case.op == ATTENTION:
        return {name: ranks[rank][:, : attention_rows(case)[rank]] for name, ranks in arrays.items()}
    if case.op in CONTEXT_OPS:
        layout = context_sequence(case)
        rows = None if layout is None else layout.sizes[rank]
        return {name: ranks[rank][:, :rows] for name, ranks in arrays.items()}
    plan = _uneven_plan(case)
    cuts = uneven.rows(plan, rank) if plan is not None else (None, None)
    return {name: _cut(ranks[rank], cuts[1] if name == "cotangent" else cuts[0]) for name, ranks in arrays.items()}


def padded_result(case: Case, rank: int, output: np.ndarray, gradients: dict) -> tuple[np.ndarray, dict]:
    """An exact result of rank `rank` (torch) in the case's padded layout: zeros past the rank's rows."""
    if case.op in CONTEXT_OPS:
        layout = context_sequence(case)
        if layout is None:
            return output, gradients
        rows = (1, layout.sizes[rank]), layout.max_size
        return _pad(output, *rows), {name: _pad(gradient, *rows) for name, gradient in gradients.items()}
    if case.op == ATTENTION:
        rows = (1, attention_rows(case)[rank]), max(attention_rows(case))
        return _pad(output, *rows), {name: _pad(gradient, *rows) for name, gradient in gradients.items()}
    plan = _uneven_plan(case)
    if plan is None:
        return output, gradients
    before, after = uneven.rows(plan, rank)
    out_size = 0 if after is None else plan.out_shape[after[0]]
    in_size = 0 if before is None else plan.in_shape[before[0]]
    padded = {name: _pad(gradient, before, in_size) for name, gradient in gradients.items()}
    return _pad(output, after, out_size), padded


def error_text(case: Case) -> str | None:
    """``"CommError: ..."`` / ``"TypeError: ..."`` if the spec rejects the case, else None."""
    try:
        if case.op in CONTEXT_OPS:
            context_plan(case)
        elif case.op == ATTENTION:
            _attention_plans(case)
        else:
            case.plan()
    except (CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _attention_plans(case: Case) -> list[attention.UlyssesPlan]:
    """Every rank's plan (the exact layout): raises the spec's error for an invalid row."""
    shapes = _attention_global_shapes(case)
    kwargs = attention_kwargs(case)
    plans = []
    for rank, rows in enumerate(attention_rows(case)):
        q, k, v = ((*shapes[name][:1], rows, *shapes[name][2:]) for name in "qkv")
        plans.append(attention.ulysses_plan(q, k, v, case.world_size, rank=rank, dtypes=(case.dtype,) * 3, **kwargs))
    return plans


def _attention_expected(case: Case, arrays: Arrays) -> tuple[list, dict]:
    """The float64 reference on the whole sequence, cut into every rank's (padded) rows."""
    whole, kwargs = attention_whole(case, arrays), attention_kwargs(case)
    q, k, v, ct = (whole[name].astype(np.float64) for name in ("q", "k", "v", "cotangent"))
    options = dict(causal=kwargs.get("causal", False), scale=kwargs.get("scale"))
    grads = attention.attention_vjp(q, k, v, ct, **options)
    outputs = attention_shards(case, attention.attention(q, k, v, **options))
    return outputs, {name: attention_shards(case, g) for name, g in zip("qkv", grads, strict=True)}


def expected(case: Case, arrays: Arrays) -> tuple[list[np.ndarray], dict[str, list[np.ndarray]]]:
    """Reference per-rank outputs and per-rank input gradients {input name: [rank arrays]}."""
    if case.op in CONTEXT_OPS:
        return _context_expected(case, arrays)
    if case.op == ATTENTION:
        return _attention_expected(case, arrays)
    plan = case.plan()
    xs = arrays["x"]
    if not case.differentiable:
        return reference.forward(plan, xs), {}
    return reference.forward(plan, xs), {"x": reference.vjp(plan, xs, arrays["cotangent"])}


def _context_expected(case: Case, arrays: Arrays) -> tuple[list, dict]:
    """The float64 reference of a context row (an any-length row: on the valid rows, padded back with zeros)."""
    ring_size, ulysses_size, layout = context_layout(case)
    kwargs = context_kwargs(case)
    options = dict(causal=kwargs.get("causal", False), scale=kwargs.get("scale"))
    any_length = context_sequence(case)
    if any_length is None:
        outs, *grads = ring_reference.reference(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            arrays["cotangent"],
            ring_size,
            layout=layout,
            ulysses_size=ulysses_size,
            **options,
        )
        return outs, dict(zip("qkv", grads, strict=True))
    exact = [exact_arrays(case, arrays, rank) for rank in range(case.world_size)]
    qs, ks, vs, cotangents = ([mine[name] for mine in exact] for name in ("q", "k", "v", "cotangent"))
    outs, *grads = ring_reference.reference(qs, ks, vs, cotangents, ring_size, layout=any_length, **options)
    padded = [
        padded_result(case, rank, outs[rank], {name: grad[rank] for name, grad in zip("qkv", grads, strict=True)})
        for rank in range(case.world_size)
    ]
    return [out for out, _ in padded], {name: [mine[name] for _, mine in padded] for name in "qkv"}


def tolerance(case: Case) -> float:
    base = _TOLERANCE.get(case.dtype, 0.0)  # integers and bool: exact
    return max(base, 1e-4) if case.op in (ATTENTION, *CONTEXT_OPS) and case.dtype == "float32" else base


def _key(*parts: object) -> str:
    return "|".join(map(str, parts))


def write(directory: Path, cases: Sequence[Case], seed: int) -> None:
    """Write ``cases.json`` and ``arrays.npz`` for the frontend runners."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {}
    for case in cases:
        for name, ranks in make_arrays(case, seed).items():
            arrays.update({_key(case.name, name, rank): value for rank, value in enumerate(ranks)})
    np.savez(directory / "arrays.npz", **arrays)
    table = [dataclasses.asdict(case) for case in cases]
    (directory / "cases.json").write_text(json.dumps({"seed": seed, "cases": table}, indent=1))


def read(directory: Path) -> list[tuple[Case, dict[str, list[np.ndarray]]]]:
    """The cases and their arrays as written by `write`."""
    table = json.loads((directory / "cases.json").read_text())["cases"]
    with np.load(directory / "arrays.npz") as stored:
        data = dict(stored)
    result = []
    for row in table:
        row = {
            **row,
            "shape": tuple(row["shape"]),
            "inputs": tuple(row["inputs"]),
            "kwargs": tuple((key, value) for key, value in row["kwargs"]),
        }
        case = Case(**row)
        names = [*case.inputs, "cotangent"]
        arrays = {
            name: [data[_key(case.name, name, rank)] for rank in range(case.world_size)]
            for name in names
            if _key(case.name, name, 0) in data
        }
        result.append((case, arrays))
    return result


def result_key(case: Case, mode: str, what: str, rank: int) -> str:
    """Key of a runner's result array: what = "out" or "grad_<input>"."""
    return _key(case.name, mode, what, rank)


def per_op(table: Sequence[Case]) -> list[Case]:
    """A few rows of `table` per op, for a wrapper of the ops (a communicator, sub-groups, checked mode, a
    subclass) whose arithmetic the whole table proves through the functions: per op, the first row of each set of
    keyword names it is called with (so every keyword a wrapper must forward, uneven sizes included) and its first
    rejected row."""
    seen: set[tuple[str, object]] = set()
    rows = []
    for case in table:
        key = (case.op, "rejected" if error_text(case) is not None else frozenset(case.params))
        if key not in seen:
            seen.add(key)
            rows.append(case)
    return rows
