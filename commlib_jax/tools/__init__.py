"""Tooling around the JAX frontend, not part of the library: the runners that `commlib parity` and `commlib
bench` start as subprocesses (``python -m commlib_jax.tools.parity_runner``, ``python -m
commlib_jax.tools.bench_runner``)."""
