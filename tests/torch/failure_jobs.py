"""Job functions for tests/torch/test_checked.py and test_failures.py (module level, so worker processes
import them by name). Jobs that expect an error return ("error", type name, message) instead of raising,
so the test sees every rank's outcome and the pool keeps its workers; failure jobs raise, as user code
would, so the pool reports the ranks."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import torch
import torch.distributed as dist

import commlib_torch
from commlib import CommError
from commlib_torch._checked import checked, is_checked, set_checked
from commlib_torch.tools.parity_jobs import run_case
from tests.torch.op_calls import every_op

ENABLERS = ("context", "set_checked", "env")


def _input(shape, dtype: str = "float32", rank: int = 0) -> torch.Tensor:
    x = (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) % 7 + rank).to(getattr(torch, dtype))
    return x.requires_grad_(x.is_floating_point())


@contextlib.contextmanager
def _enabled(how: str):
    """Checked mode on the way `how` names: ``with checked()``, `set_checked`, or ``COMMLIB_CHECK=1``."""
    if how == "context":
        with checked():
            yield
        return
    previous = os.environ.get("COMMLIB_CHECK")
    if how == "env":
        os.environ["COMMLIB_CHECK"] = "1"
    else:
        set_checked(True)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("COMMLIB_CHECK", None)
        else:
            os.environ["COMMLIB_CHECK"] = previous
        set_checked(None)  # back to following the environment


def call_checked(ctx, calls, *, backward: bool = False, enable: str = "context"):
    """Rank r calls ``calls[r] = (op, shape, dtype, kwargs)`` in checked mode (backward too if asked):
    ("ok", output) or ("error", type name, message)."""
    op, shape, dtype, kwargs = calls[ctx.rank]
    x = _input(shape, dtype, ctx.rank)
    try:
        with _enabled(enable):
            assert is_checked()
            out = getattr(commlib_torch, op)(x, **kwargs)
            if backward:
                out.float().sum().backward()
    except (CommError, TypeError) as error:
        return "error", type(error).__name__, str(error)
    return "ok", out.detach().double().numpy()


def backward_disagrees(ctx):
    """Every rank runs all_gather then all_to_all forward; rank 0 backpropagates only through the first,
    the others only through the second: the backward collectives differ."""
    W = ctx.world_size
    x = _input((2 * W, 3), rank=ctx.rank)
    with checked():
        gathered = commlib_torch.all_gather(x, 0)
        exchanged = commlib_torch.all_to_all(x, 0, 1)
        loss = gathered.sum() if ctx.rank == 0 else exchanged.sum()
        try:
            loss.backward()
        except CommError as error:
            return "error", type(error).__name__, str(error)
    return "ok", x.grad.numpy()


def checked_state(ctx):
    """is_checked() under each way of switching, restored after each."""
    states = {"default": is_checked()}
    for how in ENABLERS:
        with _enabled(how):
            states[how] = is_checked()
        states[f"after {how}"] = is_checked()
    with checked():
        with checked(False):
            states["checked(False) inside checked()"] = is_checked()
        states["restored"] = is_checked()
    return states


def run_case_checked(ctx, case, arrays):
    """`run_case` in checked mode: every valid case must pass the fingerprint exchange, forward and backward."""
    with checked():
        return run_case(ctx, case, arrays)


_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def autograd_state(ctx, mode: str, check: bool = False):
    """{op: (has grad_fn, requires_grad, tensors saved for backward)} for one call per op under `mode`:
    "no_grad" / "inference_mode" (input requires grad), "constant" (input doesn't), "grad" (the control)."""
    saved = []
    x = torch.ones(2 * ctx.world_size, 3, requires_grad=mode != "constant")
    result = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), checked(check):
        for name, call in every_op(ctx.world_size, x).items():
            before = len(saved)
            with _MODES.get(mode, torch.enable_grad)():
                out = call()
            result[name] = (out.grad_fn is not None, out.requires_grad, len(saved) - before)
    return result


def overhead(ctx, shape, repeats):
    from commlib_torch.tools.bench_cases import checked_overhead as measure

    return measure(torch.ones(shape), repeats=repeats)


# --- failures: skipped collectives and dead ranks ---------------------------------------------------


def _op_call(op: str, x: torch.Tensor, W: int):
    if op == "all_gather":
        return commlib_torch.all_gather(x, 0)
    if op == "all_to_all_4d":
        return commlib_torch.all_to_all_4d(x.reshape(1, W, 3 * W, 1))
    return commlib_torch.all_reduce(x)


def skip_collective(ctx, skipper: int, op: str = "all_reduce", phase: str = "forward", check: bool = False):
    """Rank `skipper` skips `op` (in `phase`: its forward, or only its backward) and returns; the others
    call it and raise whatever they get."""
    x = _input((ctx.world_size, 3 * ctx.world_size), rank=ctx.rank)
    with checked(check):
        if ctx.rank == skipper and phase == "forward":
            return "skipped"
        out = _op_call(op, x, ctx.world_size)
        if ctx.rank == skipper:
            return "skipped"
        out.sum().backward()
    return "finished"


