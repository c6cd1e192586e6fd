"""Joint attention in the spec (`commlib.joint`): the float64 reference's VJP against central finite differences,
the spec's Ulysses walk with joint tensors on W simulated numpy ranks (`simulate_ulysses`, exact and padded
layouts) against the reference of the concatenation on every rank, the ring / USP cases' per-rank gradient parts
against the full reference (their sum), and the call path's refusals (Ulysses, ring, USP: naming the layer, the
argument and both numbers, before any communication)."""

import numpy as np
import pytest

from commlib import CommError, SequenceLayout, ring
from commlib.layer_call import ring_call, ulysses_call
from commlib.masks import SlidingWindow
from commlib.reference import joint as joint_reference
from commlib.reference.ring import SimulatedRanks
from commlib.reference.ulysses import simulate_ulysses
from commlib.sequence import shard_positions
from tests import joint_cases

JOINT = ("joint_q", "joint_k", "joint_v")


class _Numpy:  # the call path's frontend of numpy arrays, never in checked mode
    array_types, array_name = (np.ndarray,), "numpy.ndarray"

    def dtype_name(self, x):
        return str(x.dtype)

    def checked(self):
        return False

    def exchange_layer(self, call):
        raise AssertionError("not checked")


@pytest.mark.parametrize(("position", "causal"), [("front", False), ("rear", True), ("front", True)])
def test_reference_vjp_matches_finite_differences(position, causal):
    rng = np.random.default_rng(7)
    shapes = [(1, 3, 4, 2), (1, 3, 2, 2), (1, 3, 2, 3), (1, 2, 4, 2), (1, 2, 2, 2), (1, 2, 2, 3)]
    inputs = [rng.standard_normal(shape) for shape in shapes]
    cots = (rng.standard_normal((1, 3, 4, 3)), rng.standard_normal((1, 2, 4, 3)))

    def loss(xs):
        out, joint_out, _ = joint_reference.reference(*xs[:3], xs[3:], position, causal=causal)
        return float((out * cots[0]).sum() + (joint_out * cots[1]).sum())

    _, _, grads = joint_reference.reference(*inputs[:3], inputs[3:], position, causal=causal, cotangents=cots)
    step = 1e-6
    for index, x in enumerate(inputs):
        numeric = np.zeros_like(x)
        for at in np.ndindex(x.shape):
            plus, minus = [list(inputs) for _ in range(2)]
            plus[index], minus[index] = x.copy(), x.copy()
            plus[index][at] += step
            minus[index][at] -= step
            numeric[at] = (loss(plus) - loss(minus)) / (2 * step)
        np.testing.assert_allclose(grads[index], numeric, atol=1e-7, err_msg=f"input {index}")


def _plans(case, layout):
    rows = [size if layout == "exact" else max(case.seq_sizes) for size in case.seq_sizes]
    plans = []
    for rank in range(case.world_size):
        q = np.zeros((case.batch, rows[rank], case.heads, case.head_dim))
        k = np.zeros((case.batch, rows[rank], case.kv_heads, case.head_dim))
        v = np.zeros((case.batch, rows[rank], case.kv_heads, case.v_dim))
        tensors = [np.zeros((case.batch, case.joint_seq, *x.shape[2:])) for x in (q, k, v)]
        options = case.kwargs()
        plans.append(
            ulysses_call(
                _Numpy(),
                q,
                k,
                v,
                None,
                world_size=case.world_size,
                rank=rank if layout == "exact" else None,
                joint_qkv=tensors,
                **options,
            )
        )
    return plans


def _padded(x, rows):
    return np.pad(x, [(0, 0), (0, rows - x.shape[1]), (0, 0), (0, 0)])


