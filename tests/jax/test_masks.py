"""Segment masks (``segment_ids=``) in `ulysses_attention`, `ring_attention` and `usp_attention` on simulated CPU
devices: the handed case within 1e-10 of the unsharded masked reference on every rank (outputs and
dq/dk/dv, ``jax.grad`` of per-rank losses under ``shard_map``, check_vma True and False), padding rows exactly
0 with gradient exactly 0; documents of random lengths at any length (every shard padded to ``max_size``);
bad segment ids refused by name; and a NaN in q gives NaN rows and a query whose every score is
-inf gives 0 (gradient 0) through JAX's default attention and the ring (JAX's ring gave NaN)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commlib
from commlib import CommError, SequenceLayout
from commlib_jax.attention import attention
from tests import mask_cases as masks
from tests.jax.layer_meshes import call as _call
from tests.jax.layer_meshes import mesh as _mesh


def _run(op, layout, name, whole, ids, causal, check_vma=True, dtype=jnp.float64):
    """Per shard (exact rows): ``[outs, dqs, dks, dvs]`` (float64 numpy) of `op` with segment ids `ids` (None:
    none), from ``jax.grad`` of the per-rank losses summed outside ``shard_map``."""
    mesh, spec = _mesh(op, layout)
    stacked = [np.stack(masks.shards(x, layout, padded=True)) for x in whole]
    segments = None if ids is None else jnp.asarray(np.stack(masks.shards(ids, layout, padded=True)), jnp.int32)

    def body(cotangent, q, k, v, segment_ids):
        kwargs = {} if segment_ids is None else {"segment_ids": segment_ids[0]}
        out = _call(op, name, q[0], k[0], v[0], causal=causal, **kwargs)
        return out[None], (out.astype(cotangent.dtype) * cotangent[0]).sum()[None]

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

    grads, out = jax.jit(jax.grad(total, has_aux=True))([jnp.asarray(x, dtype) for x in stacked[:3]])
    return [[np.asarray(x[i], np.float64)[:, :size] for i, size in enumerate(layout.sizes)] for x in (out, *grads)]


@pytest.mark.parametrize(("op", "layout", "name"), masks.HANDED, ids=lambda x: str(getattr(x, "layout", x)))
def test_handed_case(op, layout, name):
    """W = 4, B = 2, S = 40, H = 8, H_kv = 2, D = 16, float64, causal; row 0 documents of 3, 17, 9, 11, row 1
    25 tokens then 15 of padding: within 1e-10 on every rank (check_vma True and False); padding rows' output,
    dq, dk, dv exactly 0."""
    whole, ids = masks.whole_inputs(*masks.HANDED_SHAPE), masks.handed_ids()
    for check_vma in (True, False):
        got = _run(op, layout, name, whole, ids, True, check_vma)
        masks.check_handed(got, ids, layout, f"{op} {name} check_vma={check_vma}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_documents_at_any_length(world_size):
    """S = 37 (uneven shards, held padded), documents of random lengths (some shorter than a shard, some
    crossing shards, a padding tail), causal: ring (both layouts) and Ulysses at W, USP 2 x 2 at W = 4."""
    ids, whole, settings = masks.random_documents(world_size)
    want = masks.expected(whole, ids, True)
    failed = []
    for op, layout in settings:
        error = masks.worst_error(_run(op, layout, layout, whole, ids, True), want, layout)
        failed += [f"{op} {layout}: {error:.2e}"] if error > masks.TOLERANCE else []
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("op", ["ulysses_attention", "ring_attention", "usp_attention"])
@pytest.mark.parametrize(
    ("ids", "text"),
    [
        (np.zeros((1, 3), np.float32), "TypeError: {op}: segment_ids dtype (float32) must be an integer dtype"),
        (np.zeros((1, 4), np.int32), "CommError: {op}: segment_ids shape (1, 4) must be q's [batch, seq] (1, 3)"),
    ],
)
def test_bad_segment_ids(op, ids, text):
    """Refused while tracing, before any collective, naming the layer and the argument (the torch text)."""
    layout = SequenceLayout(12, ring_size=2, ulysses_size=2)
    mesh, spec = _mesh("usp_attention", layout) if op == "usp_attention" else _mesh(op, SequenceLayout(12, 4))
    name = "contiguous"

    def body(q):
        return _call(op, name, q[0], q[0], q[0], segment_ids=jnp.asarray(ids))[None]

    with pytest.raises((CommError, TypeError)) as raised:
        jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(jnp.zeros((4, 1, 3, 2, 4)))
    message = f"{type(raised.value).__name__}: {raised.value}"
    assert message.startswith(text.format(op=op) + ". Received: "), message


@pytest.mark.parametrize("argument", ["q", "segment_ids"])
@pytest.mark.parametrize("op", ["ulysses_attention", "ring_attention", "usp_attention"])
def test_list_inputs_are_refused(op, argument):
    """A Python list as q or segment_ids (JAX converted the ids and raised AttributeError for q): the spec's
    TypeError (`commlib.attention.check_layer_inputs`, torch's text with JAX's types) while tracing."""
    layout = SequenceLayout(12, ring_size=2, ulysses_size=2)
    mesh, spec = _mesh("usp_attention", layout) if op == "usp_attention" else _mesh(op, SequenceLayout(12, 4))

    def body(q):
        inputs = {"q": q[0], "segment_ids": jnp.zeros((1, 3), jnp.int32)}
        inputs[argument] = [[0, 0, 0]] if argument == "segment_ids" else [q[0]]
        return _call(op, "contiguous", inputs["q"], q[0], q[0], segment_ids=inputs["segment_ids"])[None]

    with pytest.raises(TypeError) as raised:
        jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(jnp.zeros((4, 1, 3, 2, 4)))
    assert str(raised.value) == (
        f"{op}: {argument} must be a jax.Array or numpy.ndarray, not list. Received: type='list'"
    ), raised.value


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize(("op", "layout"), masks.NAN_LAYOUTS)
@pytest.mark.parametrize("row", ["nan", "blind"])
def test_nan_rows_and_rows_that_see_no_finite_score(op, layout, dtype, row):
    """Causal: a NaN in q's row 3 gives a NaN output row, as the reference; row 9, whose every
    score is -inf ("blind"), gives exactly 0 and dq exactly 0 (JAX's ring gave NaN, its default attention the
    average of the keys the causal mask hides); the other rows equal the reference."""
    whole = masks.nan_or_blind(row)
    got = _run(op, layout, layout.layout, whole, None, True, dtype=dtype)
    out, dq = (layout.unshard(parts, 1) for parts in got[:2])
    masks.check_nan_or_blind(out, dq, whole, row, dtype == jnp.float64)


def test_default_attention_masks():
    """`attention` with segment ids is the reference (float64), a padding row exactly 0."""
    whole, ids = masks.whole_inputs(2, 12, 4, 2, 3), np.stack([commlib.segment_ids([5, 4], 12)] * 2)
    out = attention(*(jnp.asarray(x) for x in whole[:3]), causal=True, segment_ids=jnp.asarray(ids))
    np.testing.assert_allclose(out, masks.expected(whole, ids, True)[0], rtol=0, atol=1e-12)
    assert np.all(np.asarray(out)[:, 9:] == 0)


@pytest.mark.parametrize(("op", "layout"), masks.NAN_K_JAX_SETTINGS, ids=masks.setting_id)
def test_nan_in_k_reaches_the_rows_that_see_it_and_no_other(op, layout):
    """The torch rows (`masks.NAN_K_CASES`) at a few of its settings: a NaN key makes exactly the
    rows that see it NaN, as the float64 reference; a NaN at a padding key changes no output (JAX's dq is NaN
    there, as the reference VJP's: torch's test checks the gradients)."""
    failed = []
    for where, causal, segmented, value_dim in masks.NAN_K_CASES:
        if where == "padding" and layout.seq_len < 4:
            continue
        whole, ids = masks.nan_in_k(layout.seq_len, where, segmented, value_dim)
        got = _run(op, layout, layout, whole, ids, causal)
        try:
            masks.check_nan_in_k(got, whole, ids, causal, where, layout, gradients=False)
        except AssertionError as error:
            failed.append(f"{where} causal={causal} segmented={segmented} D_v={value_dim}: {str(error)[:300]}")
    assert not failed, "\n".join(failed)
