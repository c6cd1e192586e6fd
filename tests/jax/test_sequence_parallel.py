"""`commlib_jax.sequence.parallel` and `dot_product_attention` on 4 simulated CPU devices: every shard's output and
dq/dk/dv (padded layout: rows past a shard's own are zeros with gradient 0) against the float64 reference
(`commlib.attention`: unsharded GQA attention) for Ulysses at odd lengths, ring zigzag and USP 2 x 2; every refusal
with its message; nested contexts; a context entered inside the shard_map body.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib
from commlib import CommError
from commlib import attention as A
from commlib_jax import _parallel, sequence
from commlib_jax.sequence import dot_product_attention, parallel
from tests import mask_cases

TOLERANCE = 1e-10
SCALE = 0.3


def _whole(seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """float64 q ``[2, S, 8, 4]``, k and v ``[2, S, 2, 4]`` (GQA) and the output cotangent."""
    rng = np.random.default_rng(seed)
    shapes = [(2, seq_len, 8, 4), (2, seq_len, 2, 4), (2, seq_len, 2, 4), (2, seq_len, 8, 4)]
    return [rng.standard_normal(shape) for shape in shapes]


def _mesh(layout: commlib.SequenceLayout, attention: str):
    """The mesh and the shard spec: one axis "x", or USP's ("ring", "ulysses") so shard r * U + u sits at row-major
    position (r, u)."""
    devices = np.array(jax.devices()[: layout.world_size])
    if attention == "usp":
        return Mesh(devices.reshape(layout.ring_size, layout.ulysses_size), ("ring", "ulysses")), P(
            None, ("ring", "ulysses")
        )
    return Mesh(devices, ("x",)), P(None, "x")


def _context(layout, attention):
    if attention == "usp":
        return parallel(layout, attention="usp", ulysses_axis="ulysses", ring_axis="ring")
    return parallel(layout, "x", attention=attention)


def _run(layout: commlib.SequenceLayout, attention: str, causal: bool, check_vma: bool = True):
    """Every shard's output and (dq, dk, dv), padded rows dropped, and the gradients of the padded rows."""
    whole = _whole(layout.seq_len)
    cut = [jnp.asarray(np.concatenate(layout.shard(x, padded=True), axis=1)) for x in whole]
    mesh, spec = _mesh(layout, attention)

    def body(cotangent, q, k, v):
        out = dot_product_attention(q, k, v, scale=SCALE, is_causal=causal)
        return out, (out * cotangent).sum()[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, P(spec[1])), check_vma=check_vma)

    def total(q, k, v):
        out, losses = mapped(cut[3], q, k, v)
        return losses.sum(), out

    with _context(layout, attention):
        grads, out = jax.jit(jax.grad(total, argnums=(0, 1, 2), has_aux=True))(*cut[:3])
    split = lambda x: np.split(np.asarray(x), layout.world_size, axis=1)  # noqa: E731
    return [layout.unshard(split(x), padded=True) for x in (out, *grads)], [split(x) for x in (out, *grads)], whole


def _check(layout, attention, causal, check_vma=True):
    got, padded, whole = _run(layout, attention, causal, check_vma)
    want = [A.attention(*whole[:3], causal=causal, scale=SCALE), *A.attention_vjp(*whole, causal=causal, scale=SCALE)]
    for name, value, wanted in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(value, wanted, rtol=0, atol=TOLERANCE, err_msg=name)
    for x in padded:  # rows past each shard's own: zeros (output) and gradient exactly 0
        for shard, size in zip(x, layout.sizes, strict=True):
            assert not shard[:, size:].any()


@pytest.mark.parametrize("seq_len", [5, 37])
def test_ulysses_any_length(seq_len):
    _check(commlib.SequenceLayout(seq_len, ulysses_size=4), "ulysses", causal=True)


def test_ulysses_check_vma_false():
    _check(commlib.SequenceLayout(37, ulysses_size=4), "ulysses", causal=False, check_vma=False)


def test_ring_zigzag():
    _check(commlib.SequenceLayout(16, ring_size=4, layout="zigzag"), "ring", causal=True)


