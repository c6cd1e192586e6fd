"""The sequence helpers on simulated CPU devices (W = 1-4, every layout of `tests.sequence_cases`), in every mode
(shard_map with check_vma True and False, pmap): every rank's outputs and input gradients against the spec's
float64 references in the padded layout (padding rows of the inputs hold random values: ignored, gradient
exactly 0), and `training.value_and_grad` with `cross_entropy`: the unsharded loss and gradients of a tiny model,
with argnums and has_aux."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError, SequenceLayout
from commlib import sequence_helpers as spec
from commlib.reference import sequence as reference
from commlib_jax import sequence
from commlib_jax.training import value_and_grad
from tests.sequence_cases import IGNORE, B, D, V, data, documents, layouts, model_parameters

MODES = ("shard_map[check_vma=True]", "shard_map[check_vma=False]", "pmap")
CASES = [
    (layout, mode)
    for world_size in (1, 2, 3, 4)
    for layout in layouts(world_size)
    for mode in MODES
    if world_size > 2 or mode == MODES[0]
]


def _per_rank(body, mode: str, world_size: int):
    """`body` on each of `world_size` ranks over arrays stacked [W, ...]; its outputs come back stacked."""
    if mode == "pmap":
        return jax.pmap(body, axis_name="i", devices=jax.devices()[:world_size])
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("i",))

    def stacked(*args):
        return jax.tree.map(lambda t: t[None], body(*(arg[0] for arg in args)))

    return jax.shard_map(stacked, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=mode == MODES[0])


def _padded(shards, layout: SequenceLayout, rng) -> np.ndarray:
    """Every rank's shard padded to max_size rows with random values (which the helpers must ignore)."""
    return np.stack(
        [
            np.concatenate(
                [shard, rng.standard_normal((B, layout.max_size - shard.shape[1], *shard.shape[2:]))], axis=1
            )
            for shard in shards
        ]
    )


def _body(layout: SequenceLayout):
    def body(ids, x, shards_sum, shards_replicated, logits, labels, *cotangents):
        tokens = sequence.shard_tokens(ids, layout, "i", ignore_index=IGNORE)
        outputs = (
            sequence.shard_sequence(x, layout, "i"),
            sequence.gather_sequence(shards_sum, layout, "i"),
            sequence.gather_sequence(shards_replicated, layout, "i", convention="replicated"),
            sequence.cross_entropy(logits, labels, "i", ignore_index=IGNORE),
        )
        loss = sum(jnp.sum(out * cotangent) for out, cotangent in zip(outputs[:3], cotangents, strict=True))
        return (*tokens, sequence.position_ids(layout, "i"), *outputs), loss + outputs[3]

    return body


@functools.cache
def _program(layout: SequenceLayout, mode: str):
    mapped = _per_rank(_body(layout), mode, layout.world_size)

    def run(ids, x, shards_sum, shards_replicated, logits, labels, cotangents):
        def total(x, shards_sum, shards_replicated, logits):
            outputs, losses = mapped(ids, x, shards_sum, shards_replicated, logits, labels, *cotangents)
            return losses.sum(), outputs

        return jax.grad(total, argnums=(0, 1, 2, 3), has_aux=True)(x, shards_sum, shards_replicated, logits)

    return jax.jit(run)


def _inputs(layout: SequenceLayout, case: dict, rng):
    W, S = layout.world_size, layout.seq_len
    shards = _padded(layout.shard(case["x"], 1), layout, rng)
    labels = np.stack(
        [
            np.pad(shard, ((0, 0), (0, layout.max_size - shard.shape[1])), constant_values=IGNORE)
            for shard in layout.shard(case["labels"], 1)
        ]
    )
    cotangents = (
        _padded(case["shard_cotangents"], layout, rng),
        np.stack(case["gather_cotangents"]),
        np.stack(case["gather_cotangents"][::-1]),
    )
    return (
        np.broadcast_to(case["ids"], (W, B, S)),
        np.broadcast_to(case["x"], (W, B, S, D)),
        shards,
        shards,
        _padded(layout.shard(case["logits"], 1), layout, rng),
        labels,
        cotangents,
    )


