"""The three attention layers on the JAX mesh their case calls for, shared by the mask and key-block tests:
`mesh` (one axis "i", or USP's ("ring", "ulysses") grid) and `call` (the layer on that mesh's axis names)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention


def mesh(op, layout):
    devices = np.array(jax.devices()[: layout.world_size])
    if op == "usp_attention":
        return Mesh(devices.reshape(layout.ring_size, layout.ulysses_size), ("ring", "ulysses")), P(("ring", "ulysses"))
    return Mesh(devices, ("i",)), P("i")


def call(op, name, q, k, v, **kwargs):
    if op == "usp_attention":
        return usp_attention(q, k, v, "ulysses", "ring", layout=name, **kwargs)
    if op == "ulysses_attention":
        return ulysses_attention(q, k, v, "i", layout=name, **kwargs)
    return ring_attention(q, k, v, "i", layout=name, **kwargs)
