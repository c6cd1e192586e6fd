"""Torch tests run on real gloo process groups: one persistent `WorkerPool` per world size, shared by
the whole session (started on first use, closed at the end)."""

import pytest

from commlib_torch.pool import WorkerPool


@pytest.fixture(scope="session")
def pool():
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size, timeout=120.0)
        return pools[world_size]

    yield get
    for started in pools.values():
        started.close()
