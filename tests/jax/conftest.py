"""JAX tests run on 4 simulated CPU devices, with float64 enabled for the property tests.

These settings must be made before any JAX backend is used, so they happen here at import time (pytest
imports this conftest before collecting the test modules of this folder). The torch tests may run in the
same process: their workers are forkserver processes, so JAX's threads are never forked.

Compiling dominates these tests (hundreds of tiny programs), so XLA's LLVM backend runs at -O0: about a
third less compile time, and the optimized HLO the tests inspect is the same (only machine code differs).

A host callback that raises (checked mode's refusals) leaves its error in JAX's runtime token of each device the
program ran on, and every later ``jax.effects_barrier()`` of the process raises it again (`record()` of
commlib_jax.testing_trace calls one) until each of those devices runs another program with a callback: a later
test would fail or pass by the order the files run in (pytest-xdist hands each worker its own order). So a test
that makes a callback raise drops the token (``_runtime_error`` of tests/jax/test_sequence_parallel.py), and a
test that leaves one fails here, at its teardown.
"""

import os

_FAST_COMPILE = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def _no_failed_callback_outlives_its_test():
    yield
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError as error:
        from jax._src import dispatch  # the runtime tokens, read on jax 0.10.2

        dispatch.runtime_tokens.clear()
        pytest.fail(f"a host callback of this test raised and its runtime token was left for later tests: {error}")
