"""The worker pool of the tools and tests: `commlib_torch._pool` (moved there so that `commlib_torch.testing`, part
of the library, can use it: the library never imports its tools)."""

from commlib_torch._pool import STRAGGLER_GRACE, WorkerContext, WorkerError, WorkerPool

__all__ = ["STRAGGLER_GRACE", "WorkerContext", "WorkerError", "WorkerPool"]
