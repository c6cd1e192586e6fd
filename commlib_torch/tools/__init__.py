"""Tooling around the torch frontend, not part of the library: the `WorkerPool` of gloo ranks (`pool`), the
runners that `commlib parity` and `commlib bench` start as subprocesses (``python -m
commlib_torch.tools.parity_runner``, ``python -m commlib_torch.tools.bench_runner``) and the benchmarks'
baselines (`baselines`: the seed's three-copy all-to-all, hand-written Ulysses layouts)."""
