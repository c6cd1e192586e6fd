"""The JAX layers' pieces over several key blocks (issue 32 item 1: ``block_size=`` smaller than a piece, so the
``lax.fori_loop`` of `commlib.blockwise.attend_blocks` / `attend_blocks_vjp` runs; the other layer tests use
the default block, which holds their whole pieces): Ulysses, ring (both layouts) and USP against the unsharded
float64 reference on every rank -- outputs and dq, dk, dv, with and without segment ids, uneven lengths, check_vma
True and False, block sizes that do not divide a piece -- the NaN and blind-row rules, and bad block sizes
refused by name before any collective."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError, SequenceLayout
from commlib_jax.attention import ulysses_attention
from tests import mask_cases as masks
from tests.jax.layer_meshes import call as _call
from tests.jax.layer_meshes import mesh as _mesh


def _run(op, layout, name, whole, ids, block_size, check_vma=True, dtype=jnp.float64):
    """Per shard (exact rows): ``[outs, dqs, dks, dvs]`` of `op` (causal) at `block_size`, from ``jax.grad`` of
    the per-rank losses summed outside ``shard_map``."""
    mesh, spec = _mesh(op, layout)
    stacked = [np.stack(masks.shards(x, layout, padded=True)) for x in whole]
    segments = None if ids is None else jnp.asarray(np.stack(masks.shards(ids, layout, padded=True)), jnp.int32)

    def body(cotangent, q, k, v, segment_ids):
        kwargs = {} if segment_ids is None else {"segment_ids": segment_ids[0]}
        out = _call(op, name, q[0], k[0], v[0], causal=True, block_size=block_size, **kwargs)
        return out[None], (out.astype(cotangent.dtype) * cotangent[0]).sum()[None]

    in_specs = (spec,) * 4 + (None if ids is None else spec,)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(spec, spec), check_vma=check_vma)

    def total(inputs):
        out, losses = mapped(jnp.asarray(stacked[3]), *inputs, segments)
        return losses.sum(), out

    grads, out = jax.jit(jax.grad(total, has_aux=True))([jnp.asarray(x, dtype) for x in stacked[:3]])
    return [[np.asarray(x[i], np.float64)[:, :size] for i, size in enumerate(layout.sizes)] for x in (out, *grads)]


@pytest.mark.parametrize("segments", [False, True], ids=["causal", "segments"])
@pytest.mark.parametrize(("op", "layout", "name"), masks.HANDED, ids=lambda x: str(getattr(x, "layout", x)))
def test_several_blocks_match_the_reference(op, layout, name, segments):
    """S = 40 at W = 4 (ring pieces of 10 or 5 rows, Ulysses' 40), blocks of 3 keys: within 1e-10 of the
    reference, padding rows exactly 0 (check_vma True and False)."""
    whole = masks.whole_inputs(*masks.HANDED_SHAPE)
    ids = masks.handed_ids() if segments else None
    for check_vma in (True, False):
        got = _run(op, layout, name, whole, ids, 3, check_vma)
        if segments:
            masks.check_handed(got, ids, layout, f"{op} {name} check_vma={check_vma}")
        else:
            assert masks.worst_error(got, masks.expected(whole, None, True), layout) < masks.TOLERANCE


def test_documents_at_an_uneven_length():
    """S = 37 on 4 ranks (shards held padded, masks from global positions), random documents, blocks of 2 and
    4 keys: every layer within 1e-10 of the reference."""
    ids, whole, settings = masks.random_documents(4)
    want = masks.expected(whole, ids, True)
    failed = []
    for block_size in (2, 4):
        for op, layout in settings:
            error = masks.worst_error(_run(op, layout, layout, whole, ids, block_size), want, layout)
            failed += [f"{op} {layout} block {block_size}: {error:.2e}"] if error > masks.TOLERANCE else []
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize(("op", "layout"), masks.NAN_LAYOUTS)
@pytest.mark.parametrize("row", ["nan", "blind"])
def test_nan_rows_and_blind_rows_over_blocks(op, layout, row):
    """Issue 23 item 5's rules over blocks of 3 keys: a NaN in q's row gives a NaN row; a row whose every score
    is -inf outputs exactly 0 with dq exactly 0."""
    whole = masks.nan_or_blind(row)
    got = _run(op, layout, layout.layout, whole, None, 3)
    out, dq = (layout.unshard(parts, 1) for parts in got[:2])
    masks.check_nan_or_blind(out, dq, whole, row, True)


@pytest.mark.parametrize("op", ["ulysses_attention", "ring_attention", "usp_attention"])
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "CommError: {op}: block_size (0) must be >= 1. Received: block_size=0"),
        (2.0, "TypeError: {op}: block_size must be an int, not float. Received: block_size=2.0"),
    ],
)
def test_bad_block_size(op, value, text):
    """Refused while tracing, before any collective, naming the layer and the argument."""
    layout = SequenceLayout(12, ring_size=2, ulysses_size=2) if op == "usp_attention" else SequenceLayout(12, 4)
    mesh, spec = _mesh(op, layout)

    def body(q):
        return _call(op, "contiguous", q[0], q[0], q[0], block_size=value)[None]

    with pytest.raises((CommError, TypeError)) as raised:
        jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(jnp.zeros((4, 1, 3, 2, 4)))
    assert f"{type(raised.value).__name__}: {raised.value}" == text.format(op=op)


def test_no_keys():
    """Ulysses at S = 0 (``seq_sizes=(0, 0, 0, 0)``; found by tests/jax/test_layer_fuzz.py: the key loop's body
    sliced a block of an empty axis): an empty output and empty gradients, at the default block and at 3."""
    mesh, spec = Mesh(np.array(jax.devices()[:4]), ("i",)), P("i")
    for block_size in (None, 3):

        def body(q, block_size=block_size):
            out = ulysses_attention(q[0], q[0], q[0], "i", seq_sizes=(0,) * 4, block_size=block_size)
            return out[None]

        mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
        q = jnp.zeros((4, 1, 0, 2, 4))
        out, grad = jax.jit(jax.value_and_grad(lambda q, mapped=mapped: mapped(q).sum()))(q)
        assert float(out) == 0.0 and grad.shape == q.shape
