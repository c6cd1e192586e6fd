"""``python examples/port_check.py --bug none --bug local-positions``: the transformers Llama
(4 gloo ranks) against its Flax port (4 CPU devices) under Ulysses, float64, one torch run against both ports.
The faithful port agrees (logits, loss, every gradient within 1e-10 relative, the traces call for call); the
port whose RoPE is fed local positions is reported at layer 0's attention call, q and k on ranks 1-3, not at
the loss. XLA at -O0 (as tests/jax/conftest.py): the JAX side in half the time (25 s against 50 s at a load of
11); the whole test ~40 s on 2 cores at a load of 5."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 240  # seconds


def test_port_check_passes_the_port_and_names_the_first_diverging_call():
    environment = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    environment["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # compile time halved, as tests/jax/conftest.py
    command = [sys.executable, "examples/port_check.py", "--bug", "none", "--bug", "local-positions"]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=LIMIT,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    output = done.stdout
    assert done.returncode == 1, output + done.stderr  # the planted bug fails the run
    faithful, planted = output.split("port with bug local-positions:")
    errors = re.search(
        r"logits ([0-9.e+-]+), loss ([0-9.e+-]+), gradients ([0-9.e+-]+) .*; 21 parameters; "
        r"traces: 2 torch calls, 2 jax calls",
        faithful,
    )
    assert errors and max(float(value) for value in errors.groups()) <= 1e-10, faithful
    assert "first divergence" not in faithful and "\nPASS: transformers Llama vs Flax port" in faithful, faithful
    assert float(re.search(r"logits ([0-9.e+-]+)", planted).group(1)) > 1e-3, planted
    lines = planted.splitlines()
    start = lines.index(
        "first divergence at call 0 (torch: 2 calls, jax: 2 calls; the 0 before it agree within tolerance)"
    )
    assert lines[start + 1 : start + 4] == [
        "  torch: ulysses_attention at model.layers.0.self_attn",
        "  jax:   ulysses_attention at layers.0.attention",
        "  inputs beyond tolerance:",
    ], planted
    rows = [line.split()[:2] for line in lines[start + 5 : start + 11]]
    assert rows == [[name, str(rank)] for name in "qk" for rank in (1, 2, 3)], planted
    assert "  within tolerance: q on rank 0; k on rank 0; v on ranks 0-3" in lines, planted
    assert any(line.startswith("  hint: q and k differ and v agrees: the rotary embedding (RoPE)") for line in lines)
    assert lines[-1].startswith("FAIL: transformers Llama vs Flax port, Ulysses W=4"), planted
