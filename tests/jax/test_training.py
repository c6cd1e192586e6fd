"""docs/training.md, JAX side: the block of `commlib.tools.train_block` with the torch recipe (f = sum_grad, g =
all_reduce(replicated), gradients summed over "sp"), on the 4 CPU devices of tests/jax/conftest.py.

`commlib_jax.training.value_and_grad` gives the unsharded gradients in every mode and mesh; every row of the
factor table either gives factor 1, is refused with a CommError, or -- where nothing can see it (no varying
types) -- has exactly the factor the doc lists. A factor is (gradient returned) / (unsharded gradient), for
the replicated parameters and the TP-sharded ones (w_in, w_out) separately.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib_jax as cj
from commlib import CommError
from commlib.tools import train_block
from commlib.tools import train_parity as spec_parity
from commlib_jax.tools import train_parity
from commlib_jax.tools.train_block import block_loss, parameter_specs
from commlib_jax.training import value_and_grad

CONFIG = train_block.BlockConfig.for_world_size(4)
PARAMS, X, TARGET = train_block.init(CONFIG, seed=0)
LOSS, GRADS = train_block.loss_and_grads(CONFIG, PARAMS, X, TARGET)
MODES = train_parity.MODES
AXES = ("sp", "tp")
#: The mesh of each mode's factor rows: pmap maps one axis, so its rows use SP 1 x TP 4 (pmap over TP).
FACTOR_MESH = {"shard_map[check_vma=True]": (2, 2), "shard_map[check_vma=False]": (2, 2), "pmap": (1, 4)}
REFUSED = r"sum_grad: x is one value shared by the 2 ranks of \('tp',\).*commlib_jax\.training\.value_and_grad"


def _loss(params, x, target):
    return block_loss(params, x, target, CONFIG, AXES)


@pytest.fixture
def no_f_and_g_sum(monkeypatch):
    """The rank's loss with table row 6's MLP: no f, g = all_reduce(convention="sum"). A new function object,
    so pmap's trace cache (keyed by the function) cannot hand back the block with f and g."""
    from commlib_jax.tools import train_block

    ops = types.SimpleNamespace(
        sum_grad=lambda x, axis_name: x, all_reduce=lambda x, axis_name, convention: cj.all_reduce(x, axis_name)
    )
    monkeypatch.setattr(train_block, "cj", ops)
    return lambda params, x, target: block_loss(params, x, target, CONFIG, AXES)


def _assert_factors(grads, replicated: float, sharded: float):
    """Every parameter's gradient is exactly `replicated` (or, for w_in / w_out, `sharded`) times the unsharded one."""
    for name, value in grads.items():
        factor = replicated if train_block.TP_DIM[name] is None else sharded
        np.testing.assert_allclose(np.asarray(value), factor * GRADS[name], rtol=1e-10, atol=1e-13, err_msg=name)


def _gathered(grads, tp):
    """Every rank's [sp, tp, ...] gradient -> the unsharded one, after checking that all SP ranks agree."""
    for name, value in grads.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(value)[:1].repeat(value.shape[0], 0), err_msg=name)
    return spec_parity.unshard_gradients({name: np.asarray(value) for name, value in grads.items()}, tp)


# --- the helper: the unsharded gradients in every mode and mesh ------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_value_and_grad_gives_the_unsharded_gradients(mode):
    """SP 2 x TP 2 (`commlib parity --workload train` runs every mesh): every rank's loss is the unsharded loss
    and its gradient block the unsharded gradient's, over 2 SGD steps against the numpy reference (float64)."""
    mesh = sp, tp = (2, 2)
    history = train_parity.run(CONFIG, PARAMS, X, TARGET, mode, sp, tp, steps=2)
    expected = spec_parity.expected(spec_parity.reference(CONFIG, PARAMS, X, TARGET, 2), mesh)
    row = spec_parity.check("train", "jax", mode, history, expected)
    assert row.passed, row
    np.testing.assert_allclose(history[0][0], LOSS, rtol=1e-12)
    _assert_factors(_gathered(history[0][1], tp), 1, 1)


