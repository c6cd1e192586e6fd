"""The torch bench cases of `commlib bench` (run by ``python -m commlib_torch.tools.bench_runner``).

Each bench case (`CASES`, filled by `@bench_case`) builds, on every rank, its variants over the same bytes:
commlib and the baselines it is compared with. One `WorkerPool` of gloo ranks per world size times them in
rotating order (so no variant always runs first), with a barrier before each call; per round the slowest
rank's wall-clock time counts (a collective ends when its last rank does), and the CPU time of all ranks
together (the work done, which a loaded machine's preemptions do not inflate). The driver
(`commlib.tools.bench`) takes medians.

To add a row (e.g. checked mode, or commlib under ``torch.no_grad()``), register a builder::

    @bench_case("all_to_all_4d (2, 1) B=1 no_grad", baselines=("commlib",), subject="commlib no_grad")
    def _no_grad(ctx, nbytes):
        x = _ulysses_input(ctx, nbytes, batch=1, dims=(2, 1)).requires_grad_()
        def under_no_grad():
            with torch.no_grad():
                return commlib_torch.all_to_all_4d(x)
        return {"commlib no_grad": under_no_grad, "commlib": lambda: commlib_torch.all_to_all_4d(x)}

The first variant named in a builder's dict need not be the subject; every variant runs every round.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

import commlib_torch
from commlib_torch._c10d import all_gather_single, reduce_scatter_single
from commlib_torch.tools.baselines import SeedAllToAll4D, seed_all_to_all_4d, ulysses_by_hand
from commlib_torch.tools.pool import WorkerContext

__all__ = ["CASES", "BenchCase", "bench_case", "checked_overhead", "time_case"]

Variant = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]  # timed, or (untimed prep, timed)
_HEADS, _HEAD_DIM = 8, 64  # Ulysses inputs: [B, S, H, D] float32, S from the byte size

warnings.filterwarnings("ignore", message=r".*deprecated.*", category=FutureWarning)  # renamed torch APIs


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One row family of the bench: a builder of variants over the same bytes."""

    name: str  # row name
    build: Callable[[WorkerContext, int], dict[str, Variant]]  # (ctx, bytes per rank) -> {variant: call}
    baselines: tuple[str, ...]  # variants `subject` is compared with: ratio = subject / baseline
    subject: str = "commlib"  # the variant under test
    quick: bool = False  # part of `commlib bench --quick`
    wire: Callable[[int, int], dict[str, int]] | None = None  # (W, bytes per rank) -> bytes on the wire per variant
    sizes_mib: tuple[float, ...] | None = None  # the sizes this case runs at, whatever --sizes-mib says (None: those)


CASES: dict[str, BenchCase] = {}


def bench_case(
    name: str,
    baselines: tuple[str, ...],
    *,
    subject: str = "commlib",
    quick: bool = False,
    wire: Callable[[int, int], dict[str, int]] | None = None,
    sizes_mib: tuple[float, ...] | None = None,
):
    """Register a builder ``(ctx, bytes per rank) -> {variant name: call}`` as the bench case `name`; `wire`
    gives the bytes each variant sends, where the case reports them; `sizes_mib` the case's own sizes (a whole
    training step cannot run at every size of the collective cases)."""

    def register(build):
        CASES[name] = BenchCase(name, build, tuple(baselines), subject, quick, wire, sizes_mib)
        return build

    return register


# ---- other baselines -------------------------------------------------------------------------------------


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _funcol_call(name: str, old_name: str):
    """A functional collective, waited on; torch 2.13 renamed some (the old names warn), 2.11 has the old."""
    funcol = _funcol()
    function = getattr(funcol, name, None) or getattr(funcol, old_name)
    return lambda *args: funcol.wait_tensor(function(*args))


def _nn_exchange(group):
    import torch.distributed.nn.functional as nn_functional

    return lambda send: nn_functional.all_to_all_single(torch.empty_like(send), send, group=group)


def _funcol_exchange(group):
    call = _funcol_call("all_to_all_single", "all_to_all_single")
    return lambda send: call(send, None, None, group)


def _input(ctx: WorkerContext, shape) -> torch.Tensor:
    generator = torch.Generator().manual_seed(ctx.rank)
    return torch.randn(shape, generator=generator)


def _numel(nbytes: int) -> int:
    return nbytes // 4  # float32


# ---- cases: commlib vs the raw torch.distributed call (and functional collectives) on the same bytes ------


@bench_case("all_reduce", baselines=("torch.distributed", "clone + torch.distributed", "funcol"), quick=True)
def _all_reduce(ctx, nbytes):
    """c10d reduces in place: the raw call overwrites a buffer refilled (untimed) before each call; a
    functional all_reduce (commlib, funcol, the seed) must first copy the input into a fresh output."""
    x, buffer = _input(ctx, (_numel(nbytes),)), torch.empty(_numel(nbytes))
    funcol = _funcol_call("all_reduce", "all_reduce")

    def clone_and_reduce():
        out = x.clone()
        dist.all_reduce(out, group=ctx.group)
        return out

    return {
        "commlib": lambda: commlib_torch.all_reduce(x),
        "torch.distributed": (lambda: buffer.copy_(x), lambda: dist.all_reduce(buffer, group=ctx.group)),
        "clone + torch.distributed": clone_and_reduce,
        "funcol": lambda: funcol(x, "sum", ctx.group),
    }


