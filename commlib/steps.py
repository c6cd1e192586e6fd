"""The step kinds of a plan: what happens between its pack and unpack passes, each with only the fields it needs.

A `Plan` (`commlib.layout`) has exactly one `Step`. Two families:

- the collectives (`Collective`), which move data between ranks, each a dim-0 collective on the packed buffer:
  `AllReduce` and `Reduce` (a reduce op; `Reduce` a root), `Broadcast` (a root), `AllGather` and `Gather` (the
  gathered dim; `Gather` a root), `ReduceScatter` (the scattered dim, a reduce op), `Scatter` (the scattered
  dim, a root), `AllToAll` (its two dims) and `Permute` (its (source, destination) pairs);
- the local steps (`LocalStep`), which move no data between ranks: `Identity` (with the plan's scale: a
  multiply), `Slice` (rank r keeps block r of `dim`) and `Pad` (rank r's input becomes block r of zeros along
  `dim`, the transpose of `Slice`). They are what the gradient rules of `commlib.gradients` are made of besides
  the collectives, so every backward is a plan the frontends walk; `Slice` is also `shard`'s forward.

Roots and pairs are group-local ranks; dims are normalised (in ``[0, ndim)``). Every kind has a class-level
`name` (the collective's name in messages, "all_reduce", ...) and `is_local`. Code that walks or transforms
a plan dispatches on the step with ``match`` and ends in ``typing.assert_never``, so a new kind that one of
them does not handle is a mypy error there.

>>> AllToAll(scatter_dim=2, gather_dim=1).name, Slice(dim=0).is_local
('all_to_all', True)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, TypeAlias, assert_never

from commlib.reduce_op import ReduceOp

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Broadcast",
    "Collective",
    "Gather",
    "Identity",
    "LocalStep",
    "Pad",
    "Permute",
    "Reduce",
    "ReduceScatter",
    "Scatter",
    "Slice",
    "Step",
    "dims",
    "gathered_dim",
    "scattered_dim",
]


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """Every rank gets the reduction over ranks."""

    name: ClassVar[str] = "all_reduce"
    is_local: ClassVar[bool] = False
    op: ReduceOp


@dataclasses.dataclass(frozen=True)
class Reduce:
    """Rank `root` gets the reduction over ranks, the others nothing (their outputs are zeros)."""

    name: ClassVar[str] = "reduce"
    is_local: ClassVar[bool] = False
    op: ReduceOp
    root: int


@dataclasses.dataclass(frozen=True)
class Broadcast:
    """Every rank gets rank `root`'s buffer."""

    name: ClassVar[str] = "broadcast"
    is_local: ClassVar[bool] = False
    root: int


@dataclasses.dataclass(frozen=True)
class AllGather:
    """Every rank gets every rank's buffer, stacked in rank order; the unpack places them along `dim`."""

    name: ClassVar[str] = "all_gather"
    is_local: ClassVar[bool] = False
    dim: int  # the gathered dim of the plan's output


@dataclasses.dataclass(frozen=True)
class Gather:
    """`AllGather` received on rank `root` only."""

    name: ClassVar[str] = "gather"
    is_local: ClassVar[bool] = False
    dim: int
    root: int


@dataclasses.dataclass(frozen=True)
class ReduceScatter:
    """Rank r gets block r of the reduction over ranks of the packed buffer (blocks of `dim`)."""

    name: ClassVar[str] = "reduce_scatter"
    is_local: ClassVar[bool] = False
    dim: int  # the scattered dim of the plan's input
    op: ReduceOp


@dataclasses.dataclass(frozen=True)
class Scatter:
    """Rank r gets block r of rank `root`'s packed buffer (blocks of `dim`)."""

    name: ClassVar[str] = "scatter"
    is_local: ClassVar[bool] = False
    dim: int
    root: int


@dataclasses.dataclass(frozen=True)
class AllToAll:
    """Block j of `scatter_dim` goes to rank j; the blocks received go along `gather_dim` in rank order."""

    name: ClassVar[str] = "all_to_all"
    is_local: ClassVar[bool] = False
    scatter_dim: int
    gather_dim: int


@dataclasses.dataclass(frozen=True)
class Permute:
    """For each (source, destination) pair, rank destination gets rank source's buffer; others get nothing."""

    name: ClassVar[str] = "permute"
    is_local: ClassVar[bool] = False
    pairs: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Identity:
    """The input itself (times the plan's scale)."""

    name: ClassVar[str] = "identity"
    is_local: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rank r keeps block r of `dim`."""

    name: ClassVar[str] = "slice"
    is_local: ClassVar[bool] = True
    dim: int


@dataclasses.dataclass(frozen=True)
class Pad:
    """Rank r's input becomes block r of zeros along `dim` (the transpose of `Slice`)."""

    name: ClassVar[str] = "pad"
    is_local: ClassVar[bool] = True
    dim: int


Collective: TypeAlias = (
    AllReduce | Reduce | Broadcast | AllGather | Gather | ReduceScatter | Scatter | AllToAll | Permute
)
LocalStep: TypeAlias = Identity | Slice | Pad
Step: TypeAlias = Collective | LocalStep


def scattered_dim(step: Step) -> int | None:
    """The dim the step splits over ranks (whole on input, a block per rank on output), None where none is."""
    match step:
        case AllToAll(scatter_dim=dim) | ReduceScatter(dim=dim) | Scatter(dim=dim) | Slice(dim=dim):
            return dim
        case AllGather() | Gather() | Pad() | AllReduce() | Reduce() | Broadcast() | Permute() | Identity():
            return None
        case _:
            assert_never(step)


def gathered_dim(step: Step) -> int | None:
    """The dim the step joins over ranks (a block per rank on input, whole on output), None where none is."""
    match step:
        case AllToAll(gather_dim=dim) | AllGather(dim=dim) | Gather(dim=dim) | Pad(dim=dim):
            return dim
        case ReduceScatter() | Scatter() | Slice() | AllReduce() | Reduce() | Broadcast() | Permute() | Identity():
            return None
        case _:
            assert_never(step)


def dims(step: Step) -> tuple[int, ...]:
    """The step's dims in the order the user gives them: ``(scatter_dim, gather_dim)``, ``(dim,)`` or ``()``
    (what checked mode's fingerprint and messages show).

    >>> dims(AllToAll(2, 1)), dims(Gather(dim=0, root=3)), dims(Permute(((0, 1),)))
    ((2, 1), (0,), ())
    """
    match step:
        case AllToAll(scatter_dim=scatter_dim, gather_dim=gather_dim):
            return (scatter_dim, gather_dim)
        case (
            AllGather(dim=dim)
            | Gather(dim=dim)
            | ReduceScatter(dim=dim)
            | Scatter(dim=dim)
            | Slice(dim=dim)
            | Pad(dim=dim)
        ):
            return (dim,)
        case AllReduce() | Reduce() | Broadcast() | Permute() | Identity():
            return ()
        case _:
            assert_never(step)