@pytest.mark.parametrize(("layout", "mode"), CASES, ids=[f"{layout!r}-{mode}" for layout, mode in CASES])
def test_every_helper_against_the_reference(layout, mode):
    case, rng = data(layout), np.random.default_rng(1)
    inputs = _inputs(layout, case, rng)
    grads, outputs = _program(layout, mode)(*inputs[:6], tuple(inputs[6]))
    outputs, grads = [np.asarray(out) for out in outputs], [np.asarray(grad) for grad in grads]
    tokens = reference.shard_tokens_reference(case["ids"], layout, IGNORE, padded=True)
    shard_out, shard_grad = reference.shard_sequence_reference(case["x"], list(inputs[6][0]), layout, padded=True)
    own = layout.shard(case["x"], 1, padded=True)
    gather_sum = reference.gather_sequence_reference(own, list(inputs[6][1]), layout, padded=True)
    gather_replicated = reference.gather_sequence_reference(
        own, list(inputs[6][2]), layout, convention="replicated", padded=True
    )
    loss, logits_grad = reference.cross_entropy_reference(case["logits"], case["labels"], IGNORE)
    for rank in range(layout.world_size):
        for got, expected in zip(outputs[:3], tokens[rank], strict=True):
            np.testing.assert_array_equal(got[rank], expected)
        np.testing.assert_array_equal(outputs[3][rank], np.maximum(spec.position_table(layout)[rank], 0))
        np.testing.assert_array_equal(outputs[4][rank], shard_out[rank])
        np.testing.assert_array_equal(grads[0][rank], shard_grad[rank])
        np.testing.assert_array_equal(outputs[5][rank], gather_sum[0][rank])
        np.testing.assert_allclose(grads[1][rank], gather_sum[1][rank], rtol=0, atol=1e-14)
        np.testing.assert_array_equal(outputs[6][rank], gather_replicated[0][rank])
        np.testing.assert_array_equal(grads[2][rank], gather_replicated[1][rank])
        np.testing.assert_allclose(outputs[7][rank], loss, rtol=1e-13)
        np.testing.assert_allclose(grads[3][rank], layout.shard(logits_grad, 1, padded=True)[rank], rtol=0, atol=1e-15)


PACKED = [
    (layout, mode)
    for world_size in (1, 2, 3, 4)
    for layout in layouts(world_size)
    for mode in (MODES[0], MODES[2])
    if world_size == 4 or mode == MODES[0]
]


@pytest.mark.parametrize(("layout", "mode"), PACKED, ids=[f"{layout!r}-{mode}" for layout, mode in PACKED])
def test_shard_tokens_of_packed_documents_is_the_reference(layout, mode):
    _packed_documents(layout, mode, holes=False)


@pytest.mark.parametrize("layout", [layout for world_size in (1, 2, 3, 4) for layout in layouts(world_size)], ids=repr)
def test_shard_tokens_of_documents_with_holes_is_the_reference(layout):
    """Padding inside a document (a padding mask's zero between ones) is a hole: the positions after it go on
    counting, the labels stop before it (issue 34 item 8: they restarted after it, splitting the document)."""
    _packed_documents(layout, MODES[0], holes=True)


def _packed_documents(layout, mode, *, holes: bool) -> None:
    ids, segments = data(layout)["ids"].astype(np.int32), documents(layout, holes=holes).astype(np.int16)
    W = layout.world_size
    body = _per_rank(lambda i, s: sequence.shard_tokens(i, layout, "i", ignore_index=IGNORE, segment_ids=s), mode, W)
    got = jax.jit(body)(np.broadcast_to(ids, (W, *ids.shape)), np.broadcast_to(segments, (W, *segments.shape)))
    expected = reference.shard_tokens_reference(ids, layout, IGNORE, padded=True, segment_ids=segments)
    assert [part.dtype for part in got] == [jnp.int32, jnp.int32, jnp.int32, jnp.int16]
    for rank in range(W):
        for part, want in zip(got, expected[rank], strict=True):
            np.testing.assert_array_equal(np.asarray(part[rank]), want)


@pytest.mark.parametrize(
    ("segments", "kind", "message"),
    [
        (np.zeros((B, 7), np.int32), CommError, "shard_tokens: segment_ids.shape ((2, 7)) must be input_ids.shape"),
        (np.zeros((B, 8), np.float32), TypeError, "shard_tokens: segment_ids must have an integer dtype, not float32"),
        ([[0] * 8] * B, TypeError, "shard_tokens: segment_ids must be a jax.Array or numpy.ndarray"),
    ],
)
def test_bad_segment_ids(segments, kind, message):
    with pytest.raises(kind, match=re.escape(message)):
        _per_rank(lambda ids: sequence.shard_tokens(ids, SequenceLayout(8), "i", segment_ids=segments)[0], MODES[0], 1)(
            np.zeros((1, B, 8), np.int32)
        )


