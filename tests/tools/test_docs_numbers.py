"""The numbers the docs quote from stored results are those results' (`commlib.tools.quotes`), and the pictures'
script still draws them (docs/figures.py)."""

import subprocess
import sys

from commlib.tools import quotes


def test_every_quoted_number_is_its_stored_results():
    assert quotes.check() == []
    names = {name for found in quotes.quoted().values() for name, _ in found}
    assert names == set(quotes.QUOTES)
    assert {"parity-ops", "train-example-torch", "parity-train", "bench-quick"} <= names
    assert "dead-rank" in names  # the claim about a killed rank is the measured distribution


def test_a_number_that_drifted_is_named_and_write_puts_the_results_back(monkeypatch, tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("took <!-- quote run -->12 s<!-- /quote --> and <!-- quote gone -->1<!-- /quote -->.\n")
    (tmp_path / "README.md").write_text("no quotes\n")
    monkeypatch.setattr(quotes, "ROOT", tmp_path)
    monkeypatch.setattr(quotes, "QUOTES", {"run": lambda: "64 s", "unused": lambda: "0"})
    assert quotes.check() == [
        "docs/page.md: quote 'run' says '12 s', its result gives '64 s'",
        "docs/page.md: unknown quote 'gone'",
        "no document quotes 'unused'",
    ]
    monkeypatch.setattr(quotes, "QUOTES", {"run": lambda: "64 s"})
    assert quotes.write() == [page]
    assert page.read_text() == "took <!-- quote run -->64 s<!-- /quote --> and <!-- quote gone -->1<!-- /quote -->.\n"


def test_the_figures_script_draws_the_pictures(tmp_path):
    done = subprocess.run(
        [sys.executable, "docs/figures.py", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=quotes.ROOT,
    )
    assert done.returncode == 0, done.stderr
    drawn = sorted(path.name for path in tmp_path.iterdir())
    assert drawn == ["benchmarks-cpu.png", "layouts.png", "sequence-layouts.png", "ulysses.png"]
