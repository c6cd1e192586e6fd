"""`ulysses_attention(..., chunks=)` on simulated CPU devices (DESIGN "Overlap"): head groups
give chunks=1's output and dq, dk, dv bit for bit where no kv head serves q heads of two groups
(`tests.attention_cases.kv_exact`: MHA, GQA whose groups keep a kv head's q heads together), else to rounding
(a group's GQA shape differs and XLA may round its dots otherwise), every rank, with check_vma on and off, and
the float64 reference's values; segment ids; in the program, no group's all-to-all reads another group's
attention (XLA may overlap them); bad `chunks` refused while tracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError
from commlib.tools import cases, parity
from commlib_jax.attention import ulysses_attention
from commlib_jax.tools import parity_runner
from tests import mask_cases as masks
from tests.attention_cases import BAD_CHUNKS, chunk_cases, chunked_segments, kv_exact, with_chunks
from tests.jax.dependencies import collective_sources

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]")


@pytest.mark.parametrize(("world_size", "mode"), [(3, MODES[0]), (4, MODES[0]), (4, MODES[1])])
def test_chunks_equal_one_group(world_size, mode):
    """W 3 and 4 with check_vma on, W 4 with it off (each case compiles programs of its own: W 3 with check_vma
    off walked the same groups as W 3 on and W 4 off, and cost the most of the four); torch runs W 1-4."""
    failed = []
    for case, chunks in chunk_cases(world_size):
        arrays = cases.make_arrays(case, 0)
        whole_out, whole_grads = parity_runner.run_case(case, arrays, mode)
        for count in chunks:
            chunked = with_chunks(case, count)
            outputs, gradients = parity_runner.run_case(chunked, arrays, mode)
            row = parity.check(chunked, arrays, outputs, gradients, None, "jax", mode)
            failed += [] if row.passed else [f"{chunked.name}: {row.out_error} {row.grad_error} {row.detail}"]
            pairs = [(outputs, whole_out), *((gradients[name], whole_grads[name]) for name in "qkv")]
            for rank in range(world_size):
                for what, (got, want) in zip(("out", "dq", "dk", "dv"), pairs, strict=True):
                    if kv_exact(case, count):
                        assert np.array_equal(got[rank], want[rank]), (chunked.name, rank, what)
                    else:
                        np.testing.assert_allclose(got[rank], want[rank], rtol=1e-12, atol=1e-15)
    assert not failed, "\n".join(failed)


def _mapped(world_size: int, **kwargs):
    """``(cotangent, q, k, v) -> (outputs, losses)`` over stacked [W, B, rows, ...] arrays (check_vma on)."""

    def body(cotangent, q, k, v, ids):
        out = ulysses_attention(q[0], k[0], v[0], "i", segment_ids=None if ids is None else ids[0], **kwargs)
        return out[None], (out * cotangent[0]).sum()[None]

    mesh = Mesh(np.array(jax.devices()[:world_size]), ("i",))
    return jax.shard_map(body, mesh=mesh, in_specs=(P("i"),) * 5, out_specs=(P("i"), P("i")))


def test_segment_ids():
    """Packed documents and padding, GQA, uneven S (padded layout), causal, float64, W = 4: chunks=2 is chunks=1
    to rounding (kv heads of 2 q heads a rank, cut by the groups), and within 1e-10 of the masked reference."""
    layout, whole, ids, chunks = chunked_segments(4)
    stacked = [jnp.asarray(np.stack(masks.shards(x, layout, padded=True))) for x in (*whole, ids)]
    results = {}
    for count in (1, chunks):
        mapped = _mapped(4, causal=True, layout=layout, chunks=count)

        def total(inputs, mapped=mapped):
            out, losses = mapped(stacked[3], *inputs, stacked[4])
            return losses.sum(), out

        grads, out = jax.jit(jax.grad(total, has_aux=True))(stacked[:3])
        results[count] = [np.asarray(out), *(np.asarray(grad) for grad in grads)]
    for got, want in zip(results[chunks], results[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    got = [list(array) for array in results[chunks]]
    assert masks.worst_error(got, masks.expected(whole, ids, causal=True), layout) < masks.TOLERANCE


def _program(chunks: int, world_size: int = 4):
    """The handed case's shapes (H = 6, H_kv = 2, uneven S and heads) at `world_size`, causal: the forward and
    the gradient as jaxprs."""
    mapped = _mapped(world_size, causal=True, seq_sizes=(3, 3, 2, 2)[:world_size], chunks=chunks)
    inputs = [jnp.zeros((world_size, 1, 3, heads, 4)) for heads in (6, 2, 2)]
    cotangent = jnp.zeros((world_size, 1, 3, 6, 4))
    forward = jax.make_jaxpr(lambda *xs: mapped(cotangent, *xs, None)[0])(*inputs)
    gradient = jax.make_jaxpr(jax.grad(lambda xs: mapped(cotangent, *xs, None)[1].sum()))(inputs)
    return forward.jaxpr, gradient.jaxpr


def test_no_group_waits_for_another_groups_attention():
    """The forward's all-to-alls in program order: group 0's and group 1's in (reading no attention: both may
    run before or during group 0's attention), group 0's out (reading group 0's two dot_generals only: it may
    run during group 1's attention), group 1's out (group 1's only). The gradient's: the forward's four, the
    cotangent's two back (reading no attention), then each group's reverse exchange, reading only its own
    group's dot_generals (the two groups' backward never wait for each other)."""
    forward, gradient = _program(chunks=2)
    assert collective_sources(forward, "all_to_all") == [set(), set(), {0, 1}, {2, 3}]
    found = collective_sources(gradient, "all_to_all")
    assert len(found) == 8 and found[:4] == [set(), set(), {0, 1}, {2, 3}], found
    back = found[4:]
    assert [sources for sources in back if not sources] == [set(), set()], back
    computed = [sources for sources in back if sources]
    assert len(computed) == 2 and not computed[0] & computed[1], back
    one_group = collective_sources(_program(chunks=1)[0], "all_to_all")
    assert one_group == [set(), {0, 1}]  # chunks=1: one all-to-all each way, the output reading the attention


@pytest.mark.parametrize(("chunks", "kind", "message"), BAD_CHUNKS)
def test_bad_chunks_are_refused_while_tracing(chunks, kind, message):
    """The spec's text (torch's for the same call), before anything is traced."""
    mapped = _mapped(4, chunks=chunks)
    inputs = [jnp.zeros((4, 1, 3, heads, 4)) for heads in (6, 2, 2)]
    with pytest.raises((CommError, TypeError)) as raised:
        jax.jit(mapped).trace(jnp.zeros((4, 1, 3, 6, 4)), *inputs, None)
    assert type(raised.value).__name__ == kind
    assert str(raised.value).startswith(f"{message}. Received: q_shape=(1, 3, 6, 4)")
    assert str(raised.value).endswith(f"chunks={chunks!r}")