def test_value_and_grad_outputs_leave_shard_map_as_the_parameters():
    """check_vma=True: the loss is invariant (out_specs=P()) and each gradient typed like its parameter."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), AXES)
    step = train_parity.train_step(CONFIG)
    specs, sequence = parameter_specs("tp"), P(None, "sp")
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(specs, sequence, sequence), out_specs=(P(), specs))
    loss, grads = jax.jit(mapped)(PARAMS, X, TARGET)
    np.testing.assert_allclose(float(loss), LOSS, rtol=1e-12)
    _assert_factors(grads, 1, 1)


def test_value_and_grad_refuses_a_parameter_split_over_the_data_axis():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), AXES)
    step = value_and_grad(lambda w, x: jnp.sum(w * x), "sp")
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P("sp"), P("sp")), out_specs=(P(), P("sp")))
    with pytest.raises(CommError, match=r"value_and_grad: parameter params is split over the data axes \('sp',\)"):
        jax.jit(mapped)(jnp.ones(4), jnp.ones(4))


# --- the factor table ------------------------------------------------------------------------------------------


def _inside(mode, psum: bool):
    """jax.grad of the rank's loss inside the map, the gradients psummed over "sp" or not."""

    def body(params, x, target):
        grads = jax.grad(_loss)(params, x, target)
        return jax.tree.map(lambda g: lax.psum(g, "sp"), grads) if psum else grads

    return jax.jit(train_parity.per_rank(body, mode, *FACTOR_MESH[mode]))


def _outside(mode, loss=_loss):
    """The per-rank losses out of the map, grad outside of (their sum, their sum over sp averaged over tp)."""
    sp, tp = FACTOR_MESH[mode]
    losses = train_parity.per_rank(loss, mode, sp, tp)

    def both(params, x, target):
        _, pullback = jax.vjp(lambda p: losses(p, x, target), params)
        return pullback(jnp.ones((sp, tp)))[0], pullback(jnp.full((sp, tp), 1 / tp))[0]

    return jax.jit(both)


@pytest.mark.parametrize("mode", MODES)
def test_grad_inside_with_psum_over_sp(mode):
    """Table row 2: check_vma=True refuses f on the TP-shared activations (4 / 2 before); check_vma=False and
    pmap: factor 1 / 1 (each rank's gradient is torch's)."""
    if mode == "shard_map[check_vma=True]":
        with pytest.raises(CommError, match=REFUSED):
            _inside(mode, psum=True)(PARAMS, X, TARGET)
        return
    _assert_factors(_gathered(_inside(mode, psum=True)(PARAMS, X, TARGET), FACTOR_MESH[mode][1]), 1, 1)


def test_grad_inside_without_psum_is_refused_under_check_vma():
    """Table row 3 (2 / 1 before); unchecked it is each rank's p.grad before the all_reduce of row 2."""
    with pytest.raises(CommError, match=REFUSED):
        _inside("shard_map[check_vma=True]", psum=False)(PARAMS, X, TARGET)


@pytest.mark.parametrize("mode", MODES)
def test_grad_outside_of_the_per_rank_losses(mode):
    """Table rows 4 and 5: the per-rank losses out (out_specs=P("sp", "tp") / out_axes 0), grad outside.
    check_vma=True refuses f; unchecked nothing can see the TP copies: the sum counts each replicated
    parameter's gradient once per TP rank (TP / 1: 2 / 1 at SP 2 x TP 2, 4 / 1 under pmap at 1 x 4), and
    averaging over TP divides the sharded ones by TP (1 / (1 / TP))."""
    if mode == "shard_map[check_vma=True]":
        with pytest.raises(CommError, match=REFUSED):
            _outside(mode)(PARAMS, X, TARGET)
        return
    tp = FACTOR_MESH[mode][1]
    summed, averaged = _outside(mode)(PARAMS, X, TARGET)
    _assert_factors(summed, tp, 1)
    _assert_factors(averaged, 1, 1 / tp)