def test_usp_two_by_two():
    _check(commlib.SequenceLayout(16, ring_size=2, ulysses_size=2, layout="zigzag"), "usp", causal=True)


def _run_segments(layout: commlib.SequenceLayout, attention: str, ids: np.ndarray):
    """`dot_product_attention(..., is_causal=True, segment_ids=)` on every shard: output and (dq, dk, dv), whole."""
    whole = _whole(layout.seq_len, seed=3)
    cut = [jnp.asarray(np.concatenate(layout.shard(x, padded=True), axis=1)) for x in whole]
    segments = jnp.asarray(np.concatenate(mask_cases.shards(ids, layout, padded=True), axis=1))
    mesh, spec = _mesh(layout, attention)

    def body(segments, cotangent, q, k, v):
        out = dot_product_attention(q, k, v, scale=SCALE, is_causal=True, segment_ids=segments)
        return out, (out * cotangent).sum()[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, P(spec[1])))

    def total(q, k, v):
        out, losses = mapped(segments, cut[3], q, k, v)
        return losses.sum(), out

    with _context(layout, attention):
        grads, out = jax.jit(jax.grad(total, argnums=(0, 1, 2), has_aux=True))(*cut[:3])
    split = lambda x: np.split(np.asarray(x), layout.world_size, axis=1)  # noqa: E731
    return [layout.unshard(split(x), padded=True) for x in (out, *grads)], whole


SEGMENTED = [
    (commlib.SequenceLayout(37, ulysses_size=4), "ulysses"),
    (commlib.SequenceLayout(37, ring_size=4), "ring"),
    (commlib.SequenceLayout(40, ring_size=4, layout="zigzag"), "ring"),
    (commlib.SequenceLayout(40, ring_size=2, ulysses_size=2, layout="zigzag"), "usp"),
]


@pytest.mark.parametrize(("layout", "attention"), SEGMENTED, ids=[f"{kind}-{case!r}" for case, kind in SEGMENTED])
def test_segment_ids_are_the_masked_reference(layout, attention):
    """The handed documents (3, 17, 9, 11; 25 then padding), cut to S: every shard equals the unsharded masked
    attention; padding outputs exactly 0 with gradient exactly 0."""
    ids = mask_cases.handed_ids(40)[:, : layout.seq_len]
    got, whole = _run_segments(layout, attention, ids)
    want = [
        A.attention(*whole[:3], causal=True, scale=SCALE, q_segments=ids),
        *A.attention_vjp(*whole, causal=True, scale=SCALE, q_segments=ids),
    ]
    for name, value, wanted in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(value, wanted, rtol=0, atol=TOLERANCE, err_msg=name)
        assert not value[ids < 0].any(), name


def test_segment_ids_of_the_wrong_shape_are_refused():
    layout = commlib.SequenceLayout(8, ulysses_size=4)
    body = lambda q: dot_product_attention(q, q, q, segment_ids=jnp.zeros((2, 3), jnp.int32))  # noqa: E731
    mapped = jax.shard_map(
        body, mesh=Mesh(np.array(jax.devices()[:4]), ("x",)), in_specs=P(None, "x"), out_specs=P(None, "x")
    )
    with parallel(layout, "x"), pytest.raises(CommError, match=r"segment_ids shape \(2, 3\) must be q's"):
        mapped(jnp.zeros((2, 8, 4, 4)))


@pytest.mark.parametrize("argument", ["query", "key", "value"])
@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_a_list_query_key_or_value_is_the_spec_type_error(attention, argument):
    """A Python list as query, key or value (a list query raised AttributeError reading its shape): the spec's
    TypeError naming the call and the argument, as torch's layers give for a list, while tracing."""
    layout = commlib.SequenceLayout(12, **{f"{attention}_size": 4})

    def body(x):
        inputs = {"query": x, "key": x, "value": x}
        inputs[argument] = [x]
        return dot_product_attention(inputs["query"], inputs["key"], inputs["value"])

    mapped = jax.shard_map(
        body, mesh=Mesh(np.array(jax.devices()[:4]), ("x",)), in_specs=P(None, "x"), out_specs=P(None, "x")
    )
    with parallel(layout, "x", attention=attention), pytest.raises(TypeError) as raised:
        mapped(jnp.zeros((1, 12, 4, 4)))
    assert str(raised.value) == (
        f"commlib attention: {argument} must be a jax.Array or numpy.ndarray, not list. Received: type='list'"
    )


