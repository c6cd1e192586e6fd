"""Layout plans: how a local tensor becomes the contiguous dim-0 buffer a collective sends, and back.

Every collective of the project is run as ``pack -> dim-0 collective -> unpack``. A `Rearrange` is one
local pass (view the source as `split_shape`, permute its axes by `perm`, lay the result out contiguously); when
the permutation keeps the memory order of every axis longer than 1 the pass is a view, not a copy. The
torch frontend and the numpy reference both walk these plans, so the reference tests the plans themselves.
JAX hands the dims to `lax` and lets XLA choose the layout.

Geometry (W = world_size, n = size // W), one rank's view of the all-to-all on ``scatter_dim=a,
gather_dim=b``::

    input  s                   -- view --> s[:a] + (W, n) + s[a+1:]
           pack: move the W axis first -> send [W, *chunk],   chunk = s[:a] + (n,) + s[a+1:]
    all_to_all_single          -> recv [W, *chunk]   (recv[i] = rank i's chunk for this rank)
           unpack: move the W axis in front of b, merge (W, s[b]) -> output, shape[a] /= W, shape[b] *= W

Uneven sizes (`commlib.uneven`) add two kinds of local pass: `Blocks` (the exact layout: W slices of different
sizes into or out of one flat buffer, around an all_to_all_v) and `Take` (the padded layout: a static index map
around the even collective on padded shapes).

A `Plan` is composed of typed records, not one record of optional fields: its `step` (`commlib.steps`: which
collective or local step, with only that kind's dims, root, reduce op or pairs), its `Layout` (the pack and
unpack passes, which every plan has and every walk reads the same way), its `Arithmetic` (scales and the
accumulation dtype, `PLAIN` for most plans) and, for uneven sizes only, `Exact` or `Padded`. Why this cut:
each walk has one question per record, asked once -- which kind (one ``match`` on the step, in the walk's
builder, never per call), which passes (the layout, the same code for every kind), which arithmetic (the same
code too), which uneven layout (the exact or the padded walk) -- so no walk reads a field whose meaning depends
on another, and a new step kind is a mypy error in every ``match`` that does not handle it. Fields every
plan has (op name, world size, shapes, dtype, convention, the wire view of a dtype the backend lacks) stay
the plan's own. Per call, torch reads a derived field (`Plan.is_trivial`) and the step's type and reduce op
(`commlib.gradients.needs_primal`); the rest is read once, when it makes the plan's walk.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

from commlib.plan_cache import held_cache
from commlib.steps import Gather, Permute, Reduce, Scatter, Step, gathered_dim

__all__ = [
    "Arithmetic",
    "Convention",
    "Exact",
    "Layout",
    "Padded",
    "PLAIN",
    "Rearrange",
    "Blocks",
    "Take",
    "Plan",
    "all_to_all_layout",
    "all_gather_layout",
    "reduce_scatter_layout",
    "flat_layout",
    "local_layout",
    "permute_splits",
    "rooted_splits",
    "reorder_pairs",
    "completed_pairs",
    "offsets",
    "resized",
]

Shape = tuple[int, ...]


class Convention(str, enum.Enum):
    """How a plan's gradient counts the ranks (docs/gradients.md).

    - `SUM`: each rank's loss is its own and the objective is their sum: the VJP is the exact transpose of
      the collective over all ranks.
    - `REPLICATED`: the output is replicated (every rank computes the same loss from it, counted once), so
      the incoming cotangent is already the full gradient (Megatron's g).
    - `REPLICATED_INPUT`: the input is replicated (the same value on every rank), so its gradient is the sum
      of every rank's (Megatron's f and split: `sum_grad`, `shard`). Users do not pass it; the ops set it.
    """

    SUM = "sum"
    REPLICATED = "replicated"
    REPLICATED_INPUT = "replicated_input"

    def __repr__(self) -> str:
        return repr(self.value)


def _derived(value: object, **fields: object) -> None:
    """Set the derived (non-init) fields of a frozen dataclass: computed once, when the plan is built, so the
    frontends read attributes per call (no properties or caches: torch.compile traces plain attributes)."""
    for name, field_value in fields.items():
        object.__setattr__(value, name, field_value)


@dataclasses.dataclass(frozen=True)
class Rearrange:
    """One local pass: ``source.reshape(split_shape).permute(perm)``, laid out contiguously.

    >>> Rearrange(split_shape=(1, 4, 3), perm=(1, 0, 2)).is_identity  # moves only a size-1 axis
    True
    >>> Rearrange(split_shape=(2, 4, 3), perm=(1, 0, 2)).is_identity
    False
    """

    split_shape: Shape  # the source's shape with at most one axis split in two (always a view, any strides)
    perm: tuple[int, ...]  # destination axis order over `split_shape`'s axes
    always_copy: bool = False  # True when the collective writes in place and needs a fresh buffer
    # Derived when built (`_derived`): the shape after the permutation (before any final reshape); whether the
    # permutation keeps memory order (moves only size-1 axes); whether a contiguous source needs no pass.
    out_shape: Shape = dataclasses.field(init=False, repr=False, compare=False)
    keeps_order: bool = dataclasses.field(init=False, repr=False, compare=False)
    is_identity: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        moved = [axis for axis in self.perm if self.split_shape[axis] != 1]
        keeps_order = moved == sorted(moved)
        _derived(
            self,
            out_shape=tuple(self.split_shape[axis] for axis in self.perm),
            keeps_order=keeps_order,
            is_identity=keeps_order and not self.always_copy,
        )

    def merged(self) -> tuple[Shape, tuple[int, ...]]:
        """The same permutation over the fewest axes (size-1 axes dropped, co-moving neighbours merged).

        E.g. the Ulysses pack ``[B, S/W, W, H/W, D]`` by ``(2, 0, 1, 3, 4)`` merges to
        ``[B*S/W, W, H/W*D]`` by ``(1, 0, 2)``: a single batched transpose, the shape a pack kernel takes.

        >>> Rearrange(split_shape=(2, 8, 4, 3, 16), perm=(2, 0, 1, 3, 4)).merged()
        ((16, 4, 48), (1, 0, 2))
        """
        order = [axis for axis in self.perm if self.split_shape[axis] != 1]
        groups: list[list[int]] = []
        for axis in order:
            if groups and groups[-1][-1] == axis - 1 - _ones_between(self.split_shape, groups[-1][-1], axis):
                groups[-1].append(axis)
            else:
                groups.append([axis])
        by_source = sorted(range(len(groups)), key=lambda g: groups[g][0])
        shape = tuple(math.prod(self.split_shape[axis] for axis in groups[g]) for g in by_source)
        perm = tuple(by_source.index(g) for g in range(len(groups)))
        return shape, perm


def _ones_between(shape: Shape, left: int, right: int) -> int:
    """Number of size-1 axes strictly between `left` and `right` (they do not break adjacency)."""
    return sum(1 for axis in range(left + 1, right) if shape[axis] == 1)


def offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Where each rank's rows start in the whole dim: running sums of `sizes`.

    >>> offsets((2, 2, 1, 1))
    (0, 2, 4, 5)
    """
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return tuple(starts)


