"""``commlib bench --host``: the driver's targets and table, and one tiny end-to-end run on torch's fake process
group. Not a timed test: nothing here asserts a time or a ratio's value."""

import importlib.util
import json

import pytest

from commlib.tools import bench, cli, host_bench


def _record(case, baselines, subject="commlib", seconds=(2e-6, 3e-6, 4e-6)):
    variants = {subject: list(seconds), **{name: [1e-6, 2e-6, 3e-6] for name in baselines}}
    return {
        "framework": "torch",
        "case": case,
        "world_size": 4,
        "size_mib": 0.0,
        "subject": subject,
        "baselines": list(baselines),
        "seconds": variants,
    }


def test_targets_follow_the_issue():
    records = [
        _record("all_reduce", ("torch.distributed.nn", "by hand")),
        _record("all_to_all_4d (2, 1) B=1", ("hand-written (torch.distributed.nn)", "by hand")),
        _record("permute (ring)", ("by hand",)),
        _record("all_reduce checked", ("commlib",), subject="commlib checked"),
    ]
    targets = {(row.case, row.baseline): row.target for row in bench.rows(records, host_bench.TARGETS)}
    assert targets == {
        ("all_reduce", "torch.distributed.nn"): 1.3,
        ("all_reduce", "by hand"): None,
        ("all_to_all_4d (2, 1) B=1", "hand-written (torch.distributed.nn)"): 1.1,
        ("all_to_all_4d (2, 1) B=1", "by hand"): None,
        ("permute (ring)", "by hand"): 1.3,
        ("all_reduce checked", "commlib"): None,
    }


def test_table_in_microseconds_and_checked_cost():
    rows = bench.rows([_record("all_reduce checked", ("commlib",), subject="commlib checked")], host_bench.TARGETS)
    table = host_bench.markdown(rows)
    cells = [cell.strip() for cell in table.splitlines()[-1].split("|")[1:-1]]
    assert cells[:7] == ["all_reduce checked", "commlib checked", "3.0", "commlib", "2.0", "1.50", "+1.0"]
    assert host_bench.checked_cost(rows) == pytest.approx(1.0)


def test_cli_host_options():
    args = cli._parser().parse_args(["bench", "--host", "--calls", "50"])
    assert args.host and args.calls == 50


@pytest.mark.skipif(not importlib.util.find_spec("torch"), reason="needs torch")
def test_end_to_end_tiny_run(tmp_path):
    out = tmp_path / "host.json"
    assert (
        cli.main(
            ["bench", "--host", "--calls", "20", "--cases", "all_reduce", "all_reduce checked", "--json", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(row["case"], row["baseline"]) for row in rows} == {
        ("all_reduce", "torch.distributed.nn"),
        ("all_reduce", "by hand"),
        ("all_reduce checked", "commlib"),
    }
    assert all(row["ratio"] > 0 for row in rows)
