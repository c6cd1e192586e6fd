"""``async_op=True`` (DESIGN "Overlap") on real gloo ranks: every op that takes it, W = 1-4,
every row of the parity case table for those ops (float32 / bfloat16 with accum_dtype, uneven sizes, empty
shards, non-contiguous inputs, the rejected calls; each valid float32 row in float64 too): outputs and
gradients bit for bit the synchronous call's on every rank and within the reference's tolerance, the same error
text for a bad call; the collective really begun asynchronously (forward, and the dual in backward, started by
the wait node's backward and waited by the start node's with other nodes run in between); two handles waited in
reverse order; checked mode, record(), failures, torch.compile, torch.func and the Handle's own behaviour."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

import commlib_torch
from commlib.tools import cases, parity
from commlib_torch import handle as handle_module
from commlib_torch.tools.parity_jobs import merge, run_case

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------


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


# --- the tests ----------------------------------------------------------------------------------------------


WORLD_SIZES = (1, 2, 3, 4)


def _rows(world_size: int) -> list:
    """The case table's rows of the async ops, and each valid float32 row again in float64."""
    rows = [case for case in cases.case_table(world_size) if case.op in ASYNC_OPS]
    wide = [
        dataclasses.replace(case, dtype="float64")
        for case in rows
        if case.dtype == "float32" and cases.error_text(case) is None
    ]
    assert len(wide) >= 20, len(wide)
    return rows + wide


def _check(case, arrays, results):
    """The `parity.Row` of one run of `case` (every rank's `run_case` result) against the reference."""
    outputs, gradients, error = merge(case, results)
    return parity.check(case, arrays, outputs, gradients, error)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_async_equals_sync_on_the_case_table(pool, world_size):
    failed = []
    for case in _rows(world_size):
        arrays = cases.make_arrays(case, 0)
        replies = pool(world_size).run(sync_and_async, case, arrays)
        synchronous, asynchronous = [reply[0] for reply in replies], [reply[1] for reply in replies]
        row = _check(case, arrays, asynchronous)
        if not row.passed or not all(map(numpy_equal, synchronous, asynchronous)):
            failed.append(f"{case.name}: {row.out_error} {row.grad_error} {row.detail}")
            continue
        begun = [reply[2] for reply in replies]
        rejected, linear = (
            cases.error_text(case) is not None,
            "op" not in case.params or case.params["op"] in ("sum", "avg"),
        )
        if rejected or world_size == 1 or not linear:  # nothing begun: refused, W = 1, or run synchronously
            assert all(calls == [] for calls in begun), (case.name, begun)
        else:  # the forward's collective, and (differentiable) the backward's dual, begun asynchronously
            assert all(len(calls) == 1 + case.differentiable for calls in begun), (case.name, begun)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_backward_starts_the_dual_and_waits_for_it_later(pool, world_size):
    """The wait node's backward starts the dual all_to_all; the compute made between the call and its wait
    runs its backward next; the start node's backward waits for the dual after it. Gradients as synchronous."""
    for events, asynchronous, synchronous in pool(world_size).run(backward_order):
        assert events == [("dual started", True), "compute between", ("dual waited", True)], events
        assert all(np.array_equal(a, s) for a, s in zip(asynchronous, synchronous, strict=True))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_two_handles_waited_in_reverse_order(pool, world_size):
    assert all(all(equal) for equal in pool(world_size).run(two_in_flight))


@pytest.mark.parametrize("world_size", [1, 3])
def test_handle_facts(pool, world_size):
    for facts in pool(world_size).run(handle_facts):
        second_async, second_sync = facts.pop("second derivative async"), facts.pop("second derivative sync")
        assert np.array_equal(second_async, second_sync) and np.abs(second_sync).max() > 0
        assert all(facts.values()), facts


def test_bad_input_refused_before_anything_is_sent(pool):
    for message, begun in pool(4).run(refused):
        assert message.startswith("all_to_all_4d: heads (9) must be divisible by world_size (4)"), message
        assert begun == 0


def test_compile_fullgraph_no_graph_break(pool):
    """Under Dynamo the call runs synchronously and returns a completed Handle: one graph, eager's values."""
    for breaks, out_error, grad_error in pool(2).run(compiled_wait, timeout=300):
        assert (breaks, out_error, grad_error) == (0, 0.0, 0.0)


def test_torch_func(pool):
    for vmapped, grad_equal in pool(2).run(under_transforms):
        assert vmapped.startswith("all_reduce: torch.func.vmap is not supported"), vmapped
        assert grad_equal


