"""Pool jobs for tests/torch/test_async.py: ``async_op=True`` against the synchronous call on every rank
(module-level: the pool's workers import them by name)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

import commlib_torch
from commlib.tools import cases
from commlib_torch import handle as handle_module
from commlib_torch.tools.parity_jobs import run_case

#: The ops that take ``async_op``.
ASYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_4d", "permute")


@contextlib.contextmanager
def asynchronous(op: str, begun: list):
    """While inside, ``commlib_torch.<op>(...)`` is ``commlib_torch.<op>(..., async_op=True).wait()``, and every
    collective the calls begin asynchronously is appended to `begun` (its plan's step name)."""
    synchronous, begin = getattr(commlib_torch, op), handle_module._begin

    def waited(*args, **kwargs):
        handle = synchronous(*args, **kwargs, async_op=True)
        assert isinstance(handle, commlib_torch.Handle), type(handle)
        return handle.wait()

    def counted(plan, x, group):
        begun.append(plan.step.name)
        return begin(plan, x, group)

    setattr(commlib_torch, op, waited)
    handle_module._begin = counted
    try:
        yield
    finally:
        setattr(commlib_torch, op, synchronous)
        handle_module._begin = begin


def sync_and_async(context, case: cases.Case, arrays) -> tuple:
    """`run_case` of `case` on this rank synchronously and with ``async_op=True`` (each ("ok", out, grads) or
    ("error", text)), and the collectives the asynchronous run began (forward and backward)."""
    synchronous = run_case(context, case, arrays)
    begun: list = []
    with asynchronous(case.op, begun):
        result = run_case(context, case, arrays)
    return synchronous, result, begun


def _leaf(shape, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 17 * dist.get_rank())
    return torch.randn(shape, generator=generator, dtype=dtype).requires_grad_()


def _marked(events: list, name: str):
    """An identity autograd Function whose backward appends `name` to `events`."""

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, cotangent):
            events.append(name)
            return cotangent

    return Mark.apply


@contextlib.contextmanager
def _events_of_the_nodes(events: list):
    """While inside, the start and wait nodes' backwards append what they do to `events`, and the dual
    collective's work is recorded as begun / waited."""
    start_backward, wait_backward = handle_module._StartNode.backward, handle_module._WaitNode.backward

    def waits(ctx, token_cotangent):
        pending = ctx.call.dual
        events.append(("dual waited", pending is not None))
        return start_backward(ctx, token_cotangent)

    def starts(ctx, cotangent):
        out = wait_backward(ctx, cotangent)
        events.append(("dual started", ctx.call.dual is not None))
        return out

    handle_module._StartNode.backward, handle_module._WaitNode.backward = staticmethod(waits), staticmethod(starts)
    try:
        yield
    finally:
        handle_module._StartNode.backward = staticmethod(start_backward)
        handle_module._WaitNode.backward = staticmethod(wait_backward)


def backward_order(context) -> tuple[list, list, list]:
    """An all_to_all_4d started, compute on another tensor (marked) before its ``wait()``, both in the loss:
    the order in which backward started the dual all_to_all, ran the marked compute's backward, and waited for
    the dual; and the gradients against the synchronous call's (float64 numpy)."""
    world_size = context.world_size
    events: list = []
    mark = _marked(events, "compute between")
    x, other = _leaf((2, 3, 2 * world_size, 5)), _leaf((4, 4), seed=1)
    with _events_of_the_nodes(events):
        handle = commlib_torch.all_to_all_4d(x, async_op=True)
        between = mark(other @ other)  # made after the start, before the wait: its backward may overlap
        out = handle.wait()
        (out.sin().sum() + between.sum()).backward()
    asynchronous_grads = [x.grad.numpy().copy(), other.grad.numpy().copy()]
    x.grad = other.grad = None
    (commlib_torch.all_to_all_4d(x).sin().sum() + (other @ other).sum()).backward()
    return events, asynchronous_grads, [x.grad.numpy(), other.grad.numpy()]


