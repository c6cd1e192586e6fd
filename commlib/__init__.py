"""commlib: the framework-free spec of differentiable collectives (numpy + stdlib only).

Op catalogue and validation (`commlib.ops`), layout plans (`commlib.layout`), the numpy reference that
simulates W ranks (`commlib.reference`), and the `commlib` CLI. Frontends: `commlib_torch`, `commlib_jax`.
Importing this package never imports torch or jax.
"""

from commlib.check import CommFailure, CommTimeout
from commlib.errors import CommError
from commlib.layout import Plan, Rearrange
from commlib.ops import CONVENTIONS, OP_NAMES
from commlib.reduce_op import ReduceOp

__all__ = ["CommError", "CommFailure", "CommTimeout", "ReduceOp", "Plan", "Rearrange", "CONVENTIONS", "OP_NAMES"]
__version__ = "0.1.0"
