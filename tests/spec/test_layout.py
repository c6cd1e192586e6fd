"""Layout plans: `Rearrange.is_identity`, `Rearrange.merged` and `Plan.copies`.

Hand-checked examples first (Ulysses pack/unpack at batch 1 and batch > 1, dim-0 gather/scatter), then
properties: executing ``view -> transpose(perm)`` equals executing the merged ``(shape, perm)`` form on
the same contiguous data, and `is_identity` holds exactly when the pass leaves memory order unchanged.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import plans
from commlib.layout import Rearrange


def _execute(step: Rearrange, data: np.ndarray) -> np.ndarray:
    """The pass as the plan states it: view, permute, lay out contiguously (flat, memory order)."""
    return np.ascontiguousarray(data.reshape(step.split_shape).transpose(step.perm)).ravel()


def _execute_merged(step: Rearrange, data: np.ndarray) -> np.ndarray:
    shape, perm = step.merged()
    return np.ascontiguousarray(data.reshape(shape).transpose(perm)).ravel()


# ---------------------------------------------------------------- Rearrange on hand-checked examples


@pytest.mark.parametrize(
    ("view", "perm", "identity", "merged"),
    [
        ((2, 3), (0, 1), True, ((6,), (0,))),
        ((2, 3), (1, 0), False, ((2, 3), (1, 0))),
        ((1, 3), (1, 0), True, ((3,), (0,))),  # a size-1 axis moving is no move
        ((2, 1, 3), (1, 0, 2), True, ((6,), (0,))),
        ((2, 1, 3), (2, 1, 0), False, ((2, 3), (1, 0))),
        ((2, 1, 3), (0, 2, 1), True, ((6,), (0,))),  # size-1 axes do not break adjacency
        ((2, 3, 4), (0, 2, 1), False, ((2, 3, 4), (0, 2, 1))),
        ((2, 3, 4), (2, 0, 1), False, ((6, 4), (1, 0))),  # (0, 1) move together
        ((2, 3, 4), (1, 2, 0), False, ((2, 12), (1, 0))),
        ((2, 3, 1, 4), (3, 0, 1, 2), False, ((6, 4), (1, 0))),
        ((1, 1), (1, 0), True, ((), ())),  # nothing but size-1 axes
        ((5,), (0,), True, ((5,), (0,))),
        ((0, 3), (1, 0), False, ((0, 3), (1, 0))),  # empty, but still a transpose by the rule
    ],
)
def test_rearrange_identity_and_merged(view, perm, identity, merged):
    step = Rearrange(split_shape=view, perm=perm)
    assert step.is_identity is identity
    assert step.merged() == merged


def test_rearrange_out_shape():
    assert Rearrange(split_shape=(2, 3, 4), perm=(2, 0, 1)).out_shape == (4, 2, 3)
    assert Rearrange(split_shape=(2, 1, 3), perm=(1, 2, 0)).out_shape == (1, 3, 2)


def test_always_copy_is_never_identity():
    step = Rearrange(split_shape=(4, 5), perm=(0, 1), always_copy=True)
    assert not step.is_identity
    assert step.merged() == ((20,), (0,))  # merged() describes the permutation only


# ---------------------------------------------------------------- Plans: Ulysses and the dim-0 collectives

W = 4


def test_ulysses_forward_batch_1_is_one_copy():
    plan = plans.all_to_all_4d((1, 8, 12, 16), W, 2, 1)  # [B, S/W, H, D] -> [B, S, H/W, D]
    assert plan.copies == 1
    assert not plan.layout.pack.is_identity
    assert plan.layout.unpack.is_identity  # [W, 1, S/W, H/W, D] -> [1, W, S/W, H/W, D] moves only a size-1 axis
    assert plan.out_shape == (1, 32, 3, 16)


def test_ulysses_forward_batch_2_is_two_copies():
    plan = plans.all_to_all_4d((2, 8, 12, 16), W, 2, 1)
    assert plan.copies == 2
    assert not plan.layout.pack.is_identity and not plan.layout.unpack.is_identity
    assert plan.out_shape == (2, 32, 3, 16)


def test_ulysses_reverse_batch_1_is_one_copy():
    plan = plans.all_to_all_4d((1, 32, 3, 16), W, 1, 2)  # [B, S, H/W, D] -> [B, S/W, H, D]
    assert plan.copies == 1
    assert plan.layout.pack.is_identity  # [1, W, S/W, H/W, D] -> [W, 1, ...]: the W blocks of seq are contiguous
    assert not plan.layout.unpack.is_identity
    assert plan.out_shape == (1, 8, 12, 16)


def test_ulysses_reverse_batch_2_is_two_copies():
    plan = plans.all_to_all_4d((2, 32, 3, 16), W, 1, 2)
    assert plan.copies == 2
    assert plan.out_shape == (2, 8, 12, 16)


@pytest.mark.parametrize("batch", [1, 2])
def test_ulysses_pack_merges_to_a_batched_transpose(batch):
    """[B, S/W, H, D] (2, 1): view [B, S/W, W, H/W, D], send [W, B, S/W, H/W, D] = a (1, 0, 2) transpose."""
    plan = plans.all_to_all_4d((batch, 8, 12, 16), W, 2, 1)
    assert plan.layout.pack.split_shape == (batch, 8, W, 3, 16)
    assert plan.layout.pack.merged() == ((batch * 8, W, 3 * 16), (1, 0, 2))


def test_ulysses_forward_unpack_merges_to_a_transpose_of_batch_and_world():
    plan = plans.all_to_all_4d((2, 8, 12, 16), W, 2, 1)
    assert plan.layout.unpack.merged() == ((W, 2, 8 * 3 * 16), (1, 0, 2))


def test_ulysses_reverse_unpack_merges_to_a_transpose():
    """recv [W, B, S/W, H/W, D] -> [B, S/W, W, H/W, D]: the W axis moves behind (B, S/W)."""
    for batch in (1, 2):
        plan = plans.all_to_all_4d((batch, 32, 3, 16), W, 1, 2)
        assert plan.layout.unpack.merged() == ((W, batch * 8, 3 * 16), (1, 0, 2))


@pytest.mark.parametrize("shape", [(8,), (8, 3), (4, 1, 5)])
def test_all_gather_dim_0_is_zero_copy(shape):
    assert plans.all_gather(shape, W, 0).copies == 0


@pytest.mark.parametrize("shape", [(8,), (8, 3), (4, 1, 5)])
def test_reduce_scatter_dim_0_is_zero_copy(shape):
    assert plans.reduce_scatter(shape, W, 0).copies == 0


def test_last_dim_gather_and_scatter_copy_once():
    assert plans.all_gather((3, 5), W, -1).copies == 1  # unpack moves the rank axis
    assert plans.reduce_scatter((3, 8), W, -1).copies == 1  # pack moves the rank axis
    assert plans.all_gather((1, 5), W, -1).copies == 0  # nothing in front of dim but size 1
    assert plans.reduce_scatter((1, 8), W, -1).copies == 0


@pytest.mark.parametrize("shape", [(8,), (8, 3), (4, 1, 5)])
def test_all_to_all_on_dim_0_alone_is_zero_copy(shape):
    """scatter_dim == gather_dim == 0 (torch's all_to_all_single): the buffer is sent and received as it is."""
    plan = plans.all_to_all(shape, W, 0, 0)
    assert plan.copies == 0 and plan.out_shape == shape


def test_all_to_all_on_another_dim_alone_copies_once_per_side():
    assert plans.all_to_all((3, 8, 2), W, 1, 1).copies == 2  # pack and unpack each move the rank axis
    assert plans.all_to_all((1, 8, 2), W, 1, -2).copies == 0  # nothing in front of the dim but size 1


def test_shard_is_one_local_step_and_reduce_copies_into_a_fresh_buffer():
    """shard moves no data between ranks: no pack or unpack pass, the slice is the step itself; reduce, like
    all_reduce, reduces in place, so its one pass is the copy into a fresh buffer."""
    plan = plans.shard((3, 8), W, -1)
    assert plan.step.is_local and plan.copies == 0 and plan.out_shape == (3, 2)
    plan = plans.reduce((3, 8), W)
    assert plan.layout.pack.always_copy and plan.copies == 1


def test_all_reduce_copies_into_a_fresh_buffer():
    plan = plans.all_reduce((3, 5), W)
    assert plan.layout.pack.always_copy
    assert plan.copies == 1


def test_world_size_1_all_to_all_is_zero_copy():
    assert plans.all_to_all_4d((2, 8, 12, 16), 1, 2, 1).copies == 0
    assert plans.all_to_all((3, 4, 5), 1, 0, 2).copies == 0


# ---------------------------------------------------------------- properties


@st.composite
def rearranges(draw):
    ndim = draw(st.integers(1, 6))
    view = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    perm = tuple(draw(st.permutations(range(ndim))))
    return Rearrange(split_shape=view, perm=perm)


def _check_step(step: Rearrange) -> None:
    data = np.arange(math.prod(step.split_shape))
    expected = _execute(step, data)
    assert np.array_equal(_execute_merged(step, data), expected)
    shape, perm = step.merged()
    assert math.prod(shape) == math.prod(step.split_shape)
    assert all(size > 1 for size in shape)
    # fewest axes: no two neighbours in the destination come from neighbours in the source
    assert all(perm[i + 1] != perm[i] + 1 for i in range(len(perm) - 1))
    assert step.is_identity == (list(perm) == sorted(perm))
    # identity means exactly "the contiguous source already is the result"
    assert step.is_identity == np.array_equal(expected, data)


@given(rearranges())
def test_merged_executes_like_the_rearrange(step):
    _check_step(step)


@st.composite
def all_to_all_plans(draw):
    world_size = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 5))
    shape = list(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    scatter = draw(st.integers(0, ndim - 1))
    shape[scatter] *= world_size
    if ndim == 1:  # all_to_all needs two dims: use all_gather / reduce_scatter plans on the one dim
        kind = draw(st.sampled_from(["all_gather", "reduce_scatter"]))
        return getattr(plans, kind)(tuple(shape), world_size, draw(st.sampled_from([0, -1])))
    gather = draw(st.integers(0, ndim - 1).filter(lambda dim: dim != scatter))
    negate = draw(st.tuples(st.booleans(), st.booleans()))
    return plans.all_to_all(tuple(shape), world_size, scatter - ndim * negate[0], gather - ndim * negate[1])


def _moves_memory(step: Rearrange) -> bool:
    """Executing the pass on contiguous data changes the memory order (a view could not give the result)."""
    data = np.arange(math.prod(step.split_shape))
    return step.always_copy or not np.array_equal(_execute(step, data), data)


@given(all_to_all_plans())
def test_plan_steps_merge_correctly(plan):
    for step in (plan.layout.pack, plan.layout.unpack):
        _check_step(step)
    assert plan.copies == _moves_memory(plan.layout.pack) + _moves_memory(plan.layout.unpack)
    assert math.prod(plan.layout.pack.split_shape) == math.prod(plan.in_shape) == math.prod(plan.layout.send_shape)
    assert plan.layout.pack.out_shape == plan.layout.send_shape
    assert math.prod(plan.layout.unpack.split_shape) == math.prod(plan.layout.recv_shape) == math.prod(plan.out_shape)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
def test_ulysses_batch_1_moves_no_memory_on_one_side(world_size, batch, seq, heads, head_dim):
    """At batch 1 the forward's unpack and the reverse's pack leave memory order as it is (views); at batch > 1
    (and W > 1) they move it."""
    forward = plans.all_to_all_4d((batch, seq, heads * world_size, head_dim), world_size, 2, 1)
    reverse = plans.all_to_all_4d((batch, seq * world_size, heads, head_dim), world_size, 1, 2)
    for step in (forward.layout.unpack, reverse.layout.pack):
        assert step.is_identity == (not _moves_memory(step))
        assert _moves_memory(step) == (batch > 1 and world_size > 1)
