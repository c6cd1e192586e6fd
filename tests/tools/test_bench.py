"""`commlib bench`: the driver's reduction of runner records (medians, ratios, targets), its outputs, and one
tiny end-to-end run through both frontends' runners. Benchmarks are not timed tests: nothing here asserts a
time or a ratio's value.
"""

import importlib.util
import json
import subprocess
import sys

import pytest

from commlib.tools import bench, cli


def _record(framework="torch", case="all_reduce", subject=(2.0, 3.0, 4.0), baseline=(1.0, 2.0, 100.0), size=16):
    return {
        "framework": framework,
        "case": case,
        "world_size": 4,
        "size_mib": size,
        "subject": "commlib",
        "baselines": ["torch.distributed"],
        "seconds": {"commlib": list(subject), "torch.distributed": list(baseline)},
        "cpu_seconds": {"commlib": [1.0, 1.0, 1.0], "torch.distributed": [2.0, 2.0, 2.0]},
    }


def test_rows_take_medians_and_ratios():
    (row,) = bench.rows([_record()])
    assert (row.subject_ms, row.baseline_ms) == (3000.0, 2000.0)  # medians, robust to the 100 s outlier
    assert row.ratio == pytest.approx(1.5)
    assert row.cpu_ratio == pytest.approx(0.5)
    assert (row.target, row.met) == (1.10, False)


def test_targets_apply_only_at_their_size_and_baseline():
    (other_size,) = bench.rows([_record(size=4)])
    assert other_size.target is None and other_size.met is None
    jax = _record("jax", "all_to_all_4d (2, 1) B=1 fwd+bwd", subject=(1.0,), baseline=(1.0,))
    jax["baselines"] = ["jax.lax"]
    jax["seconds"] = jax["cpu_seconds"] = {"commlib": [1.0], "jax.lax": [1.0]}
    (row,) = bench.rows([jax])
    assert (row.target, row.met) == (1.05, True)


def test_markdown_lists_every_row():
    table = bench.markdown(bench.rows([_record(), _record(case="all_gather (dim 0)")]))
    assert table.count("\n") == 3 and "MISSED" in table and "all_gather (dim 0)" in table


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert bench.plot(bench.rows([_record(size=1), _record(size=16)]), path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_cli_quick_settings_and_overrides():
    args = cli._parser().parse_args(["bench", "--quick", "--repeats", "3"])
    assert args.quick and args.repeats == 3 and args.world_sizes is None


def test_driver_imports_no_framework():
    probe = "import sys, commlib.tools.bench, commlib.tools.cli; print(sorted({'torch', 'jax'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(
    not (importlib.util.find_spec("torch") and importlib.util.find_spec("jax")), reason="needs torch and jax"
)
def test_end_to_end_tiny_run(tmp_path):
    """Both runners through the CLI, one tiny case each: rows for every baseline, JSON and markdown written."""
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "--world-sizes",
        "2",
        "--sizes-mib",
        "0.0625",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--cases",
        "all_reduce",
        "--json",
        str(out),
        "--markdown",
        str(tmp_path / "bench.md"),
    ]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    pairs = {(row["framework"], row["baseline"]) for row in rows}
    assert pairs == {
        ("torch", "torch.distributed"),
        ("torch", "clone + torch.distributed"),
        ("torch", "funcol"),
        ("jax", "jax.lax"),
    }
    assert all(row["ratio"] > 0 for row in rows)
