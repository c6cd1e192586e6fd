"""The masks workload's cases and comparison (commlib.tools.mask_parity), without a framework: the cases are the
issue's (the handed case, padding, documents crossing shards and shorter than a shard, every layer, causal and not,
even and uneven S); the reference stored as a runner would store it passes every row; a gradient off by 1e-6, a
padding row off by 1e-300 (under the tolerance, but not 0), a missing case and a runner's error fail theirs; torch
against JAX likewise."""

import numpy as np
import pytest

from commlib import SequenceLayout
from commlib.attention import attention
from commlib.tools import mask_parity as spec

W = 4


def _save(tmp_path, framework, modes, spoil=None, skip=(), errors=()):
    """The reference of every case at W as `framework`'s runner would save it in `modes`; `spoil(case, mode,
    ranks)` edits one."""
    results = spec.MaskResults(framework)
    for case in spec.cases(W):
        for mode in modes:
            if case.name in skip:
                continue
            if case.name in errors:
                results.fail(case.name, mode, "CommError: ring_attention: a message")
                continue
            ranks = spec.expected(case)
            if spoil is not None:
                spoil(case, mode, ranks)
            results.add(case.name, mode, ranks)
    results.save(tmp_path / framework, {})
    return tmp_path / framework


def test_cases_cover_the_issue():
    for world_size in (1, 2, 3, 4):
        names = [case.name for case in spec.cases(world_size)]
        assert len(names) == len(set(names)) == (10 if world_size == 4 else 6)
    found = spec.cases(W)
    assert {(case.op, case.layout.layout) for case in found} == {
        ("ulysses_attention", "contiguous"),
        ("ring_attention", "contiguous"),
        ("ring_attention", "zigzag"),
        ("usp_attention", "contiguous"),
        ("usp_attention", "zigzag"),
    }
    assert {case.causal for case in found} == {True, False}
    assert {case.layout.is_even for case in found} == {True, False}
    assert SequenceLayout(40, 2, 2, layout="zigzag") in {case.layout for case in found}
    handed = spec.data(found[0])
    assert [handed[name].shape for name in ("q", "k", "v")] == [(2, 40, 8, 16), (2, 40, 2, 16), (2, 40, 2, 16)]
    assert handed["segment_ids"][0].tolist() == [0] * 3 + [1] * 17 + [2] * 9 + [3] * 11
    assert handed["segment_ids"][1].tolist() == [0] * 25 + [-1] * 15
    assert found[0].causal and found[0].name == "ulysses_attention[handed,S=40,ulysses=4,causal]"


@pytest.mark.parametrize("case", spec.cases(W), ids=lambda case: case.name)
def test_documents_cross_shards_and_are_shorter_than_a_shard(case):
    ids = spec.data(case)["segment_ids"]
    shards = spec.segment_shards(ids, case.layout)
    documents = [(row, document) for row in range(2) for document in set(ids[row].tolist()) - {-1}]
    holders = [sum(np.any(shard[row] == document) for shard in shards) for row, document in documents]
    assert max(holders) >= 2  # a document crossing a shard boundary
    size = min(case.layout.sizes)
    assert any(np.sum(ids[row] == document) < size for row, document in documents)
    assert any(np.any(shard < 0) for shard in shards)  # padding


def test_expected_is_the_unsharded_reference_with_padding_exactly_zero():
    case = spec.cases(W)[7]  # ring zigzag at the uneven S = 37
    assert case.name == "ring_attention[packed,S=37,ring=4,zigzag]"
    ranks, inputs = spec.expected(case), spec.data(case)
    out = case.layout.unshard([rank["out"] for rank in ranks], 1, padded=True)
    want = attention(inputs["q"], inputs["k"], inputs["v"], q_segments=inputs["segment_ids"])
    np.testing.assert_array_equal(out, want)
    padding = spec.padding(case)
    assert [rows.any() for rows in padding] == [True, True, True, False]  # rank 3 holds 15-24: no padding
    for rank, rows in zip(ranks, padding, strict=True):
        for key in spec.OUTPUTS:
            assert np.all(rank[key][rows] == 0) and np.any(rank[key][~rows] != 0)


def test_fill_and_padded_ids_are_in_the_padded_rows_only():
    case = spec.cases(W)[5]  # Ulysses at S = 37: sizes (10, 9, 9, 9)
    q = spec.data(case)["q"]
    parts = spec.shards(q, case.layout, spec.FILL)
    assert [part.shape[1] for part in parts] == [10] * 4
    assert np.all(parts[1][:, 9] == spec.FILL)
    np.testing.assert_array_equal(parts[1][:, :9], q[:, 10:19])
    ids = spec.segment_shards(spec.data(case)["segment_ids"], case.layout)
    assert ids[1][:, 9].tolist() == [-1, -1] and ids[0][:, 9].tolist() == [1, 0]  # padded row; position 9


def test_compare_passes_the_reference_and_fails_what_is_wrong(tmp_path):
    names = [case.name for case in spec.cases(W)]

    def spoil(case, mode, ranks):
        if case.name == names[2]:
            ranks[3]["dk"][1, 0, 1, 2] += 1e-6
        if case.name == names[6]:  # ring contiguous at S = 37: rank 3 holds padding of row 0
            rows = spec.padding(case)[3]
            ranks[3]["dv"][rows] = 1e-300

    folder = _save(tmp_path, "torch", ["gloo"], spoil, skip=(names[4],), errors=(names[9],))
    rows = {row.case: row for row in spec.compare("torch", folder, W, 0)}
    assert {name for name, row in rows.items() if not row.passed} == {names[2], names[4], names[6], names[9]}
    scale = max(1.0, np.abs(spec.expected(spec.cases(W)[2])[3]["dk"]).max())  # relative to max(1, |reference|)
    assert rows[names[2]].grad_error == pytest.approx(1e-6 / scale) and rows[names[2]].out_error == 0.0
    assert rows[names[6]].grad_error < spec.TOLERANCE
    assert rows[names[6]].detail == "padding rows not exactly 0 in dv"
    assert rows[names[4]].detail == "not run" and rows[names[4]].mode == "-"
    assert rows[names[9]].detail == "CommError: ring_attention: a message"
    assert rows[names[0]].passed and rows[names[0]].out_error == rows[names[0]].grad_error == 0.0


def test_cross_compares_torch_with_every_jax_mode(tmp_path):
    modes = ["shard_map[check_vma=True]", "shard_map[check_vma=False]"]

    def spoil(case, mode, ranks):
        if case.name == "usp_attention[handed,S=40,ring=2,ulysses=2,zigzag,causal]" and mode == modes[1]:
            ranks[1]["out"][0, 0, 0, 0] *= 1 + 1e-6

    torch_dir = _save(tmp_path, "torch", ["gloo"], errors=("ulysses_attention[packed,S=37,ulysses=4]",))
    rows = spec.cross(torch_dir, _save(tmp_path, "jax", modes, spoil), W, 0)
    assert len(rows) == 2 * (len(spec.cases(W)) - 1)
    assert [(row.case, row.mode) for row in rows if not row.passed] == [
        ("usp_attention[handed,S=40,ring=2,ulysses=2,zigzag,causal]", modes[1])
    ]
