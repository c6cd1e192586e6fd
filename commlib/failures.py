"""Failed collectives: the text of a backend error (gloo / NCCL ``RuntimeError``) turned into a
`commlib.CommTimeout` (a rank never arrived within the process group's timeout) or a `commlib.CommFailure`
(the connection to a rank was closed: by that rank's own failed or timed-out collective, or by its death), naming
the op and the group.

Both are ``RuntimeError`` subclasses, not `CommError`: the call was valid, the group failed.

>>> failure("all_reduce", "[../gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", rank=0,
...         group_ranks=[0, 1])
CommFailure("all_reduce: group rank 0 of the group with global ranks [0, 1] lost its connection to another rank, which closed it: that rank stopped answering (it may have raised an error and gone on to another collective, which failed or timed out: see that rank's output), or it died or left the group. Received: backend_error='Connection closed by peer [127.0.0.1]:1234'")
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from commlib.errors import CommFailure, CommTimeout, comm_error

__all__ = ["failure"]

# Lower-case fragments of backend error texts (gloo, NCCL, c10d store) and what they mean.
_TIMEOUT_TEXTS = ("timed out", "timeout")
_PEER_TEXTS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote worker crash",
    "remote process exited",
    "socket closed",
    "communicator was aborted",
    "nccl error",
    "connection refused",
)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _backend_text(text: str) -> str:
    """The backend message's first line, without gloo's ``[.../file.cc:78] `` source prefix and its
    "This is typically caused by ..." advice."""
    first = (text.strip().splitlines() or [""])[0]
    return _SOURCE_PREFIX.sub("", first).split(" This is typically caused by")[0].strip()


def failure(
    op_name: str,
    error_text: str,
    *,
    rank: int,
    group_ranks: Sequence[int],
    phase: str = "forward",
    received: dict[str, object] | None = None,
) -> CommFailure | None:
    """The `CommTimeout` / `CommFailure` for a backend error of a collective, or None if the text is neither
    a timeout nor a lost peer (e.g. out of memory: then the backend's error stands).

    `rank` is this rank's group rank, `group_ranks` the group's global ranks (group-local order).
    """
    lowered = error_text.lower()
    name = op_name if phase == "forward" else f"{op_name} backward"
    group = f"group rank {rank} of the group with global ranks {list(group_ranks)}"
    details = {**(received or {}), "backend_error": _backend_text(error_text)}
    if any(text in lowered for text in _TIMEOUT_TEXTS):
        message = (
            f"timed out on {group} waiting for the other ranks: a rank did not join this collective (it may have "
            f"raised an error and stayed alive: see that rank's output), or it is stuck or dead"
        )
        return CommTimeout(str(comm_error(name, message, **details)))
    if any(text in lowered for text in _PEER_TEXTS):
        # gloo closes a pair when its own side of a collective fails or times out, so a live rank that raised
        # and went on to another collective is reported exactly as a dead one: the text cannot tell them apart
        message = (
            f"{group} lost its connection to another rank, which closed it: that rank stopped answering (it may have "
            f"raised an error and gone on to another collective, which failed or timed out: see that rank's "
            f"output), or it died or left the group"
        )
        return CommFailure(str(comm_error(name, message, **details)))
    return None
