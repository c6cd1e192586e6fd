"""Shared pytest configuration.

Hypothesis profiles, chosen by the HYPOTHESIS_PROFILE environment variable: "default" (25 examples per property,
for a quick local run) and "slow" (200), the profile CI and the README's test command run
(``HYPOTHESIS_PROFILE=slow python -m pytest -q -n 2 --dist loadfile``, .ci/run: two pytest-xdist workers,
each running whole files). A property whose examples each cost a compile caps its
own count under "slow" and says which other test covers the rest (tests/jax/test_properties.py, test_uneven.py).

Inductor compiles in the worker processes (tests/torch/test_compile.py) run with one compile thread: each rank
otherwise starts a pool of compile subprocesses, more processes than the CPUs that run them.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("default", max_examples=25, deadline=None)
settings.register_profile("slow", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # inherited by the pool's workers


@pytest.fixture(scope="session")
def pool():
    """``pool(world_size)``: a persistent `WorkerPool` of real gloo ranks per world size, shared by every
    torch test of the session (started on first use, closed at the end)."""
    from commlib_torch.tools.pool import WorkerPool

    pools = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size, timeout=120.0)
        return pools[world_size]

    yield get
    for started in pools.values():
        started.close()
