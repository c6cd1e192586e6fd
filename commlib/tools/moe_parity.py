"""``commlib parity --workload moe``: expert parallelism's `route`, `dispatch` and `combine`, torch (layouts
``exact`` and ``padded``) vs JAX (``padded``) vs the float64 reference `commlib.reference.moe.simulate_moe`.

Every case of `cases` is one MoE layer on every rank: ``route(indices)``, ``d = dispatch(x)``, the experts
``y = tanh((1 + e / E) * d)`` (a different function per expert e, so a wrong ordering cannot pass; computed in
float32 for bf16 rows), ``out = combine(y, weights)`` and the loss ``sum(out * cotangent)`` summed over ranks. In
the padded layout NaN is written into y's padded rows and into the padded rows of d's cotangent: they must reach
nothing. Each runner stores every rank's `OUTPUTS`: the dispatched rows, the combined output, the x / y / weights
gradients (y's: the cotangent combine gives the expert outputs), and `COUNTS` (``tokens_per_expert``, zero-padded
to ``max(experts_per_rank)``, and ``[rows, dropped]``). torch's rows are ``exact`` and ``padded`` (a case with
another T per rank: exact only), JAX's ``shard_map[check_vma=True]`` (every case with one T). The driver compares
them with the reference in the same layout: "err out" is the dispatched rows' and output's error, "err grad" the
largest of the three gradients', each relative to max(1, |reference|); a row passes within
`commlib.testing.TOLERANCES` of its dtype, with the counts equal, every value finite and the padded rows of the
dispatched rows and of y's gradient exactly 0. torch's padded rows are also compared with JAX's.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from commlib.reference.moe import simulate_moe
from commlib.testing.parity import TOLERANCES
from commlib.tools.parity import FRAMEWORKS, Row, run_workload
from commlib.tools.sequence_parity import SequenceResults, load, relative_error
from commlib.uneven import split_sizes

__all__ = [
    "COUNTS",
    "OUTPUTS",
    "RESULTS",
    "TORCH_LAYOUTS",
    "MoeCase",
    "MoeResults",
    "cases",
    "compare",
    "cross",
    "data",
    "expected",
    "expert_scales",
    "round_to",
    "route_options",
    "run",
]

OUTPUTS = ("dispatched", "out", "x_grad", "y_grad", "w_grad")  # float, per rank
COUNTS = ("tokens_per_expert", "counts")  # int, per rank: exact
RESULTS = "moe_results"  # the runners' file names: moe_results.npz / .json
TORCH_LAYOUTS = ("exact", "padded")  # torch's modes; JAX's mode is its layout's (padded)
TOKENS = 6  # T of a rank in every case but the one with T = 0 on a rank
RANDOM, NONE, RANK_NONE, ONE_EXPERT = "random", "none", "rank none", "one expert"


@dataclasses.dataclass(frozen=True)
class MoeCase:
    """One row of the workload: E experts over the ranks (`experts_per_rank`, None: E / W each), top-`top_k`
    indices of `tokens` rows per rank (a tuple: T per rank) with features `features`, `routes` (``"random"``:
    each row a random set of K experts, 15% of the entries then -1; ``"none"``: all -1; ``"rank none"``: random
    but the last rank all -1; ``"one expert"``: every entry expert E - 1), `capacity` (an int, ``"tight"``: the
    busiest (source rank, expert) pair's routes minus one, or None) or `capacity_factor`, `dtype`, weights
    given to combine or not, and torch's inputs non-contiguous views."""

    label: str
    num_experts: int
    top_k: int
    tokens: tuple[int, ...]
    features: tuple[int, ...]
    experts_per_rank: tuple[int, ...] | None = None
    capacity: int | str | None = None
    capacity_factor: float | None = None
    routes: str = RANDOM
    dtype: str = "float64"
    weighted: bool = True
    noncontiguous: bool = False

    @property
    def world_size(self) -> int:
        return len(self.tokens)

    @property
    def same_tokens(self) -> bool:
        """Every rank has the same T: the padded layout (torch's opt-in, JAX's only) runs it."""
        return len(set(self.tokens)) == 1

    @property
    def name(self) -> str:
        """``moe[uneven,E=9(3,2,2,2),K=2,capacity=1,F=2x3]``."""
        placement = "" if self.experts_per_rank is None else str(self.experts_per_rank).replace(" ", "")
        parts = [self.label, f"E={self.num_experts}{placement}", f"K={self.top_k}"]
        if self.capacity is not None:
            parts.append(f"capacity={self.capacity}")
        if self.capacity_factor is not None:
            parts.append(f"capacity_factor={self.capacity_factor}")
        parts.append("F=" + "x".join(map(str, self.features)))
        parts += [] if self.same_tokens else ["T=" + "/".join(map(str, self.tokens))]
        parts += [] if self.dtype == "float64" else [self.dtype]
        parts += [] if self.weighted else ["unweighted"]
        parts += ["non-contiguous"] if self.noncontiguous else []
        return f"moe[{','.join(parts)}]"


def cases(world_size: int) -> list[MoeCase]:
    """The workload's rows at `world_size` W, each covering a few of the conditions (one compile each in JAX):
    even (2 per rank) and uneven placement (``split_sizes(8, 3)`` at W = 3, else ``split_sizes(2W + 1, W)``), a
    rank owning no experts (W > 1), K = 1, 2 and E, capacity None, 0, 1, tight, T and a factor 1.0, all -1
    everywhere, a rank routing nothing, everything to one expert (no weights), T = 0 on a rank (torch's exact
    layout only), features ``[T, H]`` and ``[T, 2, 3]``, non-contiguous inputs (torch), float32 and bfloat16
    (float32 accumulation); 15% of the entries -1 in every random routing."""
    W = world_size
    even, odd = 2 * W, 8 if W == 3 else 2 * W + 1
    uneven = split_sizes(odd, W)
    same = (TOKENS,) * W
    found = [
        MoeCase("even", even, 2, same, (4,), noncontiguous=True),
        MoeCase("uneven", odd, 2, same, (2, 3), uneven),
        MoeCase("uneven", odd, 1, same, (4,), uneven, capacity=1),
        MoeCase("even", even, 2, same, (4,), capacity=0),
        MoeCase("uneven", odd, 2, same, (2, 3), uneven, capacity="tight", dtype="float32"),
        MoeCase("even", even, 2, same, (4,), capacity=TOKENS, dtype="bfloat16"),
        MoeCase("rank routes nothing", odd, 2, same, (4,), uneven, capacity_factor=1.0, routes=RANK_NONE),
        MoeCase("K=E", odd, odd, (3,) * W, (4,), uneven),
        MoeCase("all -1", even, 2, same, (4,), routes=NONE),
        MoeCase("one expert", even, 1, same, (4,), routes=ONE_EXPERT, weighted=False),
        MoeCase("T=0 on a rank", odd, 2, (*(5, 3, 4)[: W - 1], 0), (2, 3), uneven),
    ]
    if W > 1:
        idle = (0, *split_sizes(2 * W - 1, W - 1))
        found.append(MoeCase("rank owns no experts", 2 * W - 1, 2, same, (2, 3), idle, capacity=3, dtype="bfloat16"))
    return found


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` rounded to `dtype` (float64, float32, bfloat16: nearest, ties to even), held as float64: what a
    framework's cast of them gives, exactly."""
    if dtype == "float64":
        return np.asarray(values, np.float64)
    single = np.asarray(values, np.float32)
    if dtype == "float32":
        return single.astype(np.float64)
    bits = single.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def _indices(case: MoeCase, rank: int, rng: np.random.Generator) -> np.ndarray:
    tokens, experts, top_k = case.tokens[rank], case.num_experts, case.top_k
    chosen = np.array([rng.permutation(experts)[:top_k] for _ in range(tokens)], dtype=np.int64)
    chosen = chosen.reshape(tokens, top_k)
    chosen[rng.random(chosen.shape) < 0.15] = -1
    if case.routes == NONE or (case.routes == RANK_NONE and rank == case.world_size - 1):
        chosen[:] = -1
    if case.routes == ONE_EXPERT:
        chosen[:] = experts - 1
    return chosen


def data(case: MoeCase, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """The seeded inputs of `case`, per rank (the same on every side): ``x [T, *F]``, ``indices [T, K]``
    (int64), ``weights [T, K]`` and the output's ``cotangent [T, *F]``, the floats rounded to the case's dtype."""
    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode())])
    found: dict[str, list[np.ndarray]] = {"x": [], "indices": [], "weights": [], "cotangent": []}
    for rank, tokens in enumerate(case.tokens):
        found["x"].append(round_to(rng.standard_normal((tokens, *case.features)), case.dtype))
        found["indices"].append(_indices(case, rank, rng))
        found["weights"].append(round_to(rng.random((tokens, case.top_k)), case.dtype))
        found["cotangent"].append(round_to(rng.standard_normal((tokens, *case.features)), case.dtype))
    return found


def route_options(case: MoeCase, indices: list[np.ndarray]) -> dict:
    """`route`'s keywords but the layout: capacity ``"tight"`` resolved from every rank's `indices` (the busiest
    (source rank, expert) pair's routes minus one: that pair drops one)."""
    capacity = case.capacity
    if capacity == "tight":
        busiest = max(int(np.bincount(i[i >= 0], minlength=case.num_experts).max(initial=0)) for i in indices)
        capacity = max(busiest - 1, 0)
    placement = case.experts_per_rank
    return dict(capacity=capacity, capacity_factor=case.capacity_factor, experts_per_rank=placement)


def expert_scales(
    tokens_per_expert: Sequence[int], first_expert: int, rows: int, length: int, num_experts: int
) -> np.ndarray:
    """``[length]``: each dispatched row's expert e as ``1 + e / E`` (expert e is ``tanh((1 + e / E) * row)``),
    0 past `rows` (the padded rows). `tokens_per_expert`: this rank's rows per local expert, in order."""
    counts = np.asarray(tokens_per_expert, dtype=np.int64)
    experts = np.repeat(np.arange(counts.size) + first_expert, counts)
    scale = np.zeros(length)
    scale[:rows] = 1.0 + experts / num_experts
    return scale


def _column(values: np.ndarray, ndim: int) -> np.ndarray:
    return values.reshape(*values.shape, *[1] * (ndim - values.ndim))


def expected(case: MoeCase, layout: str, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Every rank's `OUTPUTS` and `COUNTS` from `simulate_moe` (float64) in `layout` (w_grad: zeros without
    weights)."""
    inputs = data(case, seed)
    xs, indices, bars = inputs["x"], inputs["indices"], inputs["cotangent"]
    weights = inputs["weights"] if case.weighted else None
    options = dict(layout=layout, **route_options(case, indices))
    first = simulate_moe(xs, indices, case.num_experts, **options)
    offsets, ndim = first.plans[0].expert_offsets, 1 + len(case.features)
    scales = [
        _column(expert_scales(t.tokens_per_expert, offsets[r], t.rows, len(d), case.num_experts), ndim)
        for r, (t, d) in enumerate(zip(first.tables, first.dispatched, strict=True))
    ]
    valid = [_column(np.arange(len(d)) < t.rows, ndim) for d, t in zip(first.dispatched, first.tables, strict=True)]
    ys = [np.where(v, np.tanh(s * d), np.nan) for v, s, d in zip(valid, scales, first.dispatched, strict=True)]
    sim = simulate_moe(xs, indices, case.num_experts, weights=weights, ys=ys, out_bars=bars, **options)
    d_bars = [
        np.where(v, y_bar * s * (1 - np.tanh(s * d) ** 2), 0.0)
        for v, y_bar, s, d in zip(valid, sim.y_bar, scales, first.dispatched, strict=True)
    ]
    x_grads = simulate_moe(xs, indices, case.num_experts, ys=d_bars, **options).combined
    most = max(first.plans[0].experts_per_rank)
    ranks = []
    for rank, table in enumerate(sim.tables):
        w_grad = np.zeros(inputs["weights"][rank].shape) if sim.weights_bar is None else sim.weights_bar[rank]
        per_expert = np.zeros(most, np.int64)
        per_expert[: len(table.tokens_per_expert)] = table.tokens_per_expert
        values = (first.dispatched[rank], sim.combined[rank], x_grads[rank], sim.y_bar[rank], w_grad)
        ranks.append(
            dict(zip(OUTPUTS, values, strict=True))
            | {"tokens_per_expert": per_expert, "counts": np.array([table.rows, table.dropped])}
        )
    return ranks


def _problems(got: list[dict], want: list[dict]) -> list[str]:
    """What is wrong beyond the tolerance: counts, non-finite values, padded rows not exactly 0."""
    found = []
    for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for key in COUNTS:
            if np.asarray(mine[key]).tolist() != np.asarray(theirs[key]).tolist():
                found.append(f"rank {rank} {key} {np.asarray(mine[key]).tolist()} != {theirs[key].tolist()}")
        found += [f"rank {rank} {key} not finite" for key in OUTPUTS if not np.isfinite(mine[key]).all()]
        rows = int(theirs["counts"][0])
        padded = [key for key in ("dispatched", "y_grad") if mine[key][rows:].any()]
        found += [f"rank {rank} {key}'s padded rows not 0" for key in padded]
    return found


def _row(case: MoeCase, framework: str, mode: str, got: list[dict], want: list[dict]) -> Row:
    out_error = relative_error(got, want, OUTPUTS[:2])
    grad_error = relative_error(got, want, OUTPUTS[2:])
    problems = _problems(got, want)
    tolerance = TOLERANCES[case.dtype]
    passed = out_error <= tolerance and grad_error <= tolerance and not problems
    return Row(case.name, framework, mode, out_error, grad_error, passed, "; ".join(problems[:3]))


def _ranks(stored: dict, case: MoeCase, mode: str) -> list[dict[str, np.ndarray]]:
    keys = OUTPUTS + COUNTS
    return [{key: stored[f"{case.name}|{mode}|{key}|{rank}"] for key in keys} for rank in range(case.world_size)]


def modes(framework: str, case: MoeCase) -> tuple[str, ...]:
    """The modes `framework`'s runner runs `case` in (the padded layout needs one T on every rank)."""
    if framework == "torch":
        return TORCH_LAYOUTS if case.same_tokens else TORCH_LAYOUTS[:1]
    return ("shard_map[check_vma=True]",) if case.same_tokens else ()


def layout_of(mode: str) -> str:
    return "exact" if mode == "exact" else "padded"


def compare(framework: str, result_dir: Path, world_size: int, seed: int) -> list[Row]:
    """Rows of one runner: every (case, mode) it reported against the reference; a case it never ran in one of
    its `modes` fails."""
    meta, stored = load(result_dir, RESULTS)
    by_name = {case.name: case for case in cases(world_size)}
    rows = []
    for name, mode in meta["entries"]:
        error, case = meta["errors"].get(f"{name}|{mode}"), by_name.get(name)
        if error is not None or case is None:
            rows.append(Row(name, framework, mode, None, None, False, error or "not a case of this world size"))
            continue
        rows.append(_row(case, framework, mode, _ranks(stored, case, mode), expected(case, layout_of(mode), seed)))
    ran = {tuple(entry) for entry in meta["entries"]}
    return rows + [
        Row(case.name, framework, mode, None, None, False, "not run")
        for case in by_name.values()
        for mode in modes(framework, case)
        if (case.name, mode) not in ran
    ]


def cross(torch_dir: Path, jax_dir: Path, world_size: int) -> list[Row]:
    """torch's padded layout against JAX, case by case (the same shapes)."""
    (torch_meta, torch_stored), (jax_meta, jax_stored) = load(torch_dir, RESULTS), load(jax_dir, RESULTS)
    rows = []
    for case in cases(world_size):
        if [case.name, "padded"] not in torch_meta["entries"] or f"{case.name}|padded" in torch_meta["errors"]:
            continue
        mine = _ranks(torch_stored, case, "padded")
        for name, mode in jax_meta["entries"]:
            if name == case.name and f"{name}|{mode}" not in jax_meta["errors"]:
                rows.append(_row(case, "torch vs jax", mode, mine, _ranks(jax_stored, case, mode)))
    return rows


class MoeResults(SequenceResults):
    """What an MoE runner writes: per (case name, mode) every rank's `OUTPUTS` and `COUNTS`, or the error it
    raised."""

    stem = RESULTS


def run(
    world_size: int, seed: int = 0, frameworks: Sequence[str] = FRAMEWORKS, timeout: float | None = None
) -> list[Row]:
    """The moe workload at `world_size`: rows per framework, mode and case, then torch's padded rows against
    JAX's."""
    return run_workload(
        "moe",
        world_size,
        seed,
        frameworks,
        timeout,
        lambda framework, out_dir: compare(framework, out_dir, world_size, seed),
        lambda torch_dir, jax_dir: cross(torch_dir, jax_dir, world_size),
    )