@pytest.mark.parametrize("layout", ["exact", "padded"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_simulated_walk_gives_the_reference_on_every_rank(world_size, layout):
    failed = []
    for case in joint_cases.cases(world_size):
        arrays = joint_cases.arrays(case)
        rows = max(case.seq_sizes)
        shards = [[x if layout == "exact" else _padded(x, rows) for x in arrays[name]] for name in "qkv"]
        tensors = [arrays[name] for name in ("joint_q", "joint_k", "joint_v")]
        results = simulate_ulysses(_plans(case, layout), *shards, joint=tensors)
        for rank, (out, joint_out) in enumerate(results):
            error = np.abs(out[:, : case.seq_sizes[rank]] - arrays["out"][rank]).max(initial=0.0)
            joint_error = np.abs(joint_out - arrays["joint_out"]).max()
            if error > 1e-12 or joint_error > 1e-12:
                failed.append(f"{case.name} rank {rank}: out {error}, joint_out {joint_error}")
            if not np.array_equal(joint_out, results[0][1]):
                failed.append(f"{case.name} rank {rank}: joint_out differs from rank 0's")
    assert not failed, "\n".join(failed)


def _call(joint_qkv, **options):
    q = np.zeros((1, 4, 6, 8))
    k = np.zeros((1, 4, 2, 8))
    return ulysses_call(_Numpy(), q, k, k, options.pop("segment_ids", None), world_size=2, rank=0,
                        joint_qkv=joint_qkv, **options)  # fmt: skip


TEXT = (np.zeros((1, 3, 6, 8)), np.zeros((1, 3, 2, 8)), np.zeros((1, 3, 2, 8)))
BAD = [
    ((TEXT[0], None, TEXT[2]), {}, CommError, r"ulysses_attention: joint_q, joint_k and joint_v must be given "
     r"together \(joint_k is None\)"),
    ((TEXT[0], np.zeros((1, 2, 2, 8)), TEXT[2]), {}, CommError,
     r"ulysses_attention: joint_k seq \(2\) must equal joint_q seq \(3\)"),
    ((np.zeros((1, 3, 4, 8)), *TEXT[1:]), {}, CommError,
     r"ulysses_attention: joint_q heads \(4\) must equal q heads \(6\)"),
    ((TEXT[0], TEXT[1], np.zeros((1, 3, 2, 5))), {}, CommError,
     r"ulysses_attention: joint_v head_dim \(5\) must equal v head_dim \(8\)"),
    ((np.zeros((2, 3, 6, 8)), *TEXT[1:]), {}, CommError, r"ulysses_attention: joint_q batch \(2\) must equal q batch"),
    ((np.zeros((3, 6, 8)), *TEXT[1:]), {}, CommError, r"ulysses_attention: joint_q ndim \(3\) must be 4"),
    (TEXT, {"joint_position": "middle"}, CommError,
     r"ulysses_attention: joint_position \('middle'\) must be one of 'front', 'rear'"),
    (TEXT, {"joint_position": 0}, TypeError, r"ulysses_attention: joint_position must be a str, not int"),
    ((TEXT[0].astype(np.float32), *TEXT[1:]), {}, CommError,
     r"ulysses_attention: joint_q, joint_k, joint_v dtypes \(float32, float64, float64\) must equal q's \(float64\)"),
    (TEXT, {"segment_ids": np.zeros((1, 4), dtype=np.int32)}, CommError,
     r"ulysses_attention: segment_ids cannot be given with joint_q"),
    ((TEXT[0], [0], TEXT[2]), {}, TypeError, r"ulysses_attention: joint_k must be a numpy.ndarray, not list"),
]  # fmt: skip


@pytest.mark.parametrize(("joint_qkv", "options", "error", "match"), BAD)
def test_bad_joint_calls_name_the_layer_and_both_numbers(joint_qkv, options, error, match):
    with pytest.raises(error, match=match):
        _call(joint_qkv, **options)


def test_a_bogus_position_is_refused_without_joint_tensors_too():
    assert _call((None, None, None)).joint is None
    with pytest.raises(CommError, match=r"joint_position \('middle'\) must be one of 'front', 'rear'"):
        _call((None, None, None), joint_position="middle")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_cases_parts_sum_to_the_reference(world_size):
    """Every rank's expected d joint_* of a ring / USP case (tests/joint_cases.py: its part, in its heads) summed
    over the ranks is the full float64 gradient of the concatenation -- the "sum" convention's promise."""
    for case in joint_cases.ring_cases(world_size):
        arrays = joint_cases.ring_arrays(case)
        cotangent = np.concatenate(arrays["cotangent"], axis=1)
        order = np.argsort(np.concatenate([x.reshape(-1) for x in _held(case)]))
        tensors = [arrays[name] for name in ("joint_q", "joint_k", "joint_v")]
        full = [np.concatenate(arrays[name], axis=1)[:, order] for name in "qkv"]
        cotangents = (cotangent[:, order], sum(arrays["joint_cotangent"]))
        _, _, grads = joint_reference.reference(
            *full, tensors, case.position, causal=case.causal, cotangents=cotangents
        )
        for index, name in enumerate(("djoint_q", "djoint_k", "djoint_v")):
            np.testing.assert_allclose(sum(arrays[name]), grads[3 + index], atol=1e-12, err_msg=f"{case.name} {name}")


def _held(case):
    return shard_positions(case.seq, case.ring_size, case.layout, case.ulysses_size)


def _ring_call(joint_qkv, op="ring_attention", **options):
    q = np.zeros((1, 4, 6, 8))
    k = np.zeros((1, 4, 2, 8))
    sizes = dict(ring_size=2) if op == "ring_attention" else dict(ring_size=1, ulysses_size=2)
    segment_ids = options.pop("segment_ids", None)
    return ring_call(_Numpy(), q, k, k, segment_ids, **sizes, joint_qkv=joint_qkv, **options)


RING_BAD = [
    ((TEXT[0], None, TEXT[2]), {}, CommError, r"ring_attention: joint_q, joint_k and joint_v must be given "
     r"together \(joint_k is None\)"),
    ((TEXT[0], np.zeros((1, 2, 2, 8)), TEXT[2]), {}, CommError,
     r"ring_attention: joint_k seq \(2\) must equal joint_q seq \(3\)"),
    ((np.zeros((1, 3, 4, 8)), *TEXT[1:]), {"op": "usp_attention"}, CommError,
     r"usp_attention: joint_q heads \(4\) must equal q heads \(6\)"),
    (TEXT, {"joint_position": "middle"}, CommError,
     r"ring_attention: joint_position \('middle'\) must be one of 'front', 'rear'"),
    (TEXT, {"joint_position": 0}, TypeError, r"ring_attention: joint_position must be a str, not int"),
    ((TEXT[0].astype(np.float32), *TEXT[1:]), {}, CommError,
     r"ring_attention: joint_q, joint_k, joint_v dtypes \(float32, float64, float64\) must equal q's \(float64\)"),
    (TEXT, {"segment_ids": np.zeros((1, 4), dtype=np.int32)}, CommError,
     r"ring_attention: segment_ids cannot be given with joint_q"),
    (TEXT, {"mask": SlidingWindow(2)}, CommError, r"ring_attention: mask cannot be given with joint_q"),
    (TEXT, {"layout": SequenceLayout(7, ring_size=2), "shard": 0}, CommError,
     r"ring_attention: joint_q cannot be given with a SequenceLayout whose shards are uneven \(sizes \(4, 3\)\)"),
    ((TEXT[0], [0], TEXT[2]), {"op": "usp_attention"}, TypeError,
     r"usp_attention: joint_k must be a numpy.ndarray, not list"),
]  # fmt: skip


@pytest.mark.parametrize(("joint_qkv", "options", "error", "match"), RING_BAD)
def test_bad_ring_joint_calls_name_the_layer_and_both_numbers(joint_qkv, options, error, match):
    with pytest.raises(error, match=match):
        _ring_call(joint_qkv, **options)


def test_ring_joint_plan_and_an_even_sequence_layout():
    assert _ring_call((None, None, None)).joint is None
    plan = _ring_call(TEXT, layout=SequenceLayout(8, ring_size=2), shard=1, joint_position="rear")
    assert (plan.joint.position, plan.joint.seq) == ("rear", 3)
    with pytest.raises(CommError, match=r"ring_attention: joint_position \('middle'\) must be one of"):
        _ring_call((None, None, None), joint_position="middle")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_simulated_ring_walk_gives_the_reference_on_every_rank(world_size):
    """The spec's ring walk with joint tensors (`commlib.ring.forward` / `backward`) on W simulated numpy ranks
    (`SimulatedRanks`: rank r's arrays on its batch rows) against tests/joint_cases.py's ring cases: out, joint_out
    (bit for bit the same on every rank) and every rank's gradients, its d joint_* its part."""
    failed = []
    for case in (case for case in joint_cases.ring_cases(world_size) if case.ulysses_size == 1):
        arrays = joint_cases.ring_arrays(case)
        q, k, v = (np.concatenate(arrays[name]) for name in "qkv")
        plan = ring_call(_Numpy(), arrays["q"][0], arrays["k"][0], arrays["v"][0], None, ring_size=world_size,
                         joint_qkv=[arrays[name] for name in JOINT], **case.kwargs())  # fmt: skip
        ranks = SimulatedRanks(plan)
        joint = tuple(np.concatenate([arrays[name]] * world_size) for name in JOINT)
        out, lse, joint_out, joint_lse = ring.forward(plan, ranks, q, k, v, joint=joint)
        d_out, d_joint = (np.concatenate(arrays[name]) for name in ("cotangent", "joint_cotangent"))
        grads = ring.backward(plan, ranks, q, k, v, out, lse, d_out, joint=(*joint, joint_out, joint_lse, d_joint))
        names = ("out", "joint_out", "dq", "dk", "dv", *(f"d{n}" for n in JOINT))
        got = dict(zip(names, (out, joint_out, *grads), strict=True))
        for name, value in got.items():
            for rank, mine in enumerate(ranks.split(value)):
                want = arrays[name] if name == "joint_out" else arrays[name][rank]
                error = np.abs(mine - want).max(initial=0.0)
                if error > 1e-12:
                    failed.append(f"{case.name} rank {rank} {name}: {error}")
        parts = ranks.split(joint_out)
        if not all(np.array_equal(part, parts[0]) for part in parts):
            failed.append(f"{case.name}: joint_out differs between ranks")
    assert not failed, "\n".join(failed)
