"""Shared pytest configuration.

Hypothesis profiles: "default" (quick, the CI run) and "slow" (long property runs), chosen by the
HYPOTHESIS_PROFILE environment variable: ``HYPOTHESIS_PROFILE=slow pytest tests/spec``.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("default", max_examples=25, deadline=None)
settings.register_profile("slow", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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
