"""The argument types the JAX frontend's modules annotate with and check, in a module that imports nothing of
commlib_jax (so that `_op` and `_vma`, which `functional` imports, can name them without importing it back)."""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["ARRAY_NAME", "ARRAY_TYPES", "Array", "AxisName"]

#: What ``x`` takes: this rank's block, a jax array (a numpy array is taken as one).
Array = jax.Array | np.ndarray
#: What ``axis_name=`` takes: a mesh axis name of the enclosing shard_map / pmap, or a tuple of them.
AxisName = str | tuple[str, ...]
#: The array kinds a layer takes as q, k, v and segment ids (`commlib.attention.check_layer_inputs`); the
#: collectives take numpy scalars too (``(*ARRAY_TYPES, np.generic)``).
ARRAY_TYPES: tuple[type, ...] = (jax.Array, np.ndarray)
#: How the errors name them.
ARRAY_NAME = "jax.Array or numpy.ndarray"
