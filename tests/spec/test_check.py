"""commlib.check: fingerprints (fixed size, round trip), the disagreement messages, and the translation of
backend failure texts into CommTimeout / CommFailure."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import commlib
from commlib import CommError, CommFailure, CommTimeout, check, failures, layer_check, plans, steps


def _rows(*calls):
    return np.stack([check.fingerprint(plan, dtype, phase) for plan, dtype, phase in calls])


def _message(rows, rank=0) -> str:
    with pytest.raises(CommError) as info:
        check.compare(rows, rank)
    return str(info.value)


PLANS = [
    plans.all_reduce((3,), 4, "max"),
    plans.all_reduce((2, 3), 4, dtype="bfloat16", accum_dtype="float32", convention="replicated"),
    plans.all_gather((2, 3), 4, -1),
    plans.reduce_scatter((8, 3), 4, 0, "avg"),
    plans.all_to_all((4, 3, 2), 4, 0, 2),
    plans.all_to_all_4d((2, 8, 8, 4), 4),
    plans.broadcast((), 4, 3),
    plans.gather((0, 3), 4, 1, 0),
    plans.scatter((4,), 4, 2),
    plans.permute((3,), 4, [[0, 1], [1, 2], [2, 3], [3, 0]]),
    plans.sum_grad((5, 1), 4),
    plans.shard((2, 8), 4, scale_grad=True),
    plans.all_reduce(tuple(range(1, 11)), 4),
    plans.permute((2,), 8, [[rank, (rank + 3) % 8] for rank in range(8)]),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.op_name)
def test_every_op_has_the_same_fingerprint_size_and_decodes(plan):
    for phase in check.PHASES:
        row = check.fingerprint(plan, "float32", phase)
        assert row.shape == (check.FINGERPRINT_SIZE,) and row.dtype == np.int64
        call = check.decode(row)
        assert (call.op_name, call.phase, call.world_size, call.dims, call.root) == (
            plan.op_name,
            phase,
            plan.world_size,
            steps.dims(plan.step),
            getattr(plan.step, "root", None),
        )
        assert (call.reduce_op, call.convention, call.accum_dtype, call.grad_scale) == (
            getattr(plan.step, "op", None),
            plan.convention,
            plan.arithmetic.accum_dtype,
            plan.arithmetic.grad_scale,
        )
        if len(plan.in_shape) <= 8:
            assert call.shape == plan.in_shape
        if len(getattr(plan.step, "pairs", ())) <= 4:
            assert call.perm == getattr(plan.step, "pairs", ())


def test_agreeing_ranks_pass():
    plan = plans.all_to_all_4d((2, 8, 8, 4), 4)
    check.compare(_rows(*[(plan, "bfloat16", "forward")] * 4), 3)


def test_shape_disagreement_groups_the_ranks():
    same, other = plans.all_to_all_4d((2, 8, 8, 4), 4), plans.all_to_all_4d((2, 8, 12, 4), 4)
    rows = _rows(
        (same, "float32", "forward"),
        (same, "float32", "forward"),
        (other, "float32", "forward"),
        (same, "float32", "forward"),
    )
    assert _message(rows, 2) == (
        "all_to_all_4d: ranks disagree on shape: ranks 0, 1, 3 have (2, 8, 8, 4), rank 2 has (2, 8, 12, 4). "
        "Received: rank=2, phase='forward', shape=(2, 8, 12, 4), dtype='float32', dims=(2, 1)"
    )


def test_a_different_collective_is_reported_alone():
    rows = _rows((plans.all_reduce((3,), 2), "float32", "forward"), (plans.all_gather((4,), 2), "int32", "backward"))
    assert _message(rows, 1) == (
        "all_gather backward: ranks disagree on the collective: rank 0 runs all_reduce, rank 1 runs all_gather "
        "backward. Received: rank=1, phase='backward', shape=(4,), dtype='int32', dims=(0,)"
    )
    forward_backward = _rows(
        (plans.all_reduce((3,), 2), "float32", "forward"), (plans.all_reduce((3,), 2), "float32", "backward")
    )
    assert "rank 0 runs all_reduce, rank 1 runs all_reduce backward" in _message(forward_backward)


@pytest.mark.parametrize(
    ("left", "right", "expected"),
    [
        (
            plans.all_reduce((3,), 2, "sum"),
            plans.all_reduce((3,), 2, "product"),
            "reduce op: rank 0 has sum, rank 1 has product",
        ),
        (
            plans.all_reduce((3,), 2),
            plans.all_reduce((3,), 2, convention="replicated"),
            "convention: rank 0 has sum, rank 1 has replicated",
        ),
        (plans.broadcast((3,), 2, 0), plans.broadcast((3,), 2, 1), "src: rank 0 has 0, rank 1 has 1"),
        (plans.gather((3,), 2, 0), plans.gather((3,), 2, 1), "dst: rank 0 has 0, rank 1 has 1"),
        (plans.all_gather((2, 2), 2, 0), plans.all_gather((2, 2), 2, 1), "dims: rank 0 has (0,), rank 1 has (1,)"),
        (
            plans.all_reduce((3,), 2, dtype="float16", accum_dtype="float32"),
            plans.all_reduce((3,), 2, dtype="float16"),
            "accum_dtype: rank 0 has float32, rank 1 has None",
        ),
        (
            plans.permute((3,), 2, [[0, 1]]),
            plans.permute((3,), 2, [[1, 0]]),
            "perm: rank 0 has ((0, 1),), rank 1 has ((1, 0),)",
        ),
        (plans.all_reduce((3,), 2), plans.all_reduce((3,), 3), "world_size: rank 0 has 2, rank 1 has 3"),
        (plans.shard((2, 8), 2, scale_grad=True), plans.shard((2, 8), 2), "grad_scale: rank 0 has 0.5, rank 1 has 1.0"),
    ],
)
def test_each_aspect_is_named(left, right, expected):
    assert f"ranks disagree on {expected}. Received: rank=0" in _message(
        _rows((left, "float16", "forward"), (right, "float16", "forward"))
    )


def test_several_aspects_are_all_named():
    rows = _rows(
        (plans.reduce_scatter((4, 3), 2), "float32", "forward"),
        (plans.reduce_scatter((4, 5), 2), "bfloat16", "forward"),
    )
    assert _message(rows).startswith(
        "reduce_scatter: ranks disagree on shape: rank 0 has (4, 3), rank 1 has (4, 5); "
        "on dtype: rank 0 has float32, rank 1 has bfloat16. Received: "
    )


def test_long_shapes_and_perms_are_compared_in_full():
    base = tuple(range(1, 11))
    rows = _rows(
        (plans.all_reduce(base, 2), "float32", "forward"), (plans.all_reduce((*base[:-1], 11), 2), "float32", "forward")
    )
    assert "ranks disagree on shape: rank 0 has (1, 2, 3, 4, 5, 6, 7, 8, ...) [10-d" in _message(rows)
    ring = [[rank, (rank + 1) % 6] for rank in range(6)]
    rows = _rows(
        (plans.permute((2,), 6, ring), "float32", "forward"), (plans.permute((2,), 6, ring[:-1]), "float32", "forward")
    )
    assert "ranks disagree on perm: rank 0 has ((0, 1), (1, 2), (2, 3), (3, 4), ...) [6 pairs" in _message(rows)


def test_a_backward_names_the_forward_call_each_rank_runs():
    """A forward's numbers are each rank's own (not compared; the ranks adopt rank 0's); a backward's are the
    forward's agreed number, compared: two same-shape calls' backwards met in different orders are refused."""
    plan = plans.all_to_all((4, 3), 2, 0, 1)
    forward = np.stack([check.fingerprint(plan, "float32", "forward", call) for call in (7, 3)])
    check.compare(forward, 1)  # different counts on the ranks: not an error
    assert check.agreed_call(forward) == 7 and check.decode(forward[1]).call == 3
    backward = np.stack([check.fingerprint(plan, "float32", "backward", call) for call in (8, 7)])
    assert check.decode(backward[0]).call == 8
    message = _message(backward, 1)
    assert message.startswith(
        "all_to_all backward: ranks disagree on the forward call: rank 0 has call 8, rank 1 has call 7 (every rank "
        "must run the backward of its collectives in the same order; with async_op=True, wait the handles in the "
        "same order on every rank: the backward begins the duals in the reverse order of the waits). Received: "
    ), message
    assert message.endswith("dims=(0, 1), call=7"), message
    check.compare(np.stack([check.fingerprint(plan, "float32", "backward", 7)] * 2), 0)
    other = check.fingerprint(plans.all_to_all((6, 3), 2, 0, 1), "float32", "backward", 7)
    assert "forward call" not in _message(np.stack([backward[0], other]))  # named only where nothing else differs
    unnumbered = np.stack([check.fingerprint(plan, "float32", "backward")] * 2)
    check.compare(unnumbered, 0)
    assert check.agreed_call(unnumbered) is None and check.decode(unnumbered[0]).call is None


def test_a_rank_without_checked_mode_is_named():
    rows = _rows((plans.all_reduce((3,), 2), "float32", "forward"), (plans.all_reduce((3,), 2), "float32", "forward"))
    rows[1] = np.arange(check.FINGERPRINT_SIZE)
    assert _message(rows).startswith("all_reduce: rank 1 sent no commlib fingerprint: checked mode must be on")


GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "5000ms for recv operation to complete"
)
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:5339. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error. GLHF!"
)


def test_backend_timeout_becomes_comm_timeout():
    error = failures.failure(
        "all_reduce", GLOO_TIMEOUT, rank=1, group_ranks=[0, 2, 3], received=dict(shape=(3,), dtype="float32")
    )
    assert isinstance(error, CommTimeout) and isinstance(error, RuntimeError)
    assert str(error) == (
        "all_reduce: timed out on group rank 1 of the group with global ranks [0, 2, 3] waiting for the other ranks: "
        "a rank did not join this collective (it may have raised an error and stayed alive: see that rank's "
        "output), or it is stuck or dead. Received: shape=(3,), dtype='float32', "
        "backend_error='Timed out waiting 5000ms for recv operation to complete'"
    )


def test_lost_peer_becomes_comm_failure():
    error = failures.failure("all_gather", GLOO_CLOSED, rank=0, group_ranks=[0, 1], phase="backward")
    assert type(error) is CommFailure
    assert str(error) == (
        "all_gather backward: group rank 0 of the group with global ranks [0, 1] lost its connection to another "
        "rank, which closed it: that rank stopped answering (it may have raised an error and gone on to another "
        "collective, which failed or timed out: see that rank's output), or it died or left the group. Received: "
        "backend_error='Connection closed by peer "
        "[127.0.0.1]:5339.'"
    )


def test_other_errors_are_not_translated():
    assert failures.failure("all_reduce", "CUDA out of memory", rank=0, group_ranks=[0, 1]) is None


# --- Layers: the options the user passed ---------------------------------------------------------------------


def _attention(**options):
    defaults = dict(world_size=4, causal=False, scale=None, layout="contiguous", seq_sizes=None)
    return layer_check.attention_call(
        "ulysses_attention", [(2, 10, 8, 16), (2, 10, 2, 16), (2, 10, 2, 16)], "float32", **{**defaults, **options}
    )


def _layer_message(calls, rank=0) -> str:
    with pytest.raises(CommError) as info:
        layer_check.compare_layers(calls, rank)
    return str(info.value)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "None"),
        (True, "True"),
        ("zigzag", "'zigzag'"),
        (np.int64(3), "3"),
        (1.0, "1"),
        (0.125, "0.125"),
        (np.float32(0.5), "0.5"),
        ([10, np.int32(9)], "(10, 9)"),
        ((4,), "(4,)"),
        (np.zeros((3, 2)), "a ndarray"),
        (layer_check.layer_call, "commlib.layer_check.layer_call"),
        (functools.partial(layer_check.layer_call, "x"), "functools.partial"),
        (object(), "<object object>"),
        (
            commlib.SequenceLayout(7, 2, layout="zigzag"),
            "SequenceLayout(seq_len=7, ring_size=2, ulysses_size=1, layout='zigzag')",
        ),
    ],
)
def test_an_option_is_compared_by_value(value, text):
    assert layer_check.layer_call("ring_attention", option=value).options == (("option", text),)


def test_equal_calls_give_equal_rows_and_each_option_changes_them():
    row = _attention().fingerprint()
    assert row.shape == (check.FINGERPRINT_SIZE,) and row.dtype == np.int64
    assert (_attention(scale=1).fingerprint() == _attention(scale=1.0).fingerprint()).all()
    assert not layer_check.layers_differ(np.stack([row, _attention().fingerprint()]))
    for option, value in [
        ("world_size", 3),
        ("causal", True),
        ("scale", 0.5),
        ("layout", "zigzag"),
        ("seq_sizes", (10, 10, 10, 10)),
        ("segment_ids", np.zeros((2, 10))),
    ]:
        assert layer_check.layers_differ(np.stack([row, _attention(**{option: value}).fingerprint()])), option


def test_every_option_counts_past_the_slots():
    many = {f"option_{index}": index for index in range(40)}
    rows = np.stack(
        [
            layer_check.layer_call("ring_attention", **many).fingerprint(),
            layer_check.layer_call("ring_attention", **{**many, "option_39": -1}).fingerprint(),
        ]
    )
    assert layer_check.layers_differ(rows)


def test_a_forgotten_seq_sizes_is_named_by_the_layer_and_its_argument():
    calls = [_attention(seq_sizes=(10, 10, 10, 10))] * 3 + [_attention()]
    assert _layer_message(calls, 3) == (
        "ulysses_attention: ranks disagree on seq_sizes: ranks 0, 1, 2 have "
        "(10, 10, 10, 10), rank 3 has None. Received: rank=3, seq_sizes=None"
    )


def test_rows_are_named_only_when_nothing_else_differs():
    uneven = layer_check.attention_call(
        "ulysses_attention", [(2, 9, 8, 16)] * 3, "float32", world_size=2, seq_sizes=None
    )
    given = layer_check.attention_call(
        "ulysses_attention", [(2, 10, 8, 16)] * 3, "float32", world_size=2, seq_sizes=(10, 9)
    )
    assert "ranks disagree on seq_sizes: rank 0 has (10, 9), rank 1 has None. Received" in _layer_message(
        [given, uneven]
    )
    even = layer_check.attention_call(
        "ulysses_attention", [(2, 10, 8, 16)] * 3, "float32", world_size=2, seq_sizes=None
    )
    assert "ranks disagree on rows: rank 0 has 10, rank 1 has 9. Received: rank=0, rows=10" in _layer_message(
        [even, uneven]
    )


def test_several_options_are_all_named_with_this_ranks_values():
    calls = [_attention(causal=True, layout="zigzag"), _attention(causal=False, layout="contiguous")]
    assert _layer_message(calls, 1) == (
        "ulysses_attention: ranks disagree on causal: rank 0 has True, rank 1 has False; on layout: rank 0 has "
        "'zigzag', rank 1 has 'contiguous'. Received: rank=1, causal=False, layout='contiguous'"
    )


def test_a_new_option_missing_on_a_rank_is_named():
    calls = [
        layer_check.layer_call("ring_attention", causal=True, segment_ids=np.zeros(3)),
        layer_check.layer_call("ring_attention", causal=True),
    ]
    assert "ranks disagree on segment_ids: rank 0 has a ndarray, rank 1 has (not passed)" in _layer_message(calls)


def test_agreeing_layers_pass():
    layer_check.compare_layers([_attention()] * 4, 2)


def test_different_layers_and_a_layer_beside_a_collective():
    calls = [layer_check.layer_call("ring_attention"), layer_check.layer_call("usp_attention")]
    assert _layer_message(calls).startswith(
        "ring_attention: ranks disagree on the collective: rank 0 runs "
        "ring_attention, rank 1 runs usp_attention. Received: rank=0"
    )
    rows = np.stack([check.fingerprint(plans.all_reduce((3,), 2), "float32"), _attention().fingerprint()])
    assert not layer_check.layers_differ(rows)
    assert _message(rows, 0) == (
        "all_reduce: ranks disagree on the collective: rank 0 runs all_reduce, rank 1 runs "
        "ulysses_attention. Received: rank=0"
    )
    assert _message(rows, 1).startswith("ulysses_attention: ranks disagree on the collective: rank 0 runs all_reduce")


def test_a_layer_call_travels_as_text():
    call = _attention(seq_sizes=(3, 3, 2, 2), layout=commlib.SequenceLayout(10, ulysses_size=4))
    assert layer_check.LayerCall.decode(call.encode()) == call


def test_the_collectives_checked_mode_imports_no_layer():
    """`commlib.check` serves the collectives: importing it loads no layer (the layers' record is
    `commlib.layer_check`, which imports `check`, not the other way)."""
    code = (
        "import sys, commlib.check as check\n"
        "layers = sorted(m for m in sys.modules if m in ('commlib.attention', 'commlib.ring', 'commlib.moe', "
        "'commlib.layer_check', 'commlib.sequence_helpers'))\n"
        "assert not layers, layers\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])}
    )
