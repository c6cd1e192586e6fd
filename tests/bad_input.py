"""The bad-input table: calls users get wrong, and edge cases that must still give the reference value.

Every `Row` wraps a `commlib.cases.Case` (so the reference, `commlib.tools.parity.check` and both frontends'
parity runners take it as it is) plus how a frontend feeds the input: its memory layout (contiguous, a
non-contiguous transposed view, or torch's channels_last) and its autograd mode (requires grad, a constant,
under ``torch.no_grad()`` or ``torch.inference_mode()``; JAX runs those forward-only). `error` is the start
of the text every side must raise (``"CommError: ..."`` / ``"TypeError: ..."``), or None: then every side
must give the reference value (and, in grad mode, the reference gradient).

Covered: non-divisible split dims, all_to_all_4d's ndim and dim pairs, dims out of range, unknown and
dtype-forbidden reduce ops (reduce and reduce_scatter take sum and avg only), bad accum_dtype and convention,
src/dst/perm out of range or repeated, wrong argument kinds (shard's scale_grad), zero-size dims (all_to_all
on one dim too), non-contiguous and channels_last inputs, inputs that don't require grad, no_grad and
inference_mode (every op at W = 3), world size 1's refusals and the columns its case table rows lack, and
float16/int32 on every op at W = 3 (float64 and bfloat16: the case table's rows, tests/torch/test_properties.py);
uneven sizes: wrong length, negative, a sum
that is not the whole dim, wrong kinds, equal dims (the same text in both layouts), and zero-size ranks in
every layout and grad mode; ring attention and USP (the spec's errors, non-contiguous and channels_last inputs,
grad modes, bfloat16). (A sharded dim that is not the rank's size, or the largest, is each layout's own
text: tests/torch and tests/jax test_uneven.py.)
"""

from __future__ import annotations

import dataclasses

from commlib import split_sizes
from commlib.tools.cases import Case, context_case

__all__ = ["LAYOUTS", "GRAD_MODES", "WORLD_SIZES", "Row", "table"]

#: How a frontend lays out the input (and cotangent) in memory; JAX ignores it.
LAYOUTS = ("contiguous", "transposed", "channels_last")
#: "grad": input requires grad, backward runs; the others run forward only.
GRAD_MODES = ("grad", "constant", "no_grad", "inference_mode")
#: World sizes the table covers.
WORLD_SIZES = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Row:
    """One bad-input case: `case` fed as `layout` in `grad_mode`, expected to raise `error` (a prefix) or
    to match the reference."""

    case: Case
    error: str | None = None  # start of the expected "Type: message" text; None: the reference value
    layout: str = "contiguous"  # one of LAYOUTS ("transposed" is the case's own `transposed` flag)
    grad_mode: str = "grad"  # one of GRAD_MODES

    @property
    def name(self) -> str:
        extras = [
            value for value, default in ((self.layout, "contiguous"), (self.grad_mode, "grad")) if value != default
        ]
        return self.case.name + "".join(f"<{extra}>" for extra in extras)

    @property
    def forward_only(self) -> bool:
        """No backward: integer dtypes, and every mode but "grad"."""
        return self.grad_mode != "grad" or not self.case.differentiable


def _row(
    op: str,
    world_size: int,
    shape,
    /,
    *,
    error: str | None = None,
    layout: str = "contiguous",
    grad_mode: str = "grad",
    dtype: str = "float32",
    **kwargs,
) -> Row:
    arguments = ",".join(f"{key}={value}" for key, value in kwargs.items())
    shape = tuple(shape)
    name = f"{op}[W={world_size},{'x'.join(map(str, shape)) or '()'},{dtype}{',' + arguments if arguments else ''}]"
    case = Case(name, op, world_size, shape, dtype, tuple(kwargs.items()), transposed=layout == "transposed")
    return Row(case, error, layout, grad_mode)