@pytest.mark.parametrize("mode", MODES)
def test_no_f_and_g_sum_averaged_over_tp(mode, no_f_and_g_sum):
    """Table row 6: no f, g = all_reduce(convention="sum"), the losses summed over sp and averaged over tp
    outside: that objective is the unsharded loss and every rule is a true VJP: factor 1 / 1 in every mode."""
    _, averaged = _outside(mode, no_f_and_g_sum)(PARAMS, X, TARGET)
    _assert_factors(averaged, 1, 1)


@pytest.fixture
def without_the_check(monkeypatch):
    """sum_grad without its shared-input check, to show what the refused settings would give."""
    from commlib_jax import functional

    monkeypatch.setattr(functional, "shared_axes", lambda x, axes: ())


@pytest.mark.usefixtures("without_the_check")
def test_what_the_refused_settings_would_give():
    """check_vma=True, SP 2 x TP 2, without the refusal: f sums a gradient JAX already summed over TP, so the
    replicated parameters get TP times theirs, and the psum over SP doubles what JAX summed over SP already."""
    mode = "shard_map[check_vma=True]"
    _assert_factors(_gathered(_inside(mode, psum=True)(PARAMS, X, TARGET), 2), 4, 2)  # row 2
    _assert_factors(_gathered(_inside(mode, psum=False)(PARAMS, X, TARGET), 2), 2, 1)  # row 3
    summed, averaged = _outside(mode)(PARAMS, X, TARGET)
    _assert_factors(summed, 2, 1)  # row 4
    _assert_factors(averaged, 1, 0.5)  # row 5


# --- the refusal itself --------------------------------------------------------------------------------------------


def test_sum_grad_of_a_shared_value_is_refused_with_what_to_do():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), AXES)
    body = lambda x: cj.sum_grad(x, "tp")  # noqa: E731
    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("sp"), out_specs=P("sp"))
    with pytest.raises(CommError) as raised:
        jax.jit(mapped)(jnp.ones((4, 3)))
    assert str(raised.value) == (
        "sum_grad: x is one value shared by the 2 ranks of ('tp',) (typed invariant under check_vma=True), and JAX "
        "already sums a shared value's gradient over them, so sum_grad would sum it again (2 times the gradient). "
        "Take the gradient with commlib_jax.training.value_and_grad, which gives every rank its own copy of the "
        "parameters as torch does, or use lax.pcast(x, ('tp',), to='varying') as f. Received: shape=(2, 3), "
        "axis_name='tp'"
    )


SETTINGS = {  # name -> (mesh shape, in_specs = out_specs, check_vma, gradient on every rank)
    "x varying over tp": ((1, 4), P("tp"), True, 10.0),
    "x in_specs=P(), check_vma=False": ((1, 4), P(), False, 10.0),
    "x invariant over a tp of one rank": ((4, 1), P("sp"), True, 1.0),
}


@pytest.mark.parametrize("setting", [*SETTINGS, "pmap"])
def test_sum_grad_of_a_per_rank_value_is_accepted(setting):
    """f on each rank's own copy (typed varying, or untyped) keeps Megatron's rule: the TP ranks' cotangents,
    here t + 1 on rank t, summed: 1 + 2 + 3 + 4 = 10 (1 where tp has one rank)."""
    x = jnp.arange(12.0).reshape(4, 3)
    loss = lambda x: jnp.sum(cj.sum_grad(x, "tp") * (lax.axis_index("tp") + 1.0))  # noqa: E731
    if setting == "pmap":
        got, want = jax.pmap(jax.grad(loss), axis_name="tp")(x.reshape(4, 1, 3)), 10.0
    else:
        shape, spec, check_vma, want = SETTINGS[setting]
        mesh = Mesh(np.array(jax.devices()).reshape(shape), AXES)
        got = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma))(x)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1, 3), np.full((np.size(got) // 3, 3), want))