def two_in_flight(context) -> list[bool]:
    """Two handles in flight at once (an all_gather and a reduce_scatter of other tensors), waited in reverse
    order, a loss of both: outputs and gradients equal (bit for bit) to the synchronous calls'."""
    world_size = context.world_size
    a, b = _leaf((3, 2 * world_size), torch.float32), _leaf((2 * world_size, 3), torch.float32, seed=2)
    first = commlib_torch.all_gather(a, dim=0, async_op=True)
    second = commlib_torch.reduce_scatter(b, dim=0, async_op=True)
    out_b, out_a = second.wait(), first.wait()
    (out_a.cos().sum() + (out_b * out_b).sum()).backward()
    got = [out_a.detach().clone(), out_b.detach().clone(), a.grad.clone(), b.grad.clone()]
    a.grad = b.grad = None
    want_a, want_b = commlib_torch.all_gather(a, dim=0), commlib_torch.reduce_scatter(b, dim=0)
    (want_a.cos().sum() + (want_b * want_b).sum()).backward()
    want = [want_a.detach(), want_b.detach(), a.grad, b.grad]
    return [torch.equal(g, w) for g, w in zip(got, want, strict=True)]


def handle_facts(context) -> dict:
    """What a Handle does besides its value: wait twice, is_completed, no autograd state without grad,
    a Handle never waited, a second derivative (create_graph) through it."""
    world_size = context.world_size
    x = _leaf((2 * world_size, 3))
    handle = commlib_torch.all_to_all(x, 0, 1, async_op=True)
    first = handle.wait()
    facts: dict = {"same tensor": first is handle.wait(), "completed after wait": handle.is_completed()}
    with torch.no_grad():
        quiet = commlib_torch.all_reduce(x, async_op=True).wait()
    facts["no_grad: no graph"] = quiet.grad_fn is None
    constant = commlib_torch.all_reduce(x.detach(), async_op=True).wait()
    facts["constant: no graph"] = constant.grad_fn is None
    facts["freed without the garbage collector"] = _freed(x)
    commlib_torch.all_gather(x, async_op=True)  # never waited: it completes on every rank all the same
    after = commlib_torch.all_reduce(torch.ones(2), async_op=True).wait()
    facts["after an unwaited handle"] = torch.equal(after, torch.full((2,), float(world_size)))
    # second derivative: d/dx of sum(grad(all_reduce(x)^3)) through the async pair, against the synchronous
    for asynchronous_op in (True, False):
        y = x.detach().requires_grad_()
        out = commlib_torch.all_reduce(y, async_op=True).wait() if asynchronous_op else commlib_torch.all_reduce(y)
        (grad,) = torch.autograd.grad((out**3).sum(), y, create_graph=True)
        (second,) = torch.autograd.grad(grad.sum(), y)
        facts[f"second derivative {'async' if asynchronous_op else 'sync'}"] = second.numpy()
    return facts


def _freed(x: torch.Tensor) -> bool:
    """Whether a waited and backpropagated call's shared record dies with its Handle and output, with the
    garbage collector off (no reference cycle through the autograd graph)."""
    import gc

    def records() -> int:
        return sum(type(thing) is handle_module._Call for thing in gc.get_objects())

    gc.disable()
    try:
        before = records()
        handle = commlib_torch.all_to_all(x, 0, 1, async_op=True)
        out = handle.wait()
        out.sum().backward()
        alive = records() == before + (dist.get_world_size() > 1)  # (W = 1: no record, the identity)
        del handle, out
        return alive and records() == before
    finally:
        gc.enable()


def compiled_wait(context) -> tuple[int, float, float]:
    """``torch.compile(fullgraph=True)`` of a function calling ``all_to_all(..., async_op=True).wait()``:
    (graph breaks, max |compiled - eager| of the output, of the gradient)."""
    from torch._dynamo.utils import counters

    def function(x):
        return commlib_torch.all_to_all(x, 0, 1, async_op=True).wait().sin()

    torch._dynamo.reset()
    counters.clear()
    x = _leaf((2 * context.world_size, 3), torch.float32)
    compiled = torch.compile(function, fullgraph=True, backend="aot_eager")
    out_c = compiled(x)
    out_c.sum().backward()
    grad_c, x.grad = x.grad, None
    out = function(x)
    out.sum().backward()
    breaks = sum(counters["graph_break"].values())
    return breaks, float((out_c - out).abs().max()), float((grad_c - x.grad).abs().max())