@bench_case("all_gather (dim 0)", baselines=("torch.distributed", "funcol"), quick=True)
def _all_gather(ctx, nbytes):
    x = _input(ctx, (_numel(nbytes),))
    funcol = _funcol_call("all_gather_single", "all_gather_tensor")

    def raw():
        out = torch.empty(ctx.world_size * x.numel())
        all_gather_single(out, x, group=ctx.group)
        return out

    return {
        "commlib": lambda: commlib_torch.all_gather(x, dim=0),
        "torch.distributed": raw,
        "funcol": lambda: funcol(x, 0, ctx.group),
    }


@bench_case("reduce_scatter (dim 0)", baselines=("torch.distributed", "funcol"), quick=True)
def _reduce_scatter(ctx, nbytes):
    x = _input(ctx, (_numel(nbytes),))
    funcol = _funcol_call("reduce_scatter_single", "reduce_scatter_tensor")

    def raw():
        out = torch.empty(x.numel() // ctx.world_size)
        reduce_scatter_single(out, x, group=ctx.group)
        return out

    return {
        "commlib": lambda: commlib_torch.reduce_scatter(x, dim=0),
        "torch.distributed": raw,
        "funcol": lambda: funcol(x, "sum", 0, ctx.group),
    }


@bench_case("all_to_all_single", baselines=("torch.distributed", "funcol"), quick=True)
def _all_to_all_single(ctx, nbytes):
    x = _input(ctx, (1, _numel(nbytes)))  # scatter dim 1, gather dim 0: the plan is all_to_all_single itself
    funcol = _funcol_exchange(ctx.group)

    def raw():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=ctx.group)
        return out

    return {
        "commlib": lambda: commlib_torch.all_to_all(x, 1, 0).reshape(1, -1),
        "torch.distributed": raw,
        "funcol": lambda: funcol(x.reshape(ctx.world_size, -1)).reshape(1, -1),
    }


# ---- cases: Ulysses all_to_all_4d vs the seed's three copies and the hand-written permute + collective ------