def resized(shape: Shape, dim: int, size: int) -> Shape:
    """`shape` with ``shape[dim] = size``."""
    return (*shape[:dim], size, *shape[dim + 1 :])


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One local pass of the exact layout, between a tensor of `shape` and a flat buffer of blocks: block j is
    rows ``[starts[j], starts[j] + sizes[j])`` of `dim`, laid out contiguously after block j - 1.

    As a pack, the blocks are copied out of the input (block j goes to rank j); as an unpack, block i (from
    rank i) is written into the output at its rows, zeros where no block lands, or, with `reduce`, the blocks
    (each the whole output) are summed. W narrow copies into one buffer are one pass.
    """

    shape: Shape  # the tensor's shape: the input of a pack, the output of an unpack
    dim: int  # the dim the blocks slice
    starts: tuple[int, ...]  # first row of each block along `dim`
    sizes: tuple[int, ...]  # rows of each block (0: an empty block)
    reduce: bool = False  # unpack only: sum the blocks instead of placing them

    @property
    def counts(self) -> tuple[int, ...]:
        """Elements of each block: the split sizes of ``all_to_all_single``."""
        row = math.prod(self.shape[: self.dim]) * math.prod(self.shape[self.dim + 1 :])
        return tuple(size * row for size in self.sizes)

    @property
    def numel(self) -> int:
        """Elements of the flat buffer."""
        return sum(self.counts)

    def block_shape(self, index: int) -> Shape:
        return resized(self.shape, self.dim, self.sizes[index])

    def pieces(self) -> tuple[tuple[int, int, int, int, Shape], ...]:
        """``(start, rows, buffer offset, elements, block shape)`` of each non-empty block, in buffer order."""
        result, offset = [], 0
        for index, (start, size, count) in enumerate(zip(self.starts, self.sizes, self.counts, strict=True)):
            if count:
                result.append((start, size, offset, count, self.block_shape(index)))
            offset += count
        return tuple(result)

    @property
    def covers(self) -> bool:
        """True when the blocks tile the whole dim (an unpack then writes every element: no zero fill)."""
        if self.reduce:
            return True
        spans = sorted((start, size) for start, size in zip(self.starts, self.sizes, strict=True) if size)
        end = 0
        for start, size in spans:
            if start != end:
                return False
            end += size
        return end == self.shape[self.dim]

    @property
    def is_identity(self) -> bool:
        """True when the buffer is the tensor's own memory (contiguous): no pass, a view.

        That is the case when the non-empty blocks, in buffer order, tile the dim from row 0 and either one of
        them is the whole tensor or every dim before `dim` has size 1 (each block is then one memory range).
        """
        if self.reduce or self.numel != math.prod(self.shape):
            return False
        pieces = self.pieces()
        if not pieces:
            return True
        end = 0
        for start, size, *_ in pieces:
            if start != end:
                return False
            end += size
        return end == self.shape[self.dim] and (len(pieces) == 1 or math.prod(self.shape[: self.dim]) == 1)


@dataclasses.dataclass(frozen=True)
class Take:
    """A static index map along `dim` of the padded layout: ``out[..., i, ...] = x[..., index[i], ...]``, and
    zero where ``index[i] == source_size`` (one past the end: ``jnp.take(..., mode="fill")``).

    Kinds, for `sizes` of the sharded dim (M = max(sizes), N = sum(sizes)):

    - "pad": the whole dim (N rows) -> W blocks of M rows, block r = rank r's rows, then zeros;
    - "unpad": W blocks of M rows -> the whole dim (N rows): the inverse of "pad";
    - "slice" (per rank): the whole dim -> this rank's M rows (its own, then zeros);
    - "place" (per rank): this rank's M rows -> the whole dim, its rows in place, zeros elsewhere.
    """

    dim: int
    kind: str  # "pad", "unpad", "slice" or "place"
    sizes: tuple[int, ...]

    @property
    def per_rank(self) -> bool:
        """True when the map depends on the rank ("slice", "place"): index it with the rank, see `table`."""
        return self.kind in ("slice", "place")

    @property
    def source_size(self) -> int:
        """Rows of `dim` before the map (also the index that means zero)."""
        most = max(self.sizes, default=0)
        return {"unpad": len(self.sizes) * most, "place": most}.get(self.kind, sum(self.sizes))

    @property
    def rows(self) -> int:
        """Rows of `dim` after the map."""
        most = max(self.sizes, default=0)
        return {"pad": len(self.sizes) * most, "slice": most}.get(self.kind, sum(self.sizes))

    def index(self, rank: int | None = None) -> np.ndarray:
        """The map as an int array (read-only); `rank` is needed for the per-rank kinds."""
        if self.per_rank and rank is None:
            raise ValueError(f"Take {self.kind!r} is per rank: give the rank")
        return _index(self.kind, self.sizes, rank if self.per_rank else None)

    def table(self) -> np.ndarray:
        """``[W, rows]``: row r is rank r's map (the same row W times for a shared map)."""
        return np.stack([self.index(rank) for rank in range(len(self.sizes))])

    def runs(self) -> tuple[tuple[int | None, int], ...]:
        """A shared map as ``(source start, rows)`` runs in output order, None for rows of zeros: the output is
        their concatenation (static slices, which a compiler fuses into one pass).

        >>> Take(0, "pad", (2, 0, 3)).runs()
        ((0, 2), (None, 4), (2, 3))
        """
        if self.per_rank:
            raise ValueError(f"Take {self.kind!r} is per rank: it has no shared runs")
        runs: list[tuple[int | None, int]] = []
        for source in self.index().tolist():
            start = None if source == self.source_size else source
            if runs and (runs[-1][0] is None if start is None else runs[-1][0] == start - runs[-1][1]):
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((start, 1))
        return tuple(runs)


