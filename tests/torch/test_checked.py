"""Checked mode on real gloo groups: ranks that disagree on a call all raise the same `CommError` before the
collective runs (where unchecked gloo aborts, hangs or returns garbage), valid calls pass unchanged; and
calls outside grad mode build no autograd state."""

from __future__ import annotations

import pytest

from commlib.tools import cases
from commlib_torch.attention import attention
from commlib_torch.tools.parity_jobs import merge
from tests.torch import checked_jobs, failure_jobs

pytestmark = pytest.mark.timeout(120)


def _call(name, shape, dtype="float32", /, **kwargs):
    """One rank's call for `failure_jobs.call_checked`: (op name, shape, dtype, keyword arguments)."""
    return (name, shape, dtype, kwargs)


def _errors(replies):
    """Every rank's error message; fails if a rank did not raise CommError."""
    assert all(reply[:2] == ("error", "CommError") for reply in replies), replies
    return [reply[2] for reply in replies]


def _same_body(messages):
    """The part of the message every rank shares (before each rank's own "Received: ...")."""
    bodies = {message.split(": ", 1)[1].split(". Received: ")[0] for message in messages}
    assert len(bodies) == 1, messages
    return bodies.pop()


def test_shape_disagreement_names_the_op_the_ranks_and_the_shapes(pool):
    calls = [_call("all_to_all_4d", (2, 8, 8, 4))] * 4
    calls[2] = _call("all_to_all_4d", (2, 8, 12, 4))
    messages = _errors(pool(4).run(failure_jobs.call_checked, calls))
    assert messages[0] == (
        "all_to_all_4d: ranks disagree on shape: ranks 0, 1, 3 have (2, 8, 8, 4), rank 2 has "
        "(2, 8, 12, 4). Received: rank=0, phase='forward', shape=(2, 8, 8, 4), dtype='float32', "
        "dims=(2, 1)"
    )
    assert messages[2].endswith("Received: rank=2, phase='forward', shape=(2, 8, 12, 4), dtype='float32', dims=(2, 1)")
    _same_body(messages)


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        (
            [_call("all_reduce", (3,)), _call("all_reduce", (4,))],
            "ranks disagree on shape: rank 0 has (3,), rank 1 has (4,)",
        ),
        (
            [_call("all_gather", (2, 3), dim=0), _call("all_gather", (2, 3), "float64", dim=0)],
            "ranks disagree on dtype: rank 0 has float32, rank 1 has float64",
        ),
        (
            [_call("all_reduce", (2, 2)), _call("all_gather", (2, 2))],
            "ranks disagree on the collective: rank 0 runs all_reduce, rank 1 runs all_gather",
        ),
        (
            [_call("all_reduce", (3,), op="sum"), _call("all_reduce", (3,), op="max")],
            "ranks disagree on reduce op: rank 0 has sum, rank 1 has max",
        ),
        (
            [_call("all_reduce", (3,)), _call("all_reduce", (3,), convention="replicated")],
            "ranks disagree on convention: rank 0 has sum, rank 1 has replicated",
        ),
        (
            [_call("broadcast", (3,), src=0), _call("broadcast", (3,), src=1)],
            "ranks disagree on src: rank 0 has 0, rank 1 has 1",
        ),
        (
            [_call("gather", (3,), dst=1), _call("gather", (3,), dst=0)],
            "ranks disagree on dst: rank 0 has 1, rank 1 has 0",
        ),
        (
            [_call("permute", (3,), perm=[[0, 1], [1, 0]]), _call("permute", (3,), perm=[[0, 1]])],
            "ranks disagree on perm: rank 0 has ((0, 1), (1, 0)), rank 1 has ((0, 1),)",
        ),
        (
            [_call("all_gather", (2, 2), dim=0), _call("all_gather", (2, 2), dim=-1)],
            "ranks disagree on dims: rank 0 has (0,), rank 1 has (1,)",
        ),
        (
            [
                _call("all_to_all", (2, 2), scatter_dim=0, gather_dim=1),
                _call("all_to_all", (2, 2), scatter_dim=1, gather_dim=0),
            ],
            "ranks disagree on dims: rank 0 has (0, 1), rank 1 has (1, 0)",
        ),
        (
            [_call("all_reduce", (3,), "bfloat16", accum_dtype="float32"), _call("all_reduce", (3,), "bfloat16")],
            "ranks disagree on accum_dtype: rank 0 has float32, rank 1 has None",
        ),
        (
            [_call("reduce_scatter", (4, 3)), _call("reduce_scatter", (4, 5), "float16")],
            "ranks disagree on shape: rank 0 has (4, 3), rank 1 has (4, 5); on dtype: rank 0 has float32, rank 1 has "
            "float16",
        ),
    ],
    ids=[
        "shape",
        "dtype",
        "op",
        "reduce_op",
        "convention",
        "src",
        "dst",
        "perm",
        "dim",
        "dims",
        "accum_dtype",
        "shape+dtype",
    ],
)
def test_every_rank_raises_the_same_error_before_the_collective(pool, calls, expected):
    messages = _errors(pool(2).run(failure_jobs.call_checked, calls, backward=True))
    assert _same_body(messages) == expected
    assert messages[0].startswith(f"{calls[0][0]}: {expected}. Received: rank=0, phase='forward'")
    assert messages[1].startswith(f"{calls[1][0]}: {expected}. Received: rank=1, phase='forward'")