def _error(call) -> str:
    with pytest.raises((CommError, TypeError)) as raised:
        call()
    return str(raised.value)


def _enter(*args, **kwargs):
    with parallel(*args, **kwargs):
        pass


def _traced(layout, **kwargs):
    """`dot_product_attention` traced inside a W = 4 shard_map with `kwargs`."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    q = jnp.ones((1, 4 * kwargs.pop("rows", layout.max_size), 4, 8))
    body = lambda q: dot_product_attention(q, q, q, **kwargs)  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=P(None, "x"), out_specs=P(None, "x"))(q)


def test_refusals():
    layout = commlib.SequenceLayout(10, ulysses_size=4)
    assert _error(lambda: _traced(layout)).startswith(
        "commlib attention: called outside a commlib_jax.sequence.parallel(...) context"
    )
    with parallel(layout, "x"):
        assert "an attention bias is not supported" in _error(lambda: _traced(layout, bias=jnp.zeros((1, 4, 3, 3))))
        assert "a dense attention mask is not supported" in _error(
            lambda: _traced(layout, mask=jnp.ones((1, 4, 3, 3), bool))
        )
        assert "query rows (4) must be layout.max_size (3)" in _error(lambda: _traced(layout, rows=4))
    two = commlib.SequenceLayout(10, ulysses_size=2)
    with parallel(two, "x"):  # checked when traced: the axis has 4
        assert "layout.ulysses_size (2) must be 4" in _error(lambda: _traced(two))
    assert "attention='ulysses' needs axis_name" in _error(lambda: _enter(layout))
    assert "attention='usp' needs both ulysses_axis and ring_axis" in _error(
        lambda: _enter(layout, attention="usp", ring_axis="x")
    )
    assert "attention ('flash') must be one of ulysses, ring, usp" in _error(
        lambda: _enter(layout, "x", attention="flash")
    )
    assert "layout must be a commlib.SequenceLayout, not int" in _error(lambda: _enter(10, "x"))


def test_checked_on_entry_inside_shard_map():
    """Entered inside the body, the layout's size is checked against the axis at once."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def body(q):
        with parallel(commlib.SequenceLayout(8, ring_size=2), "x", attention="ring"):
            return q

    text = _error(lambda: jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.ones(4)))
    assert "parallel: layout.ring_size (2) must be 4 (the group's size for attention='ring')" in text


def test_nesting():
    outer, inner = commlib.SequenceLayout(8, ulysses_size=4), commlib.SequenceLayout(8, ring_size=4)
    seen = []
    with parallel(outer, "x"):
        seen.append(_parallel.current("test").plan.attention)
        with parallel(inner, "x", attention="ring") as plan:
            seen.append(_parallel.current("test").plan.attention)
            assert plan.keywords == {"layout": "contiguous"}
        seen.append(_parallel.current("test").plan.attention)
    assert seen == ["ulysses", "ring", "ulysses"]
    assert _parallel.CONTEXTS.innermost() is None


# --- the helpers and the context agree on one layout and one axis order ----------------------------------------


def _tokens_in(context, call, layout):
    """`call(ids)` (a sequence helper) inside a W = 4 shard_map over `layout`'s mesh, traced inside `context`
    (None: outside every context)."""
    attention = "usp" if layout.ulysses_size > 1 and layout.ring_size > 1 else "ring"
    mesh, spec = _mesh(layout, attention)
    ids = jnp.arange(layout.seq_len)[None]
    mapped = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P(), out_specs=spec))
    if context is None:
        return mapped(ids)
    with context:
        return mapped(ids)


