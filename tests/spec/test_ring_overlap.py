"""The ring's overlap in the spec's walk (DESIGN "Overlap"): `commlib.ring.forward` /
`backward` begin step t+1's send of k/v (and segment ids) before step t's pieces and wait for it after them
(the backward's dk/dv, the step's sums, after the pieces), on a recording `SimulatedRanks`; and the overlapped
walk gives what the sequential one (``overlap=False``) gives, bit for bit, W = 1-4, causal, layouts, segment ids,
uneven `SequenceLayout`\\ s."""

import numpy as np
import pytest

from commlib import SequenceLayout, ring, segment_ids
from commlib.reference.ring import SimulatedRanks, _ring_ids


class _Recording(SimulatedRanks):
    """`SimulatedRanks` that logs ``("start", n)``, ``("wait", n)`` (n: the start's number), ``"attend"`` and
    ``"attend_vjp"`` in the walk's order."""

    def __init__(self, plan):
        super().__init__(plan)
        self.events: list = []

    def start(self, arrays):
        self.events.append(("start", len(self.events)))
        return self.events[-1][1], super().start(arrays)

    def wait(self, pending):
        self.events.append(("wait", pending[0]))
        return super().wait(pending[1])

    def attend(self, *args):
        self.events.append("attend")
        return super().attend(*args)

    def attend_vjp(self, *args):
        self.events.append("attend_vjp")
        return super().attend_vjp(*args)


def _inputs(plan, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = plan.batch * plan.ring_size
    shapes = [
        (rows, plan.rows, plan.heads, plan.head_dim),
        (rows, plan.rows, plan.kv_heads, plan.head_dim),
        (rows, plan.rows, plan.kv_heads, plan.value_dim),
        (rows, plan.rows, plan.heads, plan.value_dim),
    ]
    return [rng.standard_normal(shape) for shape in shapes]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_send_is_begun_before_the_step_and_waited_after_it(layout):
    """Forward, W = 4 causal: start (k/v of step t+1), the step's pieces, wait -- W - 1 times, then the last
    step's pieces. Backward: start (k/v), the step's VJPs, start and wait (dk/dv), wait (k/v); the last step's
    VJPs then dk/dv home."""
    plan = ring.ring_plan((2, 4, 2, 3), (2, 4, 1, 3), (2, 4, 1, 5), 4, causal=True, layout=layout)
    ranks = _Recording(plan)
    q, k, v, cotangent = _inputs(plan)
    out, lse = ring.forward(plan, ranks, q, k, v)
    forward, ranks.events = ranks.events, []
    ring.backward(plan, ranks, q, k, v, out, lse, cotangent)
    shape = lambda events: [e if isinstance(e, str) else e[0] for e in events]  # noqa: E731
    kinds = shape(forward)
    for step in range(plan.ring_size - 1):
        start = kinds.index("start")
        wait = kinds.index("wait")
        assert start == 0 and wait > start + 1 and set(kinds[1:wait]) == {"attend"}, (step, kinds)
        kinds = kinds[wait + 1 :]
    assert set(kinds) == {"attend"}, kinds
    kinds = shape(ranks.events)
    for step in range(plan.ring_size):
        vjps = kinds.index("start") if step < plan.ring_size - 1 else 0
        if step < plan.ring_size - 1:
            assert vjps == 0, (step, kinds)
            kinds = kinds[1:]
        end = kinds.index("start")
        assert end > 0 and set(kinds[:end]) == {"attend_vjp"}, (step, kinds)
        tail = 2 if step == plan.ring_size - 1 else 3
        assert kinds[end : end + tail] == ["start", "wait", "wait"][:tail], (step, kinds)
        kinds = kinds[end + tail :]
    assert kinds == []


def _walk(plan, overlap: bool, ids=None):
    q, k, v, cotangent = _inputs(plan, seed=plan.ring_size)
    ranks = SimulatedRanks(plan)
    out, lse = ring.forward(plan, ranks, q, k, v, ids, overlap=overlap)
    return [out, lse, *ring.backward(plan, ranks, q, k, v, out, lse, cotangent, ids, overlap=overlap)]


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "uneven"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segmented", [False, True])
def test_overlapped_equals_sequential(ring_size, layout, causal, segmented):
    """out, LSE, dq, dk, dv of the overlapped walk equal the sequential walk's bit for bit."""
    if layout == "uneven":
        sequence = SequenceLayout(4 * ring_size + 3, ring_size=ring_size)
        shard = (2, sequence.max_size)
        plan = ring.ring_plan(
            (*shard, 2, 3),
            (*shard, 1, 3),
            (*shard, 1, 5),
            ring_size,
            causal=causal,
            layout=sequence,
            segment_ids=(shard, "int32") if segmented else None,
        )
    else:
        shard = (2, 4)
        plan = ring.ring_plan(
            (*shard, 2, 3),
            (*shard, 1, 3),
            (*shard, 1, 5),
            ring_size,
            causal=causal,
            layout=layout,
            segment_ids=(shard, "int32") if segmented else None,
        )
    ids = None
    if segmented:
        seq = plan.rows * ring_size
        whole = [segment_ids([seq // 2, 1], seq), segment_ids([1, seq - 2], seq)]  # padding: -1
        ids = _ring_ids(plan, [np.stack(whole)[:, r * plan.rows : (r + 1) * plan.rows] for r in range(ring_size)])
    overlapped, sequential = _walk(plan, True, ids), _walk(plan, False, ids)
    for got, want in zip(overlapped, sequential, strict=True):
        assert np.array_equal(got, want, equal_nan=True)
    assert np.abs(overlapped[2]).max() > 0