def _errors(W: int) -> list[Row]:
    """Calls every side must reject with the spec's text (W >= 2)."""
    odd = 2 * W + 1
    return [
        _row(
            "reduce_scatter",
            W,
            (odd, 3),
            error=f"CommError: reduce_scatter: size of dim 0 ({odd}) must be divisible by world_size ({W})",
        ),
        _row("scatter", W, (2, odd), dim=-1, error=f"CommError: scatter: size of dim 1 ({odd}) must be divisible"),
        _row(
            "all_to_all",
            W,
            (odd, 3),
            scatter_dim=0,
            gather_dim=1,
            error=f"CommError: all_to_all: size of scatter_dim 0 ({odd}) must be divisible by world_size ({W})",
        ),
        _row("all_to_all_4d", W, (2, 4, odd, 2), error=f"CommError: all_to_all_4d: heads ({odd}) must be divisible"),
        _row("all_to_all_4d", W, (2, 4 * W, 3), error="CommError: all_to_all_4d: ndim (3) must be 4"),
        _row("all_to_all_4d", W, (1, 2, W, 2, 1), error="CommError: all_to_all_4d: ndim (5) must be 4"),
        _row(
            "all_to_all_4d",
            W,
            (2, 4, 2 * W, 2),
            scatter_dim=0,
            gather_dim=3,
            error="CommError: all_to_all_4d: (scatter_dim, gather_dim) (0, 3) must be (2, 1) or (1, 2)",
        ),
        _row(
            "shard", W, (3, odd), error=f"CommError: shard: size of dim 1 ({odd}) must be divisible by world_size ({W})"
        ),
        _row("shard", W, (2 * W,), dim=1, error="CommError: shard: dim (1) must be in [-1, 1) for ndim 1"),
        _row("shard", W, (2 * W,), scale_grad=1, error="TypeError: shard: scale_grad must be a bool, not int"),
        _row("reduce", W, (3,), op="max", error="CommError: reduce: op ('max') must be one of sum, avg"),
        _row("reduce", W, (3,), dst=W, error=f"CommError: reduce: dst ({W}) must be in [0, {W})"),
        _row(
            "reduce",
            W,
            (3,),
            op="avg",
            dtype="int32",
            error="CommError: reduce: op ('avg') needs a floating or complex dtype, not int32",
        ),
        _row("all_gather", W, (3, 4), dim=2, error="CommError: all_gather: dim (2) must be in [-2, 2) for ndim 2"),
        _row("reduce_scatter", W, (2 * W, 3), dim=-3, error="CommError: reduce_scatter: dim (-3) must be in [-2, 2)"),
        _row("gather", W, (3,), dim=1, error="CommError: gather: dim (1) must be in [-1, 1) for ndim 1"),
        _row("scatter", W, (2 * W, 3), dim=2, error="CommError: scatter: dim (2) must be in [-2, 2)"),
        _row(
            "all_to_all",
            W,
            (2 * W, 3),
            scatter_dim=0,
            gather_dim=5,
            error="CommError: all_to_all: gather_dim (5) must be in [-2, 2)",
        ),
        _row("all_to_all_4d", W, (2, 4, 2 * W, 2), scatter_dim=4, error="CommError: all_to_all_4d: scatter_dim (4)"),
        _row("all_gather", W, (), error="CommError: all_gather: dim (-1) must be in [0, 0) for ndim 0"),
        _row("all_reduce", W, (3,), op="band", error="CommError: all_reduce: op ('band') must be one of sum, avg"),
        _row("all_reduce", W, (3,), op="mean", error="CommError: all_reduce: op ('mean') must be one of"),
        _row(
            "reduce_scatter",
            W,
            (2 * W,),
            op="max",
            error="CommError: reduce_scatter: op ('max') must be one of sum, avg",
        ),
        _row(
            "all_reduce",
            W,
            (3,),
            op="avg",
            dtype="int32",
            error="CommError: all_reduce: op ('avg') needs a floating or complex dtype, not int32",
        ),
        _row(
            "reduce_scatter",
            W,
            (2 * W,),
            op="avg",
            dtype="int32",
            error="CommError: reduce_scatter: op ('avg') needs a floating or complex dtype, not int32",
        ),
        _row(
            "all_reduce",
            W,
            (3,),
            accum_dtype="int32",
            error="CommError: all_reduce: accum_dtype (int32) and the input dtype (float32) must be floating",
        ),
        _row(
            "all_reduce",
            W,
            (3,),
            dtype="int32",
            accum_dtype="float32",
            error="CommError: all_reduce: accum_dtype (float32) and the input dtype (int32) must be floating",
        ),
        _row(
            "all_reduce",
            W,
            (3,),
            dtype="bfloat16",
            accum_dtype="float16",
            error="CommError: all_reduce: accum_dtype (float16: 5 exponent, 10 mantissa bits) must hold every value "
            "of the input dtype (bfloat16: 8, 7)",
        ),
        _row(
            "reduce_scatter",
            W,
            (2 * W,),
            dtype="float16",
            accum_dtype="bfloat16",
            error="CommError: reduce_scatter: accum_dtype (bfloat16: 8 exponent, 7 mantissa bits) must hold every "
            "value of the input dtype (float16: 5, 10)",
        ),
        _row(
            "all_reduce",
            W,
            (3,),
            convention="mean",
            error="CommError: all_reduce: convention ('mean') must be one of sum, replicated",
        ),
        _row("broadcast", W, (3,), src=W, error=f"CommError: broadcast: src ({W}) must be in [0, {W})"),
        _row("broadcast", W, (3,), src=-1, error=f"CommError: broadcast: src (-1) must be in [0, {W})"),
        _row("gather", W, (3,), dst=W, error=f"CommError: gather: dst ({W}) must be in [0, {W})"),
        _row("scatter", W, (2 * W,), src=-1, error=f"CommError: scatter: src (-1) must be in [0, {W})"),
        _row("permute", W, (3,), perm=[[0, W]], error=f"CommError: permute: dst ({W}) must be in [0, {W})"),
        _row("permute", W, (3,), perm=[[-1, 0]], error=f"CommError: permute: src (-1) must be in [0, {W})"),
        _row("permute", W, (3,), perm=[[0, 1], [0, W - 1]], error="CommError: permute: perm repeats source rank 0"),
        _row(
            "permute", W, (3,), perm=[[0, 1], [W - 1, 1]], error="CommError: permute: perm repeats destination rank 1"
        ),
        _row("permute", W, (3,), perm=[[0]], error="TypeError: permute: perm must be a sequence of (src, dst) pairs"),
        _row("permute", W, (3,), perm=[[0, 1, 1]], error="TypeError: permute: perm must be a sequence of"),
        _row("all_gather", W, (3,), dim="0", error="TypeError: all_gather: dim must be an int, not str"),
        _row("reduce_scatter", W, (2 * W,), dim=True, error="TypeError: reduce_scatter: dim must be an int, not bool"),
        _row("broadcast", W, (3,), src=1.0, error="TypeError: broadcast: src must be an int, not float"),
        _row("all_reduce", W, (3,), op=3, error="TypeError: all_reduce: op must be a string or a ReduceOp, not int"),
    ]