@held_cache(maxsize=512)
def _index(kind: str, sizes: tuple[int, ...], rank: int | None) -> np.ndarray:
    world_size, most, total, starts = len(sizes), max(sizes, default=0), sum(sizes), offsets(sizes)
    size_of, start_of = np.asarray(sizes, dtype=np.int64), np.asarray(starts, dtype=np.int64)
    if kind == "pad":
        block, row = np.divmod(np.arange(world_size * most), max(most, 1))
        index = np.where(row < size_of[block], start_of[block] + row, total)
    elif kind == "unpad":
        blocks = [block * most + np.arange(size) for block, size in enumerate(sizes)]
        index = np.concatenate([np.zeros(0, np.int64), *blocks])
    elif kind == "slice":
        row = np.arange(most)
        index = np.where(row < sizes[rank], starts[rank] + row, total)  # type: ignore[index]
    elif kind == "place":
        row = np.arange(total) - starts[rank]  # type: ignore[index]
        index = np.where((row >= 0) & (row < sizes[rank]), row, most)  # type: ignore[index]
    else:
        raise ValueError(f"unknown Take kind {kind!r}")
    index = index.astype(np.int64)
    index.flags.writeable = False
    return index


@dataclasses.dataclass(frozen=True)
class Layout:
    """The local passes around a plan's step: input -> send buffer, and received buffer -> output.

    Returned by the layout helpers below (for valid, normalised arguments) and by `commlib.uneven`.
    """

    pack: Rearrange | Blocks  # input -> contiguous send buffer of `send_shape` (Blocks: the exact layout)
    send_shape: Shape
    recv_shape: Shape  # what the step returns on this rank
    unpack: Rearrange | Blocks  # recv buffer -> a tensor of `out_shape`
    out_shape: Shape  # the unpack's output: the plan's output (before the padded layout's `after` map)


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """What a plan multiplies by and the dtype it reduces in (the defaults: nothing, the input's)."""

    scale: float = 1.0  # multiply the received buffer by this (1/W for avg), in the accumulation dtype
    scale_first: bool = False  # multiply every rank's value by `scale` before the step instead (half-precision avg)
    grad_scale: float = 1.0  # an extra factor of the VJP only, not of this plan (1/W for shard's scale_grad)
    accum_dtype: str | None = None  # dtype the reduction runs in (and the buffers travel in), None = the input's


