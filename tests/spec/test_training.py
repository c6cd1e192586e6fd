"""commlib.training and the train workload's comparison (commlib.tools.train_parity), without a framework:
the numpy block's hand-written gradients against finite differences, the mesh and shard bookkeeping, the JAX
helper's reduction rule, and a comparison that fails on a wrong gradient, a wrong loss or a failed run."""

import itertools

import numpy as np
import pytest

from commlib import CommError, training
from commlib.tools import train_block, train_parity

CONFIG = train_block.BlockConfig.for_world_size(4)
PARAMS, X, TARGET = train_block.init(CONFIG, seed=0)


@pytest.mark.parametrize("name", list(train_block.TP_DIM))
def test_reference_gradient_matches_finite_differences(name):
    """The directional derivative along a random direction, central differences, float64."""
    _, grads = train_block.loss_and_grads(CONFIG, PARAMS, X, TARGET)
    direction = np.random.default_rng(1).standard_normal(PARAMS[name].shape)
    step = 1e-6

    def loss(scale):
        return train_block.loss_and_grads(CONFIG, {**PARAMS, name: PARAMS[name] + scale * direction}, X, TARGET)[0]

    numeric = (loss(step) - loss(-step)) / (2 * step)
    np.testing.assert_allclose(np.sum(grads[name] * direction), numeric, rtol=1e-7)


def test_reference_loss_is_a_mean_over_tokens_and_training_lowers_it():
    trajectory = train_parity.reference(CONFIG, PARAMS, X, TARGET, steps=CONFIG.steps)
    losses = [loss for loss, _ in trajectory]
    assert all(later < earlier for earlier, later in itertools.pairwise(losses))
    zero_output = {**PARAMS, "wo": np.zeros_like(PARAMS["wo"]), "w_out": np.zeros_like(PARAMS["w_out"])}
    loss, _ = train_block.loss_and_grads(CONFIG, zero_output, X, TARGET)  # the block is the identity: z = x
    np.testing.assert_allclose(loss, 0.5 * np.sum((X - TARGET) ** 2) / CONFIG.tokens, rtol=1e-14)


def test_meshes_and_shards():
    assert train_block.meshes(4) == [(4, 1), (2, 2), (1, 4)]
    assert train_block.meshes(1) == [(1, 1)]
    assert train_block.meshes(6) == [(6, 1), (3, 2), (2, 3), (1, 6)]
    for name, value in PARAMS.items():
        blocks = [train_block.shard_parameter(name, value, 4, t) for t in range(4)]
        dim = train_block.TP_DIM[name]
        whole = blocks[0] if dim is None else np.concatenate(blocks, axis=dim)
        np.testing.assert_array_equal(whole, value)
    np.testing.assert_array_equal(np.concatenate([train_block.sequence_block(X, 4, s) for s in range(4)], axis=1), X)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((4, 3, None), "training: sp (3) must divide the world size (4). Received: sp=3, tp=None"),
        ((4, 2, 1), "training: sp * tp (2) must equal the world size (4). Received: sp=2, tp=1"),
        ((4, None, 0), "training: tp (0) must divide the world size (4). Received: sp=None, tp=0"),
    ],
)
def test_mesh_shape_errors(arguments, message):
    with pytest.raises(CommError) as raised:
        train_block.mesh_shape(*arguments)
    assert str(raised.value) == message


def test_shard_errors():
    with pytest.raises(CommError, match=r"training: seq \(8\) must be divisible by the mesh size \(3\)"):
        train_block.sequence_block(X, 3, 0)
    with pytest.raises(CommError, match=r"training: rank \(4\) must be in \[0, 4\)"):
        train_block.shard_parameter("w_in", PARAMS["w_in"], 4, 4)


def test_reduction_axes():
    assert training.reduction_axes("wq", ("sp",), (), ("sp", "tp")) == (("sp",), ("tp",))
    assert training.reduction_axes("w_in", ("sp",), ("tp",), ("sp", "tp")) == (("sp",), ())
    assert training.reduction_axes("wq", ("sp",), (), ()) == (("sp",), ())  # unchecked: no copies to average
    with pytest.raises(CommError, match=r"value_and_grad: parameter w is split over the data axes \('sp',\)"):
        training.reduction_axes("w", ("sp",), ("sp",), ("sp", "tp"))


