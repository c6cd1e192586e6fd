"""`cases.per_op`: the few rows per op the wrappers' tests run keep every op, every keyword set and a rejected
call of each op that has one."""

import pytest

from commlib.tools import cases


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_per_op_keeps_every_keyword_set_and_a_rejected_call(world_size):
    table = cases.case_table(world_size)
    rows = cases.per_op(table)

    def kinds(of):
        return {(case.op, cases.error_text(case) is None and frozenset(case.params)) for case in of}

    assert kinds(rows) == kinds(table)
    assert len(rows) == len(kinds(table)) < len(table)
    assert [case for case in table if case in rows] == rows  # the table's order