def _zero_size(W: int) -> list[Row]:
    """Zero-size dims: valid, every side gives the (empty) reference value and gradient."""
    ring = [[rank, (rank + 1) % W] for rank in range(W)]
    return [
        _row("all_reduce", W, (0, 3)),
        _row("all_reduce", W, (2, 0), op="max"),
        _row("all_reduce", W, (0,), op="product"),
        _row("all_gather", W, (0, 3), dim=0),
        _row("all_gather", W, (3, 0), dim=-1),
        _row("reduce_scatter", W, (0, 3), dim=0),
        _row("reduce_scatter", W, (2 * W, 0), dim=0),
        _row("all_to_all", W, (2 * W, 0), scatter_dim=0, gather_dim=1),
        _row("all_to_all", W, (0, W), scatter_dim=1, gather_dim=0),
        _row("all_to_all_4d", W, (0, 4, 2 * W, 3)),
        _row("all_to_all_4d", W, (2, 4 * W, 2, 0), scatter_dim=1, gather_dim=2),
        _row("broadcast", W, (0, 2), src=W - 1),
        _row("gather", W, (0,), dst=W - 1, dim=0),
        _row("scatter", W, (2 * W, 0), src=W - 1),
        _row("permute", W, (0, 3), perm=ring),
        _row("permute", W, (3, 0), perm=ring[:1]),  # rows to send, no elements
        _row("sum_grad", W, (0,)),
        _row("all_to_all", W, (2 * W, 0), scatter_dim=0, gather_dim=0),
        _row("shard", W, (0, 2 * W)),
        _row("shard", W, (2 * W, 0), dim=0, scale_grad=True),
        _row("reduce", W, (0, 3), dst=W - 1),
    ]


