"""`commlib_jax.testing.run` on simulated CPU devices (W = 1-4, a 2 x 2 mesh, check_vma on and off): every device's
outputs and gradients against the float64 numpy reference of `tests.testing_cases` (the same reference as torch's
run: the two frontends' runs agree through it); a mesh larger than the device count, 64-bit inputs without x64
and unnamed mesh axes are clear errors; `named_arrays` / `load_named_arrays` on pytrees and nnx states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import commlib_jax as cj
from commlib.testing import ParameterMapError, assert_parity
from commlib_jax.testing import load_named_arrays, named_arrays, run
from tests import testing_cases


def scaled_collectives(axis):
    """`tests.testing_cases`'s workload over mesh axis (or axes) `axis`."""

    def body(x, ids):
        rank = lax.axis_index(axis)
        y = x * (rank + 1)
        return {
            "reduced": cj.all_reduce(y, axis),
            "gathered": cj.all_gather(lax.dynamic_slice_in_dim(y, rank, 1), axis, dim=0),
            "square": (y * y).sum(),
            "ids": ids + rank,
        }

    return body


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_outputs_and_gradients_of_every_device_match_the_reference(world_size, check_vma):
    got = run(scaled_collectives("sp"), world_size, inputs=testing_cases.inputs(world_size), check_vma=check_vma)
    assert len(got) == world_size and got[0]["outputs"]["square"].shape == ()
    assert got[0]["outputs"]["ids"].dtype == np.int64 and got[0]["gradients"]["ids"] is None
    assert_parity(got, testing_cases.expected(world_size), names=("jax", "reference"))


def test_a_two_axis_mesh_ranks_in_row_major_order():
    got = run(
        scaled_collectives(("ring", "ulysses")),
        (2, 2),
        axis_names=("ring", "ulysses"),
        inputs=testing_cases.inputs(4),
        seed=3,
    )
    assert_parity(got, testing_cases.expected(4, seed=3))


def test_float32_and_a_comparison_that_fails():
    got = run(scaled_collectives("sp"), 2, inputs=testing_cases.inputs(2, "float32"))
    assert got[1]["gradients"]["x"].dtype == np.float32
    assert_parity(got, testing_cases.expected(2, dtype="float32"))
    want = testing_cases.expected(2, dtype="float32")
    want[0]["outputs"]["gathered"][1, 2, 3] += 1e-3
    with pytest.raises(AssertionError, match=r"'outputs\.gathered'\s+0\s+1\.0e-03.*\(1, 2, 3\)"):
        assert_parity(got, want)


def test_positional_inputs_without_gradients():
    got = run(lambda a, b: a - b, 2, inputs=(np.ones(3), np.arange(3.0)), grad=False)
    assert got.gradients == [None, None]
    np.testing.assert_array_equal(got.outputs[1], [1.0, 0.0, -1.0])
    cotangent = run(lambda a, b: a - b, 2, inputs=(np.ones(3), np.arange(3.0)))[1]["gradients"]
    np.testing.assert_array_equal(cotangent[0], -cotangent[1])


def test_a_mesh_larger_than_the_device_count_says_how_to_set_it():
    with pytest.raises(
        ValueError,
        match=r"mesh_shape \(8,\) needs 8 devices, JAX has 4 \(cpu\)\. .*"
        r"jax\.config\.update\('jax_num_cpu_devices', 8\).*--commlib-jax-devices=8",
    ):
        run(lambda x: x, 8, inputs={"x": np.ones(2)})


def test_unnamed_axes_and_64_bit_inputs_without_x64_are_refused():
    with pytest.raises(ValueError, match=r"axis_names must name each of the 2 mesh axes"):
        run(lambda x: x, (2, 2), inputs={"x": np.ones(2)})
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(ValueError, match=r"inputs \['x'\] are 64-bit but JAX's x64 mode is off"):
            run(lambda x: x, 2, inputs={"x": np.ones(2)})
    finally:
        jax.config.update("jax_enable_x64", True)


def test_named_arrays_of_a_pytree_round_trip_and_refuse_wrong_paths():
    tree = {"head": {"kernel": jnp.zeros((3, 2))}, "layers": [{"scale": jnp.ones(3, jnp.float32)}]}
    arrays = named_arrays(tree)
    assert list(arrays) == ["head.kernel", "layers.0.scale"]
    loaded = load_named_arrays(tree, {"head.kernel": np.full((3, 2), 2.0), "layers.0.scale": np.zeros(3)})
    assert loaded["layers"][0]["scale"].dtype == jnp.float32 and float(loaded["head"]["kernel"].sum()) == 12.0
    with pytest.raises(ParameterMapError) as info:
        load_named_arrays(tree, {"head.kernel": np.zeros((2, 3)), "layers.1.scale": np.zeros(3)})
    assert str(info.value).splitlines()[1:] == [
        "  no array for path 'layers.0.scale'",
        "  no leaf at path 'layers.1.scale'",
        "  shape differs: 'head.kernel' is (3, 2), the array is (2, 3)",
    ]


def test_named_arrays_of_an_nnx_state():
    from flax import nnx  # the [flax] extra, which CI installs

    model = nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.RMSNorm(2, rngs=nnx.Rngs(0)))
    _, state = nnx.split(model, nnx.Param)
    arrays = named_arrays(state)
    assert set(arrays) == {"layers.0.kernel", "layers.0.bias", "layers.1.scale"}
    loaded = load_named_arrays(state, {**arrays, "layers.0.kernel": np.ones((3, 2))})
    assert type(loaded) is type(state)
    np.testing.assert_array_equal(named_arrays(loaded)["layers.0.kernel"], np.ones((3, 2)))
    np.testing.assert_array_equal(named_arrays(state)["layers.0.kernel"], arrays["layers.0.kernel"])  # a copy
