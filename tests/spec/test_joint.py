"""Joint attention in the spec (`commlib.joint`): the float64 reference's VJP against central finite differences,
the spec's Ulysses walk with joint tensors on W simulated numpy ranks (`simulate_ulysses`, exact and padded
layouts) against the reference of the concatenation on every rank, and the call path's refusals (naming the
layer, the argument and both numbers, before any communication)."""

import numpy as np
import pytest

from commlib import CommError
from commlib.layer_call import ulysses_call
from commlib.reference import joint as joint_reference
from commlib.reference.ulysses import simulate_ulysses
from tests import joint_cases


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
