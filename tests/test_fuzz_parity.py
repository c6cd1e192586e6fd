"""``commlib parity --workload fuzz`` in the suite: the draw is seeded and spans the space it promises (numpy
only), and a bounded run (`CASES` cases, both runners as subprocesses, as the command runs them) passes every row:
each framework against the float64 reference and torch against JAX."""

from __future__ import annotations

import os

import pytest

from commlib.tools import fuzz_parity

CASES = int(os.environ.get("COMMLIB_FUZZ_CASES", "12"))  # more for a longer hunt


def test_the_draw_is_seeded_and_spans_the_space():
    drawn = fuzz_parity.cases(200, seed=3)
    assert [case.name for case in drawn] == [case.name for case in fuzz_parity.cases(200, seed=3)]
    assert [case.name for case in drawn] != [case.name for case in fuzz_parity.cases(200, seed=4)]
    assert {case.op for case in drawn} == {"ulysses_attention", "ring_attention", "usp_attention"}
    assert {case.layout.world_size for case in drawn} == {1, 2, 3, 4}
    assert {case.layout.layout for case in drawn if case.op != "ulysses_attention"} == {"contiguous", "zigzag"}
    assert any(case.layout.seq_len < case.layout.world_size for case in drawn)  # empty shards
    assert any(len(set(case.layout.sizes)) > 1 for case in drawn)  # uneven
    assert any(case.kv_heads == 1 < case.heads for case in drawn)  # MQA
    assert any(1 < case.kv_heads < case.heads for case in drawn)  # GQA
    assert {case.chunks for case in drawn} == {1, 2, 3} and {case.dtype for case in drawn} == {"float64", "float32"}
    assert any(case.documents is not None and sum(case.documents[0]) < case.layout.seq_len for case in drawn)


@pytest.mark.timeout(300)
def test_a_bounded_fuzz_run_passes():
    rows = fuzz_parity.run(4, seed=0, count=CASES)
    assert [row for row in rows if not row.passed] == []
    assert len(rows) == 3 * CASES  # torch, JAX and torch vs JAX per case
