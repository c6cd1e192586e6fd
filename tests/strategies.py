"""Hypothesis strategies for every op's cases, shared by tests/torch/test_properties.py and
tests/jax/test_properties.py (plain data: neither framework is imported here).

`cases(op, space)` draws a `commlib.tools.cases.Case`: random shapes (size-1 dims, 0-d where the op allows), dims
(negative too, all_to_all's equal too), rank arguments, both conventions and shard's scale_grad, ties and zeros
for the reductions ("small" draws), world sizes 1-4. A `Space` says what a frontend's tests draw from: torch
takes sizes up to 3, bfloat16 and transposed (non-contiguous) inputs; JAX keeps sizes in {1, 2} so that examples
often lower to a program it already compiled (see tests/jax/programs.py).

`uneven_calls()` draws calls with uneven sizes (zeros included) for every op that takes them, as (op, world size,
padded input shape, keywords), for the spec, torch and JAX tests of uneven sizes; `uneven_case` makes the `Case`
(stored in the padded layout; torch's parity job cuts each rank's rows).
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from commlib.reduce_op import is_floating
from commlib.tools.cases import Case

__all__ = [
    "JAX",
    "MOVING_OPS",
    "OPS",
    "SEEDS",
    "TORCH",
    "UNEVEN_OPS",
    "Space",
    "cases",
    "fuzz_cases",
    "uneven_calls",
    "uneven_case",
]

SEEDS = st.integers(0, 2**16)


@dataclasses.dataclass(frozen=True)
class Space:
    """What one frontend's property tests draw from."""

    max_size: int  # each dim is drawn from 1..max_size (times W on a split dim)
    dtypes: tuple[str, ...]  # floating dtypes of the inputs
    transposed: bool  # also draw non-contiguous (transposed) inputs and cotangents
    world_sizes: tuple[int, ...] = (1, 2, 3, 4)


TORCH = Space(max_size=3, dtypes=("float64", "bfloat16"), transposed=True)
JAX = Space(max_size=2, dtypes=("float64",), transposed=False)


@st.composite
def _setting(draw, space: Space, min_ndim: int = 0, max_ndim: int = 4, dtypes: tuple[str, ...] | None = None):
    """(world_size, shape as a list to adjust a split dim, dtype, transposed)."""
    world_size = draw(st.sampled_from(space.world_sizes))
    shape = draw(st.lists(st.integers(1, space.max_size), min_size=min_ndim, max_size=max_ndim))
    dtype = draw(st.sampled_from(dtypes or space.dtypes))
    transposed = space.transposed and draw(st.booleans())
    return world_size, shape, dtype, transposed


def _dim(ndim: int):
    return st.integers(-ndim, ndim - 1)


def _case(op: str, setting: tuple, kwargs: list, draw: str = "normal") -> Case:
    world_size, shape, dtype, transposed = setting
    kwargs_tuple = tuple(kwargs)
    name = f"prop:{op}{list(shape)}{dict(kwargs_tuple)},{dtype},{'T' if transposed else ''}{draw}"
    return Case(name, op, world_size, tuple(shape), dtype, kwargs_tuple, transposed, draw=draw)


@st.composite
def _all_to_all(draw, space: Space):
    """Any scatter and gather dims (equal ones: torch's all_to_all_single, lax's split == concat), either spelled
    negative."""
    setting = draw(_setting(space, min_ndim=1))
    world_size, shape = setting[0], setting[1]
    ndim = len(shape)
    scatter = draw(_dim(ndim))
    gather = (scatter + draw(st.integers(0, ndim - 1))) % ndim - draw(st.sampled_from([0, ndim]))
    shape[scatter] *= world_size
    return _case("all_to_all", setting, [("scatter_dim", scatter), ("gather_dim", gather)])


@st.composite
def _all_gather(draw, space: Space):
    setting = draw(_setting(space, min_ndim=1))
    convention = draw(st.sampled_from(["sum", "replicated"]))
    return _case("all_gather", setting, [("dim", draw(_dim(len(setting[1])))), ("convention", convention)])


