"""`commlib_torch.attention.ring_attention` / `usp_attention` on real gloo process groups: every row of
`commlib.tools.cases.context_table` (ring at W = 1-4, USP on 2 x 2, float64 / float32 / bfloat16, invalid calls)
against the float64 reference, the handed case with its errors printed, the collectives each way and their bytes
(k and v unrepeated), the bytes saved for backward, non-contiguous inputs and forward-only calls.
"""

import numpy as np
import pytest

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge, run_case
from tests.torch import ring_jobs as jobs

WORLD_SIZES = (1, 2, 3, 4)


def _handed_case(**kwargs):
    """W=4, B=2, S=16, H=4, H_kv=2, D=3, float64, causal, zigzag."""
    return cases.context_case(4, (2, 16, 4, 3), kv_heads=2, causal=True, layout="zigzag", **kwargs)


def _row(case, replies) -> parity.Row:
    outputs = [reply[0] for reply in replies]
    gradients = {name: [reply[1][name] for reply in replies] for name in case.inputs}
    return parity.check(case, cases.make_arrays(case, 0), outputs, gradients, None, "torch", "gloo")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_context_table(pool, world_size):
    """Every context row at W: outputs and dq/dk/dv on every rank within the row's tolerance (float64: 1e-10),
    invalid rows with the spec's text on every rank."""
    failed = []
    for case in cases.context_table(world_size):
        arrays = cases.make_arrays(case, 0)
        outputs, gradients, error = merge(case, pool(world_size).run(run_case, case, arrays))
        row = parity.check(case, arrays, outputs, gradients, error)
        failed += [] if row.passed else [f"{row.case}: {row.out_error} {row.grad_error} {row.detail}"]
        assert cases.error_text(case) is not None or row.out_error is not None
    assert not failed, "\n".join(failed)


def test_context_table_through_torch_func(pool):
    """``torch.func.vjp`` over ring and USP (W = 4 rows, 2 x 2 USP) gives the reference's gradients."""
    rows = []
    for case in cases.context_table(4):
        if cases.error_text(case) is None:
            arrays = cases.make_arrays(case, 0)
            replies = pool(case.world_size).run(run_case, case, arrays, grad_mode="func")
            rows.append(parity.check(case, arrays, *merge(case, replies)))
    failed = [f"{row.case}: {row.out_error} {row.grad_error} {row.detail}" for row in rows if not row.passed]
    assert len(rows) >= 4 and not failed, "\n".join(failed)


@pytest.mark.parametrize("how", ["autograd", "func"])
def test_second_derivative_is_refused_by_name(pool, how):
    """The backward is hand-written: differentiating the gradient again (create_graph=True, or nested
    torch.func.grad) raises the spec's error on every rank, not a gradient that comes out silently zero."""
    case = _handed_case()
    messages = set(pool(4).run(jobs.second_order, case, cases.make_arrays(case, 0), how))
    assert messages == {
        "TypeError: ring_attention: a second derivative is not supported: the backward is "
        "hand-written (first order); take one gradient, or use ulysses_attention, whose backward is "
        "autograd's own. Received: order=2"
    }


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_torch_func_grad_causal(pool, layout):
    """``torch.func.grad`` with a causal mask (ranks skip different pieces: the walk must stay in step) equals
    ``loss.backward()``'s gradients."""
    case = cases.context_case(4, (2, 16, 4, 3), kv_heads=2, causal=True, layout=layout)
    arrays = cases.make_arrays(case, 0)
    for by_func, (_, by_backward, _, _) in zip(
        pool(4).run(jobs.func_grad, case, arrays), pool(4).run(jobs.counted_call, case, arrays), strict=True
    ):
        for name in case.inputs:
            np.testing.assert_allclose(by_func[name], by_backward[name], rtol=0, atol=1e-13)


def test_handed_case(pool):
    """The handed case within 1e-10 (outputs, dq, dk, dv on every rank) from non-contiguous inputs. Forward:
    W - 1 = 3 ring steps (one asynchronous ``batch_isend_irecv`` each) carrying k and v unrepeated, B * S/W *
    H_kv * (D + D_v) float64s; backward: at each of 3 steps one of k, v (begun before the step's pieces) and one
    of dk, dv (their sums, after them), and one of dk, dv home."""
    case = _handed_case()
    replies = pool(4).run(jobs.counted_call, case, cases.make_arrays(case, 0), transposed=True)
    row = _row(case, replies)
    print(f"\nhanded case (torch, W=4): max error out {row.out_error:.3g}, dq/dk/dv {row.grad_error:.3g}")
    assert row.passed and row.out_error <= 1e-10 and row.grad_error <= 1e-10, row
    kv = 2 * 4 * 2 * (3 + 3) * 8  # bytes of k and v one rank receives per step
    for _, _, forward, backward in replies:
        assert forward == [("batch_isend_irecv", kv)] * 3, forward
        assert backward == [("batch_isend_irecv", kv)] * 7, backward


