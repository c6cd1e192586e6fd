"""JAX tests run on 4 simulated CPU devices, with float64 enabled for the property tests.

These settings must be made before any JAX backend is used, so they happen here at import time (pytest
imports this conftest before collecting the test modules of this folder). The torch tests may run in the
same process: their workers are forkserver processes, so JAX's threads are never forked.

Compiling dominates these tests (hundreds of tiny programs), so XLA's LLVM backend runs at -O0: about a
third less compile time, and the optimized HLO the tests inspect is the same (only machine code differs).
"""

import os

_FAST_COMPILE = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", True)