def test_scale_grad_disagreement_is_caught_in_the_backward(pool):
    """shard's forward is local (nothing exchanged); its backward all_gather carries the forward plan, whose
    grad_scale the ranks must agree on, or the gradient is silently scaled on some ranks only."""
    calls = [_call("shard", (2, 4), dim=-1, scale_grad=True), _call("shard", (2, 4), dim=-1)]
    messages = _errors(pool(2).run(failure_jobs.call_checked, calls, backward=True))
    expected = "ranks disagree on grad_scale: rank 0 has 0.5, rank 1 has 1.0"
    assert _same_body(messages) == expected
    assert messages[0].startswith(f"shard backward: {expected}. Received: rank=0, phase='backward'")
    assert messages[0].endswith("grad_scale=0.5")


def test_backward_collectives_are_checked_too(pool):
    messages = _errors(pool(3).run(failure_jobs.backward_disagrees))
    expected = "ranks disagree on the collective: rank 0 runs all_gather backward, ranks 1, 2 run all_to_all backward"
    assert _same_body(messages) == expected
    assert messages[0].startswith(f"all_gather backward: {expected}. Received: rank=0, phase='backward', shape=(6, 3)")
    assert messages[1].startswith(f"all_to_all backward: {expected}. Received: rank=1, phase='backward'")


@pytest.mark.parametrize("enable", failure_jobs.ENABLERS)
def test_each_switch_turns_checking_on(pool, enable):
    calls = [_call("all_reduce", (3,)), _call("all_reduce", (5,))]
    messages = _errors(pool(2).run(failure_jobs.call_checked, calls, enable=enable))
    assert _same_body(messages) == "ranks disagree on shape: rank 0 has (3,), rank 1 has (5,)"


def test_switches_restore_the_previous_state(pool):
    (states, _) = pool(2).run(failure_jobs.checked_state)
    default = states["default"]  # False unless the test run itself sets COMMLIB_CHECK
    assert states == {
        "default": default,
        "context": True,
        "after context": default,
        "set_checked": True,
        "after set_checked": default,
        "env": True,
        "after env": default,
        "checked(False) inside checked()": False,
        "restored": True,
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_valid_calls_pass_unchanged_in_checked_mode(pool, world_size):
    """A few of the parity table's cases per op (`cases.per_op`: every keyword each op takes, both conventions,
    uneven sizes, a rejected call; forward and backward) pass checked with the reference's values; the table's
    arithmetic is tests/torch/test_ops.py's."""
    from commlib.tools import parity

    failed = []
    for case in cases.per_op(cases.case_table(world_size)):
        arrays = cases.make_arrays(case, 0)
        outputs, gradients, error = merge(case, pool(world_size).run(failure_jobs.run_case_checked, case, arrays))
        row = parity.check(case, arrays, outputs, gradients, error)
        failed += [] if row.passed else [f"{row.case}: {row.detail} out {row.out_error} grad {row.grad_error}"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "constant"])
def test_no_autograd_state_outside_grad_mode(pool, mode, check):
    for per_op in pool(3).run(failure_jobs.autograd_state, mode, check):
        assert per_op == dict.fromkeys(per_op, (False, False, 0)), per_op


def test_grad_mode_control_builds_the_graph(pool):
    for per_op in pool(3).run(failure_jobs.autograd_state, "grad"):
        assert all(has_grad_fn and requires_grad for has_grad_fn, requires_grad, _ in per_op.values()), per_op
        assert per_op["all_reduce_max"][2] == 2 and per_op["all_reduce_product"][2] == 1  # their VJPs need x