def test_helpers_default_to_the_context_layout_and_axes():
    """Inside a context, layout=None and axis_name=None are the context's: the same tokens, positions and labels
    as given explicitly; USP's sequence axes are (ring_axis, ulysses_axis)."""
    for layout, attention in [
        (commlib.SequenceLayout(37, ring_size=4, layout="zigzag"), "ring"),
        (commlib.SequenceLayout(30, ring_size=2, ulysses_size=2, layout="zigzag"), "usp"),
    ]:
        axes = ("ring", "ulysses") if attention == "usp" else "x"
        explicit = functools.partial(
            lambda ids, layout, axes: jnp.stack(sequence.shard_tokens(ids, layout, axes)), layout=layout, axes=axes
        )
        given = _tokens_in(_context(layout, attention), explicit, layout)
        default = _tokens_in(_context(layout, attention), lambda ids: jnp.stack(sequence.shard_tokens(ids)), layout)
        np.testing.assert_array_equal(np.asarray(default), np.asarray(given))
        positions = _tokens_in(_context(layout, attention), lambda ids: sequence.position_ids()[None], layout)
        want = spec_positions(layout)
        np.testing.assert_array_equal(np.asarray(positions)[0], want)


def spec_positions(layout):
    """Every shard's positions, padded to max_size with 0, in shard order (what position_ids gives)."""
    from commlib import sequence_helpers

    return np.maximum(sequence_helpers.position_table(layout), 0).reshape(-1)


def test_a_helper_with_another_layout_than_the_context_is_refused():
    """The newcomer's zigzag tokens under a context told contiguous (gradients 94-110% off): refused, naming the
    helper, the argument, the context's layout and the given one."""
    contiguous = commlib.SequenceLayout(37, ring_size=4)
    zigzag = commlib.SequenceLayout(37, ring_size=4, layout="zigzag")
    for helper in (
        lambda ids: sequence.shard_tokens(ids, zigzag, "x")[0],
        lambda ids: sequence.position_ids(zigzag, "x")[None],
        lambda ids: sequence.shard_sequence(ids.astype(jnp.float32), zigzag, "x"),
        lambda ids: sequence.gather_sequence(ids[:, :10].astype(jnp.float32), zigzag, "x")[:, :10],
    ):
        text = _error(lambda helper=helper: _tokens_in(_context(contiguous, "ring"), helper, contiguous))
        assert f"layout ({zigzag!r}) must be the parallel context's layout ({contiguous!r})" in text, text
        assert text.split(":")[0] in ("shard_tokens", "position_ids", "shard_sequence", "gather_sequence")


def test_usp_axes_in_the_other_order_are_refused():
    """USP with the tokens sharded over (ulysses, ring) while the context's shard r * U + u is (ring, ulysses)
    (74-89% off): refused with both orders."""
    layout = commlib.SequenceLayout(30, ring_size=2, ulysses_size=2, layout="zigzag")
    text = _error(
        lambda: _tokens_in(
            _context(layout, "usp"), lambda ids: sequence.shard_tokens(ids, layout, ("ulysses", "ring"))[0], layout
        )
    )
    assert text.startswith(
        "shard_tokens: axis_name (('ulysses', 'ring')) must be the parallel context's sequence "
        "axes (('ring', 'ulysses')) in that order"
    ), text


def test_helpers_outside_every_context_need_a_layout():
    layout = commlib.SequenceLayout(8, ring_size=4)
    assert _error(lambda: _tokens_in(None, lambda ids: sequence.shard_tokens(ids)[0], layout)).startswith(
        "shard_tokens: layout is required outside a parallel(...) context"
    )
    assert _error(lambda: _tokens_in(None, lambda ids: sequence.shard_tokens(ids, layout)[0], layout)).startswith(
        "shard_tokens: axis_name is required outside a parallel(...) context"
    )


# --- positions=: the model's positions checked against the layout's ---------------------------------------------


def _attend(layout, attention, positions_of):
    """`dot_product_attention(q, q, q, positions=positions_of(ids))` over `layout`, materialised."""
    mesh, spec = _mesh(layout, attention)
    q = jnp.asarray(np.concatenate(layout.shard(_whole(layout.seq_len)[0], padded=True), axis=1))

    def body(q, ids):
        return dot_product_attention(q, q, q, is_causal=True, positions=positions_of(ids))

    with _context(layout, attention):
        step = jax.jit(
            jax.grad(
                lambda q: jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec)(
                    q, jnp.arange(layout.seq_len)[None]
                ).sum()
            )
        )
        return np.asarray(step(q))


