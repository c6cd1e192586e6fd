"""Run the ``>>>`` examples of one frontend's public modules in this process and print a JSON report:
``python -m tests.doctest_runner torch`` or ``... jax`` (torch and JAX never share a process).

The lead's convention for the examples: torch examples run where WORLD is a 1-rank gloo group already
initialised (they call with ``group=None``); JAX examples run with 4 CPU devices (set here before JAX's first
use) and build their own mesh and ``jax.shard_map``, so they show real W = 4 results.

The report: ``attempted`` / ``failed`` examples, the doctest ``output`` of the failures, and ``missing``: the
public functions and classes (a module's ``__all__``, defined in that module) whose docstring has no example.
"""

from __future__ import annotations

import doctest
import importlib
import io
import json
import os
import pathlib
import subprocess
import sys

MODULES = {
    "torch": (
        "commlib_torch.functional",
        "commlib_torch.attention",
        "commlib_torch.cross_attention",
        "commlib_torch.cfg",
        "commlib_torch.communicator",
        "commlib_torch.ring",
        "commlib_torch.sequence",
        "commlib_torch.video",
        "commlib_torch.moe",
        "commlib_torch.integrations.transformers",
        "commlib_torch.integrations.diffusers",
        "commlib_torch.testing",
        "commlib_torch.testing_trace",
        "commlib_torch.handle",
    ),
    "jax": (
        "commlib_jax.functional",
        "commlib_jax.attention",
        "commlib_jax.cross_attention",
        "commlib_jax.cfg",
        "commlib_jax.communicator",
        "commlib_jax.moe",
        "commlib_jax.ring",
        "commlib_jax.sequence",
        "commlib_jax.video",
        "commlib_jax.training",
        "commlib_jax.testing",
        "commlib_jax.testing_trace",
    ),
}
JAX_DEVICES = 4


def _start(frontend: str) -> None:
    if frontend == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_num_cpu_devices", JAX_DEVICES)


def _missing(module) -> list[str]:
    """``module.name`` for each public function or class defined in `module` whose docstring has no ``>>>``."""
    names = []
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if ">>>" not in (value.__doc__ or ""):
            names.append(f"{module.__name__}.{name}")
    return names


def run(frontend: str) -> dict:
    _start(frontend)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    output, missing = io.StringIO(), []
    for name in MODULES[frontend]:
        module = importlib.import_module(name)
        for test in finder.find(module):
            runner.run(test, out=output.write)
        missing += _missing(module)
    results = runner.summarize(verbose=False)
    return {"attempted": results.attempted, "failed": results.failed, "output": output.getvalue(), "missing": missing}


def check(frontend: str) -> None:
    """Run `run(frontend)` in a fresh interpreter; fail on a failed example or a public function without one."""
    root = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "tests.doctest_runner", frontend],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == 0, report["output"]
    assert report["missing"] == [], f"public functions without a >>> example: {report['missing']}"
    assert report["attempted"] > 0


if __name__ == "__main__":
    sys.stdout = io.StringIO()  # what the examples print goes to the report, not over the JSON line
    report = run(sys.argv[1])
    sys.stdout = sys.__stdout__
    print(json.dumps(report))
