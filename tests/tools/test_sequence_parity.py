"""The sequence workload's comparison (commlib.tools.sequence_parity), without a framework: the reference stored as
a runner would store it passes every row; a wrong token, a gradient off by 1e-6, a missing layout, a runner's
error and a model row past the tolerance fail theirs; torch against JAX likewise."""

import numpy as np
import pytest

from commlib import SequenceLayout
from commlib.tools import sequence_parity as spec

W = 4
HELPERS = len(spec.HELPERS)


def _save(tmp_path, framework, mode, spoil=None, skip=(), models=None, errors=()):
    """The reference of every layout at W as `framework`'s runner would save it; `spoil(case, ranks)` edits one."""
    results = spec.SequenceResults(framework)
    for layout in spec.layouts(W):
        case = spec.name(layout)
        if case in skip:
            continue
        if case in errors:
            results.fail(case, mode, "CommError: shard_tokens: a message")
            continue
        ranks = spec.expected(layout)
        if spoil is not None:
            spoil(case, ranks)
        results.add(case, mode, ranks)
    for case, errors_ in (models or {}).items():
        results.add(case, mode, [errors_])
    results.save(tmp_path / framework, {})
    return tmp_path / framework


def test_layouts_have_distinct_names_and_cover_the_cases_named_in_the_issue():
    for world_size in (1, 2, 3, 4):
        names = [spec.name(layout) for layout in spec.layouts(world_size)]
        assert len(names) == len(set(names))
    layouts = spec.layouts(4)
    assert {layout.layout for layout in layouts} == {"contiguous", "zigzag"}
    assert any(layout.is_even for layout in layouts) and any(not layout.is_even for layout in layouts)
    assert any(0 in layout.sizes for layout in layouts)  # an empty shard
    assert SequenceLayout(37, 2, 2, layout="zigzag") in layouts  # USP
    assert spec.name(SequenceLayout(37, 2, 2, layout="zigzag")) == "S=37,ring=2,ulysses=2,zigzag"


def test_expected_is_the_whole_sequence_reference_in_the_padded_layout():
    layout = SequenceLayout(5, ulysses_size=4)  # sizes (2, 1, 1, 1)
    ranks, case = spec.expected(layout), spec.data(layout)
    assert ranks[1]["positions"].tolist() == [[2, 0]] * spec.B  # position 2, then a padding row
    assert ranks[1]["labels"][:, 1].tolist() == [spec.IGNORE] * spec.B
    assert ranks[3]["labels"][:, 0].tolist() == [spec.IGNORE] * spec.B  # the last position: no next token
    np.testing.assert_array_equal(ranks[0]["gather_out"], case["x"])
    assert float(ranks[2]["loss"]) == float(ranks[0]["loss"]) > 0
    total = sum(rank["loss_grad"].sum() for rank in ranks)  # softmax - one_hot sums to 0 over the vocabulary
    assert abs(total) < 1e-12


def test_compare_passes_the_reference_and_fails_what_is_wrong(tmp_path):
    def spoil(case, ranks):
        if case == "S=37,ring=4,zigzag":
            ranks[2]["labels"][0, 0] += 1
        if case == "S=5,ulysses=4":
            ranks[0]["loss_grad"][0, 0, 0] += 1e-6

    models = {
        "model[transformers,ulysses,S=37]": {"loss": 1e-16, "logits": 2e-16, "gradients": 3e-16},
        "model[transformers,ring,S=37]": {"loss": 1e-16, "logits": 2e-16, "gradients": 1e-8},
    }
    folder = _save(
        tmp_path, "torch", "gloo", spoil, skip=("S=32,ring=4,zigzag",), models=models, errors=("S=3,ring=4,zigzag",)
    )
    rows = {(row.case, row.mode): row for row in spec.compare("torch", folder, W, 0)}
    failed = {case for (case, _), row in rows.items() if not row.passed}
    assert failed == {
        "shard_tokens[S=37,ring=4,zigzag]",
        "cross_entropy[S=5,ulysses=4]",
        "sequence helpers[S=3,ring=4,zigzag]",
        "S=32,ring=4,zigzag",
        "model[transformers,ring,S=37]",
        "model[transformers,usp,S=37]",
    }
    assert rows["S=32,ring=4,zigzag", "-"].detail == "not run"
    assert rows["sequence helpers[S=3,ring=4,zigzag]", "gloo"].detail == "CommError: shard_tokens: a message"
    assert rows["cross_entropy[S=5,ulysses=4]", "gloo"].grad_error == pytest.approx(1e-6)
    assert rows["model[transformers,ulysses,S=37]", "gloo"].out_error == 2e-16
    assert rows["shard_sequence[S=37,ring=2,ulysses=2,zigzag]", "gloo"].grad_error == 0.0
    helpers = [case for case, _ in rows if case.endswith("]") and not case.startswith(("model", "sequence"))]
    assert len(helpers) == HELPERS * (len(spec.layouts(W)) - 2)


def test_cross_compares_torch_with_every_jax_mode(tmp_path):
    def spoil(case, ranks):
        if case == "S=37,ring=4,contiguous":
            ranks[3]["gather_replicated_grad"][1, 0, 2] *= 1 + 1e-6

    torch_dir = _save(tmp_path, "torch", "gloo")
    results = spec.SequenceResults("jax")
    for mode, edit in (("shard_map[check_vma=True]", None), ("shard_map[check_vma=False]", spoil)):
        for layout in spec.layouts(W):
            ranks = spec.expected(layout)
            if edit:
                edit(spec.name(layout), ranks)
            results.add(spec.name(layout), mode, ranks)
    results.save(tmp_path / "jax", {})
    rows = spec.cross(torch_dir, tmp_path / "jax", W)
    assert len(rows) == 2 * HELPERS * len(spec.layouts(W))
    assert [(row.case, row.mode) for row in rows if not row.passed] == [
        ("gather_sequence,convention=replicated[S=37,ring=4,contiguous]", "shard_map[check_vma=False]")
    ]
