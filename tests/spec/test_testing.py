"""`commlib.testing` without a framework: `assert_parity` (structures, ranks, per-dtype tolerances, the failure
table), `ParameterMap` both ways (names, transposes, stacked layers, every unmappable name), the seeded inputs and
cotangents both frontends' ``run`` share."""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib.errors import CommError
from commlib.testing import (
    LINEAR,
    TOLERANCES,
    ParameterMap,
    ParameterMapError,
    Rule,
    RunResult,
    assert_parity,
    cotangents,
    flatten,
    seeded_inputs,
    tolerance,
    unflatten,
)
from commlib.testing.divergence import first_divergence
from commlib.tools import cases

# --- assert_parity -------------------------------------------------------------------------------------------


def _message(a, b, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        assert_parity(a, b, **kwargs)
    return str(info.value)


def test_the_tolerances_are_commlib_paritys():
    assert cases._TOLERANCE is TOLERANCES
    for dtype, tol in TOLERANCES.items():
        case = cases.Case("x", "all_reduce", 2, (3,), dtype=dtype)
        assert cases.tolerance(case) == tol == tolerance(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-10), ("float32", 2e-5), ("float16", 2e-3)])
def test_default_tolerance_per_dtype_relative_to_max_one_and_the_values(dtype, tol):
    want = np.array([[0.5, -3.0, 4.0]], dtype=np.float64)  # scale max(1, 4) = 4
    inside, outside = want.copy(), want.copy()
    inside[0, 1] += 0.9 * tol * 4
    outside[0, 1] += 1.5 * tol * 4
    assert_parity(inside.astype(dtype), want.astype(dtype))
    message = _message(outside.astype(dtype), want.astype(dtype))
    assert "(0, 1)" in message  # the first index beyond tolerance


def test_the_looser_dtype_decides_and_integers_are_exact():
    assert_parity(np.float32([1.0 + 1e-6]), np.float64([1.0]))
    _message(np.float64([1.0 + 1e-6]), np.float64([1.0]))
    assert_parity(np.arange(3), np.arange(3))
    assert "rank" in _message(np.arange(3), np.array([0, 1, 3]))
    assert_parity(np.array([True, False]), np.array([True, False]))
    _message(np.array([True, False]), np.array([True, True]))


def test_explicit_rtol_atol_elementwise():
    a, b = np.array([100.0, 1e-3]), np.array([100.5, 1e-3 + 1e-4])
    assert_parity(a, b, rtol=1e-2, atol=1e-3)
    _message(a, b, rtol=1e-2)  # atol 0: the small element is off by 10 %
    _message(a, b, atol=1e-3)  # rtol 0: the large one is off by 0.5


def test_nans_must_sit_at_the_same_places():
    assert_parity(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]))
    message = _message(np.array([np.nan, 1.0]), np.array([0.0, 1.0]))
    assert "inf" in message and "(0,)" in message


NON_FINITE = [  # (a, b): differing values that an infinite scale or tolerance would let through
    (np.array([np.inf, 1.0]), np.array([np.inf, -1e6])),
    (np.array([np.inf]), np.array([-np.inf])),
    (np.array([np.nan, 2.0]), np.array([3.0, 2.0])),
    (np.array([np.inf, 2.0]), np.array([np.nan, 2.0])),
    (np.array([1.0 + 1j * np.inf]), np.array([1.0 - 1j * np.inf])),
]


@pytest.mark.parametrize(("a", "b"), NON_FINITE)
@pytest.mark.parametrize("tolerances", [{}, {"rtol": 1e-3}, {"atol": 1e-3}, {"rtol": 1e-3, "atol": 1e-3}])
def test_non_finite_values_compare_by_equality(a, b, tolerances):
    """One inf made the scale (default) or the element's tolerance (rtol) infinite, so these passed."""
    message = _message(a, b, **tolerances)
    assert "1 of 1 arrays differ" in message
    _message(b, a, **tolerances)


