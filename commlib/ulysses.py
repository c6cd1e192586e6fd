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
from commlib.joint import JointPlan

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

    def joint_heads(self, x: Any, heads: tuple[tuple[int, ...], ...]) -> Any:
        """Joint attention: ``[n, B, S_j, D]``, heads first, the heads `heads` gives this rank of the replicated
        `x` ``[B, S_j, H, D]`` (one row: this rank's; a row per rank: the padded layout, where an index past
        the last head is a head of zeros); differentiable."""

    def concat_seq(self, parts: list[Any]) -> Any:
        """Heads-first blocks ``[n, B, S_i, D]`` concatenated along the sequence (dim 2); differentiable."""

    def gather_heads(self, x: Any, sizes: tuple[int, ...] | None) -> Any:
        """``all_gather(x, dim=2, sizes=sizes)`` over the group (commlib's, VJP the reduce-scatter): the joint
        output's heads of every rank, in rank order (`sizes`: every rank's heads; None: even)."""


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


def _with_joint(
    backend: UlyssesBackend, joint: JointPlan, index: int, local: dict[str, Any], inputs: Mapping[str, Any]
) -> dict[str, Any]:
    """`local` with group `index`'s heads of the joint tensors (``inputs["joint_q"]``, ...) concatenated at the
    joint position along the sequence: ``[n, B, S + S_j, D]``."""
    heads = joint.groups[index]
    for name, rows in (("q", heads.q), ("k", heads.kv), ("v", heads.kv)):
        piece = backend.joint_heads(inputs[f"joint_{name}"], rows)
        local[name] = backend.concat_seq([piece, local[name]] if joint.front else [local[name], piece])
    return local


def _cut_joint(joint: JointPlan, out: Any) -> tuple[Any, Any]:
    """A group's output ``[B, S + S_j, h, D_v]`` cut into (the sequence's rows, the joint rows)."""
    if joint.front:
        return out[:, joint.seq :], out[:, : joint.seq]
    return out[:, : out.shape[1] - joint.seq], out[:, out.shape[1] - joint.seq :]


def _result(backend: UlyssesBackend, plan: UlyssesPlan, outputs: list[Any]) -> Any:
    """The groups' outputs (``[B, *, h_c, D_v]``, every source rank's heads in rank order) in head order."""
    if plan.out_runs is None:
        return outputs[0]
    return backend.concat_heads([outputs[index][:, :, start:stop] for index, start, stop in plan.out_runs])


def walk(backend: UlyssesBackend, plan: UlyssesPlan, inputs: Mapping[str, Any], segment_ids: Any) -> Any:
    """``[B, S_r, H, D_v]``: the plan's head groups walked in pipeline order (the module's steps) on `inputs`
    ``{"q", "k", "v"}`` (this rank's ``[B, S_r, n, D]``), with `segment_ids` ``[B, S_r]`` or None.

    With ``plan.joint`` (`commlib.joint`), `inputs` also holds ``joint_q``, ``joint_k``, ``joint_v``
    (``[B, S_j, n, D]``, replicated) and the result is ``(out, joint_out)``: each group takes its heads of the
    joint tensors after its exchange, attends over the concatenation, sends the sequence's rows out as above
    and all-gathers the joint rows along heads; the groups' joint outputs are put in head order as the
    sequence's (`plan.out_runs`), ``[B, S_j, H, D_v]``, the same on every rank."""
    overlap = plan.chunks > 1  # one group: nothing to overlap with, every collective runs where it starts
    incoming = _start_group(backend, plan.groups[0], inputs, overlap)
    masks = {}
    if segment_ids is not None:  # the whole sequence's ids (integers: forward only)
        masks["segment_ids"] = backend.gather_segments(segment_ids, plan.out_scatter_sizes)
    if plan.mask is not None:  # a rule on the gathered sequence's positions (0 .. S - 1): static, nothing sent
        masks["mask"] = plan.mask
    outgoing, joint_outputs = [], []
    for index, group in enumerate(plan.groups):
        local = _received(incoming)
        if index + 1 < plan.chunks:
            incoming = _start_group(backend, plan.groups[index + 1], inputs, overlap)
        if plan.joint is not None:
            local = _with_joint(backend, plan.joint, index, local, inputs)
        out = backend.attend(plan, group, local, masks)
        if plan.joint is not None:
            out, joint_out = _cut_joint(plan.joint, out)
            joint_outputs.append(backend.gather_heads(joint_out, plan.joint.groups[index].out_gather_sizes))
        outgoing.append(backend.start_output(out, plan.out_scatter_sizes, group.out_gather_sizes, overlap))
    result = _result(backend, plan, [pending.wait() for pending in outgoing])
    if plan.joint is None:
        return result
    return result, _result(backend, plan, joint_outputs)
