"""A FastVideo-style subclass of `DeviceCommunicator` on real gloo ranks (world and a sub-group): the methods
it overrides run its own path wherever it calls them, and the methods it inherits (Ulysses all-to-alls, slice,
reduce, ...) keep commlib's values and exact gradients without routing through the overrides (which, as in
FastVideo, are not differentiable)."""

import numpy as np
import pytest

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge
from tests.torch import fastvideo_jobs

GROUPS = {"world": None, "123": (1, 2, 3)}
STYLES = list(fastvideo_jobs.SUBCLASSES)


def _members(members):
    return list(range(4)) if members is None else sorted(members)


def _inherited_cases(style: str, world_size: int) -> list[cases.Case]:
    """A few of the parity table's valid cases per method the subclass inherits (`cases.per_op`: every keyword
    each forwards; the table's arithmetic is tests/torch/test_ops.py's), the seed's gather aside."""
    overridden = fastvideo_jobs.SUBCLASSES[style].OVERRIDDEN
    table = cases.per_op(cases.case_table(world_size))
    return [
        case
        for case in table
        if case.op not in (cases.ATTENTION, "gather", *overridden) and cases.error_text(case) is None
    ]


@pytest.mark.parametrize("members", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("style", STYLES)
def test_inherited_methods_keep_commlib_values_and_gradients(pool, style, members):
    inside = _members(members)
    table = [(case, cases.make_arrays(case, 0)) for case in _inherited_cases(style, len(inside))]
    assert {case.op for case, _ in table} >= {"shard", "reduce", "all_to_all_4d", "all_to_all", "reduce_scatter"}
    replies = pool(4).run(fastvideo_jobs.inherited_methods, style, members, table)
    assert all(replies[rank] is None for rank in range(4) if rank not in inside)
    members_replies = [replies[rank] for rank in inside]
    assert [calls for _, calls in members_replies] == [[]] * len(inside)  # no override ran
    failed = []
    for index, (case, arrays) in enumerate(table):
        row = parity.check(case, arrays, *merge(case, [per_case[index] for per_case, _ in members_replies]))
        failed += [] if row.passed else [f"{case.name}: out {row.out_error} grad {row.grad_error} {row.detail}"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("members", GROUPS.values(), ids=GROUPS.keys())
@pytest.mark.parametrize("style", STYLES)
def test_overrides_run_their_own_path(pool, style, members):
    inside = _members(members)
    W = len(inside)
    replies = [pool(4).run(fastvideo_jobs.overridden_methods, style, members)[rank] for rank in inside]
    xs = [np.arange(6.0).reshape(2, 3) + 10 * rank for rank in range(W)]
    for rank, (results, calls) in enumerate(replies):
        np.testing.assert_array_equal(results["all_reduce"], sum(xs))
        if style == "cpu":
            np.testing.assert_array_equal(results["all_gather"], np.concatenate(xs, axis=1))
            want = np.concatenate(xs, axis=0) if rank == W - 1 else None
            assert (results["gather"] is None) == (want is None)
            if want is not None:
                np.testing.assert_array_equal(results["gather"], want)
            assert calls == [
                "all_reduce",
                "dist_module.all_reduce",
                "all_gather",
                "dist_module.all_gather_into_tensor",
                "gather",
                "dist_module.gather",
            ]
        else:
            np.testing.assert_array_equal(results["recv"], xs[(rank - 1) % W])
            assert results["released"]
            assert calls == ["all_reduce", *(["send", "recv"] if rank == 0 else ["recv", "send"]), "destroy"]