BAD_TOLERANCES = [  # (keywords, error, words): a NaN tolerance passed any values, inf a NaN against a number
    ({"rtol": float("nan")}, CommError, "rtol must be a finite number >= 0 (nan would pass any values)"),
    ({"atol": float("nan")}, CommError, "atol must be a finite number >= 0 (nan would pass any values)"),
    ({"atol": float("inf")}, CommError, "(inf would pass a NaN against a number). Received: atol=inf"),
    ({"rtol": -1e-3}, CommError, "(a negative tolerance fails equal values). Received: rtol=-0.001"),
    ({"atol": "1e-3"}, TypeError, "atol must be a number or None, not str. Received: atol='1e-3'"),
    ({"rtol": True}, TypeError, "rtol must be a number or None, not bool"),
]


@pytest.mark.parametrize(("tolerances", "error", "words"), BAD_TOLERANCES)
def test_a_tolerance_that_cannot_compare_is_refused_before_comparing(tolerances, error, words):
    for tool, call in (
        ("assert_parity", lambda: assert_parity(np.zeros(2), np.array([np.nan, 5.0]), **tolerances)),
        ("first_divergence", lambda: first_divergence([], [], **tolerances)),
    ):
        with pytest.raises(error) as raised:
            call()
        assert str(raised.value).startswith(f"{tool}: ") and words in str(raised.value)


def test_numpy_scalar_tolerances_are_numbers():
    assert_parity(np.ones(2), np.ones(2) + 1e-4, rtol=np.float32(1e-3), atol=np.int64(0))


def test_equal_non_finite_values_pass_and_the_finite_ones_keep_their_scale():
    a = np.array([np.inf, -np.inf, np.nan, 1.0])
    assert_parity(a, a.copy())
    assert_parity(a, a.copy(), rtol=1e-6)
    moved = a.copy()
    moved[3] += 1e-3  # beyond 1e-10 * max(1, finite max 1): the infs do not widen it
    assert "(3,)" in _message(a, moved)


@pytest.mark.parametrize("leaf", ["abc", b"abc", object(), np.array(["x", "y"])])
def test_a_leaf_that_is_not_numeric_is_a_type_error_naming_the_path(leaf):
    with pytest.raises(TypeError, match=r"assert_parity: the leaf at 'out' of torch is not numeric"):
        assert_parity({"out": leaf}, {"out": np.zeros(2)}, names=("torch", "jax"))
    with pytest.raises(TypeError, match=r"the leaf at 'out' of jax is not numeric"):
        assert_parity({"out": np.zeros(2)}, {"out": leaf}, names=("torch", "jax"))


def test_per_rank_lists_name_the_rank_and_path():
    a = [{"out": np.zeros((2, 3)), "grads": {"w": np.ones(4)}} for _ in range(3)]
    b = [{"out": np.zeros((2, 3)), "grads": {"w": np.ones(4)}} for _ in range(3)]
    b[2]["grads"]["w"] = np.array([1.0, 1.0, 1.5, 1.0])
    message = _message(a, b, names=("torch", "jax"))
    header, columns, row = message.splitlines()
    assert header == (
        "assert_parity: 1 of 6 arrays differ between torch and jax (tolerance per dtype as commlib parity's)"
    )
    assert columns.split() == ["path", "rank", "max", "abs", "max", "rel", "first", "index", "torch", "jax"]
    assert re.fullmatch(r"'grads\.w'\s+2\s+5\.0e-01\s+3\.3e-01\s+\(2,\)\s+1\.0\s+1\.5", row), row


def test_every_differing_array_is_a_row():
    a = [{"x": np.zeros(2), "y": np.zeros(2)}, {"x": np.zeros(2), "y": np.zeros(2)}]
    b = [{"x": np.ones(2), "y": np.zeros(2)}, {"x": np.ones(2), "y": np.ones(2)}]
    rows = _message(a, b).splitlines()[2:]
    assert [row.split()[:2] for row in rows] == [["'x'", "0"], ["'x'", "1"], ["'y'", "1"]]
    b[0]["y"] = np.ones(2)
    rows = _message(a, b).splitlines()[2:]
    assert [row.split()[:2] for row in rows] == [["'x'", "0"], ["'x'", "1"], ["'y'", "0"], ["'y'", "1"]]


