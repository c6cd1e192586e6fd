"""One error family and one message format for every op, shared by both frontends.

Format (jax / Keras 3 style: op, quantity, both numbers, then what was received)::

    all_to_all_4d: heads (6) must be divisible by world_size (4). Received: shape=(2, 8, 6, 64), scatter_dim=2, gather_dim=1
"""

from __future__ import annotations

__all__ = ["CommError", "comm_error", "kind_error"]


class CommError(ValueError):
    """A bad value given to a collective (shape, dim, op, rank, ...), raised before any communication."""


def _received(received: dict[str, object]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in received.items())


def comm_error(op_name: str, message: str, /, **received: object) -> CommError:
    """Build the `CommError` for op `op_name`: ``"{op_name}: {message}. Received: k=v, ..."``."""
    suffix = f". Received: {_received(received)}" if received else "."
    return CommError(f"{op_name}: {message}{suffix}")


def kind_error(op_name: str, message: str, /, **received: object) -> TypeError:
    """Build the `TypeError` (a wrong kind of argument) in the same format as `comm_error`."""
    suffix = f". Received: {_received(received)}" if received else "."
    return TypeError(f"{op_name}: {message}{suffix}")