def refused(context) -> tuple[str, int]:
    """A bad call with ``async_op=True`` (heads not divisible by W): the spec's error, and how many collectives
    it began (0: refused before anything is sent)."""
    begun: list = []
    with asynchronous("all_to_all_4d", begun):
        try:
            commlib_torch.all_to_all_4d(torch.ones(2, 4, 2 * context.world_size + 1, 3))
        except commlib_torch.CommError as error:
            return str(error), len(begun)
    return "no error", len(begun)


def under_transforms(context) -> tuple[str, bool]:
    """torch.func with ``async_op=True``: vmap's error text; grad equal to the synchronous call's."""
    world_size = context.world_size
    x = _leaf((2 * world_size, 3)).detach()
    try:
        torch.func.vmap(lambda row: commlib_torch.all_reduce(row, async_op=True).wait())(x)
        vmapped = "no error"
    except TypeError as error:
        vmapped = str(error)
    grad_async = torch.func.grad(lambda y: commlib_torch.all_gather(y, 0, async_op=True).wait().sin().sum())(x)
    grad_sync = torch.func.grad(lambda y: commlib_torch.all_gather(y, 0).sin().sum())(x)
    return vmapped, bool(torch.equal(grad_async, grad_sync))


def numpy_equal(a, b) -> bool:
    """Bit-for-bit equality of two `run_case` results (NaN equal to NaN)."""
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a[1] == b[1]
    _, out_a, grads_a = a
    _, out_b, grads_b = b
    return (
        np.array_equal(out_a, out_b, equal_nan=True)
        and grads_a.keys() == grads_b.keys()
        and all(np.array_equal(grads_a[name], grads_b[name], equal_nan=True) for name in grads_a)
    )


def checked_disagreement(context) -> list:
    """Checked mode, ranks that disagree on the shape (rank 0 one column more): the error each rank raises with
    ``async_op=True`` and synchronously (the same text: the fingerprints are exchanged before the start)."""
    from commlib_torch import checked

    world_size, texts = context.world_size, []
    x = torch.ones(2 * world_size, 3 + (context.rank == 0))
    for asynchronous_op in (True, False):
        try:
            with checked():
                commlib_torch.all_to_all(x, 0, 1, async_op=asynchronous_op)
            texts.append("no error")
        except commlib_torch.CommError as error:
            texts.append(str(error))
    return texts


def recorded(context) -> tuple[list, bool, bool]:
    """``testing_trace.record()`` around an async all_to_all: the calls recorded (op, input shape), and whether
    the recorded input and output are the call's."""
    from commlib_torch.testing_trace import record

    x = _leaf((2 * context.world_size, 3))
    with record() as trace:
        out = commlib_torch.all_to_all(x, 0, 1, async_op=True).wait()
    calls = [(call.op, call.plan["in_shape"]) for call in trace]
    rank = dist.get_rank()
    return (
        calls,
        bool(np.array_equal(trace[0].inputs["x"][rank], x.detach().numpy())),
        bool(np.array_equal(trace[0].outputs["out"][rank], out.detach().numpy())),
    )


def skip_async(context, skipper: int, op: str, phase: str) -> str:
    """Rank `skipper` skips `op` (its forward, or only its backward); the others call it with ``async_op=True``,
    wait, backpropagate, and raise what they get (on a pool with a short process-group timeout)."""
    world_size = context.world_size
    x = torch.ones(2 * world_size, 3 * world_size, requires_grad=True)
    if context.rank == skipper and phase == "forward":
        return "skipped"
    if op == "all_gather":
        out = commlib_torch.all_gather(x, 0, async_op=True).wait()
    else:
        out = commlib_torch.all_to_all_4d(x.reshape(1, 2 * world_size, 3 * world_size, 1), async_op=True).wait()
    if context.rank == skipper:
        return "skipped"
    out.sum().backward()
    return "finished"


