"""`commlib_torch.attention.ulysses_attention` on real gloo process groups: every rank's output and dq, dk, dv
against the float64 reference (`commlib.attention`), the collectives it makes (one all-to-all each way) and
the bytes they carry (exactly the kv heads each rank needs), a custom `attn_fn`, forward-only calls and bad input.

The parity table (tests/torch/test_ops.py) runs the handed case, MQA and bfloat16 at W 1-4;
here are the other shapes (tests/attention_cases.py) and what the table cannot see.
"""

import numpy as np
import pytest

from commlib import attention as A
from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case
from tests.attention_cases import extra_cases, handed_case, headless_cases
from tests.torch import attention_jobs as jobs

WORLD_SIZES = (1, 2, 3, 4)


def _check(case, outputs, gradients) -> parity.Row:
    return parity.check(case, cases.make_arrays(case, 0), outputs, gradients, None, "torch", "gloo")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_more_shapes(pool, world_size):
    """Fewer heads than ranks, a rank with no rows, uneven kv grouping, even sizes, v's own head dim, float32."""
    failed = []
    for case in extra_cases(world_size):
        arrays = cases.make_arrays(case, 0)
        outputs, gradients, error = merge(case, pool(world_size).run(run_case, case, arrays))
        row = parity.check(case, arrays, outputs, gradients, error)
        failed += [] if row.passed else [f"{row.case}: {row.out_error} {row.grad_error} {row.detail}"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("checked", [False, True])
def test_headless_ranks_join_every_exchange(pool, world_size, checked):
    """A rank with no heads in a group while v has its own head dim: every rank's output and dq, dk, dv equal
    the reference (a headless rank still sends its q and k rows and gets their cotangents back), in checked
    mode too; a short timeout, so a rank left out of an exchange's backward fails the test instead of hanging."""
    job = jobs.checked_case if checked else run_case
    failed = []
    for case in headless_cases(world_size):
        arrays = cases.make_arrays(case, 0)
        outputs, gradients, error = merge(case, pool(world_size).run(job, case, arrays, timeout=30.0))
        row = parity.check(case, arrays, outputs, gradients, error)
        failed += [] if row.passed and error is None else [f"{row.case}: {error} {row.out_error} {row.grad_error}"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("causal", [False, True])
def test_handed_case(pool, causal):
    """The handed uneven case within 1e-10 of the reference (outputs, dq, dk, dv) with non-contiguous inputs; one
    all-to-all for q, k, v and one for the output, each way; each rank receives exactly the kv heads it needs."""
    case = handed_case(causal)
    replies = pool(4).run(jobs.counted_call, case, cases.make_arrays(case, 0), transposed=True)
    row = _check(case, [reply[0] for reply in replies], {n: [reply[1][n] for reply in replies] for n in "qkv"})
    assert row.passed and row.out_error < 1e-10 and row.grad_error < 1e-10, row
    split = A.head_split(6, 2, 4)
    for rank, (_, _, forward, backward) in enumerate(replies):
        assert [name for name, _ in forward] == ["all_to_all_single"] * 2, forward
        assert [name for name, _ in backward] == ["all_to_all_single"] * 2, backward
        received = forward[0][1] // 8  # float64 elements: (q heads + k heads + v heads) x B x S x D
        kv_heads = split.kv_sizes[rank]
        assert received == (split.q_sizes[rank] + 2 * kv_heads) * 1 * 10 * 4, (rank, received)
    kv_bytes = sum(reply[2][0][1] for reply in replies) - sum(split.q_sizes) * 10 * 4 * 8
    assert kv_bytes == 2 * split.min_kv_heads * 10 * 4 * 8  # k and v: 5 heads each, the minimum


def test_two_exchanges_when_v_has_its_own_head_dim(pool):
    """q, k travel together, v alone: three all-to-alls each way."""
    case = cases.attention_case(3, (1, 7, 4, 4), kv_heads=2, value_dim=6, seq_sizes="split")
    replies = pool(3).run(jobs.counted_call, case, cases.make_arrays(case, 0))
    assert _check(case, [r[0] for r in replies], {n: [r[1][n] for r in replies] for n in "qkv"}).passed
    assert all(len(forward) == len(backward) == 3 for _, _, forward, backward in replies)


def test_custom_attn_fn(pool):
    """attn_fn gets [B, S, h_r, D] q and the kv heads of rank r (GQA grouped, or indexed per q head where they
    do not group evenly), causal and the default scale; the result is the reference's."""
    case = cases.attention_case(3, (1, 5, 8, 2), kv_heads=2, seq_sizes="split", causal=True)
    replies = pool(3).run(jobs.custom_attention, case, cases.make_arrays(case, 0))
    assert _check(case, [r[0] for r in replies], {n: [r[1][n] for r in replies] for n in "qkv"}).passed
    split = A.head_split(8, 2, 3)
    for rank, (_, _, record) in enumerate(replies):
        kv = split.kv_sizes[rank] if split.local_group(rank) else split.q_sizes[rank]
        assert record == [((1, 5, split.q_sizes[rank], 2), (1, 5, kv, 2), (1, 5, kv, 2), True, 1 / np.sqrt(2))]
    assert split.local_group(1) is None  # rank 1's kv heads were indexed per q head


@pytest.mark.parametrize("mode", ["no_grad", "constant"])
def test_forward_only(pool, mode):
    case = handed_case(causal=True)
    arrays = cases.make_arrays(case, 0)
    replies = pool(4).run(jobs.forward_only, case, arrays, mode)
    expected, _ = cases.expected(case, arrays)
    for (out, tracked), want in zip(replies, expected, strict=True):
        np.testing.assert_allclose(out, want, atol=1e-12)
        assert not tracked


Q, KV = (1, 3, 6, 4), (1, 3, 2, 4)
ROWS = (3, 3, 2, 2)  # what each rank holds in the last row, against seq_sizes (2, 2, 3, 3)


@pytest.mark.parametrize(
    ("shapes", "kwargs", "message"),
    [
        (
            dict(q=Q, k=(1, 3, 4, 4), v=(1, 3, 4, 4)),
            {},
            "CommError: ulysses_attention: heads (6) must be divisible by "
            "kv heads (4). Received: q_shape=(1, 3, 6, 4), k_shape=(1, 3, 4, 4), v_shape=(1, 3, 4, 4), seq_sizes=None",
        ),
        (
            dict(q=Q, k=KV, v=KV),
            dict(seq_sizes=(3, 3, 3)),
            "CommError: ulysses_attention: len(seq_sizes) (3) must equal world_size (4)",
        ),
        (dict(q=Q, k=KV, v=KV), dict(causal="yes"), "TypeError: ulysses_attention: causal must be a bool, not str"),
        (
            {name: [(1, rows, heads, 4) for rows in ROWS] for name, heads in (("q", 6), ("k", 2), ("v", 2))},
            dict(seq_sizes=(2, 2, 3, 3)),
            "CommError: ulysses_attention: seq ({rows}) must equal seq_sizes[{rank}] ({size}) on rank {rank}",
        ),
    ],
)
def test_bad_input(pool, shapes, kwargs, message):
    """Every rank raises the spec's text before any collective."""
    replies = pool(4).run(jobs.rejected, shapes, kwargs)
    for rank, (text, calls) in enumerate(replies):
        expected = message.format(rank=rank, rows=ROWS[rank], size=(2, 2, 3, 3)[rank])
        assert text is not None and text.startswith(expected), (rank, text)
        assert calls == []


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_integer_inputs_are_refused(pool, dtype):
    """The softmax of integer scores truncates: refused by the spec before the all-to-all."""
    for text, calls in pool(4).run(jobs.rejected, dict(q=Q, k=KV, v=KV), {}, dtype):
        assert text.startswith(
            f"CommError: ulysses_attention: q, k, v dtype ({dtype}) must be floating (bfloat16, "
            "float16, float32, float64). Received: "
        )
        assert calls == []