def test_the_table_is_cut_at_forty_rows():
    lines = _message({f"w{i}": 0.0 for i in range(45)}, {f"w{i}": 1.0 for i in range(45)}).splitlines()
    assert lines[0].startswith("assert_parity: 45 of 45 arrays differ")
    assert len(lines) == 2 + 40 + 1 and lines[-1] == "... and 5 more" and lines[-2].startswith("'w39'")


def test_a_single_tree_against_every_rank():
    want = {"loss": np.float64(2.0)}
    assert_parity([{"loss": 2.0}, {"loss": 2.0}], want)
    assert "'loss'  1" in _message([{"loss": 2.0}, {"loss": 2.5}], want)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ({"x": 1.0, "y": 2.0}, {"x": 1.0}, "structures differ at (root): keys only in a: ['y']; keys only in b: []"),
        ({"p": {"w": 1.0}}, {"p": [1.0]}, "structures differ at 'p': a has a dict, b has a list of 1"),
        ({"p": [1.0, 2.0]}, {"p": [1.0]}, "structures differ at 'p': a has a list of 2, b has a list of 1"),
        ({"p": (1.0,)}, {"p": [1.0]}, "structures differ at 'p': a has a tuple of 1, b has a list of 1"),
        ({"g": {"w": None}}, {"g": {"w": 1.0}}, "structures differ at 'g.w': a has None, b has a leaf"),
        ({"w": 1.0}, {"w": {"k": 1.0}}, "structures differ at 'w': a has a leaf, b has a dict"),
        ([1.0, 2.0], [1.0], "a has 2 ranks, b has 1"),
        ({"w": np.zeros((2, 3))}, {"w": np.zeros((3, 2))}, "shapes differ at 'w': a has (2, 3), b has (3, 2)"),
        ([{"w": np.zeros(2)}], [{"w": np.zeros(3)}], "shapes differ at 'w', rank 0: a has (2,), b has (3,)"),
    ],
)
def test_structures_that_differ_name_the_path(a, b, expected):
    assert _message(a, b) == f"assert_parity: {expected}"


def test_equal_trees_with_none_leaves_pass():
    assert_parity({"g": {"ids": None, "x": np.ones(2)}}, {"g": {"ids": None, "x": np.ones(2)}})


def test_run_results_compare_by_outputs_and_gradients():
    a = RunResult([{"outputs": {"y": 1.0}, "gradients": {"x": 2.0}}])
    b = RunResult([{"outputs": {"y": 1.0}, "gradients": {"x": 3.0}}])
    assert _message(a, b).splitlines()[2].split()[:2] == ["'gradients.x'", "0"]
    assert a.outputs == [{"y": 1.0}] and a.gradients == [{"x": 2.0}]


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=6), st.sampled_from(["float64", "float32"]))
def test_a_value_passes_against_itself_and_fails_off_by_ten_tolerances(values, dtype):
    array = np.array(values, dtype=dtype)
    assert_parity(array, array.copy())
    scale = max(1.0, float(np.abs(array.astype(np.float64)).max()))
    moved = array.astype(np.float64)
    moved[-1] += 10 * tolerance(dtype) * scale
    _message(moved, array.astype(np.float64))


# --- trees ---------------------------------------------------------------------------------------------------


def test_flatten_and_unflatten_round_trip():
    tree = {"a": [1, (2, 3)], "b": {"c": None}}
    flat = flatten(tree)
    assert flat == {"a.0": 1, "a.1.0": 2, "a.1.1": 3, "b.c": None}
    assert unflatten(flat, tree) == tree
    with pytest.raises(KeyError, match=r"'a\.1\.1'"):
        unflatten({"a.0": 1, "a.1.0": 2, "b.c": None}, tree)


# --- seeded inputs and cotangents ----------------------------------------------------------------------------


def test_seeded_inputs_from_arrays_or_a_generator():
    assert seeded_inputs(None, 0, "run") == {}
    made = seeded_inputs(lambda rng: {"x": rng.standard_normal((2, 3)), "ids": [1, 2]}, 5, "run")
    again = seeded_inputs(lambda rng: {"x": rng.standard_normal((2, 3)), "ids": [1, 2]}, 5, "run")
    np.testing.assert_array_equal(made["x"], again["x"])
    assert made["ids"][0].dtype.kind == "i"
    assert isinstance(seeded_inputs((np.ones(2), 3.0), 0, "run"), tuple)
    with pytest.raises(TypeError, match=r"run: inputs must be a dict .* Received: ndarray"):
        seeded_inputs(np.ones(3), 0, "run")
    with pytest.raises(TypeError, match=r"must be strings\. Received: \[0\]"):
        seeded_inputs({0: np.ones(3)}, 0, "run")


