"""`ulysses_attention(..., chunks=)` on real gloo ranks (DESIGN "Overlap"): head groups in
pipeline order give chunks=1's output bit for bit, every rank, W = 1-4, and its dq, dk, dv bit for bit where
the arithmetic is the same -- SDPA's CPU backward computes a head alike whatever the head count in float32
(not in float64: 1e-17 differences), and no kv head serves two groups (`tests.attention_cases.kv_exact`) --
else to rounding; against the float64 reference as well; segment ids; the order of the collectives and the
attentions; torch.compile(fullgraph=True); bad `chunks` refused before any collective."""

import numpy as np
import pytest

from commlib.tools import cases, parity
from tests import mask_cases as masks
from tests.attention_cases import BAD_CHUNKS, chunk_cases, chunked_segments, kv_exact
from tests.torch import attention_jobs
from tests.torch import chunk_jobs as jobs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_chunks_equal_one_group(pool, world_size):
    failed = []
    for case, chunks in chunk_cases(world_size):
        arrays = cases.make_arrays(case, 0)
        replies = pool(world_size).run(jobs.chunked, case, arrays, chunks)
        for count in chunks:
            outputs = [reply[count][0] for reply in replies]
            gradients = {name: [reply[count][1][name] for reply in replies] for name in "qkv"}
            row = parity.check(case, arrays, outputs, gradients, None, "torch", "gloo")
            failed += [] if row.passed else [f"{case.name} chunks={count}: {row.out_error} {row.grad_error}"]
            for rank, reply in enumerate(replies):
                (out, grads), (whole_out, whole_grads) = reply[count], reply[1]
                assert np.array_equal(out, whole_out), (case.name, count, rank)
                exact = {"q": case.dtype == "float32", "k": case.dtype == "float32" and kv_exact(case, count)}
                for name in "qkv":
                    if exact[{"v": "k"}.get(name, name)]:
                        assert np.array_equal(grads[name], whole_grads[name]), (case.name, count, rank, name)
                    else:
                        np.testing.assert_allclose(grads[name], whole_grads[name], rtol=1e-12, atol=1e-15)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("world_size", [2, 4])
def test_segment_ids(pool, world_size):
    """Packed documents and padding, GQA, uneven S, causal, float64: chunks=2 is chunks=1 bit for bit in the
    output (the gradients to rounding), and within 1e-10 of the unsharded masked reference."""
    layout, whole, ids, chunks = chunked_segments(world_size)
    replies = pool(world_size).run(jobs.segments, layout, whole, ids, chunks)
    for rank, reply in enumerate(replies):
        assert np.array_equal(reply[chunks][0], reply[1][0]), rank
        for got, want in zip(reply[chunks][1:], reply[1][1:], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    got = [[reply[chunks][index] for reply in replies] for index in range(4)]
    assert masks.worst_error(got, masks.expected(whole, ids, causal=True), layout) < masks.TOLERANCE


def test_pipeline_order(pool):
    """Forward: group 0's all-to-all, group 1's started before group 0's attention, group 0's output all-to-all
    before group 1's attention, then group 1's; backward: an all-to-all per group each way, nothing else. Each of
    them begun asynchronously (a `commlib_torch.Handle`: the forward's four, and the backward's four duals begun
    when their cotangents arrive), so they overlap the attentions between."""
    case, _ = chunk_cases(3)[0]  # H = 7 at W = 3: rank 0 has 3 q heads, in groups of 2 and 1
    forward, backward, begun, begun_backward = pool(3).run(jobs.pipeline_order, case, cases.make_arrays(case, 0), 2)[0]
    kinds = [name for name, _ in forward]
    assert kinds == [
        "all_to_all_single",
        "all_to_all_single",
        "attention",
        "all_to_all_single",
        "attention",
        "all_to_all_single",
    ], forward
    assert [heads for name, heads in forward if name == "attention"] == [2, 1]
    assert [name for name, _ in backward] == ["all_to_all_single"] * 4, backward
    assert len(begun) == 4 and len(begun_backward) == 4, (begun, begun_backward)


def test_one_group_stays_synchronous(pool):
    """chunks=1 has nothing to overlap with: no collective is begun asynchronously, forward or backward."""
    case, _ = chunk_cases(3)[0]
    forward, backward, begun, begun_backward = pool(3).run(jobs.pipeline_order, case, cases.make_arrays(case, 0), 1)[0]
    assert [name for name, _ in forward] == ["all_to_all_single", "attention", "all_to_all_single"], forward
    assert [name for name, _ in backward] == ["all_to_all_single"] * 2, backward
    assert begun == [] and begun_backward == [], (begun, begun_backward)


@pytest.mark.parametrize("chunks", [1, 2])
def test_compiles_whole(pool, chunks):
    for breaks, out, grad in pool(2).run(jobs.compiled, chunks, timeout=300):
        assert breaks == 0 and out == 0.0 and grad == 0.0, (breaks, out, grad)


@pytest.mark.parametrize(("chunks", "kind", "message"), BAD_CHUNKS)
def test_bad_chunks_are_refused_before_any_collective(pool, chunks, kind, message):
    shapes = dict(q=(1, 3, 6, 4), k=(1, 3, 2, 4), v=(1, 3, 2, 4))
    for text, calls in pool(4).run(attention_jobs.rejected, shapes, dict(chunks=chunks)):
        assert text.startswith(f"{kind}: {message}. Received: q_shape=(1, 3, 6, 4)"), text
        assert text.endswith(f"chunks={chunks!r}"), text
        assert calls == []