def test_shard_sequence_of_a_shared_value():
    """check_vma=True, x given with in_specs=P() (one value shared by the ranks): the gradient JAX returns for
    it is every rank's cotangent in place, as for each rank's own copy."""
    layout, rng = SequenceLayout(37, 2, 2, layout="zigzag"), np.random.default_rng(2)
    x, cotangents = rng.standard_normal((B, 37, D)), rng.standard_normal((4, B, layout.max_size, D))
    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    mapped = jax.shard_map(
        lambda x, c: jnp.sum(sequence.shard_sequence(x, layout, "i") * c[0])[None],
        mesh=mesh,
        in_specs=(P(), P("i")),
        out_specs=P("i"),
    )
    grad = jax.grad(lambda x: mapped(x, cotangents).sum())(x)
    expected = reference.shard_sequence_reference(x, list(cotangents), layout, padded=True)[1][0]
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=0, atol=1e-14)


# --- value_and_grad with cross_entropy: a tiny model -------------------------------------------------------------


def _model_loss(params, ids, layout: SequenceLayout | None):
    """Embeddings, a prefix sum over the whole sequence, a head, the mean next-token cross entropy: sharded by
    `layout` (the commlib way), or unsharded (None)."""
    if layout is None:
        positions, labels = jnp.arange(ids.shape[1]), jnp.asarray(spec.next_token_labels(np.asarray(ids), IGNORE))
        logits = jnp.cumsum(params["embed"][ids] + params["position"][positions], 1) @ params["head"]
        log_probs = jax.nn.log_softmax(logits, -1)
        valid = labels != IGNORE
        picked = jnp.take_along_axis(log_probs, jnp.where(valid, labels, 0)[..., None], -1)[..., 0]
        return -jnp.sum(jnp.where(valid, picked, 0)) / valid.sum()
    tokens, positions, labels = sequence.shard_tokens(ids, layout, "i")
    hidden = params["embed"][tokens] + params["position"][positions]
    whole = sequence.gather_sequence(hidden, layout, "i", convention="replicated")
    logits = sequence.shard_sequence(jnp.cumsum(whole, 1), layout, "i") @ params["head"]
    return sequence.cross_entropy(logits, labels, "i")


def _mapped_step(step, mode: str, world_size: int):
    """`step(params, ids)` with both replicated: shard_map(P()) / pmap (params in_axes=None, ids copied to every
    rank: pmap maps at least one argument); outputs per rank."""
    if mode == "pmap":
        mapped = jax.pmap(step, axis_name="i", in_axes=(None, 0), devices=jax.devices()[:world_size])
        return lambda params, ids: mapped(params, jnp.broadcast_to(ids, (world_size, *ids.shape)))
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("i",))
    return jax.shard_map(
        lambda *args: jax.tree.map(lambda t: t[None], step(*args)),
        mesh=mesh,
        in_specs=P(),
        out_specs=P("i"),
        check_vma=mode == MODES[0],
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "layout",
    [
        SequenceLayout(37, ulysses_size=4),
        SequenceLayout(5, 4),
        SequenceLayout(64, 2, 2, layout="zigzag"),
        SequenceLayout(3, 4, layout="zigzag"),
    ],
    ids=repr,
)
def test_value_and_grad_of_cross_entropy_is_the_unsharded_mean(layout, mode):
    params = {name: jnp.asarray(value) for name, value in model_parameters(layout.seq_len).items()}
    ids = jnp.asarray(data(layout)["ids"])
    loss, grads = jax.value_and_grad(_model_loss)(params, ids, None)
    step = value_and_grad(functools.partial(_model_loss, layout=layout), "i")
    got_loss, got_grads = jax.jit(_mapped_step(step, mode, 4))(params, ids)
    np.testing.assert_allclose(np.asarray(got_loss), np.full(4, loss), rtol=1e-13)
    for name, grad in grads.items():
        np.testing.assert_allclose(
            np.asarray(got_grads[name]),
            np.broadcast_to(grad, got_grads[name].shape),
            rtol=1e-12,
            atol=1e-14,
            err_msg=name,
        )


