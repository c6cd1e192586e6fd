"""Uneven sizes on simulated CPU devices (the padded layout: every device's sharded dim has max(sizes) rows):
the handed Ulysses case in every mode (rows past a rank's size hold random values: ignored, gradient exactly
0, output exactly 0), hypothesis over every op with uneven sizes (zeros included, W 1-4, one random mode per
example) against the reference, other sizes in one process, and the padded layout's error text."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib_jax as cl
from commlib import CommError, plans, split_sizes
from commlib.tools import cases
from commlib_jax.tools.parity_runner import modes_for
from tests.jax import programs
from tests.strategies import uneven_calls, uneven_case

W, B, S, H, D = 4, 2, 63, 6, 3  # the handed uneven case
SEQ, HEADS = split_sizes(S, W), split_sizes(H, W)


def _rows(full: np.ndarray, sizes, dim: int, rank: int) -> np.ndarray:
    start = sum(sizes[:rank])
    return np.take(full, range(start, start + sizes[rank]), axis=dim)


def _padded(part: np.ndarray, dim: int, size: int, rng) -> np.ndarray:
    """`part` padded to `size` rows along `dim` with random values (which the op must ignore)."""
    shape = list(part.shape)
    shape[dim] = size - part.shape[dim]
    return np.concatenate([part, rng.standard_normal(shape)], axis=dim)


@pytest.mark.parametrize("mode", modes_for(W))
def test_handed_case(mode):
    """(2, 1) returns X[:, :, h_r] (heads padded to 2 with zeros), the gradient is C[:, s_r] with exactly 0 on
    the padded rows, and (1, 2) on that output returns the input's valid rows."""
    rng = np.random.default_rng(9)
    X, C = rng.standard_normal((B, S, H, D)), rng.standard_normal((B, S, H, D))
    forward = cases.Case(
        "handed", "all_to_all_4d", W, (B, 16, H, D), "float64", (("scatter_sizes", HEADS), ("gather_sizes", SEQ))
    )
    arrays = {
        "x": [_padded(_rows(X, SEQ, 1, r), 1, 16, rng) for r in range(W)],
        "cotangent": [_padded(_rows(C, HEADS, 2, r), 2, 2, rng) for r in range(W)],
    }
    outputs, gradients = programs.run(forward, arrays, programs.mapped(forward, mode))
    reverse = cases.Case(
        "handed reverse",
        "all_to_all_4d",
        W,
        (B, S, 2, D),
        "float64",
        (("scatter_dim", 1), ("gather_dim", 2), ("scatter_sizes", SEQ), ("gather_sizes", HEADS)),
    )
    back, _ = programs.run(reverse, {"x": outputs}, programs.mapped(reverse, mode))
    for r in range(W):
        assert outputs[r].shape == (B, S, 2, D) and back[r].shape == (B, 16, H, D)
        np.testing.assert_array_equal(outputs[r][:, :, : HEADS[r]], _rows(X, HEADS, 2, r))
        np.testing.assert_array_equal(gradients["x"][r][:, : SEQ[r]], _rows(C, SEQ, 1, r))
        np.testing.assert_array_equal(back[r][:, : SEQ[r]], _rows(X, SEQ, 1, r))
        assert not outputs[r][:, :, HEADS[r] :].any() and not gradients["x"][r][:, SEQ[r] :].any()
        assert not back[r][:, SEQ[r] :].any()


@settings(max_examples=min(settings().max_examples, 25))  # each example compiles: the slow profile's 200 cost minutes
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_uneven_property(data, seed):
    case = uneven_case(data.draw(uneven_calls(), label="call"))
    mode = data.draw(st.sampled_from(modes_for(case.world_size)), label="mode")
    row = programs.check(case, cases.make_arrays(case, seed), programs.mapped(case, mode), mode)
    assert row.passed, row


def test_other_sizes_in_the_same_process():
    """One padded shape, three size lists, one process: each call is traced with its own sizes."""
    mesh = Mesh(np.array(jax.devices()[:W]), ("i",))
    whole = np.arange(2 * 12 * 3, dtype=np.float64).reshape(2, 12, 3)
    for sizes in ((3, 3, 3, 3), (4, 4, 2, 2), (4, 0, 4, 4), (4, 4, 2, 2)):
        blocks = np.stack(
            [_padded(_rows(whole, sizes, 1, r), 1, max(sizes), np.random.default_rng(r)) for r in range(W)]
        )
        gather = jax.jit(
            jax.shard_map(
                lambda x, sizes=sizes: cl.all_gather(x[0], "i", 1, sizes=sizes)[None],
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
            )
        )
        assert all(np.array_equal(out, whole) for out in np.asarray(gather(jnp.asarray(blocks)))), sizes


def test_a_sharded_dim_that_is_not_the_largest_size_raises_the_spec_text():
    mesh = Mesh(np.array(jax.devices()[:W]), ("i",))
    call = jax.shard_map(
        lambda x: cl.all_to_all_4d(x[0], "i", gather_sizes=SEQ, scatter_sizes=HEADS)[None],
        mesh=mesh,
        in_specs=P("i"),
        out_specs=P("i"),
    )
    with pytest.raises(CommError) as info:
        jax.jit(call)(jnp.zeros((W, B, 15, H, D)))
    with pytest.raises(CommError) as spec:
        plans.all_to_all_4d((B, 15, H, D), W, gather_sizes=SEQ, scatter_sizes=HEADS)
    assert (
        str(info.value)
        == str(spec.value)
        == (
            "all_to_all_4d: seq (15) must equal max(gather_sizes) (16) in the padded layout. Received: "
            "shape=(2, 15, 6, 3), scatter_dim=2, gather_dim=1, scatter_sizes=(2, 2, 1, 1), "
            "gather_sizes=(16, 16, 16, 15)"
        )
    )
