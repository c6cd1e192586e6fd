"""JAX dtypes by the names the spec uses (``jnp.bfloat16 -> "bfloat16"``): what every JAX call hands the spec's
planners and messages."""

from __future__ import annotations

import jax.numpy as jnp
from jax.typing import DTypeLike

__all__ = ["dtype_name"]


def dtype_name(dtype: DTypeLike) -> str:
    """``jnp.bfloat16 -> "bfloat16"``: the spelling the spec uses (names pass through)."""
    return dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