# --- the comparison -------------------------------------------------------------------------------------------


def _results(tmp_path, framework, runs):
    """Save `runs` ({(mode, mesh): history or error text}) as a runner would; return its folder."""
    results = train_parity.TrainResults(framework)
    for (mode, mesh), history in runs.items():
        if isinstance(history, str):
            results.fail(mode, mesh, history)
        else:
            results.add(mode, mesh, history)
    results.save(tmp_path / framework, {})
    return tmp_path / framework


TRAJECTORY = train_parity.reference(CONFIG, PARAMS, X, TARGET, steps=2)


def _history(mesh, scale_grad=None, scale_loss=1.0):
    """The reference as the ranks of `mesh` hold it; `scale_grad` = (name, sp, tp, factor) spoils one rank."""
    history = train_parity.expected(TRAJECTORY, mesh)
    losses, grads = history[-1]
    history[-1] = (losses * scale_loss, {name: value.copy() for name, value in grads.items()})
    if scale_grad:
        name, s, t, factor = scale_grad
        history[-1][1][name][s, t] *= factor
    return history


def test_compare_passes_the_reference_and_fails_a_wrong_rank(tmp_path):
    runs = {
        ("gloo", (2, 2)): _history((2, 2)),
        ("gloo", (4, 1)): _history((4, 1), ("wq", 3, 0, 2.0)),
        ("gloo", (1, 4)): _history((1, 4), scale_loss=1 + 1e-9),
        ("gloo", None): "WorkerError: rank 1 died",
    }
    rows = train_parity.compare("torch", _results(tmp_path, "torch", runs), TRAJECTORY)
    by_case = {row.case: row for row in rows}
    assert by_case["train[sp=2,tp=2]"].passed and by_case["train[sp=2,tp=2]"].grad_error < 1e-15
    assert not by_case["train[sp=4,tp=1]"].passed
    assert by_case["train[sp=4,tp=1]"].detail == "worst: wq at step 2"
    assert by_case["train[sp=4,tp=1]"].out_error == 0 and by_case["train[sp=4,tp=1]"].grad_error == pytest.approx(1)
    assert not by_case["train[sp=1,tp=4]"].passed and by_case["train[sp=1,tp=4]"].out_error == pytest.approx(1e-9)
    assert not by_case["train[unsharded]"].passed and by_case["train[unsharded]"].detail == "WorkerError: rank 1 died"


def test_cross_compares_torch_with_every_jax_mode(tmp_path):
    torch_dir = _results(tmp_path, "torch", {("gloo", (2, 2)): _history((2, 2)), ("unsharded", None): _history(None)})
    jax_dir = _results(
        tmp_path,
        "jax",
        {
            ("pmap", (2, 2)): _history((2, 2), ("w_out", 1, 1, 1 + 1e-6)),
            ("shard_map[check_vma=True]", (2, 2)): _history((2, 2)),
            ("unsharded", None): _history(None),
        },
    )
    rows = {(row.case, row.mode): row for row in train_parity.cross(torch_dir, jax_dir)}
    assert set(rows) == {
        ("train[sp=2,tp=2]", "pmap"),
        ("train[sp=2,tp=2]", "shard_map[check_vma=True]"),
        ("train[unsharded]", "unsharded"),
    }
    assert rows["train[sp=2,tp=2]", "shard_map[check_vma=True]"].passed
    assert rows["train[unsharded]", "unsharded"].passed
    assert not rows["train[sp=2,tp=2]", "pmap"].passed


def test_unshard_gradients_takes_the_tp_blocks_of_sp_rank_0():
    _, grads = train_parity.expected(TRAJECTORY, (2, 2))[0]
    full = train_parity.unshard_gradients(grads, 2)
    for name, value in TRAJECTORY[0][1].items():
        np.testing.assert_array_equal(full[name], value)
