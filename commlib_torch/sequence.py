"""Sequence parallelism for a whole model over `torch.distributed`: the `parallel` context that names the
attention layer (Ulysses, ring, USP), its groups and the `commlib.SequenceLayout` for the code inside it
(an integration, e.g. `commlib_torch.integrations.transformers`, runs that layer for the model's attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from commlib.parallel import ParallelPlan
from commlib.sequence import SequenceLayout
from commlib_torch import _parallel
from commlib_torch._groups import GroupArgument

__all__ = ["parallel"]


@contextlib.contextmanager
def parallel(layout: SequenceLayout, group: GroupArgument = None, *, attention: str = "ulysses",
             ulysses_group: GroupArgument = None, ring_group: GroupArgument = None) -> Iterator[ParallelPlan]:
    """A context in which an integration's attention call (a transformers model built with
    ``attn_implementation="commlib"``) runs commlib's `attention` layer on this rank's shard of `layout`.

    Args:
        layout: the `commlib.SequenceLayout` every rank's tokens follow (any length: Ulysses at any length;
            ring and USP through the layout itself where the length is uneven).
        group: the layer's group for ``"ulysses"`` and ``"ring"`` (None: WORLD), a 1-D DeviceMesh or
            ``(mesh, dim_name)``; for ``"usp"`` optional, the whole sequence group (its size is checked).
        attention: ``"ulysses"`` (`commlib_torch.attention.ulysses_attention`: ``layout.ulysses_size`` = the
            group's size, ``ring_size`` 1), ``"ring"`` (`ring_attention`: ``ring_size`` = the group's size) or
            ``"usp"`` (`usp_attention` over `ulysses_group` and `ring_group`, both required).

    Yields the spec's `commlib.parallel.ParallelPlan` (the layer and its layout keywords). Contexts nest (the
    innermost wins, the outer one is back on exit) and are per thread (a contextvar). The rank at Ulysses
    index u and ring index r holds shard ``r * U + u`` of the layout; the model must be fed that shard's
    tokens and its global positions (``layout.positions(shard)``) as ``position_ids``. The layers' gradients
    are exact (see each layer).

    Raises:
        CommError: an unknown `attention`, USP without both groups (or Ulysses / ring given them), a layout whose
            Ulysses or ring size is not its group's, a `group` whose size is not ``layout.world_size``.
        TypeError: `layout` not a SequenceLayout, `attention` not a str, wrong group kinds.

    Example (one rank: WORLD of size 1):
        >>> import commlib, torch
        >>> from commlib_torch.attention import attention
        >>> from commlib_torch.integrations import transformers
        >>> layout = commlib.SequenceLayout(5)
        >>> with parallel(layout, attention="ulysses") as plan:
        ...     out, _ = transformers.attention_forward(None, *(torch.ones(2, 4, 5, 8) for _ in range(3)), None)
        >>> plan.attention, out.shape  # transformers' [B, H, S, D] in, [B, S, H, D] out
        ('ulysses', torch.Size([2, 5, 4, 8]))
    """
    state = _parallel.enter(layout, group, attention, ulysses_group, ring_group)
    token = _parallel.push(state)
    try:
        yield state.plan
    finally:
        _parallel.pop(token)
