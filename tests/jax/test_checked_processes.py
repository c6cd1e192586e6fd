"""Checked mode across JAX processes (``jax.distributed``, two CPU processes of 2 devices each): processes that
trace an attention layer with different options all raise the same CommError when it is traced; agreeing
processes run as before. One process cannot disagree with itself (one trace runs on every device)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(layer: str, options: list[dict]) -> list[dict]:
    """Both processes' JSON results (`tests.jax.checked_processes`)."""
    port, root = _free_port(), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    environment.pop("XLA_FLAGS", None)  # (this session's 4-device flag is not the processes')
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.jax.checked_processes", str(process), str(port), layer, json.dumps(options)],
            cwd=root,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process in range(2)
    ]
    outputs = [process.communicate(timeout=240) for process in processes]
    assert all(process.returncode == 0 for process in processes), [error[-2000:] for _, error in outputs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.mark.parametrize(
    ("layer", "options", "expected"),
    [
        (
            "ring_attention",
            [{"causal": True, "layout": "contiguous"}, {"causal": True, "layout": "zigzag"}],
            "ring_attention: ranks disagree on layout: rank 0 has 'contiguous', rank 1 has "
            "'zigzag'. Received: rank={}, "
            "layout={}",
        ),
        (
            "ulysses_attention",
            [{"causal": False}, {"causal": True}],
            "ulysses_attention: ranks disagree on causal: rank 0 has False, rank 1 has True. Received: rank={}, "
            "causal={}",
        ),
    ],
    ids=["ring-layout", "ulysses-causal"],
)
def test_processes_that_disagree_all_raise(layer, options, expected):
    results = _run(layer, options)
    shown = [repr(options[rank][expected.split("disagree on ")[1].split(":")[0]]) for rank in range(2)]
    assert [result["error"] for result in results] == [expected.format(rank, shown[rank]) for rank in range(2)]


def test_processes_that_agree_run_as_before():
    results = _run("ring_attention", [{"causal": True}, {"causal": True}])
    assert all(result["error"] is None and result["max_error"] < 1e-5 for result in results), results
