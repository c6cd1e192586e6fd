"""The names of the layers checked mode compares: the attention layers, the sequence helpers, the MoE ops.

A leaf module: the layers take their names from here, and `commlib.check` (the collectives' checked mode)
reads them only to name what a rank runs when its row is a layer's (`commlib.layer_check`), so the collectives
half imports no layer.

>>> ULYSSES, RING, USP
('ulysses_attention', 'ring_attention', 'usp_attention')
"""

from __future__ import annotations

__all__ = [
    "COMBINE",
    "CROSS_ENTROPY",
    "DISPATCH",
    "GATHER_SEQUENCE",
    "LAYER_NAMES",
    "RING",
    "ROUTE",
    "SYNC_GRADIENTS",
    "ULYSSES",
    "USP",
]

ULYSSES = "ulysses_attention"
RING = "ring_attention"
USP = "usp_attention"
GATHER_SEQUENCE = "gather_sequence"
CROSS_ENTROPY = "cross_entropy"
SYNC_GRADIENTS = "sync_gradients"
ROUTE = "route"
DISPATCH = "dispatch"
COMBINE = "combine"

#: The layers whose options checked mode compares (`commlib.layer_check.LayerCall`); a row of another layer still
#: compares, shown by its code.
LAYER_NAMES = (ULYSSES, RING, USP, GATHER_SEQUENCE, CROSS_ENTROPY, SYNC_GRADIENTS, ROUTE, DISPATCH, COMBINE)
