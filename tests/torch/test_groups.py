"""Every op on torch sub-groups of a world-4 gloo pool: {0,1} and {2,3} side by side, the non-contiguous {0,2},
and {1,2,3} (rank 0 idle). src/dst/perm are group-local; each group gets its own arrays, and every member's
output and input gradient is checked against the reference computed for that group alone.
"""

import pytest

from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge
from tests.torch import jobs

PARTITIONS = {
    "01|23": ((0, 1), (2, 3)),
    "02": ((0, 2),),
    "123": ((1, 2, 3),),
}


def _case(op_name, world_size, shape, dtype="float64", transposed=False, draw="normal", **kwargs):
    args = ",".join(f"{key}={value}" for key, value in kwargs.items())
    name = f"group:{op_name}[{shape},{dtype},{transposed},{draw},{args}]"
    return cases.Case(name, op_name, world_size, tuple(shape), dtype, tuple(kwargs.items()), transposed, draw=draw)


def group_cases(W: int) -> list[cases.Case]:
    """A few of the parity table's cases per op at W (`cases.per_op`: every keyword each op takes, uneven sizes
    included, and a rejected call; the table's arithmetic is tests/torch/test_ops.py's) plus rank arguments != 0
    and the reductions in both conventions."""
    table = cases.per_op([case for case in cases.case_table(W) if case.op != cases.ATTENTION])
    last = W - 1
    return [
        *table,
        _case("permute", W, (2, 3), perm=[[last, 0]]),
        _case("permute", W, (2, 3), perm=[[last, 0], [0, last]], transposed=True),
        _case("broadcast", W, (4,), src=last),
        _case("gather", W, (2, 3), dst=last, dim=0),
        _case("scatter", W, (2 * W, 3), src=last, dim=0),
        _case("sum_grad", W, (3,)),
        *(
            _case("all_reduce", W, (2, 3), op=op, convention=convention, draw="small")
            for op in ("sum", "avg", "max", "min", "product")
            for convention in ("sum", "replicated")
        ),
        _case("all_reduce", W, (2, 2), op="product", dtype="int64"),
        _case("all_gather", W, (2, 3), dim=-1, convention="replicated", transposed=True),
        _case("reduce_scatter", W, (2, 3 * W), dim=-1, op="avg"),
        _case("all_to_all_4d", W, (1, 2 * W, 2 * W, 2), scatter_dim=1, gather_dim=2),
    ]


def _run(pool, partition, case):
    """Every group's (case, arrays, outputs, gradients, error) and the replies of ranks outside every group."""
    arrays = [cases.make_arrays(case, seed) for seed in range(len(partition))]
    replies = pool(4).run(jobs.run_case_in_groups, partition, case, arrays)
    members = {rank for group in partition for rank in group}
    outside = [replies[rank] for rank in range(4) if rank not in members]
    results = [
        (arrays[index], *merge(case, [replies[rank] for rank in group])) for index, group in enumerate(partition)
    ]
    return results, outside


@pytest.mark.parametrize("partition", PARTITIONS.values(), ids=PARTITIONS.keys())
def test_every_op_in_sub_groups(pool, partition):
    failed = []
    W = len(partition[0])
    for case in group_cases(W):
        results, outside = _run(pool, partition, case)
        assert outside == [("idle",)] * len(outside), case.name
        for group, (arrays, outputs, gradients, error) in zip(partition, results, strict=True):
            row = parity.check(case, arrays, outputs, gradients, error)
            if not row.passed:
                failed.append(f"{group} {case.name}: out {row.out_error} grad {row.grad_error} {row.detail}")
    assert not failed, "\n".join(failed)


def test_groups_side_by_side_get_their_own_results(pool):
    """The check can fail: group {2,3}'s results against group {0,1}'s arrays do not pass."""
    case = _case("all_reduce", 2, (3, 4), op="max")
    (first, *_), (second_arrays, outputs, gradients, error) = _run(pool, PARTITIONS["01|23"], case)[0]
    assert parity.check(case, second_arrays, outputs, gradients, error).passed
    assert not parity.check(case, first, outputs, gradients, error).passed


def test_group_local_ranks_on_the_non_contiguous_group(pool):
    """On {0,2}, perm [(1, 0)] moves global rank 2's value to global rank 0; global rank 1 is not involved."""
    case = _case("permute", 2, (3,), perm=[[1, 0]])
    ((arrays, outputs, gradients, error),), outside = _run(pool, PARTITIONS["02"], case)
    assert error is None and outside == [("idle",), ("idle",)]
    assert (outputs[0] == arrays["x"][1]).all() and (outputs[1] == 0).all()
    assert (gradients["x"][1] == arrays["cotangent"][0]).all() and (gradients["x"][0] == 0).all()
