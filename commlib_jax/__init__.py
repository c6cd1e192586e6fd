"""commlib's JAX frontend: differentiable collectives over jax.lax for shard_map and pmap.

Same op names and keywords as `commlib_torch` (tested); validation and shapes come from the spec `commlib`.
Never imports torch.
"""

from commlib import CommError, ReduceOp
from commlib_jax.communicator import Communicator
from commlib_jax.functional import (
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

__all__ = [
    "CommError",
    "ReduceOp",
    "Communicator",
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