def _runtime_error(call) -> str:
    """The text of the JaxRuntimeError `call` raises. JAX keeps the failed callback's runtime token and raises it
    again at interpreter exit (over pytest's summary); the test drops it (jax's private ``runtime_tokens``,
    read on 0.10.2), a user's process that goes on after the error does not need to."""
    from jax._src import dispatch

    with pytest.raises(jax.errors.JaxRuntimeError) as raised:
        call()
    dispatch.runtime_tokens.clear()
    return str(raised.value)


def test_positions_from_shard_tokens_pass():
    layout = commlib.SequenceLayout(30, ring_size=2, ulysses_size=2, layout="zigzag")
    checked = _attend(layout, "usp", lambda ids: sequence.shard_tokens(ids)[1])
    unchecked = _attend(layout, "usp", lambda ids: None)
    np.testing.assert_array_equal(checked, unchecked)


def test_local_positions_are_refused_on_every_rank():
    """RoPE fed local positions (97% off): the step raises, with the first shard that differs, its expected and
    received positions (rank 0's local positions are its global ones: the error is still raised)."""
    layout = commlib.SequenceLayout(10, ulysses_size=4)
    text = _runtime_error(
        lambda: _attend(layout, "ulysses", lambda ids: jnp.broadcast_to(jnp.arange(layout.max_size), (1, 3)))
    )
    assert "commlib attention: positions must be the global positions of shard 1 of the layout" in text
    assert "from row 0 of batch row 0, expected [3, 4, 5], received [0, 1, 2]" in text


def test_tokens_sharded_outside_the_context_by_another_layout_are_refused():
    """shard_tokens called outside every context with a zigzag layout, its positions used inside a contiguous
    ring context: the positions check sees it."""
    contiguous, zigzag = (
        commlib.SequenceLayout(16, ring_size=4),
        commlib.SequenceLayout(16, ring_size=4, layout="zigzag"),
    )
    mesh, spec = _mesh(zigzag, "ring")
    positions = jax.jit(
        jax.shard_map(lambda ids: sequence.shard_tokens(ids, zigzag, "x")[1], mesh=mesh, in_specs=P(), out_specs=spec)
    )(jnp.arange(16)[None])
    text = _runtime_error(
        lambda: _attend(
            contiguous,
            "ring",
            lambda ids: jax.lax.dynamic_slice_in_dim(jnp.asarray(positions), jax.lax.axis_index("x") * 4, 4, axis=1),
        )
    )
    assert "positions must be the global positions of shard 0 of the layout" in text
    assert "from row 2 of batch row 0, expected [2, 3], received [14, 15]" in text  # zigzag: chunks 0 and 7


def test_positions_of_the_wrong_length_are_refused_when_traced():
    layout = commlib.SequenceLayout(10, ulysses_size=4)
    text = _error(lambda: _attend(layout, "ulysses", lambda ids: jnp.zeros((1, 10), jnp.int32)))
    assert text.startswith("commlib attention: positions.shape[-1] (10) must be layout.max_size (3)"), text


def test_a_function_jitted_in_one_context_is_traced_again_in_another():
    """The context is part of jit's cache key: the same jitted function called in a zigzag context after a
    contiguous one gives the zigzag shards (it kept the contiguous trace before), and fails in neither."""
    contiguous, zigzag = (
        commlib.SequenceLayout(16, ring_size=4),
        commlib.SequenceLayout(16, ring_size=4, layout="zigzag"),
    )
    mesh, spec = _mesh(zigzag, "ring")
    step = jax.jit(jax.shard_map(lambda ids: sequence.shard_tokens(ids)[1], mesh=mesh, in_specs=P(), out_specs=spec))
    ids = jnp.arange(16)[None]
    for layout in (contiguous, zigzag, contiguous):
        with _context(layout, "ring"):
            np.testing.assert_array_equal(np.asarray(step(ids))[0], spec_positions(layout))


