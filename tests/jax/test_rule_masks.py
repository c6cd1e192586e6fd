"""Mask rules on global positions (``mask=``: `commlib.masks.BlockCausal`, `SlidingWindow`) in
`ulysses_attention`, `ring_attention` and `usp_attention` on simulated CPU devices: every rank's output and
dq/dk/dv (``jax.grad`` of per-rank losses under ``shard_map``) within 1e-10 of the unsharded float64 reference,
W = 1-4, both ring layouts, even and uneven lengths (every shard padded to ``max_size``), USP 2 x 2, with and
without causal and segment ids; the rule's cases in the jitted program (a skipped pair is not computed); bad
rules refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from commlib import CommError, SequenceLayout
from commlib.masks import BlockCausal, SlidingWindow, segment_ids
from commlib_jax.attention import attention
from tests import mask_cases as masks
from tests import rule_mask_cases as rules
from tests.jax.layer_meshes import call as _call
from tests.jax.layer_meshes import mesh as _mesh


def _run(op, layout, name, whole, rule, causal, ids=None, check_vma=True):
    """Per shard (exact rows): ``[outs, dqs, dks, dvs]`` (float64 numpy) of `op` with ``mask=rule``, from
    ``jax.grad`` of the per-rank losses summed outside ``shard_map``."""
    mesh, spec = _mesh(op, layout)
    stacked = [np.stack(masks.shards(x, layout, padded=True)) for x in whole]
    segments = None if ids is None else jnp.asarray(np.stack(masks.shards(ids, layout, padded=True)), jnp.int32)

    def body(cotangent, q, k, v, segment_ids):
        kwargs = {} if segment_ids is None else {"segment_ids": segment_ids[0]}
        out = _call(op, name, q[0], k[0], v[0], causal=causal, mask=rule, **kwargs)
        return out[None], (out * cotangent[0]).sum()[None]

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec,) * 4 + (None if ids is None else spec,),
        out_specs=(spec, spec),
        check_vma=check_vma,
    )

    def total(inputs):
        out, losses = mapped(jnp.asarray(stacked[3]), *inputs, segments)
        return losses.sum(), out

    grads, out = jax.jit(jax.grad(total, has_aux=True))([jnp.asarray(x, jnp.float64) for x in stacked[:3]])
    return [[np.asarray(x[i], np.float64)[:, :size] for i, size in enumerate(layout.sizes)] for x in (out, *grads)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rules_in_every_layer(world_size):
    """Every setting of `rules.settings` with two (rule, causal) pairs of `rules.RULES` x (False, True), turning
    through them from setting to setting (each pair is a compile: JAX's half of the sweep torch runs in full);
    within 1e-10 on every rank (outputs, dq, dk, dv); check_vma False for the first setting."""
    pairs = [(rule, causal) for rule in rules.RULES for causal in (False, True)]
    failed, count = [], 0
    for index, (op, layout, name) in enumerate(rules.settings(world_size)):
        whole = rules.whole_inputs(layout.seq_len, seed=world_size)
        for rule, causal in (pairs[(2 * index + world_size) % 6], pairs[(2 * index + world_size + 3) % 6]):
            got = _run(op, layout, name, whole, rule, causal, check_vma=index != 0)
            error = masks.worst_error(got, rules.expected(whole, causal, rule), layout)
            count += 1
            if not error < masks.TOLERANCE:
                failed.append(f"{op} {layout} {rule} causal={causal}: {error:.2e}")
    assert count and not failed, "\n".join(failed)


def test_rules_with_segment_ids():
    """A rule ANDed with packed documents and padding: ring zigzag at S = 37, USP 2 x 2 and Ulysses, W = 4."""
    ids = np.stack([segment_ids([9, 11, 15], 37), segment_ids([30], 37)])
    whole = rules.whole_inputs(37, seed=7)
    failed = []
    for op, layout in [
        ("ring_attention", SequenceLayout(37, ring_size=4, layout="zigzag")),
        ("usp_attention", SequenceLayout(37, ring_size=2, ulysses_size=2)),
        ("ulysses_attention", SequenceLayout(37, ulysses_size=4)),
    ]:
        for rule, causal in ((rules.RULES[0], True), (rules.RULES[1], False)):
            got = _run(op, layout, layout, whole, rule, causal, ids)
            error = masks.worst_error(got, rules.expected(whole, causal, rule, ids), layout)
            if not error < masks.TOLERANCE:
                failed.append(f"{op} {layout} {rule} causal={causal}: {error:.2e}")
    assert not failed, "\n".join(failed)


def test_default_attention_takes_the_rule():
    """`commlib_jax.attention.attention(..., mask=)` (one block, plain XLA) is the float64 reference."""
    whole = rules.whole_inputs(19)
    for rule in rules.RULES:
        got = attention(*(jnp.asarray(x) for x in whole[:3]), causal=True, mask=rule)
        assert np.abs(np.asarray(got) - rules.expected(whole, True, rule)[0]).max() < 1e-12


def test_sliding_window_leaves_skipped_pairs_out_of_the_program():
    """W = 4, S = 64, contiguous, causal, a window of 8 (half a block): the plan's steps 2 and 3 have no piece on
    any rank, so the jitted ring holds the einsums of steps 0 and 1 only -- fewer than the causal ring's."""
    mesh, _ = _mesh("ring_attention", SequenceLayout(64, ring_size=4))
    q = jnp.zeros((1, 64, 2, 8))

    def dots(mask):
        ring = jax.shard_map(
            lambda q: _call("ring_attention", "contiguous", q, q, q, causal=True, mask=mask),
            mesh=mesh,
            in_specs=P(None, "i"),
            out_specs=P(None, "i"),
        )
        return jax.jit(ring).lower(q).as_text().count("dot_general")

    assert dots(SlidingWindow(8)) < dots(None)


@pytest.mark.parametrize("op", ["ulysses_attention", "ring_attention", "usp_attention"])
@pytest.mark.parametrize(
    ("rule", "error", "text"),
    [
        (BlockCausal(0), CommError, "mask BlockCausal's block_size (0) must be >= 1"),
        (SlidingWindow(0), CommError, "mask SlidingWindow's window (0) must be >= 1"),
        ("causal", TypeError, "mask must be a commlib.masks.MaskRule (BlockCausal, SlidingWindow) or None, not str"),
    ],
)
def test_bad_rules(op, rule, error, text):
    """Named by the layer, raised while tracing (before any collective)."""
    layout = SequenceLayout(8, ring_size=2, ulysses_size=2) if op == "usp_attention" else SequenceLayout(8, ring_size=4)
    mesh, spec = _mesh(op, layout)
    q = jnp.zeros((4, 1, 2, 2, 4))  # rank r: q[r] [B = 1, S_r = 2, H = 2, D = 4]
    mapped = jax.shard_map(
        lambda q: _call(op, "contiguous", q[0], q[0], q[0], mask=rule)[None], mesh=mesh, in_specs=spec, out_specs=spec
    )
    with pytest.raises(error) as raised:
        mapped(q)
    assert str(raised.value).startswith(f"{op}: {text}. Received: "), str(raised.value)
