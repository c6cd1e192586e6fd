"""commlib's PyTorch frontend: differentiable collectives over torch.distributed.

Same op names and keywords as `commlib_jax` (tested); validation and shapes come from the spec `commlib`.
Never imports jax.
"""

from commlib import CommError, CommFailure, CommTimeout, ReduceOp
from commlib_torch._checked import checked as checked  # torch-only, so not in __all__
from commlib_torch._checked import set_checked as set_checked
from commlib_torch.communicator import DeviceCommunicator
from commlib_torch.functional import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_4d,
    broadcast,
    gather,
    permute,
    reduce,
    reduce_scatter,
    scatter,
    shard,
    sum_grad,
)
from commlib_torch.handle import Handle

__all__ = [
    "CommError",
    "CommFailure",
    "CommTimeout",
    "ReduceOp",
    "DeviceCommunicator",
    "Handle",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_4d",
    "broadcast",
    "gather",
    "scatter",
    "permute",
    "sum_grad",
    "shard",
    "reduce",
]
