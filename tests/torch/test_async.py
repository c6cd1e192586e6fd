"""``async_op=True`` (DESIGN "Overlap") on real gloo ranks: every op that takes it, W = 1-4,
every row of the parity case table for those ops (float32 / bfloat16 with accum_dtype, uneven sizes, empty
shards, non-contiguous inputs, the rejected calls; each valid float32 row in float64 too): outputs and
gradients bit for bit the synchronous call's on every rank and within the reference's tolerance, the same error
text for a bad call; the collective really begun asynchronously (forward, and the dual in backward, started by
the wait node's backward and waited by the start node's with other nodes run in between); two handles waited in
reverse order; checked mode, record(), failures, torch.compile, torch.func and the Handle's own behaviour."""

import dataclasses

import numpy as np
import pytest

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge
from tests.torch import async_jobs as jobs

WORLD_SIZES = (1, 2, 3, 4)


def _rows(world_size: int) -> list:
    """The case table's rows of the async ops, and each valid float32 row again in float64."""
    rows = [case for case in cases.case_table(world_size) if case.op in jobs.ASYNC_OPS]
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
        replies = pool(world_size).run(jobs.sync_and_async, case, arrays)
        synchronous, asynchronous = [reply[0] for reply in replies], [reply[1] for reply in replies]
        row = _check(case, arrays, asynchronous)
        if not row.passed or not all(map(jobs.numpy_equal, synchronous, asynchronous)):
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
    for events, asynchronous, synchronous in pool(world_size).run(jobs.backward_order):
        assert events == [("dual started", True), "compute between", ("dual waited", True)], events
        assert all(np.array_equal(a, s) for a, s in zip(asynchronous, synchronous, strict=True))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_two_handles_waited_in_reverse_order(pool, world_size):
    assert all(all(equal) for equal in pool(world_size).run(jobs.two_in_flight))


@pytest.mark.parametrize("world_size", [1, 3])
def test_handle_facts(pool, world_size):
    for facts in pool(world_size).run(jobs.handle_facts):
        second_async, second_sync = facts.pop("second derivative async"), facts.pop("second derivative sync")
        assert np.array_equal(second_async, second_sync) and np.abs(second_sync).max() > 0
        assert all(facts.values()), facts


def test_bad_input_refused_before_anything_is_sent(pool):
    for message, begun in pool(4).run(jobs.refused):
        assert message.startswith("all_to_all_4d: heads (9) must be divisible by world_size (4)"), message
        assert begun == 0


def test_compile_fullgraph_no_graph_break(pool):
    """Under Dynamo the call runs synchronously and returns a completed Handle: one graph, eager's values."""
    for breaks, out_error, grad_error in pool(2).run(jobs.compiled_wait, timeout=300):
        assert (breaks, out_error, grad_error) == (0, 0.0, 0.0)


def test_torch_func(pool):
    for vmapped, grad_equal in pool(2).run(jobs.under_transforms):
        assert vmapped.startswith("all_reduce: torch.func.vmap is not supported"), vmapped
        assert grad_equal


def test_checked_mode_exchanges_before_the_start(pool):
    for texts in pool(3).run(jobs.checked_disagreement):
        assert texts[0] == texts[1] and texts[0].startswith("all_to_all: ranks disagree"), texts


def test_recorded_as_one_call(pool):
    for calls, input_recorded, output_recorded in pool(2).run(jobs.recorded):
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
        failing.run(jobs.skip_async, 2, op, phase)
    assert info.value.ranks == (0, 1) and isinstance(info.value.cause, CommTimeout), info.value
    name = op if phase == "forward" else f"{op} backward"
    for rank in (0, 1):
        assert f"rank {rank} raised CommTimeout: {name}: timed out on group rank {rank}" in str(info.value)


@pytest.mark.parametrize("world_size", [1, 3])
def test_misuse_is_refused_or_right(pool, world_size):
    """async_op not a bool: a TypeError naming the op, before anything begins; a Handle begun in inference mode
    and waited outside: the synchronous values; x modified in place before wait(): a CommError on that rank."""
    for rank, facts in enumerate(pool(world_size).run(jobs.misuse)):
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
    unchecked = pool(world_size).run(jobs.waited_out_of_order, False)
    assert all(kind == "ok" and error > 1.0 for kind, error in unchecked), unchecked  # mixed, as documented
    replies = pool(world_size).run(jobs.waited_out_of_order, True)
    messages = [message for _, message in replies]
    assert all(kind == "error" for kind, _ in replies), replies
    assert len({message.split(" Received: ")[0] for message in messages}) == 1, messages  # (but each own call)
    assert messages[0].startswith("all_to_all backward: ranks disagree on the forward call: rank 0 has call"), messages
    assert "wait the handles in the same order on every rank" in messages[0], messages[0]
