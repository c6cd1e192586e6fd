"""Checked mode (torch): before a collective, the ranks compare a fingerprint of the call.

In checked mode (``COMMLIB_CHECK=1``, `set_checked`, or ``with checked():``) every collective -- forward,
backward and higher derivatives -- first all-gathers a fixed-size int64 fingerprint of its call over the same
group (on the input's device; `commlib.check` encodes and compares), so a rank that disagrees on op, shape,
dtype, dims, reduce op, convention, root, perm or accum_dtype makes every rank raise the same
`commlib.CommError` before the real collective runs. `DeviceCommunicator.gather` is checked the same way, and
`DeviceCommunicator.send` / `recv` swap fingerprints between the two ends (`exchange_pair`).

The attention layers are checked once more, before their first collective, on the options the user passed
(`exchange_layer`: `commlib.layer_check.LayerCall`), so a disagreement is named by the layer and its argument
(``ulysses_attention: ranks disagree on seq_sizes: ...``), not by an internal buffer.

It costs one small all_gather (plus, on CUDA, one device-to-host copy) per collective. It is eager-only:
under ``torch.compile`` the ops run unchecked. Ranks must all be in checked mode or all out of it (the
exchange is itself a collective).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from commlib import check, layer_check
from commlib.layout import Plan
from commlib.steps import Permute
from commlib_torch._compat import all_gather_single
from commlib_torch._dtypes import dtype_name
from commlib_torch._groups import ResolvedGroup, group_rank, group_size

__all__ = [
    "ENV_VARIABLE",
    "LayerFrontend",
    "checked",
    "exchange",
    "exchange_layer",
    "exchange_pair",
    "is_checked",
    "set_checked",
]

ENV_VARIABLE = check.ENV_VARIABLE
_override: bool | None = None  # set_checked / checked(); None: follow the environment variable


# ``os.environ.get`` of an unset variable raises and catches a KeyError inside (~0.6 us, a tenth of a small
# collective's host time): read os.environ's own mapping, which it keeps in step, where CPython has one.
_ENVIRON: Mapping = getattr(os.environ, "_data", os.environ)
_ENVIRON_KEY = os.environ.encodekey(ENV_VARIABLE) if _ENVIRON is not os.environ else ENV_VARIABLE


@functools.lru_cache(maxsize=16)
def _says_checked(value: str | bytes) -> bool:
    return check.says_checked(value)


def is_checked() -> bool:
    """True when collectives exchange fingerprints first (`set_checked` / `checked`, else ``COMMLIB_CHECK``,
    read on every call)."""
    if _override is not None:
        return _override
    value = _ENVIRON.get(_ENVIRON_KEY)
    return value is not None and _says_checked(value)


def set_checked(enabled: bool | None) -> None:
    """Turn checked mode on or off in this process, whatever ``COMMLIB_CHECK`` says (None: follow it again)."""
    global _override
    _override = None if enabled is None else bool(enabled)


@contextlib.contextmanager
def checked(enabled: bool = True) -> Iterator[None]:
    """``with checked():`` -- checked mode inside the block (``checked(False)``: off), restored after."""
    global _override
    previous, _override = _override, bool(enabled)
    try:
        yield
    finally:
        _override = previous


#: A call signature's (fingerprint, receive buffer, their call-number slots as numpy views on CPU).
_Buffers = tuple[torch.Tensor, torch.Tensor, "tuple[np.ndarray, np.ndarray] | None"]


@functools.lru_cache(maxsize=1024)
def _buffers(plan: Plan, dtype: torch.dtype, phase: str, device: torch.device) -> _Buffers:
    """(this rank's fingerprint, the all_gather's receive buffer, on CPU their call-number slots as numpy views)
    on `device`, made once per call signature.

    The fingerprint is only read but for the call's number (`exchange` writes it each time: through the numpy
    views on CPU, 0.3 us where two tensor writes take 5.5). The receive buffer is reused: every rank's row is
    written by each exchange and read on the host (a synchronisation) before the exchange returns, so no call
    sees another's. It starts as this rank's row repeated (its number written by each exchange too), so a
    backend that moves no data (torch's fake process group) compares equal rather than reading uninitialised
    memory."""
    mine = torch.from_numpy(check.fingerprint(plan, dtype_name(dtype), phase)).to(device)
    everyone = mine.repeat(plan.world_size)
    slots = None
    if device.type == "cpu":
        slots = (
            mine.numpy()[check.CALL_SLOT : check.CALL_SLOT + 1],
            everyone.numpy().reshape(-1, check.FINGERPRINT_SIZE)[:, check.CALL_SLOT],
        )
    return mine, everyone, slots


_calls = itertools.count()  # this process's numbers for its forward exchanges (`exchange`)


def exchange(
    plan: Plan, tensor: torch.Tensor, group: dist.ProcessGroup | None, phase: str = "forward", call: int | None = None
) -> int | None:
    """All-gather this rank's fingerprint of (`plan`, `tensor`'s dtype, `phase`) over `group`; raise the
    spec's `CommError` on every rank if any rank's differs. A forward is numbered (this process's next number)
    and returns the number the ranks agree on (`commlib.check.agreed_call`: group rank 0's), which each
    collective of its backward passes as `call` (None: unnumbered), so that ranks whose backwards run different
    forward calls' collectives raise."""
    mine, everyone, slots = _buffers(plan, tensor.dtype, phase, tensor.device)
    number = next(_calls) if phase == "forward" else call
    slot = -1 if number is None else number
    if slots is not None:  # (the cached rows: their other slots stay as made)
        slots[0][:] = slots[1][:] = slot
    else:
        mine[check.CALL_SLOT] = slot
        everyone.view(-1, check.FINGERPRINT_SIZE)[:, check.CALL_SLOT] = slot
    all_gather_single(everyone, mine, group=group)
    rows = everyone.cpu().numpy()
    check.compare(rows, group_rank(group))
    return check.agreed_call(rows) if phase == "forward" else call


def exchange_pair(plan: Plan, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Checked mode for one send/recv: the two ends (the pair of `plan`'s `Permute` step, group-local) swap
    fingerprints of the transfer each expects (the sender's tensor, the receiver's size and dtype) and both raise
    the spec's `CommError` if they differ. The fingerprints travel by send/recv themselves, sender first."""
    assert isinstance(plan.step, Permute), plan
    ((source, destination),) = plan.step.pairs
    rank = dist.get_rank(group)
    mine = torch.from_numpy(check.fingerprint(plan.replace(op_name="send/recv"), dtype_name(tensor.dtype)))
    mine, theirs = mine.to(tensor.device), torch.empty(check.FINGERPRINT_SIZE, dtype=torch.int64, device=tensor.device)
    peer = destination if rank == source else source
    peer_global = peer if group is None else dist.get_global_rank(group, peer)
    steps = [lambda: dist.send(mine, peer_global, group), lambda: dist.recv(theirs, peer_global, group)]
    for step in steps if rank == source else reversed(steps):
        step()
    rows = torch.stack([mine, theirs] if rank == source else [theirs, mine]).cpu().numpy()
    check.compare(rows, rank, ranks=(source, destination))


def _gather(mine: torch.Tensor, groups: Sequence[ResolvedGroup]) -> torch.Tensor:
    """Every rank's `mine` (1-D, the same length on every rank) as rows: all-gathered over each group in turn
    (each rank sending the rows it has), so the rows of ``groups = (inner, outer)`` are ordered ``outer rank *
    inner size + inner rank``."""
    rows = mine.reshape(1, -1)
    for group in groups:
        everyone = rows.new_empty(group_size(group) * rows.numel())
        all_gather_single(everyone, rows.reshape(-1), group=group)
        rows = everyone.view(-1, rows.shape[1])
    return rows


def _index(groups: Sequence[ResolvedGroup]) -> int:
    """This rank's row in `_gather`'s rows."""
    index, before = 0, 1
    for group in groups:
        index, before = group_rank(group) * before + index, before * group_size(group)
    return index


def exchange_layer(call: layer_check.LayerCall, groups: Sequence[ResolvedGroup], device: torch.device) -> None:
    """Checked mode for a layer, before its first collective: the ranks of `groups` (one group, or USP's
    Ulysses then ring group: every rank of both) all-gather `call`'s fingerprint; where the rows differ they
    all-gather their calls' texts too, and every rank raises the spec's `CommError` naming the layer and the
    options they disagree on (`commlib.layer_check.compare_layers`; ranks numbered by row: group rank, or USP's shard
    index ``r * U + u``)."""
    rows = _gather(torch.from_numpy(call.fingerprint()).to(device), groups).cpu().numpy()
    index = _index(groups)
    if not layer_check.layers_differ(rows):
        check.compare(rows, index)  # equal: returns; a collective where another rank runs a layer: raises
        return
    text = torch.frombuffer(bytearray(call.encode()), dtype=torch.uint8)
    lengths = _gather(torch.tensor([len(text)], device=device), groups).cpu().reshape(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(text)] = text
    texts = _gather(padded.to(device), groups).cpu().numpy()
    calls = [layer_check.LayerCall.decode(row[:length].tobytes()) for row, length in zip(texts, lengths, strict=True)]
    layer_check.compare_layers(calls, index)


class LayerFrontend:
    """`commlib.layer_call.LayerFrontend` for torch: a layer over `groups` (its group, or USP's Ulysses then
    ring group) whose checked-mode exchange runs on q's device."""

    array_types: tuple[type, ...] = (torch.Tensor,)
    array_name = "torch.Tensor"

    def __init__(self, groups: Sequence[ResolvedGroup], q: object) -> None:
        self.groups, self.q = tuple(groups), q

    def dtype_name(self, x: torch.Tensor) -> str:
        return dtype_name(x.dtype)

    def checked(self) -> bool:
        return is_checked() and not torch.compiler.is_compiling()

    def exchange_layer(self, call: layer_check.LayerCall) -> None:
        exchange_layer(call, self.groups, self.q.device)  # type: ignore[attr-defined]  # q is a tensor by now
