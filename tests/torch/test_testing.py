"""`commlib_torch.testing.run` on real gloo ranks (W = 1-4): every rank's outputs and gradients against the float64
numpy reference of `tests.testing_cases`, positional inputs, no gradients; a rank that raises, dies or hangs is a
`RankError` naming it within the timeout; `named_arrays` / `load_named_arrays`.

The functions run on the ranks are this module's: the ranks import them by name, as a user's test module's."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import commlib_torch as cl
from commlib.testing import ParameterMapError, RankError, assert_parity
from commlib_torch.testing import load_named_arrays, named_arrays, run
from commlib_torch.tools.pool import WorkerPool
from tests import testing_cases


def scaled_collectives(x, ids):
    """`tests.testing_cases`'s workload."""
    rank = dist.get_rank()
    y = x * (rank + 1)
    return {
        "reduced": cl.all_reduce(y),
        "gathered": cl.all_gather(y[rank : rank + 1], dim=0),
        "square": (y * y).sum(),
        "ids": ids + rank,
    }


def difference(a, b):
    return a - b


def fails_on(x, rank):
    if dist.get_rank() == int(rank):
        raise ZeroDivisionError(f"rank {dist.get_rank()} divides by zero")
    return x


def dies_on(x, rank):
    if dist.get_rank() == int(rank):
        os._exit(3)
    return x


def sleeps_on(x, rank):
    if dist.get_rank() == int(rank):
        time.sleep(120)
    return x


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_outputs_and_gradients_of_every_rank_match_the_reference(pool, world_size):
    got = run(scaled_collectives, world_size, inputs=testing_cases.inputs(world_size), pool=pool(world_size))
    want = testing_cases.expected(world_size)
    assert len(got) == world_size
    assert got[0]["outputs"]["reduced"].dtype == np.float64 and got[0]["outputs"]["ids"].dtype == np.int64
    assert_parity(got, want, names=("torch", "reference"))


@pytest.mark.parametrize("seed", [1, 7])
def test_float32_and_other_seeds(pool, seed):
    got = run(scaled_collectives, 3, inputs=testing_cases.inputs(3, "float32"), seed=seed, pool=pool(3))
    assert got[2]["gradients"]["x"].dtype == np.float32
    assert_parity(got, testing_cases.expected(3, seed, "float32"))
    with pytest.raises(AssertionError, match="differ"):  # the float32 run is not the float64 seed's answer
        assert_parity(got, testing_cases.expected(3, seed + 1, "float32"))


def test_the_reference_comparison_can_fail(pool):
    got = run(scaled_collectives, 2, inputs=testing_cases.inputs(2), pool=pool(2))
    want = testing_cases.expected(2)
    want[1]["gradients"]["x"][2, 1, 0] += 1e-6
    with pytest.raises(AssertionError, match=r"'gradients\.x'\s+1\s+1\.0e-06"):
        assert_parity(got, want)


def test_positional_inputs_without_gradients(pool):
    got = run(difference, 2, inputs=(np.ones(3), np.arange(3.0)), grad=False, pool=pool(2))
    assert got.gradients == [None, None]
    np.testing.assert_array_equal(got.outputs[1], [1.0, 0.0, -1.0])
    with_gradients = run(difference, 2, inputs=(np.ones(3), np.arange(3.0)), pool=pool(2))
    cotangent = with_gradients[1]["gradients"]
    np.testing.assert_array_equal(cotangent[0], -cotangent[1])  # d(a - b) = cotangent, -cotangent


def _warm(world_size: int) -> WorkerPool:
    """A pool whose ranks have imported this module and run a gradient: the next job's replies come within
    milliseconds, so the pool's windows (another rank's `STRAGGLER_GRACE`, a short timeout) time that job alone.
    A fresh pool's ranks first import this module, which under a loaded machine (two pytest-xdist workers on two
    cores) took healthy ranks past the 2 s grace: ``ranks == (2, 1)``."""
    pool = WorkerPool(world_size, timeout=60.0)
    run(difference, world_size, inputs=(np.ones(1), np.ones(1)), pool=pool)
    return pool


def test_a_rank_that_raises_is_named():
    with _warm(3) as pool, pytest.raises(RankError) as info:
        run(fails_on, 3, inputs={"x": np.ones(2), "rank": np.array(2)}, timeout=60.0, pool=pool)
    assert info.value.ranks == (2,)
    assert "commlib_torch.testing.run(fails_on, world_size=3)" in str(info.value)
    assert "rank 2 raised ZeroDivisionError: rank 2 divides by zero" in str(info.value)


def test_a_rank_that_dies_is_named():
    with pytest.raises(RankError, match="rank 1 died with exit code 3") as info:
        run(dies_on, 2, inputs={"x": np.ones(2), "rank": np.array(1)}, timeout=60.0)
    assert info.value.ranks == (1,)


def test_a_rank_that_hangs_is_named_within_the_timeout():
    with _warm(2) as pool:
        start = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 did not answer within 3\.0 s; killed") as info:
            run(sleeps_on, 2, inputs={"x": np.ones(2), "rank": np.array(1)}, timeout=3.0, pool=pool)
    assert info.value.ranks == (1,)
    assert time.monotonic() - start < 30.0  # the timeout, the pool's kill and close; not the 120 s sleep


def test_a_function_the_ranks_cannot_import_is_refused_before_starting():
    with pytest.raises(TypeError, match=r"fn must be a module-level function of an importable module"):
        run(lambda x: x, 2, inputs={"x": np.ones(2)})


def test_a_pool_of_another_size_is_refused(pool):
    with pytest.raises(ValueError, match="the pool has 2 ranks, world_size is 3"):
        run(difference, 3, inputs=(np.ones(1), np.ones(1)), pool=pool(2))


def test_named_arrays_round_trip_and_refuse_wrong_names():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False)).double()
    arrays = named_arrays(model)
    assert list(arrays) == ["0.weight", "0.bias", "1.weight"] and arrays["0.weight"].shape == (4, 3)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False)).double()
    load_named_arrays(other, arrays)
    for name, array in named_arrays(other).items():
        np.testing.assert_array_equal(array, arrays[name])
    wrong = {"0.weight": np.zeros((3, 4)), "0.bias": np.zeros(4), "2.weight": np.zeros(2)}
    with pytest.raises(ParameterMapError) as info:
        load_named_arrays(other, wrong)
    assert str(info.value).splitlines()[1:] == [
        "  no array for parameter '1.weight'",
        "  no parameter named '2.weight'",
        "  shape differs: '0.weight' is (4, 3), the array is (3, 4)",
    ]
    np.testing.assert_array_equal(named_arrays(other)["0.bias"], arrays["0.bias"])  # nothing copied