def test_overhead_reports_every_variant(pool):
    for timings in pool(2).run(failure_jobs.overhead, (64,), 5):
        assert set(timings) == {"raw", "commlib", "no_grad", "inference_mode", "constant", "checked", "fingerprint"}
        assert all(0.0 < seconds < 5.0 for seconds in timings.values()), timings


def test_seed_gather_is_checked(pool):
    replies = pool(3).run(failure_jobs.seed_gather_checked, [(2, 3), (2, 3), (2, 4)])
    messages = _errors(replies)
    assert _same_body(messages) == "ranks disagree on shape: ranks 0, 1 have (2, 3), rank 2 has (2, 4)"
    assert messages[0].startswith("gather: ranks disagree on shape")


@pytest.mark.parametrize(
    ("sent", "expected", "body"),
    [
        (((3,), "float32"), ((4,), "float32"), "ranks disagree on shape: rank 0 has (3,), rank 1 has (4,)"),
        (((2, 3), "float32"), ((2, 3), "float64"), "ranks disagree on dtype: rank 0 has float32, rank 1 has float64"),
    ],
    ids=["shape", "dtype"],
)
def test_send_recv_are_checked(pool, sent, expected, body):
    replies = pool(3).run(failure_jobs.send_recv_checked, sent, expected)
    messages = _errors(replies[:2])
    assert replies[2] is None
    assert _same_body(messages) == body
    assert messages[0].startswith(f"send/recv: {body}. Received: rank=0, phase='forward', shape={sent[0]}")
    assert messages[1].startswith(f"send/recv: {body}. Received: rank=1, phase='forward', shape={expected[0]}")


def test_send_recv_that_agree_pass_checked(pool):
    replies = pool(2).run(failure_jobs.send_recv_checked, ((2, 3), "int16"), ((2, 3), "int16"))
    assert replies[0] == ("ok", None)
    assert replies[1][0] == "ok" and replies[1][1].tolist() == failure_jobs._input((2, 3), "int16").tolist()


def test_double_backward_collectives_are_checked(pool):
    """The collectives of a backward are `commlib_torch._op.PlanFunction`s, so a second backward exchanges
    fingerprints too."""
    messages = _errors(pool(3).run(failure_jobs.double_backward_disagrees, [(3,), (4,)]))
    assert _same_body(messages) == "ranks disagree on shape: rank 0 has (3,), ranks 1, 2 have (4,)"
    for rank, message in enumerate(messages):
        shape = (3,) if rank == 0 else (4,)
        assert message.startswith(
            f"all_reduce backward: ranks disagree on shape: rank 0 has (3,), ranks 1, 2 have "
            f"(4,). Received: rank={rank}, phase='backward', shape={shape}"
        )


# --- The attention layers: the options the user passed -------------------------------------------------------

ULYSSES, RING, USP = "ulysses_attention", "ring_attention", "usp_attention"


def _layer_errors(replies):
    """Every rank's message: every rank raised CommError before any data collective (only the fingerprint
    all_gathers, which `attention_jobs._counting` does not count, ran)."""
    assert all(reply[:2] == ("error", "CommError") for reply in replies), replies
    assert all(reply[3] == [] for reply in replies), [reply[3] for reply in replies]
    return [reply[2] for reply in replies]


def _ranks(world_size, layer, rows=8, **options):
    return [(layer, rows, options)] * world_size