def test_cotangents_are_seeded_per_rank_and_leaf():
    outputs = {"loss": np.float32(0.5), "y": np.zeros((2, 3), np.float32), "ids": np.arange(3), "none": None}
    first, again, other = cotangents(outputs, 0, 1), cotangents(outputs, 0, 1), cotangents(outputs, 0, 2)
    assert first["loss"] == 1.0 and first["ids"] is None and first["none"] is None
    assert first["y"].shape == (2, 3) and first["y"].dtype == np.float64
    np.testing.assert_array_equal(first["y"], again["y"])
    assert not np.allclose(first["y"], other["y"])


# --- ParameterMap --------------------------------------------------------------------------------------------

RULES = [
    ("model.layers.{layer}.proj.weight", "layers.{layer}.proj.kernel", LINEAR),
    ("model.layers.{layer}.norm.weight", "layers.{layer}.norm.scale"),
    ("model.embed.weight", "embed.embedding"),
]


def _torch_named(layers=3, hidden=4, inner=5):
    rng = np.random.default_rng(0)
    named = {"model.embed.weight": rng.standard_normal((7, hidden))}
    for layer in range(layers):
        named[f"model.layers.{layer}.proj.weight"] = rng.standard_normal((inner, hidden))
        named[f"model.layers.{layer}.norm.weight"] = rng.standard_normal(hidden)
    return named


def test_names_and_transposes_both_ways():
    mapping, named = ParameterMap(RULES), _torch_named()
    flat = mapping.to_jax(named)
    np.testing.assert_array_equal(flat["layers.2.proj.kernel"], named["model.layers.2.proj.weight"].T)
    np.testing.assert_array_equal(flat["layers.1.norm.scale"], named["model.layers.1.norm.weight"])
    back = mapping.to_torch(flat, like=named)
    assert list(back) == list(named)
    for name, array in named.items():
        np.testing.assert_array_equal(back[name], array)


def test_stacked_layers_both_ways():
    mapping = ParameterMap(
        [
            ("model.layers.{layer}.proj.weight", "layers.proj.kernel", LINEAR),
            ("model.layers.{layer}.norm.weight", "layers.norm.scale"),
            Rule("model.embed.weight", "embed.embedding"),
        ]
    )
    named = _torch_named(layers=3)
    flat = mapping.to_jax(
        named, like={"layers.proj.kernel": (3, 4, 5), "layers.norm.scale": (3, 4), "embed.embedding": (7, 4)}
    )
    assert list(flat) == ["layers.proj.kernel", "layers.norm.scale", "embed.embedding"]
    np.testing.assert_array_equal(flat["layers.proj.kernel"][1], named["model.layers.1.proj.weight"].T)
    back = mapping.to_torch(flat)
    assert sorted(back) == sorted(named)
    for name, array in named.items():
        np.testing.assert_array_equal(back[name], array)


def test_two_stacked_axes_in_placeholder_order():
    mapping = ParameterMap([("blocks.{block}.experts.{expert}.weight", "blocks.experts.weight", LINEAR)])
    named = {f"blocks.{b}.experts.{e}.weight": np.full((2, 3), 10 * b + e) for b in range(2) for e in range(3)}
    stacked = mapping.to_jax(named)["blocks.experts.weight"]
    assert stacked.shape == (2, 3, 3, 2) and stacked[1, 2, 0, 0] == 12
    assert mapping.to_torch({"blocks.experts.weight": stacked}).keys() == named.keys()


def _mapping_error(call) -> list[str]:
    with pytest.raises(ParameterMapError) as info:
        call()
    first, *problems = str(info.value).splitlines()
    assert first.startswith("ParameterMap.to_") and first.endswith(": parameters cannot be mapped:")
    return [problem.strip() for problem in problems]