def _layouts(W: int) -> list[Row]:
    """Non-contiguous (transposed views) and channels_last inputs and cotangents."""
    return [
        _row("all_to_all_4d", W, (2, 4, 2 * W, 3), layout="transposed"),
        _row("all_to_all_4d", W, (2, 4, 2 * W, 3), layout="channels_last"),
        _row("all_to_all_4d", W, (3, 2 * W, 2, 5), scatter_dim=1, gather_dim=2, layout="channels_last"),
        _row("all_gather", W, (2, 3, 2, 4), dim=1, layout="channels_last"),
        _row("reduce_scatter", W, (2, 3 * W, 2, 4), dim=1, layout="channels_last"),
        _row("all_reduce", W, (2, 3, 2, 4), op="avg", layout="channels_last"),
        _row("all_reduce", W, (2, 3, 2, 2), op="max", layout="channels_last"),
        _row("all_to_all", W, (2, 3, 2 * W, 4), scatter_dim=2, gather_dim=-1, layout="channels_last"),
        _row("broadcast", W, (2, 3, 2, 4), src=W - 1, layout="channels_last"),
        _row("gather", W, (2, 3, 2, 4), dim=3, layout="channels_last"),
        _row("scatter", W, (2, 3, 2 * W, 4), dim=2, layout="channels_last"),
        _row("permute", W, (2, 3, 2, 4), perm=[[0, W - 1]], layout="channels_last"),
        _row("sum_grad", W, (2, 3, 2, 4), layout="channels_last"),
        _row("all_to_all", W, (3, 2 * W, 2), scatter_dim=1, gather_dim=0, layout="transposed"),
        _row("reduce_scatter", W, (3, 2 * W), dim=-1, op="avg", layout="transposed"),
        _row("scatter", W, (2 * W, 3), src=W - 1, dim=0, layout="transposed"),
        _row("all_to_all", W, (2, 3, 2 * W, 4), scatter_dim=2, gather_dim=-2, layout="channels_last"),
        _row("shard", W, (2, 3, 2 * W, 4), dim=2, scale_grad=True, layout="channels_last"),
        _row("reduce", W, (2, 3, 2, 4), dst=W - 1, op="avg", layout="channels_last"),
    ]


def _grad_modes(W: int) -> list[Row]:
    """Inputs that don't require grad, and calls under no_grad / inference_mode, every op: forward values only,
    at W = 3 (the uneven and context rows below take the modes at W = 2 too)."""
    if W != 3:
        return []
    ring = [[rank, (rank + 1) % W] for rank in range(W)]
    rows = []
    for mode in GRAD_MODES[1:]:
        rows += [
            _row("all_reduce", W, (3, 4), grad_mode=mode),
            _row("all_reduce", W, (2, 3), op="max", grad_mode=mode),
            _row("all_reduce", W, (2, 3), op="product", grad_mode=mode),
            _row("all_gather", W, (2, 3), dim=0, grad_mode=mode),
            _row("reduce_scatter", W, (2 * W, 3), op="avg", grad_mode=mode),
            _row("all_to_all_4d", W, (2, 4, 2 * W, 3), grad_mode=mode),
            _row("gather", W, (2, 3), dst=W - 1, grad_mode=mode),
            _row("scatter", W, (2 * W,), src=W - 1, grad_mode=mode),
            _row("permute", W, (2, 3), perm=ring, grad_mode=mode),
            _row("sum_grad", W, (2, 3), grad_mode=mode),
            _row("shard", W, (2, 3 * W), grad_mode=mode),
            _row("reduce", W, (2, 3), dst=W - 1, grad_mode=mode),
        ]
    return rows