#: The arithmetic of a plan that scales nothing and reduces (if at all) in the input's dtype. (A plan always
#: names its arithmetic: torch 2.13's Dynamo, which traces the builders, cannot wrap a dataclass instance
#: given as a field's default.)
PLAIN = Arithmetic()


@dataclasses.dataclass(frozen=True)
class Exact:
    """Uneven sizes held exactly (`commlib.uneven`; torch): the plan of one `rank`, whose sharded dim has
    ``sizes[rank]`` rows; pack and unpack are `Blocks` and the wire an all_to_all_v."""

    scatter_sizes: tuple[int, ...] | None  # rows of the scattered dim each rank keeps (None: that side is even)
    gather_sizes: tuple[int, ...] | None  # rows of the gathered dim each rank contributes
    rank: int  # the rank this plan is for


@dataclasses.dataclass(frozen=True)
class Padded:
    """Uneven sizes held padded (`commlib.uneven`; JAX): every rank's sharded dim has ``max(sizes)`` rows; the
    plan is the even one on the padded shapes between two static index maps."""

    scatter_sizes: tuple[int, ...] | None
    gather_sizes: tuple[int, ...] | None
    before: Take | None  # the map before the step (whole dim -> W padded blocks), None: none
    after: Take | None  # the map after the step (W padded blocks -> whole dim), None: none


