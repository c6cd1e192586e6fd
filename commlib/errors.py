"""Every exception commlib raises, and the one message format shared by both frontends.

Format (jax / Keras 3 style: op, quantity, both numbers, then what was received)::

    all_to_all_4d: heads (6) must be divisible by world_size (4). Received: shape=(2, 8, 6, 64), scatter_dim=2, gather_dim=1

- `CommError` (a ``ValueError``): a bad value given to a collective, raised before any communication.
- ``TypeError``: a wrong kind of argument (built by `kind_error`, same format).
- `CommFailure` / `CommTimeout` (``RuntimeError``s): a valid collective the group could not complete.
"""

from __future__ import annotations

__all__ = ["CommError", "CommFailure", "CommTimeout", "comm_error", "kind_error"]


class CommError(ValueError):
    """A bad value given to a collective (shape, dim, op, rank, ...), raised before any communication."""


class CommFailure(RuntimeError):
    """A valid collective that could not complete: a rank of the group died or its connection broke.

    A ``RuntimeError`` (as the backend's own errors are), not a `CommError`: the call was fine, the group
    failed. The backend's error is chained as ``__cause__``; the process group is unusable afterwards.
    """


class CommTimeout(CommFailure):
    """A collective that timed out waiting for the other ranks (one skipped the call, is stuck, or died)."""


def _received(received: dict[str, object]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in received.items())


def _message(op_name: str, message: str, received: dict[str, object]) -> str:
    suffix = f". Received: {_received(received)}" if received else "."
    return f"{op_name}: {message}{suffix}"


def comm_error(op_name: str, message: str, /, **received: object) -> CommError:
    """The `CommError` of op `op_name`: ``"{op_name}: {message}. Received: k=v, ..."``.

    >>> comm_error("all_gather", "dim (2) must be in [-2, 2) for ndim 2", shape=(3, 5), dim=2)
    CommError('all_gather: dim (2) must be in [-2, 2) for ndim 2. Received: shape=(3, 5), dim=2')
    """
    return CommError(_message(op_name, message, received))


def kind_error(op_name: str, message: str, /, **received: object) -> TypeError:
    """The ``TypeError`` (a wrong kind of argument) in the same format as `comm_error`.

    >>> kind_error("all_reduce", "dim must be an int, not str", dim="0")
    TypeError("all_reduce: dim must be an int, not str. Received: dim='0'")
    """
    return TypeError(_message(op_name, message, received))
