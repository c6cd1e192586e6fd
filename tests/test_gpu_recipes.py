"""GPU-only commands on a machine without a GPU (CUDA hidden, so also on a GPU machine) say that they need one,
with exit status 2, instead of crashing inside torch or JAX."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = {
    **os.environ,
    "CUDA_VISIBLE_DEVICES": "",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
}


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["benchmarks/pack_probe.py"], "pack_probe.py needs a CUDA GPU"),
        (["benchmarks/layout.py", "--device", "cuda"], "--device cuda needs a CUDA GPU"),
        (["examples/train_torch.py", "--device", "cuda"], "--device cuda needs a CUDA build of torch and a GPU"),
        (["examples/train_jax.py", "--device", "cuda"], "--device cuda needs a CUDA jaxlib"),
    ],
)
def test_gpu_only_commands_say_they_need_a_gpu(command, said):
    done = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=NO_GPU,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode in (1, 2), done.stderr  # SystemExit(text) exits 1, parser.error and `return 2` exit 2
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
