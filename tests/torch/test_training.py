"""docs/training.md, torch side: the block of `commlib.tools.train_block` trained with the torch recipe (f = sum_grad,
g = all_reduce(replicated), every gradient all_reduced over the SP group) on 4 real gloo ranks, groups from
``init_device_mesh``, on every SP x TP mesh: each rank's loss and gradient blocks over 2 SGD steps equal the
numpy reference (the job is the one `commlib parity --workload train` runs)."""

import pytest

from commlib.tools import train_block, train_parity
from commlib_torch.tools import train_parity as torch_train

CONFIG = train_block.BlockConfig.for_world_size(4, steps=2)
PARAMS, X, TARGET = train_block.init(CONFIG, seed=0)
TRAJECTORY = train_parity.reference(CONFIG, PARAMS, X, TARGET, CONFIG.steps)


@pytest.mark.parametrize("mesh", train_block.meshes(4), ids=lambda mesh: f"sp={mesh[0]},tp={mesh[1]}")
def test_every_mesh_trains_as_the_unsharded_block(pool, mesh):
    replies = pool(4).run(torch_train.run_mesh, CONFIG, PARAMS, X, TARGET, *mesh)
    assert sorted(coordinate for coordinate, _ in replies) == [(s, t) for s in range(mesh[0]) for t in range(mesh[1])]
    history = torch_train._stacked(replies, *mesh)
    row = train_parity.check("train", "torch", "gloo", history, train_parity.expected(TRAJECTORY, mesh))
    assert row.passed, row


def test_the_unsharded_block_is_the_reference():
    history = torch_train._unsharded(CONFIG, PARAMS, X, TARGET)
    row = train_parity.check("train", "torch", "unsharded", history, train_parity.expected(TRAJECTORY, None))
    assert row.passed, row