@st.composite
def _reduce_scatter(draw, space: Space):
    setting = draw(_setting(space, min_ndim=1))
    dim = draw(_dim(len(setting[1])))
    setting[1][dim] *= setting[0]
    return _case("reduce_scatter", setting, [("dim", dim), ("op", draw(st.sampled_from(["sum", "avg"])))])


@st.composite
def _all_reduce(draw, space: Space):
    """Every reduction in both conventions; "small" draws (integers in [-1, 2]) give ties and zeros;
    bfloat16 sometimes accumulated in float32; int32 (forward only) for the reductions integers have."""
    op = draw(st.sampled_from(["sum", "avg", "max", "min", "product"]))
    integers = () if op == "avg" else ("int32",)
    setting = draw(_setting(space, dtypes=(*space.dtypes, *integers)))
    kwargs = [("op", op), ("convention", draw(st.sampled_from(["sum", "replicated"])))]
    if setting[2] == "bfloat16" and draw(st.booleans()):
        kwargs.append(("accum_dtype", "float32"))
    return _case("all_reduce", setting, kwargs, draw(st.sampled_from(["normal", "small"])))


@st.composite
def _broadcast(draw, space: Space):
    setting = draw(_setting(space))
    return _case("broadcast", setting, [("src", draw(st.integers(0, setting[0] - 1)))])


@st.composite
def _gather(draw, space: Space):
    setting = draw(_setting(space, min_ndim=1))
    dst = draw(st.integers(0, setting[0] - 1))
    return _case("gather", setting, [("dst", dst), ("dim", draw(_dim(len(setting[1]))))])


@st.composite
def _scatter(draw, space: Space):
    setting = draw(_setting(space, min_ndim=1))
    src, dim = draw(st.integers(0, setting[0] - 1)), draw(_dim(len(setting[1])))
    setting[1][dim] *= setting[0]
    return _case("scatter", setting, [("src", src), ("dim", dim)])


@st.composite
def _permute(draw, space: Space):
    """A partial permutation: distinct sources, distinct destinations (a rank may send to itself)."""
    setting = draw(_setting(space))
    world_size = setting[0]
    sources = draw(st.lists(st.integers(0, world_size - 1), unique=True, max_size=world_size))
    destinations = draw(st.permutations(range(world_size)))[: len(sources)]
    return _case("permute", setting, [("perm", tuple(zip(sources, destinations, strict=True)))])


@st.composite
def _sum_grad(draw, space: Space):
    return _case("sum_grad", draw(_setting(space)), [])


@st.composite
def _shard(draw, space: Space):
    setting = draw(_setting(space, min_ndim=1, max_ndim=3))
    dim = draw(_dim(len(setting[1])))
    setting[1][dim] *= setting[0]
    return _case("shard", setting, [("dim", dim), ("scale_grad", draw(st.booleans()))])


@st.composite
def _reduce(draw, space: Space):
    """Elementwise over ranks: 0-2 dims are enough (fewer distinct JAX programs to compile)."""
    setting = draw(_setting(space, max_ndim=2))
    dst, op = draw(st.integers(0, setting[0] - 1)), draw(st.sampled_from(["sum", "avg"]))
    return _case("reduce", setting, [("dst", dst), ("op", op)])


_STRATEGIES = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "broadcast": _broadcast,
    "gather": _gather,
    "scatter": _scatter,
    "permute": _permute,
    "sum_grad": _sum_grad,
    "shard": _shard,
    "reduce": _reduce,
}
#: The ops with a strategy (all_to_all_4d is all_to_all on 4 dims; its own rules are in the case table).
OPS = tuple(_STRATEGIES)


def cases(op: str, space: Space) -> st.SearchStrategy[Case]:
    """Random valid cases of `op` drawn from `space`."""
    return _STRATEGIES[op](space)


# ---- uneven sizes ------------------------------------------------------------------------------------------

