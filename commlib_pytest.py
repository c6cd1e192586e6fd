"""commlib's pytest plugin (the ``pytest11`` entry point ``commlib_pytest``): fixtures that make a parity test of
your own model a few lines. Importing it imports neither torch nor JAX; each fixture imports its framework.

- ``torch_ranks(fn, world_size, **kwargs)``: `commlib_torch.testing.run` on gloo worker pools kept for the test
  session (one per world size, started on first use);
- ``jax_devices(fn, mesh_shape, **kwargs)``: `commlib_jax.testing.run`;
- ``--commlib-jax-devices N`` (or the ini option ``commlib_jax_devices = N``): sets ``jax_num_cpu_devices`` to N
  when pytest starts, before any test module touches JAX (JAX fixes its device count at first use).

Without an installed commlib (a checkout on ``PYTHONPATH``), load it with ``pytest -p commlib_pytest``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["jax_devices", "torch_ranks"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("commlib")
    help_text = "JAX CPU device count, set before JAX's first use (commlib_jax.testing.run's meshes)"
    group.addoption("--commlib-jax-devices", type=int, default=None, help=help_text)
    parser.addini("commlib_jax_devices", help_text, default=None)


def pytest_configure(config: pytest.Config) -> None:
    count = config.getoption("--commlib-jax-devices") or config.getini("commlib_jax_devices")
    if count:
        import jax

        jax.config.update("jax_num_cpu_devices", int(count))


@pytest.fixture(scope="session")
def torch_ranks() -> Iterator[Callable[..., Any]]:
    """``torch_ranks(fn, world_size, *, inputs=None, seed=0, timeout=120.0, grad=True)``: `fn` on `world_size`
    gloo ranks (`commlib_torch.testing.run`), every rank's outputs and gradients as numpy. The ranks of each
    world size stay up for the session; a rank that fails or hangs is replaced on the next call."""
    from commlib_torch._pool import WorkerPool
    from commlib_torch.testing import run

    pools: dict[int, WorkerPool] = {}

    def call(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> Any:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size, timeout=kwargs.get("timeout", 120.0))
        return run(fn, world_size, pool=pools[world_size], **kwargs)

    yield call
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def jax_devices() -> Callable[..., Any]:
    """``jax_devices(fn, mesh_shape, *, axis_names=None, inputs=None, seed=0, grad=True, check_vma=True)``: `fn`
    under ``jax.shard_map`` on a mesh of `mesh_shape` devices (`commlib_jax.testing.run`), every device's outputs
    and gradients as numpy (set the device count with ``--commlib-jax-devices``)."""
    from commlib_jax.testing import run

    return run