def _dtypes(W: int) -> list[Row]:
    """float16 (with and without float32 accumulation) and int32 (forward only) on every op, at W = 3 (float64
    and bfloat16 on every op: the case table's rows and tests/torch/test_properties.py's draws)."""
    if W != 3:
        return []
    rows = []
    for dtype in ("float16", "int32"):
        rows += [
            _row("all_reduce", W, (3, 4), dtype=dtype),
            _row("all_reduce", W, (2, 3), op="max", dtype=dtype),
            _row("all_gather", W, (2, 3), dim=-1, dtype=dtype),
            _row("reduce_scatter", W, (2 * W, 3), dtype=dtype),
            _row("all_to_all_4d", W, (2, 4, 2 * W, 3), dtype=dtype),
            _row("broadcast", W, (3,), src=W - 1, dtype=dtype),
            _row("gather", W, (2, 2), dim=0, dtype=dtype),
            _row("scatter", W, (2 * W, 2), dtype=dtype),
            _row("permute", W, (2, 3), perm=[[W - 1, 0]], dtype=dtype),
            _row("reduce", W, (2, 3), dst=W - 1, dtype=dtype),
        ]
        if dtype == "int32":  # shard: a local forward, and its backward is the all_gather above
            rows.append(_row("shard", W, (2, 2 * W), dtype=dtype))
    rows += [
        _row("all_reduce", W, (3, 4), op="avg", dtype="float16"),
        _row("all_reduce", W, (3, 4), dtype="float16", accum_dtype="float32"),
    ]
    return rows


def _uneven(W: int) -> list[Row]:
    """Uneven sizes (stored padded: torch cuts each rank's rows): errors every side and rank shares, and
    valid calls with a zero-size rank in every layout, grad mode and dtype class."""
    zeroed, odd = (0, *split_sizes(2 * W - 1, W - 1)), split_sizes(2 * W + 1, W)
    return [
        _row(
            "all_gather",
            W,
            (3, 2),
            dim=0,
            sizes=(3,) * (W + 1),
            error=f"CommError: all_gather: len(sizes) ({W + 1}) must equal world_size ({W}). Received: dim=0, sizes=",
        ),
        _row(
            "reduce_scatter",
            W,
            (2 * W, 3),
            sizes=(-1, *[2] * (W - 1)),
            error="CommError: reduce_scatter: sizes[0] (-1) must be >= 0. Received: dim=0, op='sum', sizes=(-1, ",
        ),
        _row(
            "scatter",
            W,
            (2 * W + 2, 2),
            sizes=odd,
            error=f"CommError: scatter: sum(sizes) ({2 * W + 1}) must equal the size of dim 0 ({2 * W + 2})",
        ),
        _row(
            "all_to_all_4d",
            W,
            (1, 3, W + 2, 2),
            scatter_sizes=(W + 1, *[0] * (W - 1)),
            gather_sizes=zeroed,
            error=f"CommError: all_to_all_4d: sum(scatter_sizes) ({W + 1}) must equal heads ({W + 2})",
        ),
        _row("gather", W, (3,), sizes="3", error="TypeError: gather: sizes must be a sequence of ints"),
        _row(
            "all_to_all",
            W,
            (2 * W, 3),
            scatter_dim=0,
            gather_dim=-2,
            scatter_sizes=split_sizes(2 * W, W),
            error="CommError: all_to_all: scatter_dim (0) must differ from gather_dim (0) with uneven sizes",
        ),
        _row(
            "all_to_all",
            W,
            (2, 3),
            scatter_dim=0,
            gather_dim=1,
            scatter_sizes=(1.0, 1.0),
            error="TypeError: all_to_all: scatter_sizes must be a sequence of ints",
        ),
        _row(
            "all_to_all_4d",
            W,
            (2, 3, W + 2, 3),
            scatter_sizes=split_sizes(W + 2, W),
            gather_sizes=zeroed,
            layout="channels_last",
        ),
        _row(
            "all_to_all_4d",
            W,
            (2, 2 * W + 1, 3, 2),
            scatter_dim=1,
            gather_dim=2,
            scatter_sizes=odd,
            gather_sizes=(3, *[0] * (W - 1)),
            layout="transposed",
        ),
        _row("all_gather", W, (3, 2), dim=0, sizes=zeroed, grad_mode="no_grad"),
        _row("all_gather", W, (2, 3), dim=-1, sizes=zeroed, convention="replicated", grad_mode="constant"),
        _row("reduce_scatter", W, (2, 2 * W + 1), dim=1, sizes=odd, op="avg", grad_mode="inference_mode"),
        _row("gather", W, (3, 2, 2), dst=W - 1, dim=0, sizes=zeroed, layout="channels_last"),
        _row("scatter", W, (2 * W + 1, 2), src=W - 1, sizes=odd, dtype="float64"),
        _row(
            "all_to_all",
            W,
            (2 * W + 1, 3),
            scatter_dim=0,
            gather_dim=1,
            scatter_sizes=odd,
            gather_sizes=zeroed,
            dtype="int32",
        ),
    ]


