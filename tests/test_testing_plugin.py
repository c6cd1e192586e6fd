"""The pytest plugin as a user meets it: docs/testing.md's files ("# pytest.ini", "# conftest.py", "# test_port.py"
blocks) written to a fresh folder and run by pytest in a subprocess with the plugin, as the page says; the port
agrees, and the same test with the JAX side's attention not causal fails with the page's table. The plugin is the
project's pytest11 entry point."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "testing.md").read_text()
CAUSAL = 'out = jax_ulysses(q, k, v, "sp", causal=True)'


def _files() -> dict[str, str]:
    """The page's code blocks whose first line is ``# FILENAME``, by file name."""
    blocks = re.findall(r"```(?:python|ini)\n# (\S+)\n(.*?)```", PAGE, re.DOTALL)
    return {name: f"# {name}\n{body}" for name, body in blocks}


def test_the_pages_parity_test_passes_and_its_broken_port_fails_with_the_pages_table(tmp_path):
    files = _files()
    assert sorted(files) == ["conftest.py", "pytest.ini", "test_port.py"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert files["test_port.py"].count(CAUSAL) == 1
    (tmp_path / "test_port_not_causal.py").write_text(
        files["test_port.py"].replace(CAUSAL, CAUSAL.replace("True", "False"))
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "commlib_pytest", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "1 failed, 1 passed" in output, output
    assert "FAILED test_port_not_causal.py::test_the_port_agrees" in output
    shown = re.search(r"fails with\n\(an example.*?\n\n```\n(.*?)\n\.\.\.\n", PAGE, re.DOTALL)
    assert shown is not None
    table = [_tokens(line[1:]) for line in output.splitlines() if line.startswith("E  ")]
    for line in shown[1].splitlines():  # the header, the columns, the first rows: the run's own
        assert _tokens(line) in table, (line, output)


def _tokens(line: str) -> list[str]:
    """`line`'s words, each long float at 6 significant digits: threaded float64 sums may differ in the last bit
    from run to run, and the columns' widths with them."""
    return [f"{float(word):.6g}" if re.fullmatch(r"-?\d+\.\d{7,}", word) else word for word in line.split()]


def test_the_plugin_is_the_entry_point_and_imports_no_framework():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"commlib_pytest": "commlib_pytest"}
    probe = (
        "import sys, commlib_pytest; print(sorted({'torch', 'jax'} & set(sys.modules)), "
        "callable(commlib_pytest.torch_ranks), callable(commlib_pytest.jax_devices))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["[]", "True", "True"]
