"""``benchmarks/memory.py``'s JAX child lets XLA's CPU collectives wait as long as the measurement may run.

XLA's CPU runtime ends a process whose devices wait at a collective longer than
``--xla_cpu_collective_call_terminate_timeout_seconds`` (default 40 s): the causal contiguous ring at
S = 65,536 on 2 shared cores waits minutes at a step's permute (device 0 skips what device 3 computes), and the
stored run died there (``benchmarks/results/cpu-2026-12-07-memory/jax_65536_ring.json``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _memory():
    spec = importlib.util.spec_from_file_location("benchmarks_memory", ROOT / "benchmarks/memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(flags: str, name: str) -> str:
    values = [word.split("=", 1)[1] for word in flags.split() if word.startswith(f"--{name}=")]
    assert len(values) == 1, (name, flags)
    return values[0]


def test_jax_child_waits_at_collectives_as_long_as_the_measurement():
    flags = _memory().xla_flags(5400.0, "--xla_backend_optimization_level=0")
    assert flags.split()[0] == "--xla_backend_optimization_level=0"  # the caller's flags kept
    assert _flag(flags, "xla_force_host_platform_device_count") == "4"
    assert _flag(flags, "xla_cpu_collective_call_terminate_timeout_seconds") == "5400"
    assert _flag(flags, "xla_cpu_collective_timeout_seconds") == "5400"
