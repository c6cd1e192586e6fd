"""`commlib parity`'s table and its --workload choice, with the runs replaced by given rows."""

import subprocess
import sys

import pytest

from commlib.tools import bench, cli, mask_parity, moe_parity, parity, sequence_parity, train_parity

LONG = "all_to_all_4d[3x5x8x2,bfloat16,scatter_dim=-2,gather_dim=-3,scatter_sizes=(3, 3, 2, 2),gather_sizes=(1, 1)]"
ROWS = [
    parity.Row(
        "all_to_all_4d[3x5x8x2,bfloat16,scatter_dim=-2,gather_dim=-3]",
        "jax",
        "shard_map[check_vma=False]",
        1e-3,
        2e-3,
        True,
    ),
    parity.Row(LONG, "torch", "gloo", 1e-3, 2e-3, True),
    parity.Row(
        "permute!repeat[3,float32]",
        "torch vs jax",
        "shard_map[2x2 mesh]",
        None,
        None,
        False,
        "expected " + "'CommError: permute: a long message' " * 8,
    ),
]


def test_table_is_at_most_120_columns_with_failures_below(capsys):
    cli._print_table(ROWS)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["case", "framework", "mode", "err", "out", "err", "grad", "result"]
    assert lines[2].split()[1:] == ["jax", "check_vma=False", "1.00e-03", "2.00e-03", "pass"]
    wrapped = "".join(line[:62] for line in lines[3:5]).replace(" ", "")  # the long name wraps in its column
    assert wrapped == LONG.replace(" ", "")
    assert lines[3].split()[1:] == ["torch", "gloo", "1.00e-03", "2.00e-03", "pass"]
    assert lines[5].split()[-1] == "FAIL"
    assert max(map(len, lines[:6])) <= cli.WIDTH == 120
    assert lines[6:] == [  # after the table: each failed row's detail on one line
        "permute!repeat[3,float32] / torch vs jax / shard_map[2x2 mesh]: " + ROWS[2].detail
    ]


@pytest.mark.parametrize(
    ("workload", "expected"),
    [
        ("ops", ["ops", "moe"]),  # the default: the case table and the MoE rows
        ("train", ["train"]),
        ("sequence", ["sequence"]),
        ("masks", ["masks"]),
        ("moe", ["moe"]),
        ("all", ["ops", "train", "sequence", "masks", "moe"]),
    ],
)
def test_workload_runs_the_chosen_tables(monkeypatch, capsys, workload, expected):
    ran = []

    def fake(name, passed):
        def run(world_size, **options):
            ran.append(name)
            return [parity.Row(f"{name}-case", "torch", "gloo", 0.0, 0.0, passed)]

        return run

    monkeypatch.setattr(parity, "run", fake("ops", True))
    monkeypatch.setattr(train_parity, "run", fake("train", workload != "all"))
    monkeypatch.setattr(sequence_parity, "run", fake("sequence", True))
    monkeypatch.setattr(mask_parity, "run", fake("masks", True))
    monkeypatch.setattr(moe_parity, "run", fake("moe", True))
    status = cli.main(["parity", "--world-size", "2", "--workload", workload])
    assert ran == expected
    out = capsys.readouterr().out
    assert f"world_size=2 seed=0 workload={workload}: " in out
    assert status == (1 if workload == "all" else 0)  # "all": the train row failed


def test_workload_is_checked_by_argparse(capsys):
    with pytest.raises(SystemExit):
        cli.main(["parity", "--workload", "bench"])
    assert "invalid choice: 'bench'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == "commlib 0.1.0"


@pytest.mark.parametrize("value", ["abc", "0", "2.5"])
def test_world_size_that_is_no_positive_integer_gets_a_users_message(capsys, value):
    with pytest.raises(SystemExit):
        cli.main(["parity", "--world-size", value])
    err = capsys.readouterr().err
    assert "argument --world-size: must be" in err and "_positive" not in err


def test_parity_help_has_a_description_every_default_and_the_frameworks(capsys):
    with pytest.raises(SystemExit):
        cli.main(["parity", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "Run the seeded case table through the numpy reference" in out
    assert "examples: commlib parity --world-size 4" in out
    for shown in [
        "ranks (torch processes, JAX CPU devices) (default: 4)",
        "seed of the case table's inputs (default: 0)",
        "which frontends to compare",
        "(default: torch jax)",
        "(default: ops)",
        "--timeout TIMEOUT seconds per framework runner (default: 60 + 12 per row of the case table, at least "
        "600: 1236 s for its 98 rows at W = 4; 600 for the other workloads' runners)",
    ]:
        assert shown in out


def test_bench_list_cases_prints_each_frameworks_names(monkeypatch, capsys):
    asked = []

    def names(framework, runner="bench_runner"):
        asked.append((framework, runner))
        return ["all_reduce", "all_to_all_4d (2, 1) B=1"]

    monkeypatch.setattr(bench, "case_names", names)
    assert cli.main(["bench", "--list-cases", "--frameworks", "jax"]) == 0
    assert cli.main(["bench", "--host", "--list-cases"]) == 0
    assert asked == [("jax", "bench_runner"), ("torch", "host_runner")]
    assert capsys.readouterr().out.splitlines()[:3] == [
        "jax (bench): 2 cases (quote a name with spaces)",
        "  all_reduce",
        "  all_to_all_4d (2, 1) B=1",
    ]


def test_the_spec_needs_no_tabulate_and_the_command_says_how_to_get_it():
    probe = (
        "import sys; sys.modules['tabulate'] = None; import commlib, commlib.tools.cli as cli; "
        "sys.exit(cli.main(['parity', '--world-size', '2']))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "pip install 'commlib[cli]'" in done.stderr
