"""``benchmarks/attention_check.py`` (the GPU check of the fused attention kernels, issue 32 item 4) in its CPU
smoke mode, one framework per subprocess as on the GPU: every check passes and is stored, the sizes are timed;
and ``benchmarks/device_check_attention.sh`` refuses a machine without an NVIDIA GPU (CI's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("framework", "kernel"), [("torch", "flash-cpu"), ("jax", "blockwise")])
def test_smoke_mode(tmp_path, framework, kernel):
    command = [sys.executable, str(ROOT / "benchmarks/attention_check.py"), "--framework", framework]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [*command, "--cpu", "--small", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / f"{framework}.json").read_text())
    assert result["failed"] == [] and len(result["checks"]) >= 4
    assert all(row["passed"] for row in result["checks"])
    assert kernel in {row["kernel"] for row in result["checks"]}
    assert [row["seq"] for row in result["sizes"] if "seconds" in row]  # every size timed, none failed
    assert not [row for row in result["sizes"] if "error" in row]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA GPU")
def test_device_script_needs_a_gpu(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/device_check_attention.sh")],
        env=dict(os.environ, OUT=str(tmp_path)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "needs a machine with an NVIDIA GPU" in done.stderr