def _rope(x, positions, xp):
    """Llama's rotary embedding (the two halves of the head dim) of ``[B, S, H, D]`` at ``[B, S]`` positions."""
    half = x.shape[-1] // 2
    angle = positions[..., None, None] * (1.0 / 10000.0 ** (xp.arange(half) / half))
    cos, sin = xp.cos(angle), xp.sin(angle)
    first, second = x[..., :half], x[..., half:]
    return xp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


HOLED = [
    (commlib.SequenceLayout(11, ulysses_size=4), "ulysses"),
    (commlib.SequenceLayout(16, ring_size=4, layout="zigzag"), "ring"),
]


@pytest.mark.parametrize(("layout", "attention"), HOLED, ids=[f"{kind}-{case!r}" for case, kind in HOLED])
def test_a_padding_mask_with_holes_is_one_document(layout, attention):
    """A tokenizer's mask with zeros between ones, made segment ids as docs/integrations.md says: shard_tokens'
    positions (RoPE), dot_product_attention with its segment ids and its labels are transformers' with that mask
    -- the float64 reference here: RoPE at arange positions, one document across each hole, the hole's tokens
    padding, the label the next token where both are kept -- output and (dq, dk, dv) through RoPE within 1e-10
    (issue 34 item 8: the positions restarted after a hole, so RoPE rotated the tokens after it as a new document)."""
    S = layout.seq_len
    mask = np.ones((2, S), dtype=np.int32)
    mask[0, [3, 4, S - 4]] = 0
    mask[1, [2, S - 5, S - 1]] = 0
    segments = np.where(mask.astype(bool), 0, -1).astype(np.int32)
    ids = np.random.default_rng(5).integers(0, 64, (2, S)).astype(np.int32)
    whole = _whole(S, seed=4)
    cut = [jnp.asarray(np.concatenate(layout.shard(x, padded=True), axis=1)) for x in whole]
    mesh, spec = _mesh(layout, attention)

    def body(ids, segments, cotangent, q, k, v):
        _, positions, labels, mine = sequence.shard_tokens(ids, layout, "x", segment_ids=segments)
        q, k = (_rope(x, positions.astype(x.dtype), jnp) for x in (q, k))
        out = dot_product_attention(q, k, v, scale=SCALE, is_causal=True, segment_ids=mine)
        return out, labels, (out * cotangent).sum()[None]

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), *(spec,) * 4), out_specs=(spec, spec, P(spec[1])), check_vma=True
    )

    def total(q, k, v):
        out, labels, losses = mapped(ids, segments, cut[3], q, k, v)
        return losses.sum(), (out, labels)

    with _context(layout, attention):
        grads, (out, labels) = jax.jit(jax.grad(total, argnums=(0, 1, 2), has_aux=True))(*cut[:3])
    split = lambda x: np.split(np.asarray(x), layout.world_size, axis=1)  # noqa: E731
    got = [layout.unshard(split(x), padded=True) for x in (out, *grads)]

    arange = np.broadcast_to(np.arange(S, dtype=np.float64), (2, S))
    q, k, v, cotangent = whole
    rotated = [_rope(x, arange, np) for x in (q, k)]
    out_want = A.attention(*rotated, v, causal=True, scale=SCALE, q_segments=segments)
    dq, dk, dv = A.attention_vjp(*rotated, v, cotangent, causal=True, scale=SCALE, q_segments=segments)
    want = [out_want, _rope(dq, -arange, np), _rope(dk, -arange, np), dv]  # RoPE's VJP: the inverse rotation
    for name, value, wanted in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(value, wanted, rtol=0, atol=TOLERANCE, err_msg=name)
    kept = mask.astype(bool)
    next_kept = np.concatenate([kept[:, 1:], np.zeros((2, 1), bool)], axis=1)
    labels_want = np.where(kept & next_kept, np.roll(ids, -1, axis=1), -100)
    assert layout.unshard(split(labels), padded=True).tolist() == labels_want.tolist()