def _ulysses_input(ctx: WorkerContext, nbytes: int, batch: int, dims: tuple[int, int]) -> torch.Tensor:
    """[B, S/W, H, D] for (2, 1), [B, S, H/W, D] for (1, 2), of about `nbytes` (float32)."""
    heads = _HEADS if dims == (2, 1) else _HEADS // ctx.world_size
    seq = max(ctx.world_size, _numel(nbytes) // (batch * heads * _HEAD_DIM) // ctx.world_size * ctx.world_size)
    return _input(ctx, (batch, seq, heads, _HEAD_DIM))


def _ulysses_case(batch: int, dims: tuple[int, int], quick: bool = False) -> None:
    @bench_case(
        f"all_to_all_4d {dims} B={batch}", baselines=("seed (3 copies)", "torch.distributed.nn", "funcol"), quick=quick
    )
    def build(ctx, nbytes):
        x, W = _ulysses_input(ctx, nbytes, batch, dims), ctx.world_size
        nn_exchange, funcol_exchange = _nn_exchange(ctx.group), _funcol_exchange(ctx.group)
        return {
            "commlib": lambda: commlib_torch.all_to_all_4d(x, *dims),
            "seed (3 copies)": lambda: seed_all_to_all_4d(x, W, *dims),
            "torch.distributed.nn": lambda: ulysses_by_hand(x, W, *dims, nn_exchange),
            "funcol": lambda: ulysses_by_hand(x, W, *dims, funcol_exchange),
        }


_ulysses_case(1, (2, 1), quick=True)
_ulysses_case(1, (1, 2))
_ulysses_case(2, (2, 1))
_ulysses_case(2, (1, 2))


@bench_case("all_to_all_4d (2, 1) B=1 fwd+bwd", baselines=("seed (3 copies)",))
def _ulysses_backward(ctx, nbytes):
    x = _ulysses_input(ctx, nbytes, 1, (2, 1)).requires_grad_()
    cotangent = _input(ctx, commlib_torch.all_to_all_4d(x.detach()).shape)

    def commlib():
        commlib_torch.all_to_all_4d(x).backward(cotangent)

    def seed():
        SeedAllToAll4D.apply(x, ctx.world_size, 2, 1).backward(cotangent)

    return {"commlib": commlib, "seed (3 copies)": seed}


# ---- cases: checked mode and the inference path (issue 5) --------------------------------------------------


def _checked_case(name: str, make_input, call) -> None:
    @bench_case(f"{name} checked", baselines=("commlib",), subject="commlib checked")
    def build(ctx, nbytes):
        """Checked mode's cost: one all_gather of a 32-int64 fingerprint per rank before the collective."""
        x = make_input(ctx, nbytes)

        def checked():
            with commlib_torch.checked():
                return call(x)

        return {"commlib checked": checked, "commlib": lambda: call(x)}


_checked_case("all_reduce", lambda ctx, nbytes: _input(ctx, (_numel(nbytes),)), commlib_torch.all_reduce)
_checked_case(
    "all_to_all_4d (2, 1) B=1", lambda ctx, nbytes: _ulysses_input(ctx, nbytes, 1, (2, 1)), commlib_torch.all_to_all_4d
)


def _inference_case(mode_name: str, mode) -> None:
    @bench_case(
        f"all_reduce {mode_name}", baselines=("clone + torch.distributed", "commlib"), subject=f"commlib {mode_name}"
    )
    def build(ctx, nbytes):
        """commlib on an input that requires grad, called under `mode` (no graph), vs the raw collective
        (out of place, as commlib is) and vs commlib building the graph."""
        x = _input(ctx, (_numel(nbytes),)).requires_grad_()

        def under_mode():
            with mode():
                return commlib_torch.all_reduce(x)

        def clone_and_reduce():
            out = x.detach().clone()
            dist.all_reduce(out, group=ctx.group)
            return out

        return {
            f"commlib {mode_name}": under_mode,
            "clone + torch.distributed": clone_and_reduce,
            "commlib": lambda: commlib_torch.all_reduce(x),
        }


_inference_case("no_grad", torch.no_grad)
_inference_case("inference_mode", torch.inference_mode)


def _median_seconds(call: Callable[[], object], repeats: int, group) -> float:
    for _ in range(max(2, repeats // 10)):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def checked_overhead(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, repeats: int = 50) -> dict[str, float]:
    """Median seconds per call on this rank (call it on every rank of `group`) of an all_reduce(sum) of `x`:

    ``raw`` (``dist.all_reduce`` of a copy, as commlib's out-of-place op does), ``commlib`` (input
    requiring grad: builds the graph), ``no_grad``, ``inference_mode``, ``constant`` (input not requiring
    grad), ``checked`` (checked mode on, requiring grad) and ``fingerprint`` (the exchange alone).
    Checked-mode overhead = checked - commlib, inference overhead = no_grad - raw.
    """
    from commlib import plans
    from commlib_torch._checked import checked, exchange
    from commlib_torch._dtypes import dtype_name

    leaf = x.detach().requires_grad_(x.is_floating_point())
    constant = x.detach()
    plan = plans.all_reduce(tuple(x.shape), dist.get_world_size(group), dtype=dtype_name(x.dtype))

    def raw():
        dist.all_reduce(constant.clone(), group=group)

    def in_mode(mode):
        def call():
            with mode():
                commlib_torch.all_reduce(leaf, group=group)

        return call

    def with_check():
        with checked():
            commlib_torch.all_reduce(leaf, group=group)

    calls = {
        "raw": raw,
        "commlib": lambda: commlib_torch.all_reduce(leaf, group=group),
        "no_grad": in_mode(torch.no_grad),
        "inference_mode": in_mode(torch.inference_mode),
        "constant": lambda: commlib_torch.all_reduce(constant, group=group),
        "checked": with_check,
        "fingerprint": lambda: exchange(plan, constant, group),
    }
    with checked(False):
        return {name: _median_seconds(call, repeats, group) for name, call in calls.items()}


# ---- timing ---------------------------------------------------------------------------------------------


def _parts(variant: Variant) -> tuple[Callable[[], object] | None, Callable[[], object]]:
    return variant if isinstance(variant, tuple) else (None, variant)


def _check_agree(outputs: dict[str, object], case: str) -> None:
    """Every variant that returned a tensor computed the same value (a bench of a wrong result is no bench)."""
    tensors = {name: out for name, out in outputs.items() if isinstance(out, torch.Tensor)}
    if not tensors:
        return
    first = next(iter(tensors))
    for name, out in tensors.items():
        if out.shape != tensors[first].shape or not torch.allclose(out, tensors[first], rtol=1e-5, atol=1e-5):
            raise AssertionError(f"bench {case!r}: variant {name!r} disagrees with {first!r}")


def time_case(ctx: WorkerContext, name: str, nbytes: int, repeats: int, warmup: int) -> list[dict]:
    """A pool job: for each of `repeats` rounds after `warmup` rounds, this rank's wall-clock seconds per
    variant and its CPU seconds (all threads of the process: gloo's too)."""
    variants = CASES[name].build(ctx, nbytes)
    names, rounds = list(variants), []
    for index in range(warmup + repeats):
        shift = index % len(names)
        wall, cpu, outputs = {}, {}, {}
        for variant in names[shift:] + names[:shift]:
            prepare, timed = _parts(variants[variant])
            if prepare is not None:
                prepare()
            dist.barrier(group=ctx.group)
            start, start_cpu = time.perf_counter(), time.process_time()
            result = timed()
            wall[variant], cpu[variant] = time.perf_counter() - start, time.process_time() - start_cpu
            if index == 0:
                outputs[variant] = result
            del result
        if index == 0:
            _check_agree(outputs, name)
            del outputs
        if index >= warmup:
            rounds.append({"wall": wall, "cpu": cpu})
    return rounds