@pytest.mark.parametrize(
    "case",
    [
        _handed_case(),
        _handed_case(dtype="bfloat16"),
        cases.context_case(2, (2, 16, 4, 3), kv_heads=2, ulysses_size=2, causal=True, layout="zigzag"),
    ],
    ids=lambda case: case.name,
)
def test_spec_rules(pool, case):
    """The pieces on the spec's einsum rules (`commlib.blockwise.attend` / `attend_vjp`: CUDA's path, and CPU's
    where ``D_v != D``) instead of torch's CPU flash kernels: the same results."""
    replies = pool(4).run(jobs.spec_rules_call, case, cases.make_arrays(case, 0))
    row = _row(case, replies)
    assert row.passed, row


@pytest.mark.parametrize(
    "case",
    [_handed_case(), cases.context_case(2, (2, 8, 4, 3), kv_heads=2, ulysses_size=2)],
    ids=lambda case: case.name,
)
def test_saved_for_backward(pool, case):
    """What a rank saves for backward is exactly q, k, v, the output and the LSE ``[B, S/W, H]`` (ring), or
    those of the ring over the gathered ring block (USP: the all-to-alls save nothing): O(S/W), no per-step k/v
    block, no score matrix."""
    replies = pool(4).run(jobs.saved_for_backward, case, cases.make_arrays(case, 0))
    saved = replies[0][0]
    print(f"\n{case.op}: saved for backward on rank 0: {sum(size for _, _, size in saved)} bytes, {saved}")
    for saved, expected in replies:
        if case.op == "ring_attention":
            assert saved == expected, (saved, expected)
        else:  # the ring's q, k, v: [B, U * S_r, H / U, D] and [B, U * S_r, H_kv / U, D]; out and the LSE
            assert [shape for shape, _, _ in saved] == [
                (2, 4, 2, 3),
                (2, 4, 1, 3),
                (2, 4, 1, 3),
                (2, 4, 2, 3),
                (2, 4, 2),
            ], saved


def test_usp_collectives(pool):
    """USP on 2 x 2: one all-to-all for q, k, v together and one for the output (each way), and the ring's
    steps over the ring group (1 forward; 3 backward at W = 2: k/v, then dk/dv, and dk/dv home)."""
    case = cases.context_case(2, (2, 16, 4, 3), kv_heads=2, ulysses_size=2, causal=True, layout="zigzag")
    replies = pool(4).run(jobs.counted_call, case, cases.make_arrays(case, 0))
    assert _row(case, replies).passed
    for _, _, forward, backward in replies:
        assert len(forward) == 3 and len(backward) == 5, (forward, backward)


@pytest.mark.parametrize("mode", ["no_grad", "constant"])
def test_forward_only(pool, mode):
    case = _handed_case()
    arrays = cases.make_arrays(case, 0)
    replies = pool(4).run(jobs.forward_only, case, arrays, mode)
    want, _ = cases.expected(case, arrays)
    for (out, tracked), reference in zip(replies, want, strict=True):
        np.testing.assert_allclose(out, reference, atol=1e-10)
        assert not tracked


def test_usp_on_a_device_mesh(pool):
    """The groups as mesh dims, ``(mesh, "ulysses")`` and ``(mesh, "ring")``, as torch users build them."""
    case = cases.context_case(2, (2, 16, 4, 3), kv_heads=2, ulysses_size=2, causal=True, layout="zigzag")
    replies = pool(4).run(jobs.usp_on_mesh, case, cases.make_arrays(case, 0))
    row = _row(case, replies)
    assert row.passed and row.out_error <= 1e-10 and row.grad_error <= 1e-10, row


@pytest.mark.parametrize("op", ["ring_attention", "usp_attention"])
def test_segment_ids_compile_whole(pool, op):
    """With segment ids the ring's skips are decided on device under Dynamo (`commlib.ring.visible_pieces`, kept
    by ``torch.where``): ``torch.compile(fullgraph=True)`` has no graph break (a host read per piece did break it)
    and gives eager's output, dq, dk, dv bit for bit, at W = 2 (USP: Ulysses groups of one rank)."""
    for breaks, equal in pool(2).run(jobs.compiled_with_segments, op, timeout=300):
        assert breaks == 0 and equal, (breaks, equal)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op", ["ring_attention", "usp_attention"])
def test_segment_ids_one_host_read_per_call(pool, world_size, op):
    """The skips of a call are read to the host once, in its forward (one ``tolist`` of the call's decisions),
    and the backward reuses them: not once per piece per step (W - 1 reads a forward, W a backward before)."""
    for forward, backward in pool(world_size).run(jobs.host_reads, op):
        assert (forward, backward) == (1, 0), (forward, backward)