def test_checked_mode_exchanges_before_the_start(pool):
    for texts in pool(3).run(checked_disagreement):
        assert texts[0] == texts[1] and texts[0].startswith("all_to_all: ranks disagree"), texts


def test_recorded_as_one_call(pool):
    for calls, input_recorded, output_recorded in pool(2).run(recorded):
        assert calls == [("all_to_all", "(4, 3)")] and input_recorded and output_recorded, calls


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("op", "phase"), [("all_to_all_4d", "forward"), ("all_gather", "backward")])
def test_failure_in_wait_is_translated(monkeypatch, op, phase):
    """A rank skips the collective: the others' ``wait()`` (forward) or backward (the dual's wait) raises the
    synchronous op's CommTimeout, naming the op and the phase."""
    import commlib_torch._pool as pool_module
    from commlib import CommTimeout
    from commlib_torch.tools.pool import WorkerError, WorkerPool

    monkeypatch.setattr(pool_module, "STRAGGLER_GRACE", 15.0)
    with WorkerPool(3, timeout=60.0, pg_timeout=5.0) as failing, pytest.raises(WorkerError) as info:
        failing.run(skip_async, 2, op, phase)
    assert info.value.ranks == (0, 1) and isinstance(info.value.cause, CommTimeout), info.value
    name = op if phase == "forward" else f"{op} backward"
    for rank in (0, 1):
        assert f"rank {rank} raised CommTimeout: {name}: timed out on group rank {rank}" in str(info.value)


@pytest.mark.parametrize("world_size", [1, 3])
def test_misuse_is_refused_or_right(pool, world_size):
    """async_op not a bool: a TypeError naming the op, before anything begins; a Handle begun in inference mode
    and waited outside: the synchronous values; x modified in place before wait(): a CommError on that rank."""
    for rank, facts in enumerate(pool(world_size).run(misuse)):
        for value, kind in (("'yes'", "str"), ("None", "NoneType"), ("1", "int")):
            assert facts[f"async_op={value}"] == (
                f"reduce_scatter: async_op must be a bool, not {kind}. Received: type='{kind}'"
            ), facts
        assert facts["begun"] == 0
        assert all(facts[f"inference_mode {op}"] for op in ("reduce_scatter", "all_gather", "all_to_all")), facts
        for op in ("all_gather", "all_reduce"):
            for how in ("", " view", " detach"):  # what shares x's version counter: refused
                if rank == 0 and world_size > 1:
                    assert facts[f"modified{how} {op}"].startswith(
                        f"{op}: x was modified in place between the call with async_op=True and wait()"
                    ), facts
                    assert facts[f"modified{how} {op}"].endswith("version_at_call=0, version_at_wait=1"), facts
                else:
                    assert facts[f"modified{how} {op}"] == "no error", facts
            for how in (" data", " numpy"):  # what does not (the documented limit): unrefused
                assert facts[f"modified{how} {op}"] == "no error", facts
        if world_size > 1:  # (W = 1: no communication, the result is made at the call, with its gradient)
            assert facts["no_grad wait"].startswith(
                "all_gather: wait() ran with gradients disabled for an x that requires grad"
            ), facts
            assert facts["no_grad wait"].endswith("Received: requires_grad=True, grad_enabled=False"), facts
        else:
            assert facts["no_grad wait"] == "no error", facts


@pytest.mark.parametrize("world_size", [2, 3])
def test_waits_in_different_orders_are_refused_in_checked_mode(pool, world_size):
    """Rank 0 waits two same-shape handles in call order, the others in reverse: unchecked, the gradients are
    mixed (documented: wait in the same order on every rank); checked, every rank raises the same CommError in
    the backward, naming the op, the forward calls each rank's dual belongs to, and the rule."""
    unchecked = pool(world_size).run(waited_out_of_order, False)
    assert all(kind == "ok" and error > 1.0 for kind, error in unchecked), unchecked  # mixed, as documented
    replies = pool(world_size).run(waited_out_of_order, True)
    messages = [message for _, message in replies]
    assert all(kind == "error" for kind, _ in replies), replies
    assert len({message.split(" Received: ")[0] for message in messages}) == 1, messages  # (but each own call)
    assert messages[0].startswith("all_to_all backward: ranks disagree on the forward call: rank 0 has call"), messages
    assert "wait the handles in the same order on every rank" in messages[0], messages[0]