def test_every_unmappable_parameter_is_named():
    mapping, named = ParameterMap(RULES), _torch_named(layers=2)
    named["lm_head.weight"] = np.zeros((7, 4))
    like = {name: array.shape for name, array in mapping.to_jax(_torch_named(layers=2)).items()}
    like["layers.0.proj.kernel"] = (4, 6)  # a wrong width
    like["layers.1.proj.kernel"] = (5, 4)  # the torch layout: a missing transpose
    like["head.kernel"] = (4, 7)
    problems = _mapping_error(lambda: mapping.to_jax(named, like=like))
    assert problems == [
        "no rule matches torch name 'lm_head.weight'",
        "nothing maps to 'head.kernel'",
        "shape differs: 'layers.0.proj.kernel' is (4, 5) from 'model.layers.0.proj.weight', like has (4, 6)",
        "shape differs: 'layers.1.proj.kernel' is (4, 5) from 'model.layers.1.proj.weight', like has (5, 4) "
        "(its transpose: check the rule's axes)",
    ]


def test_the_reverse_direction_names_missing_and_extra_names():
    mapping = ParameterMap(RULES)
    flat = mapping.to_jax(_torch_named(layers=2))
    flat["layers.0.extra.kernel"] = np.zeros(2)
    like = _torch_named(layers=3)
    problems = _mapping_error(lambda: mapping.to_torch(flat, like=like))
    assert problems == [
        "no rule matches JAX path 'layers.0.extra.kernel'",
        "nothing maps to 'model.layers.2.proj.weight'",
        "nothing maps to 'model.layers.2.norm.weight'",
    ]
    del like["model.embed.weight"]
    assert "not in like: 'model.embed.weight' (from 'embed.embedding')" in _mapping_error(
        lambda: mapping.to_torch({"embed.embedding": np.zeros((7, 4))}, like=like)
    )


def test_stacking_refuses_a_missing_layer_and_two_names_for_one_path():
    mapping = ParameterMap([("layers.{i}.w", "layers.w"), ("alias.w", "embed"), ("embed.w", "embed")])
    problems = _mapping_error(
        lambda: mapping.to_jax(
            {"layers.0.w": np.zeros(2), "layers.2.w": np.zeros(2), "alias.w": np.zeros(1), "embed.w": np.zeros(1)}
        )
    )
    assert problems == [
        "two torch names map to 'embed': 'alias.w' and 'embed.w'",
        "cannot stack 'layers.w': indices [(1,)] of ('i',) missing",
    ]
    problems = _mapping_error(lambda: mapping.to_jax({"layers.0.w": np.zeros(2), "layers.1.w": np.zeros(3)}))
    assert problems == ["cannot stack 'layers.w': pieces of shapes [(2,), (3,)]"]


def test_a_rule_whose_jax_pattern_has_an_unknown_placeholder_is_refused():
    with pytest.raises(ParameterMapError, match=r"Rule: the JAX pattern's placeholders must be among"):
        Rule("layers.{i}.w", "layers.{j}.w")


def test_two_rules_matching_one_name_are_refused_naming_both_and_the_name():
    """The first matching rule was taken silently: a general rule before a specific one hid the second."""
    mapping = ParameterMap([("layers.{i}.weight", "layers.{i}.kernel", LINEAR), ("layers.0.weight", "first.kernel")])
    problems = _mapping_error(
        lambda: mapping.to_jax({"layers.0.weight": np.zeros((2, 3)), "layers.1.weight": np.zeros((2, 3))})
    )
    assert problems == [
        "torch name 'layers.0.weight' matches 2 rules: 'layers.{i}.weight' -> 'layers.{i}.kernel' "
        "and 'layers.0.weight' -> 'first.kernel'"
    ]
    mapping = ParameterMap([("a.weight", "shared.kernel"), ("b.weight", "shared.kernel")])
    problems = _mapping_error(lambda: mapping.to_torch({"shared.kernel": np.zeros(2)}))
    assert problems == [
        "JAX path 'shared.kernel' matches 2 rules: 'a.weight' -> 'shared.kernel' and 'b.weight' -> 'shared.kernel'"
    ]
