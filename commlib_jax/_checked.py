"""Checked mode (JAX): what it means where one program runs on every device.

A ``jax.shard_map`` / ``jax.pmap`` program is traced once and that one trace runs on every device, so a
layer's options -- Python values when it is traced -- and the shapes and dtypes of its collectives are the
same on every device by construction: one trace cannot disagree, and a single process needs no check.

Several processes (``jax.distributed``) each trace their own copy, and theirs can differ. With
``COMMLIB_CHECK=1`` (`commlib.check.says_checked`) and more than one process, an attention layer, when it is
traced, puts its `commlib.layer_check.LayerCall` in the coordinator's key-value store, reads every other process's,
and every process raises the same `commlib.CommError` naming the layer and the options where they differ
("rank" r: process r). This runs on the host while the layer is traced, before anything is compiled. A call
found in jit's cache is not traced, so not compared, again: a process that alone changes an option later
retraces alone and raises `commlib.CommTimeout` when the others' calls do not come (`TIMEOUT_MS`).

Values, not options, can differ per device in one process too: with ``COMMLIB_CHECK=1`` (`checks_data`, any
number of processes) `commlib_jax.sequence.cross_entropy` also all-gathers each rank's count and first label
outside ``[0, V)`` and a host callback raises the spec's `CommError` on every device when the step runs (inside
``jax.errors.JaxRuntimeError``, as the `parallel` context's positions check).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import jax

from commlib import check, layer_check
from commlib.errors import CommTimeout, comm_error
from commlib_jax._compat import distributed_client
from commlib_jax._dtypes import dtype_name
from commlib_jax._types import ARRAY_NAME, ARRAY_TYPES

__all__ = ["TIMEOUT_MS", "LayerFrontend", "checks_data", "exchange_layer", "is_checked"]

#: How long a process waits for the others' options (they may still be compiling an earlier program).
TIMEOUT_MS = 300_000
_exchanges = itertools.count()  # the n-th layer this process traced: its calls' keys in the store


def is_checked() -> bool:
    """True when ``COMMLIB_CHECK`` turns checked mode on and several processes run the program (read when a
    layer is traced)."""
    return check.says_checked(os.environ.get(check.ENV_VARIABLE)) and jax.process_count() > 1


def checks_data() -> bool:
    """True when ``COMMLIB_CHECK`` turns checked mode on, in any number of processes: the checks of values a
    traced program cannot raise on (`commlib_jax.sequence.cross_entropy`'s labels), which differ per device even
    in one process; each costs a collective and a host callback per call (read when the call is traced)."""
    return check.says_checked(os.environ.get(check.ENV_VARIABLE))


def exchange_layer(call: layer_check.LayerCall) -> None:
    """Compare `call` with the other processes' n-th traced layer: return where every process's is the same,
    else raise the spec's `CommError` on every process (`commlib.layer_check.compare_layers`)."""
    client, index, number = distributed_client(), jax.process_index(), next(_exchanges)
    key = f"commlib/checked/{number}"
    client.key_value_set_bytes(f"{key}/{index}", call.encode())
    calls = []
    for process in range(jax.process_count()):
        try:
            calls.append(
                layer_check.LayerCall.decode(client.blocking_key_value_get_bytes(f"{key}/{process}", TIMEOUT_MS))
            )
        except Exception as error:  # the runtime's deadline error (its type is jaxlib's, private)
            raise _timeout(call, process, number, index) from error
    try:  # every process has read every call before any raises (and may exit: one hosts the store)
        client.wait_at_barrier(f"{key}/read", TIMEOUT_MS)
    except Exception as error:
        raise _timeout(call, None, number, index) from error
    layer_check.compare_layers(calls, index)


def _timeout(call: layer_check.LayerCall, process: int | None, number: int, index: int) -> CommTimeout:
    who = "a process" if process is None else f"process {process}"
    message = (
        f"{who} did not compare layer #{number} within {TIMEOUT_MS / 1000:g} s: every process must trace "
        "the same layers (a process whose call was found in jit's cache does not trace it again)"
    )
    return CommTimeout(str(comm_error(call.layer, message, rank=index)))


class LayerFrontend:
    """`commlib.layer_call.LayerFrontend` for JAX: the arrays a layer takes, and checked mode across processes."""

    array_types: tuple[type, ...] = ARRAY_TYPES
    array_name = ARRAY_NAME

    def dtype_name(self, x: Any) -> str:
        return dtype_name(x.dtype)

    def checked(self) -> bool:
        return is_checked()

    def exchange_layer(self, call: layer_check.LayerCall) -> None:
        exchange_layer(call)