def _with(calls, rank, rows=None, **options):
    layer, own_rows, own = calls[rank]
    calls = list(calls)
    calls[rank] = (layer, own_rows if rows is None else rows, {**own, **options})
    return calls


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        (
            _with(_ranks(4, ULYSSES, 10, seq_sizes=(10, 10, 10, 10)), 3, seq_sizes=None),
            "seq_sizes: ranks 0, 1, 2 have (10, 10, 10, 10), rank 3 has None",
        ),
        (
            _with(_ranks(4, ULYSSES, 10, seq_sizes=(10, 10, 10, 9)), 3, 9, seq_sizes=None),  # rows follow: not named
            "seq_sizes: ranks 0, 1, 2 have (10, 10, 10, 9), rank 3 has None",
        ),
        (_with(_ranks(2, ULYSSES, 4), 1, 5), "rows: rank 0 has 4, rank 1 has 5"),
        (_with(_ranks(2, ULYSSES), 1, causal=True), "causal: rank 0 has False, rank 1 has True"),
        (_with(_ranks(3, ULYSSES, scale=0.5), 2, scale=None), "scale: ranks 0, 1 have 0.5, rank 2 has None"),
        (
            _with(_ranks(2, ULYSSES, layout=(8, 1, 2)), 0, layout="contiguous"),
            "layout: rank 0 has 'contiguous', rank 1 has SequenceLayout(seq_len=8, ring_size=1, ulysses_size=2, "
            "layout='contiguous')",
        ),
        (
            _with(_ranks(2, ULYSSES), 1, attn_fn=attention),
            "attn_fn: rank 0 has None, rank 1 has commlib_torch.attention.attention",
        ),
        (_with(_ranks(2, ULYSSES), 0, dtype="float64"), "dtype: rank 0 has float64, rank 1 has float32"),
        (_with(_ranks(2, ULYSSES), 1, heads=6), "q shape: rank 0 has (1, S_r, 4, 8), rank 1 has (1, S_r, 6, 8)"),
        (
            _with(_ranks(2, RING, layout="zigzag"), 1, layout="contiguous"),
            "layout: rank 0 has 'zigzag', rank 1 has 'contiguous'",
        ),
        (_with(_ranks(3, RING, causal=True), 0, causal=False), "causal: rank 0 has False, ranks 1, 2 have True"),
        (
            _with(_with(_ranks(4, RING, scale=1), 2, scale=0.25), 3, scale=1.0),  # 1 and 1.0 agree
            "scale: ranks 0, 1, 3 have 1, rank 2 has 0.25",
        ),
        (
            _with(_ranks(3, RING, 3, layout=(9, 3, 1, "zigzag")), 1, layout=(9, 3, 1, "contiguous")),
            "layout: ranks 0, 2 have SequenceLayout(seq_len=9, ring_size=3, ulysses_size=1, "
            "layout='zigzag'), rank 1 has "
            "SequenceLayout(seq_len=9, ring_size=3, ulysses_size=1, layout='contiguous')",
        ),
        (
            _with(_ranks(4, USP, causal=True, ulysses_size=2), 3, causal=False),
            "causal: ranks 0, 1, 2 have True, rank 3 has False",
        ),
        (
            _with(_ranks(4, USP, layout="zigzag", ulysses_size=2), 0, layout="contiguous"),
            "layout: rank 0 has 'contiguous', ranks 1, 2, 3 have 'zigzag'",
        ),
        (_with(_ranks(4, USP, ulysses_size=2), 1, scale=0.5), "scale: ranks 0, 2, 3 have None, rank 1 has 0.5"),
        (_with(_ranks(2, ULYSSES), 1, segment_ids="one document"), "segment_ids: rank 0 has None, rank 1 has a Tensor"),
        (
            _with(_ranks(3, RING, causal=True, segment_ids="one document"), 0, segment_ids=None),
            "segment_ids: rank 0 has None, ranks 1, 2 have a Tensor",
        ),
        (
            _with(_ranks(4, USP, ulysses_size=2), 2, segment_ids="one document"),
            "segment_ids: ranks 0, 1, 3 have None, rank 2 has a Tensor",
        ),
        (_with(_ranks(2, ULYSSES), 1, chunks=2), "chunks: rank 0 has 1, rank 1 has 2"),
    ],
    ids=[
        "ulysses-forgotten-seq_sizes",
        "ulysses-forgotten-uneven",
        "ulysses-rows",
        "ulysses-causal",
        "ulysses-scale",
        "ulysses-layout",
        "ulysses-attn_fn",
        "ulysses-dtype",
        "ulysses-heads",
        "ring-layout",
        "ring-causal",
        "ring-scale",
        "ring-SequenceLayout",
        "usp-causal",
        "usp-layout",
        "usp-scale",
        "ulysses-segment_ids",
        "ring-segment_ids",
        "usp-segment_ids",
        "ulysses-chunks",
    ],
)
def test_layers_that_disagree_raise_on_every_rank_before_any_collective(pool, calls, expected):
    messages = _layer_errors(pool(len(calls)).run(checked_jobs.layer_call, calls))
    assert _same_body(messages) == f"ranks disagree on {expected}"
    layer = calls[0][0]
    for rank, message in enumerate(messages):
        assert message.startswith(f"{layer}: ranks disagree on {expected}. Received: rank={rank}, "), message


def test_a_layer_where_another_rank_runs_a_collective(pool):
    calls = [(RING, 8, {}), ("all_reduce", 8, {})]
    replies = pool(2).run(checked_jobs.layer_call, calls)
    messages = [reply[2] for reply in replies]
    assert [reply[:2] for reply in replies] == [("error", "CommError")] * 2, replies
    expected = "ranks disagree on the collective: rank 0 runs ring_attention, rank 1 runs all_reduce"
    assert _same_body(messages) == expected
    assert messages[0].startswith("ring_attention: ") and messages[1].startswith("all_reduce: ")