def _context(W: int) -> list[Row]:
    """Ring attention and USP (``ring_size * ulysses_size == W``): the spec's errors, and valid calls with
    non-contiguous or channels_last inputs, forward only, and in bfloat16."""
    zigzag = dict(kv_heads=2, causal=True, layout="zigzag")
    rows = [
        Row(
            context_case(W, (1, 3 * W, 4, 3), kv_heads=2, layout="zigzag"),
            f"CommError: ring_attention: seq ({3 * W}) "
            f"must be divisible by 2 * ring_size * ulysses_size ({2 * W}) for layout 'zigzag'",
        ),
        Row(context_case(W, (1, 0, 4, 3), f"empty-{W}", kv_heads=2), "CommError: ring_attention: seq (0) must be >= 1"),
        Row(
            context_case(W, (1, 2 * W, 4, 3), kv_heads=2, layout="ring"),
            "CommError: ring_attention: layout ('ring') must be one of contiguous, zigzag",
        ),
        Row(
            context_case(W, (1, 2 * W, 4, 3), kv_heads=3),
            "CommError: ring_attention: heads (4) must be divisible by kv heads (3)",
        ),
        Row(
            context_case(W, (1, 2 * W, 4, 3), kv_heads=2, causal=1),
            "TypeError: ring_attention: causal must be a bool, not int",
        ),
        Row(
            context_case(1, (1, 2 * W, W - 1, 3), kv_heads=1, ulysses_size=W),
            f"CommError: usp_attention: ulysses_size ({W}) must be <= heads ({W - 1})",
        ),
        Row(
            context_case(1, (1, 2 * W, 2 * W, 3), kv_heads=1, ulysses_size=W),
            f"CommError: usp_attention: kv heads (1) must be divisible by ulysses_size ({W})",
        ),
        Row(context_case(W, (2, 4 * W, 4, 3), **zigzag), layout="transposed"),
        Row(context_case(W, (2, 2 * W, 2, 3), kv_heads=1, causal=True), layout="channels_last"),
        Row(context_case(W, (1, 4 * W, 4, 4), dtype="bfloat16", **zigzag)),
        Row(
            context_case(1, (2, 4 * W, 2 * W, 3), kv_heads=W, ulysses_size=W, causal=True, layout="zigzag"),
            layout="transposed",
        ),
    ]
    for mode in GRAD_MODES[1:]:
        rows += [
            Row(context_case(W, (1, 4 * W, 4, 3), **zigzag), grad_mode=mode),
            Row(context_case(1, (1, 2 * W, 2 * W, 2), kv_heads=W, ulysses_size=W), grad_mode=mode),
        ]
    return rows


def _world_size_one() -> list[Row]:
    """World size 1: invalid calls are still invalid; what the case table's W = 1 rows (every op returns its
    input) lack: a grad mode, channels_last, an empty perm, a zero-size dim."""
    return [
        _row("all_reduce", 1, (2, 3), convention="replicated", grad_mode="no_grad"),
        _row("all_to_all_4d", 1, (2, 3, 5, 4), layout="channels_last"),
        _row("permute", 1, (2, 3), perm=[]),
        _row("sum_grad", 1, (0, 3)),
        _row("broadcast", 1, (3,), src=1, error="CommError: broadcast: src (1) must be in [0, 1) for world_size 1"),
        _row("permute", 1, (3,), perm=[[0, 1]], error="CommError: permute: dst (1) must be in [0, 1)"),
        _row("reduce", 1, (3,), dst=1, error="CommError: reduce: dst (1) must be in [0, 1) for world_size 1"),
        _row(
            "all_reduce", 1, (3,), op="avg", dtype="int32", error="CommError: all_reduce: op ('avg') needs a floating"
        ),
    ]


def table(world_sizes: tuple[int, ...] = WORLD_SIZES) -> list[Row]:
    """Every row at each of `world_sizes` (names are unique across the table)."""
    rows = _world_size_one() if 1 in world_sizes else []
    for W in world_sizes:
        if W > 1:
            rows += _errors(W) + _zero_size(W) + _layouts(W) + _grad_modes(W) + _dtypes(W) + _uneven(W) + _context(W)
    names = [row.name for row in rows]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates, duplicates
    return rows
