"""`commlib.testing.trace` (traces: save, load, merge, the calling module) and `commlib.testing.divergence`
(`first_divergence`: every reason, the tolerance rules, the report), numpy only."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib.testing.divergence import first_divergence
from commlib.testing.trace import Call, Recorder, Trace, calling_module

RANKS = 4


def _call(index=0, op="all_reduce", module="model.layers.0.mlp", seed=0, shape=(2, 3), dtype="float64", **arrays):
    """A call whose input x and output out hold seeded values on `RANKS` ranks (`arrays` replaces either)."""
    rng = np.random.default_rng(seed + 100 * index)
    made = {name: {rank: rng.standard_normal(shape).astype(dtype) for rank in range(RANKS)} for name in ("x", "out")}
    made.update(arrays)
    return Call(index, op, module, {"in_shape": str(shape)}, {"x": made["x"]}, {"out": made["out"]})


def _trace(count=3, **changes) -> Trace:
    return Trace(_call(index, seed=index, **changes) for index in range(count))


def _with(call: Call, role: str, name: str, rank: int, value: np.ndarray) -> Call:
    arrays = {key: dict(ranks) for key, ranks in getattr(call, role).items()}
    arrays[name][rank] = value
    return call.replace(**{role: arrays})


def test_equal_traces_have_no_divergence():
    assert first_divergence(_trace(), _trace()) is None
    assert first_divergence(Trace(), Trace()) is None


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("rank", range(RANKS))
def test_the_first_differing_input_is_named_with_its_rank_and_element(index, rank):
    a = _trace(4)
    x = a[index].inputs["x"][rank].copy()
    x[1, 2] += 1e-6
    b = Trace([*a[:index], _with(a[index], "inputs", "x", rank, x), *a[index + 1 :]])
    b.calls[3] = _with(a[3], "inputs", "x", 0, a[3].inputs["x"][0] + 1)  # a later difference: not the first
    found = first_divergence(a, b, names=("torch", "jax"))
    assert (found.index, found.reason, len(found.differences)) == (index, "inputs", 1)
    difference = found.differences[0]
    assert (difference.name, difference.rank, difference.index) == ("x", rank, (1, 2))
    assert difference.max_abs == pytest.approx(1e-6, rel=1e-6)
    assert (difference.value_a, difference.value_b) == (a[index].inputs["x"][rank][1, 2], x[1, 2])
    assert found.agreeing == (f"x on {_shown([r for r in range(RANKS) if r != rank])}",)
    report = found.report()
    assert f"first divergence at call {index} (torch: 4 calls, jax: 4 calls; the {index} before it" in report
    assert "torch: all_reduce at model.layers.0.mlp" in report and "jax:   all_reduce" in report
    assert f"x      {rank}     1.0e-06" in report


def _shown(ranks):
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def test_equal_inputs_with_differing_outputs_blame_the_call_itself():
    a = _trace()
    b = Trace([a[0], _with(a[1], "outputs", "out", 3, a[1].outputs["out"][3] * 2), a[2]])
    found = first_divergence(a, b)
    assert (found.index, found.reason, found.differences[0].name, found.differences[0].rank) == (1, "outputs", "out", 3)
    assert "outputs (its inputs agree) beyond tolerance" in found.report()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(op="all_gather"), "different ops: all_reduce and all_gather"),
        (dict(shape=(2, 4)), "x on rank 0: shape (2, 3) float64 and (2, 4) float64"),
        (dict(dtype="float32"), "x on rank 0: shape (2, 3) float64 and (2, 3) float32"),
    ],
)
def test_a_different_call_is_a_signature_divergence(change, words):
    a = _trace()
    b = Trace([a[0], _call(1, seed=1, **change), a[2]])
    found = first_divergence(a, b)
    assert (found.index, found.reason, found.detail) == (1, "signature", words)
    assert words in found.report()


def test_different_ranks_are_a_signature_divergence():
    a = _trace(1)
    b = Trace([a[0].replace(inputs={"x": {r: a[0].inputs["x"][r] for r in range(3)}})])
    assert first_divergence(a, b).detail == "x recorded on ranks [0, 1, 2, 3] and [0, 1, 2]"


@pytest.mark.parametrize(("short", "ended"), [("a", "a"), ("b", "b")])
def test_a_trace_that_ends_first(short, ended):
    a, b = _trace(3), _trace(2)
    if short == "a":
        a, b = b, a
    found = first_divergence(a, b, names=("torch", "jax"))
    assert (found.index, found.reason) == (2, "length")
    assert found.detail == f"trace {ended} has no call 2: the other trace makes more calls"
    assert "(no call: the trace ended)" in found.report()


@pytest.mark.parametrize(("dtype", "tolerance"), [("float64", 1e-10), ("float32", 2e-5), ("float16", 2e-3)])
def test_the_default_rule_is_commlib_parity_per_dtype(dtype, tolerance):
    """Max abs error <= tolerance * max(1, max |a|, max |b|): just inside passes, twice that fails."""
    x = np.full((3,), 100.0, dtype)
    for step, diverges in ((0.4, False), (2.0, True)):
        moved = x.copy()
        moved[0] = np.asarray(x[0] + step * tolerance * 100, dtype)
        a = Trace([_call(x={0: x}, out={0: x})])
        b = Trace([_call(x={0: moved}, out={0: x})])
        assert (first_divergence(a, b) is not None) == diverges, (dtype, step)


def test_explicit_tolerances_are_elementwise():
    x, moved = np.array([1.0, 1000.0]), np.array([1.0 + 1e-3, 1000.0])
    a, b = Trace([_call(x={0: x}, out={0: x})]), Trace([_call(x={0: moved}, out={0: x})])
    assert first_divergence(a, b, rtol=1e-3) is None
    assert first_divergence(a, b, rtol=1e-4) is not None  # 1e-3 > 1e-4 * 1.001, whatever the larger element
    assert first_divergence(a, b, atol=2e-3) is None
    assert first_divergence(a, b) is not None  # the default: 1e-10 * 1000


def test_integers_are_exact_and_nans_must_match():
    ints = np.arange(4)
    a = Trace([_call(x={0: ints}, out={0: ints})])
    moved = Trace([_call(x={0: ints + np.array([0, 0, 0, 1])}, out={0: ints})])
    assert first_divergence(a, moved).differences[0].index == (3,)
    nan = np.array([np.nan, 1.0])
    b = Trace([_call(x={0: nan}, out={0: nan})])
    assert first_divergence(b, Trace([_call(x={0: nan.copy()}, out={0: nan})])) is None
    assert first_divergence(b, Trace([_call(x={0: np.array([0.0, 1.0])}, out={0: nan})])) is not None


@pytest.mark.parametrize(
    ("x", "moved"),
    [
        (np.array([np.inf, 1.0]), np.array([np.inf, -1e6])),
        (np.array([np.inf]), np.array([-np.inf])),
        (np.array([np.nan, 2.0]), np.array([3.0, 2.0])),
        (np.array([np.inf, 2.0]), np.array([np.nan, 2.0])),
    ],
)
@pytest.mark.parametrize("tolerances", [{}, {"rtol": 1e-3}, {"atol": 1e-3}])
def test_non_finite_values_compare_by_equality(x, moved, tolerances):
    """One inf made the tolerance infinite, so these traces had no divergence."""
    a, b = Trace([_call(x={0: x}, out={0: x})]), Trace([_call(x={0: moved}, out={0: x})])
    found = first_divergence(a, b, **tolerances)
    assert found is not None and found.reason == "inputs"
    assert first_divergence(b, a, **tolerances) is not None
    assert first_divergence(a, Trace([_call(x={0: x.copy()}, out={0: x})]), **tolerances) is None


def test_hints_name_rope_and_local_positions():
    """The port bug of examples/port_check.py: q and k differ on every rank but 0, v agrees."""
    rng = np.random.default_rng(0)
    inputs = {name: {rank: rng.standard_normal((1, 4, 2, 8)) for rank in range(RANKS)} for name in "qkv"}
    call = Call(0, "ulysses_attention", "model.layers.0.self_attn", {}, inputs, {})
    moved = {
        name: {rank: x + (name != "v" and rank > 0) for rank, x in ranks.items()} for name, ranks in inputs.items()
    }
    found = first_divergence([call], [call.replace(inputs=moved, module="layers.0.attention")])
    assert {(d.name, d.rank) for d in found.differences} == {(n, r) for n in "qk" for r in (1, 2, 3)}
    assert found.agreeing == ("q on rank 0", "k on rank 0", "v on ranks 0-3")
    hints = found.hints()
    assert len(hints) == 2 and "rotary embedding (RoPE)" in hints[0] and "rank 0 agrees and ranks 1-3 not" in hints[1]
    assert all(f"hint: {hint}" in found.report() for hint in hints)
    assert found.report().splitlines()[1:3] == [
        "  a: ulysses_attention at model.layers.0.self_attn",
        "  b: ulysses_attention at layers.0.attention",
    ]


@given(st.integers(1, 4), st.integers(0, 3))
def test_save_load_and_merge_round_trip(ranks, empty_calls):
    """Each rank's trace saved and loaded back, merged: every call with every rank's arrays."""
    per_rank = []
    for rank in range(ranks):
        calls = [_call(i, seed=rank) for i in range(2)] + [_call(2 + i, shape=(0,)) for i in range(empty_calls)]
        per_rank.append(
            Trace(
                c.replace(inputs={"x": {rank: c.inputs["x"][rank]}}, outputs={"out": {rank: c.outputs["out"][rank]}})
                for c in calls
            )
        )
    loaded = []
    for rank, trace in enumerate(per_rank):
        path = f"/tmp/commlib_trace_test_{rank}.npz"
        trace.save(path)
        loaded.append(Trace.load(path))
    merged = Trace.merge(loaded)
    assert [(c.index, c.op, c.module, c.plan) for c in merged] == [
        (c.index, c.op, c.module, c.plan) for c in per_rank[0]
    ]
    for call in merged:
        assert call.ranks == tuple(range(ranks))
        for rank in range(ranks):
            np.testing.assert_array_equal(call.inputs["x"][rank], per_rank[rank][call.index].inputs["x"][rank])
            np.testing.assert_array_equal(call.outputs["out"][rank], per_rank[rank][call.index].outputs["out"][rank])


def test_merge_refuses_traces_of_different_calls():
    with pytest.raises(ValueError, match=r"Trace.merge: trace 1 \(Trace\(2 calls"):
        Trace.merge([_trace(3), _trace(2)])


def test_recorder_keeps_the_first_value_and_the_names_in_order():
    recorder = Recorder()
    index = recorder.open("ulysses_attention", "", {}, inputs=("q", "k", "v"))
    recorder.store(index, "inputs", "v", 1, np.ones(2))
    recorder.store(index, "inputs", "v", 1, np.zeros(2))  # a second run of a jitted program
    recorder.store(index, "inputs", "q", 0, np.zeros(2))
    call = recorder.trace[0]
    assert list(call.inputs) == ["q", "k", "v"] and call.inputs["v"][1].tolist() == [1.0, 1.0]
    with recorder.inside():
        assert recorder.depth == 1
    assert recorder.depth == 0


class _Module:
    """A stand-in for a framework module: `children` named as torch's named_modules names them."""

    def __init__(self, **children):
        self.children = children

    def named(self, prefix=""):
        yield prefix, self
        for name, child in self.children.items():
            yield from child.named(f"{prefix}.{name}" if prefix else name)

    def call(self, path, recorder):
        if not path:
            return calling_module(recorder, lambda owner: isinstance(owner, _Module), lambda root: root.named())
        return self.children[path[0]].call(path[1:], recorder)


def test_calling_module_is_the_innermost_named_from_the_outermost():
    attention = _Module()
    root = _Module(model=_Module(layers=_Module(**{"0": _Module(), "1": _Module(self_attn=attention)})))
    recorder = Recorder()
    assert root.call(["model", "layers", "1", "self_attn"], recorder) == "model.layers.1.self_attn"
    assert root.call(["model", "layers", "0"], recorder) == "model.layers.0"
    assert root.call([], recorder) == "_Module"  # the root itself: its class
    assert calling_module(recorder, lambda owner: isinstance(owner, _Module), lambda root: root.named()) == ""