@pytest.mark.parametrize("mode", MODES)
def test_value_and_grad_with_argnums_and_has_aux(mode):
    """argnums=(0, 2) gives a tuple of both gradients; has_aux returns fun's aux as this rank's own."""
    layout = SequenceLayout(37, 4, layout="zigzag")
    params = {name: jnp.asarray(value) for name, value in model_parameters(37).items()}
    ids = jnp.asarray(data(layout)["ids"])
    head = params.pop("head")

    def fun(params, ids, head):
        loss = _model_loss({**params, "head": head}, ids, layout)
        return loss, jax.lax.axis_index("i")

    full = lambda params, head: _model_loss({**params, "head": head}, ids, None)  # noqa: E731
    loss, (grads, head_grad) = jax.value_and_grad(full, argnums=(0, 1))(params, head)
    step = value_and_grad(fun, "i", argnums=(0, 2), has_aux=True)
    (got_loss, aux), (got_grads, got_head) = jax.jit(_mapped_step(lambda p, i: step(p, i, head), mode, 4))(params, ids)
    assert np.asarray(aux).tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(np.asarray(got_loss), np.full(4, loss), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(got_head), np.broadcast_to(head_grad, got_head.shape), rtol=1e-12)
    for name, grad in grads.items():
        np.testing.assert_allclose(
            np.asarray(got_grads[name]),
            np.broadcast_to(grad, got_grads[name].shape),
            rtol=1e-12,
            atol=1e-14,
            err_msg=name,
        )


@pytest.mark.parametrize("mode", MODES)
def test_cross_entropy_jitted_outside_value_and_grad_then_called_inside(mode):
    """The loss function jitted and traced OUTSIDE value_and_grad first (where cross_entropy is the global mean on
    every rank), then called inside it (where it must be each rank's share): traced again there, so the loss is
    the unsharded mean, not W times it; and called outside again, the global mean again. With the mode read from
    a contextvar the second call kept its first trace (loss 4x)."""
    layout = SequenceLayout(37, 4, layout="zigzag")
    params = {name: jnp.asarray(value) for name, value in model_parameters(37).items()}
    ids = jnp.asarray(data(layout)["ids"])
    want = float(_model_loss(params, ids, None))
    loss = jax.jit(functools.partial(_model_loss, layout=layout))
    outside = jax.jit(_mapped_step(loss, mode, 4))
    inside = jax.jit(_mapped_step(value_and_grad(loss, "i"), mode, 4))
    np.testing.assert_allclose(np.asarray(outside(params, ids)), np.full(4, want), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(inside(params, ids)[0]), np.full(4, want), rtol=1e-13)
    np.testing.assert_allclose(
        np.asarray(jax.jit(_mapped_step(loss, mode, 4))(params, ids)), np.full(4, want), rtol=1e-13
    )


def test_value_and_grad_of_cross_entropy_over_other_axes_is_refused():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "sp"))
    step = value_and_grad(lambda w, y: sequence.cross_entropy(w[None], y, "sp"), "dp")
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("dp", "sp"))), out_specs=(P(), P()))
    with pytest.raises(
        CommError,
        match=r"cross_entropy: axis_name \(\('sp',\)\) must be among the axes "
        r"value_and_grad sums over \(\('dp',\)\)",
    ):
        jax.jit(mapped)(jnp.zeros(V), jnp.zeros(4, dtype=jnp.int32))


def test_bad_input_raises_the_spec_text():
    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    calls = {
        lambda ids: sequence.shard_tokens(ids, SequenceLayout(8, 2), "i")[0]: lambda: spec.check_layout(
            "shard_tokens", SequenceLayout(8, 2), 4
        ),
        lambda ids: sequence.shard_sequence(ids.astype(jnp.float32)[:, :7], SequenceLayout(8, 4), "i"): lambda: (
            spec.check_sequence("shard_sequence", (2, 7), 1, 8, "layout.seq_len")
        ),
    }
    for call, expected in calls.items():
        with pytest.raises(CommError) as raised:
            jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P(), out_specs=P("i")))(jnp.zeros((2, 8), jnp.int32))
        with pytest.raises(CommError) as spec_raised:
            expected()
        assert str(raised.value) == str(spec_raised.value)