def misuse(context) -> dict:
    """The mistakes a newcomer's break-it session made: ``async_op`` not a bool (refused, and no collective
    begun), a Handle begun in ``torch.inference_mode`` and waited outside it (the synchronous call's values),
    an input modified in place before ``wait()`` (refused on the rank that modified it, after the collective)."""
    world_size, begun = context.world_size, []
    facts: dict = {}
    with asynchronous("all_reduce", begun):
        for value in ("yes", None, 1):
            try:
                commlib_torch.reduce_scatter(torch.ones(2 * world_size), async_op=value)
                facts[f"async_op={value!r}"] = "no error"
            except TypeError as error:
                facts[f"async_op={value!r}"] = str(error)
    facts["begun"] = len(begun)
    x = torch.arange(2.0 * world_size * 3).reshape(2 * world_size, 3) + context.rank
    for op, call in (
        ("reduce_scatter", lambda a: commlib_torch.reduce_scatter(x, 0, async_op=a)),
        ("all_gather", lambda a: commlib_torch.all_gather(x, 0, async_op=a)),
        ("all_to_all", lambda a: commlib_torch.all_to_all(x, 0, 1, async_op=a)),
    ):
        with torch.inference_mode():
            handle, synchronous = call(True), call(False)
        facts[f"inference_mode {op}"] = torch.equal(handle.wait(), synchronous)
    changes = {
        "": lambda y: y.mul_(2),
        " view": lambda y: y[0].zero_(),
        " detach": lambda y: y.detach().add_(1),
        " data": lambda y: y.data.add_(1),  # (not seen by the version counter: documented, unrefused)
        " numpy": lambda y: y.numpy().__setitem__(0, 7.0),  # (the same)
    }
    for op, call in (
        ("all_gather", lambda y: commlib_torch.all_gather(y, 0, async_op=True)),
        ("all_reduce", lambda y: commlib_torch.all_reduce(y, async_op=True)),
    ):
        for how, change in changes.items():
            y = x.clone()
            handle = call(y)
            if context.rank == 0:
                change(y)
            try:
                handle.wait()
                facts[f"modified{how} {op}"] = "no error"
            except commlib_torch.CommError as error:
                facts[f"modified{how} {op}"] = str(error)
    leaf = x.clone().requires_grad_()
    handle = commlib_torch.all_gather(leaf, 0, async_op=True)
    try:
        with torch.no_grad():
            handle.wait()
        facts["no_grad wait"] = "no error"
    except commlib_torch.CommError as error:
        facts["no_grad wait"] = str(error)
    return facts


def waited_out_of_order(context, check: bool) -> tuple:
    """Two all_to_alls of the same shape in flight; rank 0 waits them in call order, the other ranks in reverse
    (a newcomer's mistake: the backward begins the duals in the reverse order of the waits, so rank 0's dual of
    `a` meets the others' dual of `b`). Checked or not: ("error", each rank's message) or ("ok", the largest
    difference of a's and b's gradients from the synchronous calls')."""
    from commlib_torch import checked

    world_size = context.world_size
    a, b = _leaf((2 * world_size, 3)), _leaf((2 * world_size, 3), seed=5)
    weights = torch.arange(2.0 * 3 * world_size).reshape(3 * world_size, 2).T  # out's shape: [2, 3 W]
    try:
        with checked(check):
            first = commlib_torch.all_to_all(a, 0, 1, async_op=True)
            second = commlib_torch.all_to_all(b, 0, 1, async_op=True)
            if context.rank == 0:
                out_a, out_b = first.wait(), second.wait()
            else:
                out_b, out_a = second.wait(), first.wait()
            ((out_a * weights).sum() + (out_b * weights.flip(1)).sum() ** 2).backward()
    except commlib_torch.CommError as error:
        return "error", str(error)
    got, a.grad, b.grad = (a.grad, b.grad), None, None
    want_a, want_b = commlib_torch.all_to_all(a, 0, 1), commlib_torch.all_to_all(b, 0, 1)
    ((want_a * weights).sum() + (want_b * weights.flip(1)).sum() ** 2).backward()
    return "ok", max(float((g - w).abs().max()) for g, w in zip(got, (a.grad, b.grad), strict=True))
