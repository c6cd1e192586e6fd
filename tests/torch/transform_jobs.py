"""Pool jobs for test_ops.py: torch.func transforms over commlib's ops."""

from __future__ import annotations

import torch

import commlib_torch


def vmap_all_reduce(ctx) -> str:
    """``torch.func.vmap`` over all_reduce: the error text this rank gets."""
    try:
        torch.func.vmap(commlib_torch.all_reduce)(torch.ones(3, 2))
    except TypeError as error:
        return f"TypeError: {error}"
    return "no error"