@pytest.mark.parametrize("bad", [5, -5, 9])
@pytest.mark.parametrize("inside", [False, True], ids=["grad", "value_and_grad"])
def test_a_label_outside_the_vocabulary_makes_the_loss_and_every_gradient_nan_on_every_rank(bad, inside):
    """Before: -5 was taken as label 0 silently and 5, 9 gave a NaN loss with finite gradients. The gradient is
    taken of a weight replicated over the axis (the logits are ``w`` on every row)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
    labels = jnp.array([[0, 1, IGNORE, 4], [bad, 2, 3, IGNORE]])  # rank 1 holds the bad label

    def loss(weight, labels):
        return sequence.cross_entropy(jnp.broadcast_to(weight, (4, 5)), labels, "i", ignore_index=IGNORE)

    step = value_and_grad(loss, "i") if inside else jax.value_and_grad(loss)
    mapped = jax.shard_map(
        lambda w, y: jax.tree.map(lambda t: t[None], step(w, y[0])),
        mesh=mesh,
        in_specs=(P(), P("i")),
        out_specs=P("i"),
        check_vma=False,
    )
    for rows, finite in ((labels, False), (labels.at[1, 0].set(1), True)):  # then in range: finite
        values, grads = jax.jit(mapped)(jnp.arange(5.0), rows)
        assert np.isfinite(np.asarray(values)).all() == finite and np.isfinite(np.asarray(grads)).all() == finite
        assert np.isnan(np.asarray(values)).all() != finite and np.isnan(np.asarray(grads)).all() != finite


def _checked_losses(labels, mode: str):
    """cross_entropy of ``[2, 4, 5]`` zero logits over 2 devices in `mode`, jitted and run (traced afresh)."""
    if mode == "pmap":
        step = jax.pmap(lambda y: sequence.cross_entropy(jnp.zeros((4, 5)), y, "i", ignore_index=IGNORE), "i")
        return np.asarray(step(labels))
    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
    body = lambda y: sequence.cross_entropy(jnp.zeros((4, 5)), y[0], "i", ignore_index=IGNORE)[None]  # noqa: E731
    step = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=mode == MODES[0])
    return np.asarray(jax.jit(step)(labels))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("bad", "ranks"), [((-5, None), "rank 0 (label -5)"), ((5, 9), "ranks [0, 1] (labels [5, 9]")])
def test_checked_mode_refuses_a_label_outside_the_vocabulary_on_every_rank(monkeypatch, mode, bad, ranks):
    """Before: checked mode (COMMLIB_CHECK=1) changed nothing in JAX's cross_entropy (a NaN loss, no error)."""
    from tests.jax.test_sequence_parallel import _runtime_error

    monkeypatch.setenv("COMMLIB_CHECK", "1")
    labels = np.array([[0, 1, IGNORE, 4], [1, 2, 3, IGNORE]])
    for rank, value in enumerate(bad):
        if value is not None:
            labels[rank, 1] = value
    text = _runtime_error(lambda: _checked_losses(jnp.asarray(labels), mode))
    count = sum(value is not None for value in bad)
    want = f"CommError: cross_entropy: labels must be in [0, 5) or ignore_index ({IGNORE}); {count} are not, on "
    assert want in text, text
    assert ranks in text, text
    np.testing.assert_allclose(_checked_losses(jnp.asarray(labels.clip(0, 4)), mode), np.log(5.0), rtol=1e-6)


def test_helpers_on_a_dp_by_sp_mesh_reduce_over_the_sequence_axis_only():
    """DP 2 x SP 2 (devices 2 * d + s), inside ``parallel(layout, "sp")`` with layout and axes left to the
    context: each replica's shard_tokens / position_ids / gather_sequence are its own sequence's, and its
    cross_entropy (axis "sp") is its unsharded loss (float64, 1e-12); the torch twin is
    tests/torch/test_sequence.py::test_cross_entropy_and_sync_gradients_take_the_parallel_contexts_group."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "sp"))
    layout = SequenceLayout(7, ulysses_size=2)  # uneven: shards of 4 and 3 rows
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5, size=(2, 7))  # replica d's row d
    weight = rng.standard_normal((5, 5))

    def body(ids, weight):
        tokens, positions, labels = sequence.shard_tokens(ids)
        whole = sequence.gather_sequence(tokens[..., None].astype(jnp.float64))[..., 0]
        loss = sequence.cross_entropy(weight[tokens], labels, "sp", ignore_index=IGNORE)
        return loss[None], whole, jnp.concatenate([positions, sequence.position_ids()[None]])

    with sequence.parallel(layout, "sp"):
        step = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp"), P()),
            out_specs=(P(("dp", "sp")), P("dp"), P("dp", "sp")),
            check_vma=False,
        )
        losses, whole, positions = jax.jit(step)(jnp.asarray(ids), jnp.asarray(weight))
    np.testing.assert_array_equal(np.asarray(whole), ids)
    np.testing.assert_array_equal(np.asarray(positions), [[0, 1, 2, 3, 4, 5, 6, 0]] * 4)  # the padding row 0
    for replica in range(2):
        want, _ = reference.cross_entropy_reference(
            weight[ids[replica]][None], spec.next_token_labels(ids[replica : replica + 1], IGNORE), IGNORE
        )
        np.testing.assert_allclose(np.asarray(losses)[2 * replica : 2 * replica + 2], want, rtol=0, atol=1e-12)
