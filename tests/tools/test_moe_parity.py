"""The moe workload's cases and comparison (commlib.tools.moe_parity), without a framework: the cases cover the
issue's conditions; the reference stored as a runner would store it passes every row; the mistakes peers ship
fail theirs: rows of two experts swapped, a gradient doubled, the weights' gradient lost, a NaN leaked, a padded
row not 0, a count off by one, a missing case and a runner's error; torch against JAX likewise."""

import numpy as np
import pytest

from commlib.tools import moe_parity as spec

W = 4


def _save(tmp_path, framework, spoil=None, skip=(), errors=()):
    """The reference of every case at W in `framework`'s modes, as its runner would save it; `spoil(case, mode,
    ranks)` edits one."""
    results = spec.MoeResults(framework)
    for case in spec.cases(W):
        for mode in spec.modes(framework, case):
            if case.name in skip:
                continue
            if case.name in errors:
                results.fail(case.name, mode, "CommError: route: a message")
                continue
            ranks = spec.expected(case, spec.layout_of(mode))
            if spoil is not None:
                spoil(case, mode, ranks)
            results.add(case.name, mode, ranks)
    results.save(tmp_path / framework, {})
    return tmp_path / framework


def test_cases_cover_the_issue():
    for world_size in (1, 2, 3, 4):
        names = [case.name for case in spec.cases(world_size)]
        assert len(names) == len(set(names))
    assert spec.cases(3)[1].experts_per_rank == (3, 3, 2)  # split_sizes(8, 3)
    found = spec.cases(W)
    assert {case.top_k for case in found} == {1, 2, 9} and any(c.top_k == c.num_experts for c in found)
    assert {case.capacity for case in found} == {None, 0, 1, "tight", spec.TOKENS, 3}
    assert any(case.capacity_factor is not None for case in found)
    assert {case.routes for case in found} == {spec.RANDOM, spec.NONE, spec.RANK_NONE, spec.ONE_EXPERT}
    assert {case.dtype for case in found} == {"float64", "float32", "bfloat16"}
    assert {len(case.features) for case in found} == {1, 2}
    assert any(case.noncontiguous for case in found) and any(not case.weighted for case in found)
    assert any(case.experts_per_rank and 0 in case.experts_per_rank for case in found)
    assert any(case.experts_per_rank is None for case in found)
    zero = [case for case in found if 0 in case.tokens]
    assert len(zero) == 1 and spec.modes("torch", zero[0]) == ("exact",) and spec.modes("jax", zero[0]) == ()
    tight = next(case for case in found if case.capacity == "tight")
    routes = spec.expected(tight, "exact")
    assert sum(int(rank["counts"][1]) for rank in routes) > 0  # tight drops
    inputs = spec.data(found[0])
    assert 0.05 < np.mean(np.concatenate(inputs["indices"]) == -1) < 0.3  # about 15% of the entries -1


def test_round_to_bfloat16_is_nearest_even():
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -3.14159, 0.0])
    got = spec.round_to(values, "bfloat16")
    assert got.tolist()[:4] == [1.0, 1.0, 1.0 + 2**-6, 1.0]  # ties (1 + 2^-8, 1 + 3 * 2^-8) to the even
    assert got[4] == -3.140625 and got[5] == 0.0


def test_expected_rows_are_the_experts_of_the_dispatched_rows():
    case = spec.cases(W)[1]  # uneven, [T, 2, 3]
    for layout in ("exact", "padded"):
        ranks = spec.expected(case, layout)
        for rank in ranks:
            rows = int(rank["counts"][0])
            assert rows == rank["tokens_per_expert"].sum() and not rank["dispatched"][rows:].any()
            assert not rank["y_grad"][rows:].any() and np.isfinite(rank["out"]).all()
    exact, padded = spec.expected(case, "exact"), spec.expected(case, "padded")
    for a, b in zip(exact, padded, strict=True):
        np.testing.assert_array_equal(a["out"], b["out"])
        np.testing.assert_array_equal(a["x_grad"], b["x_grad"])


def _swap_experts(case, mode, ranks):
    """The first rank with two experts' rows: its first two experts' rows swapped in the output (a wrong
    order of shapes that still fit)."""
    if case.name != spec.cases(W)[0].name or mode != "exact":
        return
    rank = ranks[0]
    first, second = rank["tokens_per_expert"][:2]
    rows = rank["dispatched"]
    rank["dispatched"] = np.concatenate([rows[first : first + second], rows[:first], rows[first + second :]])


def test_compare_passes_the_reference_and_fails_what_is_wrong(tmp_path):
    names = [case.name for case in spec.cases(W)]

    def spoil(case, mode, ranks):
        _swap_experts(case, mode, ranks)
        if case.name == names[1] and mode == "padded":
            ranks[2]["x_grad"] = 2 * ranks[2]["x_grad"]  # the 2x of EP = 2
        if case.name == names[2]:
            ranks[1]["w_grad"] = np.zeros_like(ranks[1]["w_grad"])  # the router's gradient lost
        if case.name == names[4] and mode == "padded":
            ranks[0]["out"][0, 0, 0] = np.nan  # a NaN of the padded rows leaked
        if case.name == names[6] and mode == "padded":
            ranks[3]["y_grad"][-1] = 1e-300  # a padded row's cotangent not exactly 0
        if case.name == names[7]:
            ranks[0]["counts"][1] += 1  # dropped off by one

    folder = _save(tmp_path, "torch", spoil, skip=(names[8],), errors=(names[9],))
    rows = spec.compare("torch", folder, W, 0)
    failed = {(row.case, row.mode) for row in rows if not row.passed}
    assert failed == {
        (names[0], "exact"),
        (names[1], "padded"),
        (names[2], "exact"),
        (names[2], "padded"),
        (names[4], "padded"),
        (names[6], "padded"),
        (names[7], "exact"),
        (names[7], "padded"),
        (names[8], "exact"),
        (names[8], "padded"),
        (names[9], "exact"),
        (names[9], "padded"),
    }
    detail = {(row.case, row.mode): row.detail for row in rows}
    assert detail[(names[4], "padded")] == "rank 0 out not finite"
    assert detail[(names[6], "padded")] == "rank 3 y_grad's padded rows not 0"
    assert detail[(names[8], "exact")] == "not run" and detail[(names[9], "padded")] == "CommError: route: a message"
    passed = [row for row in rows if row.passed]
    assert len(passed) == len(rows) - len(failed) and all(row.out_error == 0.0 for row in passed)


def test_cross_compares_torch_padded_with_jax(tmp_path):
    names = [case.name for case in spec.cases(W)]

    def spoil(case, mode, ranks):
        if case.name == names[3]:
            ranks[1]["out"] = ranks[1]["out"] + 1e-6

    torch_dir, jax_dir = _save(tmp_path, "torch"), _save(tmp_path, "jax", spoil)
    rows = spec.cross(torch_dir, jax_dir, W)
    assert len(rows) == len([case for case in spec.cases(W) if case.same_tokens])
    assert [row.case for row in rows if not row.passed] == [names[3]]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_world_size_has_its_cases_compared(world_size, tmp_path):
    results = spec.MoeResults("jax")
    for case in spec.cases(world_size):
        for mode in spec.modes("jax", case):
            results.add(case.name, mode, spec.expected(case, "padded"))
    results.save(tmp_path, {})
    rows = spec.compare("jax", tmp_path, world_size, 0)
    assert rows and all(row.passed for row in rows)
