"""Ulysses' walk, once: a `commlib.attention.UlyssesPlan`'s head groups in pipeline order over a small
`UlyssesBackend` that torch and JAX implement (as `commlib.ring` walks the ring over a `RingBackend`).

For head groups ``0 .. chunks - 1``:

1. group 0's exchanges in are started (`UlyssesBackend.start_exchange`: the send buffer, one local pass, and
   its all-to-all), then the segment ids are all-gathered once for every group;
2. for group c: its exchanges are waited for; group c + 1's are started (so that they run during group c's
   attention); group c attends (`UlyssesBackend.attend`); its all-to-all out is started;
3. every output is waited for, last; with several groups the outputs are cut by ``plan.out_runs`` and
   concatenated along heads.

torch starts a collective with ``async_op=True`` when ``chunks > 1`` (a `Handle`) and waits where the walk
says; JAX traces the same order with results at once, and XLA schedules (no group's all-to-all reads another
group's attention). A head's attention is the same arithmetic in any group, so the order never changes a
value.

>>> import numpy as np
>>> from commlib.attention import attention, ulysses_plan
>>> class OneRank:  # a numpy backend of W = 1 (every all-to-all is the identity), logging the walk's calls
...     def __init__(self): self.log = []
...     def start_exchange(self, exchange, inputs, overlap):
...         self.log.append("in")
...         stacked = np.concatenate([np.moveaxis(inputs[name], 2, 0) for name in exchange.inputs])
...         return Finished(stacked[list(exchange.send_index)])
...     def gather_segments(self, segment_ids, sizes): return segment_ids
...     def attend(self, plan, group, local, masks):
...         self.log.append("attend")
...         return attention(*(np.moveaxis(local[name], 0, 2) for name in "qkv"), causal=plan.causal)
...     def start_output(self, out, scatter_sizes, gather_sizes, overlap):
...         self.log.append("out")
...         return Finished(out)
...     def concat_heads(self, outputs): return np.concatenate(outputs, axis=2)
>>> q, k, v = np.random.default_rng(0).normal(size=(3, 1, 4, 2, 8))
>>> backend, plan = OneRank(), ulysses_plan(q.shape, k.shape, v.shape, 1, rank=0, causal=True, chunks=2)
>>> np.allclose(walk(backend, plan, {"q": q, "k": k, "v": v}, None), attention(q, k, v, causal=True))
True
>>> backend.log  # group 1's exchange in starts before group 0 attends
['in', 'in', 'attend', 'out', 'attend', 'out']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from commlib.attention import Exchange, HeadGroup, UlyssesPlan

__all__ = ["Pending", "Finished", "UlyssesBackend", "walk"]


class Pending(Protocol):
    """A collective started: ``wait()`` gives its result."""

    def wait(self) -> Any:
        """The collective's result (waiting for it if it runs asynchronously)."""


class UlyssesBackend(Protocol):
    """What a frontend implements for `walk`, on one rank's arrays ``[B, S_r, n, D]``."""

    def start_exchange(self, exchange: Exchange, inputs: Mapping[str, Any], overlap: bool) -> Pending:
        """Start `exchange`'s all-to-all of the heads-first inputs' send buffer (``[C, B, S_r, D] -> [c_r, B, S,
        D]``, `Exchange`); ``wait()`` gives the received block (heads first). `overlap`: other work runs before
        the wait (start it asynchronously where the frontend can)."""

    def gather_segments(self, segment_ids: Any, sizes: tuple[int, ...] | None) -> Any:
        """The whole sequence's segment ids ``[B, S]``: `segment_ids` ``[B, S_r]`` all-gathered along dim 1
        (`sizes`: every rank's rows; None: even)."""

    def attend(self, plan: UlyssesPlan, group: HeadGroup, local: Mapping[str, Any], masks: Mapping[str, Any]) -> Any:
        """`group`'s attention on this rank over the full sequence, ``[B, S, h, D_v]``, from its received heads
        ``{"q", "k", "v": [n, B, S, D]}`` (heads first; k and v indexed by ``group.kv_index`` where given), the
        plan's causal and scale, and `masks` (``segment_ids``, ``mask`` when given) as keywords of the attention."""

    def start_output(
        self, out: Any, scatter_sizes: tuple[int, ...] | None, gather_sizes: tuple[int, ...] | None, overlap: bool
    ) -> Pending:
        """Start the all-to-all out of a group's output: ``all_to_all_4d(out, 1, 2, scatter_sizes=scatter_sizes,
        gather_sizes=gather_sizes)`` (None: even), ``[B, S, h, D_v] -> [B, S_r, h_c, D_v]``."""

    def concat_heads(self, outputs: list[Any]) -> Any:
        """`outputs` ``[B, S_r, n_i, D_v]`` concatenated along heads (dim 2)."""


class Finished:
    """A collective already done (a frontend's synchronous `Pending`): ``wait()`` gives `result`."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result


def _start_group(
    backend: UlyssesBackend, group: HeadGroup, inputs: Mapping[str, Any], overlap: bool
) -> list[tuple[Exchange, Pending]]:
    return [(exchange, backend.start_exchange(exchange, inputs, overlap)) for exchange in group.exchanges]


def _received(started: list[tuple[Exchange, Pending]]) -> dict[str, Any]:
    """``{name: [n, B, S, D]}``: each input's heads of the received blocks (``Exchange.receive``)."""
    local = {}
    for exchange, pending in started:
        block = pending.wait()
        local.update({name: block[start:stop] for name, start, stop in exchange.receive})
    return local


def walk(backend: UlyssesBackend, plan: UlyssesPlan, inputs: Mapping[str, Any], segment_ids: Any) -> Any:
    """``[B, S_r, H, D_v]``: the plan's head groups walked in pipeline order (the module's steps) on `inputs`
    ``{"q", "k", "v"}`` (this rank's ``[B, S_r, n, D]``), with `segment_ids` ``[B, S_r]`` or None."""
    overlap = plan.chunks > 1  # one group: nothing to overlap with, every collective runs where it starts
    incoming = _start_group(backend, plan.groups[0], inputs, overlap)
    masks = {}
    if segment_ids is not None:  # the whole sequence's ids (integers: forward only)
        masks["segment_ids"] = backend.gather_segments(segment_ids, plan.out_scatter_sizes)
    if plan.mask is not None:  # a rule on the gathered sequence's positions (0 .. S - 1): static, nothing sent
        masks["mask"] = plan.mask
    outgoing = []
    for index, group in enumerate(plan.groups):
        local = _received(incoming)
        if index + 1 < plan.chunks:
            incoming = _start_group(backend, plan.groups[index + 1], inputs, overlap)
        out = backend.attend(plan, group, local, masks)
        outgoing.append(backend.start_output(out, plan.out_scatter_sizes, group.out_gather_sizes, overlap))
    outputs = [pending.wait() for pending in outgoing]
    if plan.out_runs is None:
        return outputs[0]
    return backend.concat_heads([outputs[index][:, :, start:stop] for index, start, stop in plan.out_runs])