def die_in_collective(ctx, victim: int, op: str = "all_reduce", phase: str = "forward", delay: float = 0.5):
    """Rank `victim` is SIGKILLed `delay` s after the others entered `op` (its forward, or its backward)."""
    x = _input((ctx.world_size, 3 * ctx.world_size), rank=ctx.rank)
    if phase == "backward":
        out = _op_call(op, x, ctx.world_size)
    if ctx.rank == victim:
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)
    if phase == "forward":
        out = _op_call(op, x, ctx.world_size)
    out.sum().backward()
    return "finished"


def kill_rank_in_case(ctx, case, arrays):
    """`run_case`, except that a case named ``kill-rank-R`` SIGKILLs rank R first (a parity run losing a rank)."""
    if case.name.startswith("kill-rank-") and ctx.rank == int(case.name.removeprefix("kill-rank-")):
        os.kill(os.getpid(), signal.SIGKILL)
    return run_case(ctx, case, arrays)


# --- checked mode beyond the functional ops: the seed's gather, send/recv, double backward ------------------


def _outcome(call):
    try:
        with checked():
            return "ok", call()
    except (CommError, TypeError) as error:
        return "error", type(error).__name__, str(error)


def seed_gather_checked(ctx, shapes):
    """`DeviceCommunicator.gather` of a tensor of `shapes[rank]` to rank 0, in checked mode."""
    comm = commlib_torch.DeviceCommunicator(torch.distributed.group.WORLD)
    x = _input(shapes[ctx.rank], rank=ctx.rank)
    return _outcome(lambda: comm.gather(x.detach(), 0, 0))


def send_recv_checked(ctx, sent, expected):
    """Rank 0 sends a tensor of `sent` = (shape, dtype) to rank 1, which receives `expected` = (size, dtype)."""
    comm = commlib_torch.DeviceCommunicator(torch.distributed.group.WORLD)
    if ctx.rank == 0:
        return _outcome(lambda: comm.send(_input(sent[0], sent[1]).detach(), 1))
    if ctx.rank == 1:
        return _outcome(lambda: comm.recv(expected[0], getattr(torch, expected[1]), 0).numpy())
    return None


def double_backward_disagrees(ctx, shapes):
    """Every rank runs all_reduce on x1 (`shapes[0]`) and x2 (`shapes[1]`) and takes both first derivatives
    with create_graph (the same collectives everywhere); then rank 0 differentiates the first again and the
    others the second: the double backward's collectives differ in shape."""
    x1, x2 = _input(shapes[0], "float64", ctx.rank), _input(shapes[1], "float64", ctx.rank)

    def call():
        (g1,) = torch.autograd.grad((commlib_torch.all_reduce(x1, "max") ** 2).sum(), x1, create_graph=True)
        (g2,) = torch.autograd.grad((commlib_torch.all_reduce(x2) ** 2).sum(), x2, create_graph=True)
        ((g1 if ctx.rank == 0 else g2) ** 2).sum().backward()
        return "finished"

    return _outcome(call)


def raise_and_go_on(ctx, raiser: int) -> str:
    """Rank `raiser` raises (a list as q: the layer's TypeError, before any communication), stays alive and goes
    on to another collective, which times out; the others, a second later, wait in the layer's all-to-all. Every
    rank's error."""
    q = torch.zeros((1, 2, 2 * ctx.world_size, 4))
    if ctx.rank != raiser:
        time.sleep(1.0)  # the raiser's next collective times out (and closes its pairs) before the others' wait
    try:
        from commlib_torch.attention import ulysses_attention

        ulysses_attention(q.tolist() if ctx.rank == raiser else q, q, q)
    except (CommError, TypeError, RuntimeError) as error:
        if ctx.rank != raiser:
            return f"{type(error).__name__}: {error}"
    try:
        commlib_torch.all_gather(torch.ones(3), 0)
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return "finished"


def raise_inside_layer(ctx, raiser: int, then: str = "return") -> str:
    """Every rank calls `ulysses_attention`; rank `raiser`'s attention function raises a ValueError (after the
    layer's first all-to-all), and that rank stays alive: it returns at once (`then` "return": idle, its
    process group intact) or goes on to another collective (`then` "collective"), which times out. The others
    wait in the layer's output all-to-all. Every rank's error text."""
    q = torch.zeros((1, 2, 2 * ctx.world_size, 4), requires_grad=True)
    dist.barrier()  # every rank enters the layer together: on a loaded machine the 5 s timeout is for the layer

    def attend(q, k, v, **options):
        if ctx.rank == raiser:
            raise ValueError("a user error inside the layer")
        return attention(q, k, v, **options)

    from commlib_torch.attention import attention, ulysses_attention

    try:
        ulysses_attention(q, q, q, attn_fn=attend)
    except (ValueError, RuntimeError) as error:
        if ctx.rank != raiser or then == "return":
            return f"{type(error).__name__}: {error}"
    try:
        commlib_torch.all_gather(torch.ones(3), 0)
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return "finished"
