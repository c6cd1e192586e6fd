"""`commlib_torch.testing_trace.record()` on real gloo ranks, W = 1-4: every forward commlib call in order with
its module and every rank's input and output (against the float64 numpy reference), no backward call, nothing
after the block; an attention layer through a `parallel` context is one call (q, k, v), not its all-to-alls."""

import numpy as np
import pytest

from commlib import attention as attention_spec
from commlib import reference
from commlib.testing.trace import Trace
from tests.torch import trace_jobs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_forward_call_in_order_with_its_module_and_arrays(pool, world_size):
    replies = pool(world_size).run(trace_jobs.tree, 5)
    trace = Trace.merge([reply[0] for reply in replies])
    assert [(call.op, call.module) for call in trace] == [
        ("all_reduce", "layers.1"),
        ("all_gather", "layers.1"),
        ("reduce_scatter", "layers.1.inner"),
        ("all_reduce", ""),
    ]
    assert trace[0].plan["convention"] == "replicated" and trace[3].plan["in_shape"] == "(3, 5)"
    xs, ys = zip(*(trace_jobs.inputs(rank, world_size, 5) for rank in range(world_size)), strict=True)
    summed = reference.all_reduce(list(xs), "sum")
    gathered = reference.all_gather(summed, 0)
    scattered = reference.reduce_scatter(list(ys), 0)
    want = [(xs, summed), (summed, gathered), (ys, scattered), ([2 * x for x in xs], [2 * s for s in summed])]
    for call, (inputs, outputs) in zip(trace, want, strict=True):
        assert call.ranks == tuple(range(world_size))
        for rank in range(world_size):
            np.testing.assert_allclose(call.inputs["x"][rank], inputs[rank], rtol=1e-12)
            np.testing.assert_allclose(call.outputs["out"][rank], outputs[rank], rtol=1e-12)
    for rank, (_, got_gathered, got_scattered) in enumerate(replies):  # the recorded outputs are what ran
        np.testing.assert_array_equal(trace[1].outputs["out"][rank], got_gathered)
        np.testing.assert_array_equal(trace[2].outputs["out"][rank], got_scattered)


def test_calls_under_torch_func_grad_are_recorded_by_value(pool):
    replies = pool(2).run(trace_jobs.under_grad, 5)
    trace = Trace.merge([trace for trace, _ in replies])
    xs = [trace_jobs.inputs(rank, 2, 5)[0] for rank in range(2)]
    assert [call.op for call in trace] == ["all_gather"]
    for rank in range(2):
        np.testing.assert_array_equal(trace[0].inputs["x"][rank], xs[rank])
        np.testing.assert_array_equal(trace[0].outputs["out"][rank], np.concatenate(xs))
        # each rank's loss is |all_gather(x)|^2: 2 x_r from each of the W = 2 ranks' losses (convention "sum")
        np.testing.assert_allclose(replies[rank][1], 2 * 2 * xs[rank], rtol=1e-12)


@pytest.mark.parametrize(("world_size", "seq_len"), [(1, 5), (2, 6), (4, 8)])
def test_an_attention_layer_is_one_call_with_q_k_v(pool, world_size, seq_len):
    replies = pool(world_size).run(trace_jobs.attention, seq_len)
    trace = Trace.merge([trace for trace, _ in replies])
    assert [(call.op, call.module, list(call.inputs)) for call in trace] == [
        ("ulysses_attention", f"layers.{i}.self_attn", ["q", "k", "v"]) for i in range(2)
    ]
    whole = trace_jobs.attention_inputs(seq_len)
    want = attention_spec.attention(*whole, causal=True, scale=0.25)
    rows = np.array_split(np.arange(seq_len), world_size)
    for call in trace:
        assert call.plan["causal"] == "True" and call.plan["dtype"] == "float64"
        for rank in range(world_size):
            for name, x in zip("qkv", whole, strict=True):
                np.testing.assert_array_equal(call.inputs[name][rank], x[:, rows[rank]])
            np.testing.assert_allclose(call.outputs["out"][rank], want[:, rows[rank]], rtol=1e-10, atol=1e-12)
