"""torch dtypes by the names the spec uses (``torch.bfloat16 -> "bfloat16"``): what every torch call hands the
spec's planners and messages."""

from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "dtype_name"]

#: Every torch dtype -> the spelling the spec uses (``torch.bfloat16 -> "bfloat16"``).
DTYPE_NAMES: dict[torch.dtype | str, str] = {
    dtype: str(dtype).removeprefix("torch.") for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16 -> "bfloat16"`` (names pass through): the spelling the spec uses."""
    name = DTYPE_NAMES.get(dtype)
    if name is not None:
        return name
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