@pytest.mark.parametrize(
    "calls",
    [
        _ranks(2, ULYSSES, causal=True),
        [(ULYSSES, rows, {"seq_sizes": (3, 3, 2), "scale": 0.5}) for rows in (3, 3, 2)],
        _ranks(4, ULYSSES, 2, layout=(8, 1, 4)),
        _ranks(2, RING, causal=True, layout="zigzag"),
        [(RING, rows, {"layout": (7, 3, 1, "zigzag"), "causal": True}) for rows in (3, 2, 2)],
        _ranks(4, RING),
        _ranks(4, USP, causal=True, layout="zigzag", ulysses_size=2),
        _ranks(2, ULYSSES, causal=True, segment_ids="one document"),
        _ranks(4, USP, causal=True, layout="zigzag", ulysses_size=2, segment_ids="one document"),
        _ranks(2, ULYSSES, causal=True, chunks=2),
    ],
    ids=[
        "ulysses-2",
        "ulysses-3-uneven",
        "ulysses-4-layout",
        "ring-2-zigzag",
        "ring-3-any-length",
        "ring-4",
        "usp-2x2",
        "ulysses-2-segment_ids",
        "usp-2x2-segment_ids",
        "ulysses-2-chunks",
    ],
)
def test_layers_that_agree_give_the_unchecked_values(pool, calls):
    """Checked mode changes nothing when the ranks agree: the same outputs as unchecked, every rank, forward and
    backward, and the same data collectives (also the control for the test above: they are counted)."""
    checked_replies = pool(len(calls)).run(checked_jobs.layer_call, calls)
    unchecked_replies = pool(len(calls)).run(checked_jobs.unchecked_never_exchanges, calls)
    for with_check, without in zip(checked_replies, unchecked_replies, strict=True):
        assert with_check[0] == without[0] == "ok", (with_check, without)
        assert (with_check[1] == without[1]).all()
        assert with_check[2] == without[2] and with_check[2], with_check[2]


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        (
            [("gather_sequence", {"layout": (7, 2, 1, "zigzag")}), ("gather_sequence", {"layout": (7, 2)})],
            "layout: rank 0 has SequenceLayout(seq_len=7, ring_size=2, ulysses_size=1, layout='zigzag'), rank 1 has "
            "SequenceLayout(seq_len=7, ring_size=2, ulysses_size=1, layout='contiguous')",
        ),
        (
            [("gather_sequence", {"layout": (6, 3), "convention": "replicated"})] * 2
            + [("gather_sequence", {"layout": (6, 3)})],
            "convention: ranks 0, 1 have 'replicated', rank 2 has 'sum'",
        ),
        (
            [("cross_entropy", {})] * 3 + [("cross_entropy", {"ignore_index": 2})],
            "ignore_index: ranks 0, 1, 2 have -100, rank 3 has 2",
        ),
        (
            [("sync_gradients", {"shapes": [(3,), (2,)]}), ("sync_gradients", {"shapes": [(2,), (3,)]})],
            "parameters: rank 0 has 2 tensors: (3,) float32, (2,) float32, rank 1 has 2 tensors: (2,) float32, "
            "(3,) float32",
        ),
        (
            [("sync_gradients", {"shapes": [(3,), ((2,), "float64")]})] * 2 + [("sync_gradients", {"shapes": []})],
            "parameters: ranks 0, 1 have 2 tensors: (3,) float32, (2,) float64, rank 2 has none (an empty "
            "iterable: a consumed generator?)",
        ),
        (
            [("sync_gradients", {"shapes": [(3,)]}), ("sync_gradients", {"shapes": [(3,)], "op": "avg"})],
            "op: rank 0 has 'sum', rank 1 has 'avg'",
        ),
    ],
    ids=[
        "gather_sequence-layout",
        "gather_sequence-convention",
        "cross_entropy-ignore_index",
        "sync_gradients-order",
        "sync_gradients-empty",
        "sync_gradients-op",
    ],
)
def test_sequence_helpers_that_disagree_raise_on_every_rank(pool, calls, expected):
    messages = _layer_errors(pool(len(calls)).run(checked_jobs.helper_call, calls))
    assert _same_body(messages) == f"ranks disagree on {expected}"
    assert all(message.startswith(f"{calls[0][0]}: ") for message in messages)