Uneven = Exact | Padded


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated collective on one rank: pack, the dim-0 collective (or a local step), unpack.

    Composed of small typed records, each with only the fields it needs, so a walk reads what its step has and
    nothing has a meaning that depends on a kind: the `step` (`commlib.steps`: which collective or local step,
    with its dims, root, reduce op or pairs), the `layout` (the pack and unpack passes around it, every plan has
    them), the `arithmetic` (scales and the accumulation dtype; `PLAIN` for most plans) and, for uneven sizes
    only, `uneven` (`Exact` or `Padded`, the layout's sizes and rank or index maps). What every plan has
    besides (op name, world size, shapes, dtype, convention) is a field of its own. The walks dispatch on
    `step` (one ``match``), then read `layout` and `arithmetic` the same way for every kind; `uneven` picks the
    walk of the exact or padded layout. Built only by `commlib.plans` (validated first) and `commlib.gradients`
    (the plans of backward passes); the frontends and the reference walk it and never re-check.

    >>> from commlib import plans
    >>> [plans.all_to_all_4d((batch, 8, 12, 16), 4).copies for batch in (1, 2)]  # local passes
    [1, 2]
    """

    op_name: str  # the public op this plan belongs to, for messages
    step: Step  # the collective (or local step) between pack and unpack
    world_size: int
    in_shape: Shape  # this rank's input
    layout: Layout
    arithmetic: Arithmetic  # `PLAIN` for most plans
    dtype: str = "float32"  # the input's dtype name ("bfloat16", "int32", ...)
    convention: Convention = Convention.SUM  # how the gradient counts the ranks
    wire_view: str | None = None  # same-size dtype the backend moves `dtype`'s bits as (it lacks `dtype`)
    uneven: Exact | Padded | None = None  # uneven sizes (`commlib.uneven`): None = the even rule

    # Derived when built (plans are built once and walked on every call): this rank's output; the identity on
    # every rank (world size 1, a permute that keeps rank 0); uneven sizes (the walk is the exact or the padded
    # layout's); uneven sizes held exactly (torch: pack and unpack are `Blocks`, the wire an all_to_all_v); a
    # zero-size dim (no data moves on any rank); the local passes on a contiguous input (0, 1 or 2).
    out_shape: Shape = dataclasses.field(init=False, repr=False, compare=False)
    is_trivial: bool = dataclasses.field(init=False, repr=False, compare=False)
    is_uneven: bool = dataclasses.field(init=False, repr=False, compare=False)
    is_exact: bool = dataclasses.field(init=False, repr=False, compare=False)
    is_empty: bool = dataclasses.field(init=False, repr=False, compare=False)
    copies: int = dataclasses.field(init=False, repr=False, compare=False)
    _hash: int | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def shared_in_shape(self) -> Shape:
        """The input shape every rank agrees on: `in_shape`, its gathered dim at ``max(gather_sizes)`` in the
        exact layout (the padded layout's shape; checked mode compares it)."""
        uneven = self.uneven
        if not isinstance(uneven, Exact) or uneven.gather_sizes is None:
            return self.in_shape
        return resized(self.in_shape, gathered_dim(self.step), max(uneven.gather_sizes))  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        step, arithmetic, uneven, layout = self.step, self.arithmetic, self.uneven, self.layout
        trivial = (
            arithmetic.scale == 1.0
            and arithmetic.grad_scale == 1.0
            and self.world_size == 1
            and (not isinstance(step, Permute) or step.pairs == ((0, 0),))
        )
        after = uneven.after if isinstance(uneven, Padded) else None
        out_shape = layout.out_shape if after is None else resized(layout.out_shape, after.dim, after.rows)
        _derived(
            self,
            out_shape=out_shape,
            is_trivial=trivial,
            is_uneven=uneven is not None,
            is_exact=isinstance(uneven, Exact),
            is_empty=0 in self.shared_in_shape,
            copies=int(not layout.pack.is_identity) + int(not layout.unpack.is_identity),
        )

    def __hash__(self) -> int:  # plans key the VJP-plan, fingerprint and walk caches: hashed per call, computed
        # once, on the first call (not when built: torch 2.11's Dynamo cannot trace hash() of a tuple, and it
        # traces the builders; nothing it traces hashes a plan)
        value = self._hash
        if value is None:
            value = hash(tuple(getattr(self, field.name) for field in dataclasses.fields(self) if field.compare))
            object.__setattr__(self, "_hash", value)
        return value

    def __reduce__(self) -> tuple:  # rebuilt, not copied: str hashes differ between processes
        return self.__class__, tuple(getattr(self, field.name) for field in dataclasses.fields(self) if field.init)

    def replace(self, **changes: object) -> Plan:
        """A copy with `changes` (the gradient rules build duals this way)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _identity(shape: Shape, always_copy: bool = False) -> Rearrange:
    return Rearrange(split_shape=shape, perm=tuple(range(len(shape))), always_copy=always_copy)


def _split_front(shape: Shape, dim: int, world_size: int) -> Rearrange:
    """Split `dim` into (world_size, size / world_size) and move the world_size axis first."""
    split = (*shape[:dim], world_size, shape[dim] // world_size, *shape[dim + 1 :])
    return Rearrange(split_shape=split, perm=(dim, *range(dim), *range(dim + 1, len(split))))


def _front_to(recv_shape: Shape, dim: int) -> Rearrange:
    """Move the leading world_size axis of `recv_shape` to just before chunk axis `dim`."""
    return Rearrange(split_shape=recv_shape, perm=(*range(1, dim + 1), 0, *range(dim + 1, len(recv_shape))))


def _chunk(shape: Shape, dim: int, world_size: int) -> Shape:
    return (*shape[:dim], shape[dim] // world_size, *shape[dim + 1 :])


def _grown(shape: Shape, dim: int, world_size: int) -> Shape:
    return (*shape[:dim], shape[dim] * world_size, *shape[dim + 1 :])


@held_cache(maxsize=4096)
def all_to_all_layout(shape: Shape, world_size: int, scatter_dim: int, gather_dim: int) -> Layout:
    """The all-to-all's layout for valid, normalised arguments (see module docstring).

    ``scatter_dim == gather_dim = d`` (torch's ``all_to_all_single``, lax's split == concat) is the same
    geometry: the pack moves block s of d to the front, the unpack puts the block received from rank r back
    at position r of d, and the shape is unchanged. On d = 0 both passes keep memory order, so there is no
    local pass at all; on another d, one before and one after (none where the dims before d are all 1).

    >>> layout = all_to_all_layout((8, 3), 4, 0, 0)
    >>> layout.pack.is_identity, layout.unpack.is_identity, layout.out_shape
    (True, True, (8, 3))
    >>> layout = all_to_all_layout((3, 8), 4, 1, 1)
    >>> layout.pack.is_identity, layout.unpack.is_identity, layout.out_shape
    (False, False, (3, 8))
    """
    chunk = _chunk(shape, scatter_dim, world_size)
    recv = (world_size, *chunk)
    return Layout(
        pack=_split_front(shape, scatter_dim, world_size),
        send_shape=recv,
        recv_shape=recv,
        unpack=_front_to(recv, gather_dim),
        out_shape=_grown(chunk, gather_dim, world_size),
    )


@held_cache(maxsize=4096)
def all_gather_layout(shape: Shape, world_size: int, dim: int) -> Layout:
    """Gather into [W, *shape] (dim 0 = source rank), then move that axis in front of `dim`."""
    recv = (world_size, *shape)
    return Layout(
        pack=_identity(shape),
        send_shape=shape,
        recv_shape=recv,
        unpack=_front_to(recv, dim),
        out_shape=_grown(shape, dim, world_size),
    )


@held_cache(maxsize=4096)
def reduce_scatter_layout(shape: Shape, world_size: int, dim: int) -> Layout:
    """Pack to [W, *chunk] (chunk r for rank r), reduce-scatter on dim 0; the result is already laid out."""
    chunk = _chunk(shape, dim, world_size)
    return Layout(
        pack=_split_front(shape, dim, world_size),
        send_shape=(world_size, *chunk),
        recv_shape=chunk,
        unpack=_identity(chunk),
        out_shape=chunk,
    )


@held_cache(maxsize=4096)
def flat_layout(shape: Shape, in_place: bool) -> Layout:
    """Same-shape collectives (all_reduce, broadcast, permute): no layout change; a fresh buffer if in place."""
    return Layout(
        pack=_identity(shape, always_copy=in_place),
        send_shape=shape,
        recv_shape=shape,
        unpack=_identity(shape),
        out_shape=shape,
    )


@held_cache(maxsize=4096)
def local_layout(in_shape: Shape, out_shape: Shape) -> Layout:
    """Local steps (identity, slice, pad): no pack or unpack pass; the step itself maps `in_shape` to `out_shape`."""
    return Layout(
        pack=_identity(in_shape),
        send_shape=in_shape,
        recv_shape=out_shape,
        unpack=_identity(out_shape),
        out_shape=out_shape,
    )


def permute_splits(
    pairs: tuple[tuple[int, int], ...], world_size: int, rank: int, numel: int
) -> tuple[list[int], list[int]]:
    """``(send_splits, recv_splits)``: a permute as one uneven all-to-all of flat buffers of `numel` elements.

    This rank sends its whole buffer to its destination (if any) and receives its source's (if any).

    >>> permute_splits(((0, 1), (1, 2)), 3, 1, 4)
    ([0, 0, 4], [4, 0, 0])
    """
    destination = dict(pairs).get(rank)
    source = {dst: src for src, dst in pairs}.get(rank)
    send = [numel if peer == destination else 0 for peer in range(world_size)]
    recv = [numel if peer == source else 0 for peer in range(world_size)]
    return send, recv


def rooted_splits(
    step: Gather | Reduce | Scatter, world_size: int, rank: int, block: int
) -> tuple[list[int], list[int]]:
    """``(send_splits, recv_splits)``: a gather, reduce or scatter as one uneven all-to-all of flat buffers, each
    rank's block `block` elements -- the same bytes on the wire as the rooted collective.

    Gather and reduce: every rank sends its block to the root, which receives one block from each rank (a reduce
    then reduces them). Scatter: the transpose, the root sends block r to rank r. (Frontends that cannot trace
    the rooted collectives run them this way: the all-to-all is the same call on every rank.)

    >>> rooted_splits(Gather(dim=0, root=1), 3, 0, 4), rooted_splits(Gather(dim=0, root=1), 3, 1, 4)
    (([0, 4, 0], [0, 0, 0]), ([0, 4, 0], [4, 4, 4]))
    >>> rooted_splits(Scatter(dim=0, root=1), 3, 1, 4)
    ([4, 4, 4], [0, 4, 0])
    """
    root = step.root
    to_root = [block if peer == root else 0 for peer in range(world_size)]
    from_every_rank = [block if rank == root else 0] * world_size
    return (from_every_rank, to_root) if isinstance(step, Scatter) else (to_root, from_every_rank)


def reorder_pairs(
    pairs: tuple[tuple[int, int], ...], sizes: tuple[int, ...], order: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    """`pairs` of ranks numbered row-major over axes of `sizes`, renumbered row-major over the same axes taken
    in `order` (indices into `sizes`).

    JAX numbers a tuple of mesh axes' ranks for ``ppermute`` in the mesh's axis order, whatever order the
    tuple gives; commlib numbers them in the order the user gives (as ``axis_index``), so the JAX frontend
    permutes over the axes in mesh order with the pairs renumbered by this.

    >>> reorder_pairs(((1, 2),), sizes=(2, 2), order=(1, 0))  # rank 1 = (0, 1) -> (1, 0) = 2
    ((2, 1),)
    """

    def renumber(rank: int) -> int:
        coordinates = []
        for size in reversed(sizes):
            rank, coordinate = divmod(rank, size)
            coordinates.append(coordinate)
        coordinates.reverse()
        index = 0
        for axis in order:
            index = index * sizes[axis] + coordinates[axis]
        return index

    return tuple((renumber(source), renumber(destination)) for source, destination in pairs)


def completed_pairs(pairs: tuple[tuple[int, int], ...], world_size: int) -> tuple[tuple[int, int], ...]:
    """`pairs` made a full permutation of `world_size` ranks: the ranks that send nothing paired, in order, with
    the ranks that receive nothing. What a partial perm gives equals the completed perm's result with the
    added destinations zeroed (for backends that take full permutations only: ``lax.ppermute`` under
    ``jax.vmap``).

    >>> completed_pairs(((0, 1), (1, 2)), 4)
    ((0, 1), (1, 2), (2, 0), (3, 3))
    """
    sources = {source for source, _ in pairs}
    destinations = {destination for _, destination in pairs}
    idle = [rank for rank in range(world_size) if rank not in sources]
    unfilled = [rank for rank in range(world_size) if rank not in destinations]
    return (*pairs, *zip(idle, unfilled, strict=True))