UNEVEN_OPS = ("all_gather", "gather", "reduce_scatter", "scatter", "all_to_all", "all_to_all_4d")
_UNEVEN_SIZES = st.integers(0, 3)


def _uneven_sizes(draw, world_size: int) -> tuple[int, ...]:
    return tuple(draw(st.lists(_UNEVEN_SIZES, min_size=world_size, max_size=world_size)))


@st.composite
def uneven_calls(draw, ops=UNEVEN_OPS, world_sizes=(1, 2, 3, 4)):
    """(op, world_size, padded input shape, kwargs): random dims (negative too) and uneven sizes with zeros."""
    op, W = draw(st.sampled_from(ops)), draw(st.sampled_from(world_sizes))
    ndim = 4 if op == "all_to_all_4d" else draw(st.integers(2 if op == "all_to_all" else 1, 3))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    sizes, kwargs = _uneven_sizes(draw, W), {}
    if op == "all_to_all_4d":
        scatter, gather = draw(st.sampled_from([(2, 1), (1, 2)]))
        kwargs.update(scatter_dim=scatter, gather_dim=gather)
    elif op == "all_to_all":
        scatter = draw(st.integers(0, ndim - 1))
        gather = (scatter + draw(st.integers(1, ndim - 1))) % ndim
        kwargs.update(scatter_dim=scatter - draw(st.sampled_from([0, ndim])), gather_dim=gather)
    else:
        kwargs["dim"] = draw(st.integers(-ndim, ndim - 1))
    if op in ("all_to_all", "all_to_all_4d"):
        other = _uneven_sizes(draw, W)
        kwargs.update(scatter_sizes=sizes, gather_sizes=other)
        shape[kwargs["scatter_dim"]], shape[kwargs["gather_dim"]] = sum(sizes), max(other)
    elif op in ("all_gather", "gather"):
        kwargs["sizes"], shape[kwargs["dim"]] = sizes, max(sizes)
    else:
        kwargs["sizes"], shape[kwargs["dim"]] = sizes, sum(sizes)
    if op in ("gather", "scatter"):
        kwargs["dst" if op == "gather" else "src"] = draw(st.integers(0, W - 1))
    if op == "reduce_scatter":
        kwargs["op"] = draw(st.sampled_from(["sum", "avg"]))
    if op == "all_gather":
        kwargs["convention"] = draw(st.sampled_from(["sum", "replicated"]))
    return op, W, tuple(shape), kwargs


def uneven_case(call, dtype: str = "float64", transposed: bool = False) -> Case:
    """The `Case` of a drawn call (padded layout)."""
    op, W, shape, kwargs = call
    name = f"uneven:{op}{list(shape)}{kwargs},{dtype}{',T' if transposed else ''}"
    return Case(name, op, W, shape, dtype, tuple(kwargs.items()), transposed)


# ---- the fuzz loop ------------------------------------------------------------------------------

#: Ops that move data without arithmetic: bool and integers run forward through them.
MOVING_OPS = ("all_gather", "gather", "scatter", "broadcast", "all_to_all", "all_to_all_4d", "permute")


@st.composite
def fuzz_cases(draw, space: Space):
    """Any op, even or with uneven sizes, in one of `space`'s floating dtypes or float32, or (ops that only move
    data) bool or int32: the mix the fuzz loop that found the stride-2 and bool-scatter bugs drew from."""
    if draw(st.booleans()):
        op = draw(st.sampled_from(UNEVEN_OPS))
        case = uneven_case(
            draw(uneven_calls(ops=(op,), world_sizes=space.world_sizes)),
            transposed=space.transposed and draw(st.booleans()),
        )
    else:
        op = draw(st.sampled_from(OPS))
        case = draw(cases(op, space))
    if not is_floating(case.dtype):  # (the reductions' integer draws stay as drawn)
        return case
    dtypes = (*space.dtypes, "float32", *(("bool", "int32") if op in MOVING_OPS else ()))
    dtype = draw(st.sampled_from(dtypes))
    return dataclasses.replace(case, dtype=dtype, name=f"fuzz:{case.name},{dtype}")
