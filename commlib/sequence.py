"""Sequence layouts: which global positions of a sequence each shard holds (ring attention, USP).

`SequenceLayout` is the layout of any length (shards may differ by a row, or hold none); `shard_positions`
and its numpy helpers below are the even special case the attention layers' ``layout="..."`` strings name.

``"contiguous"``: ring block r is positions ``[r*S/W, (r+1)*S/W)``; ``"zigzag"``: the sequence is cut into 2W
chunks and ring block r is chunk r followed by chunk 2W-1-r (every rank then has the same causal work). With
USP (``ulysses_size`` U > 1) ring block r is cut into U equal contiguous pieces and piece u is shard
``r * U + u``: the Ulysses all-to-all over the U ranks of ring index r gathers exactly ring block r.

>>> shard_positions(16, 4, "zigzag")[0]  # rank 0 of the handed case: chunks 0 and 7 of 8
array([ 0,  1, 14, 15])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from commlib.errors import comm_error, kind_error
from commlib.uneven import Sizes, check_sizes, split_sizes
from commlib.validators import check_int

__all__ = [
    "SEQUENCE_LAYOUTS",
    "SequenceLayout",
    "check_layout",
    "positions",
    "shard_positions",
    "shard_sequence",
    "ulysses_seq_sizes",
    "unshard_sequence",
]

SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


def check_layout(op_name: str, seq: int, ring_size: int, layout: object, ulysses_size: int, received: dict) -> None:
    """`layout` known, W and U >= 1, and `seq` (the global length) cut evenly into the layout's chunks."""
    if layout not in SEQUENCE_LAYOUTS:
        raise comm_error(op_name, f"layout ({layout!r}) must be one of {', '.join(SEQUENCE_LAYOUTS)}", **received)
    for name, value in (("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        if value < 1:
            raise comm_error(op_name, f"{name} ({value}) must be >= 1", **received)
    if seq < 1:  # an empty shard: nothing to attend to, and the CPU flash kernels divide by it
        raise comm_error(op_name, f"seq ({seq}) must be >= 1", **received)
    if layout == "zigzag" and seq % (2 * ring_size * ulysses_size):
        raise comm_error(
            op_name,
            f"seq ({seq}) must be divisible by 2 * ring_size * ulysses_size "
            f"({2 * ring_size * ulysses_size}) for layout 'zigzag'",
            **received,
        )
    if seq % (ring_size * ulysses_size):
        raise comm_error(
            op_name,
            f"seq ({seq}) must be divisible by ring_size * ulysses_size ({ring_size * ulysses_size})",
            **received,
        )


def positions(seq: int, ring_size: int, layout: str, ulysses_size: int) -> np.ndarray:
    """`shard_positions` of arguments already checked (`check_layout`)."""
    W, U = ring_size, ulysses_size
    if layout == "contiguous":
        blocks = np.arange(seq).reshape(W, seq // W)
    else:
        chunks = np.arange(seq).reshape(2 * W, seq // (2 * W))
        blocks = np.concatenate([chunks[:W], chunks[::-1][:W]], axis=1)
    return blocks.reshape(W * U, seq // (W * U))


def shard_positions(seq: int, ring_size: int, layout: str = "contiguous", ulysses_size: int = 1) -> np.ndarray:
    """int64 ``[W * U, S / (W * U)]``: row ``r * U + u`` holds the global positions of shard ``r * U + u``
    (ring index r, Ulysses index u; ``U = ulysses_size``), in the order the shard holds them.

    >>> shard_positions(8, 2, "zigzag", ulysses_size=2)  # ring block 0 = chunks 0, 3; block 1 = chunks 1, 2
    array([[0, 1],
           [6, 7],
           [2, 3],
           [4, 5]])

    Raises:
        CommError: an unknown layout, W or U < 1, S not divisible by W * U (2 * W * U for zigzag).
        TypeError: S, W or U not ints.
    """
    received = dict(seq=seq, ring_size=ring_size, layout=layout, ulysses_size=ulysses_size)
    seq, ring_size, ulysses_size = (
        check_int("shard_positions", name, value, received)
        for name, value in (("seq", seq), ("ring_size", ring_size), ("ulysses_size", ulysses_size))
    )
    check_layout("shard_positions", seq, ring_size, layout, ulysses_size, received)
    return positions(seq, ring_size, layout, ulysses_size)


def shard_sequence(
    x: npt.ArrayLike, dim: int, ring_size: int, layout: str = "contiguous", ulysses_size: int = 1
) -> list[np.ndarray]:
    """numpy: the W * U shards of a whole sequence `x` along `dim`, shard i holding the rows
    ``shard_positions(S, W, layout, U)[i]`` (``[.., S, ..] -> W * U x [.., S / (W * U), ..]``).

    >>> [shard.tolist() for shard in shard_sequence(np.arange(8), 0, 2, "zigzag")]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    x = np.asarray(x)
    rows = shard_positions(x.shape[dim], ring_size, layout, ulysses_size)
    return [np.take(x, row, axis=dim) for row in rows]


def unshard_sequence(
    shards: Sequence, dim: int, ring_size: int, layout: str = "contiguous", ulysses_size: int = 1
) -> np.ndarray:
    """numpy: the inverse of `shard_sequence`, the whole sequence back in position order.

    >>> unshard_sequence([[0, 1, 6, 7], [2, 3, 4, 5]], 0, 2, "zigzag").tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    shards = [np.asarray(shard) for shard in shards]
    whole = np.concatenate(shards, axis=dim)
    order = shard_positions(whole.shape[dim], ring_size, layout, ulysses_size).reshape(-1)
    return np.take(whole, np.argsort(order), axis=dim)


# ---------------------------------------------------------------------------------------------------------
# Any length
# ---------------------------------------------------------------------------------------------------------

_LAYOUT_OP = "SequenceLayout"


def _blocks(seq_len: int, ring_size: int, layout: str) -> list[list[int]]:
    """The global positions of each ring block, in the order the block holds them."""
    if layout == "contiguous":
        chunks, count = split_sizes(seq_len, ring_size), ring_size
    else:
        chunks, count = split_sizes(seq_len, 2 * ring_size), 2 * ring_size
    starts = np.cumsum((0, *chunks))
    rows = [list(range(starts[i], starts[i] + chunks[i])) for i in range(count)]
    if layout == "contiguous":
        return rows
    return [rows[block] + rows[count - 1 - block] for block in range(ring_size)]


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Which global positions of a sequence of `seq_len` tokens each of ``ring_size * ulysses_size`` shards holds,
    for any length (a shard may hold one row fewer than another, or none).

    - ``layout="contiguous"``: ring block r is chunk r of ``split_sizes(seq_len, ring_size)``;
    - ``layout="zigzag"``: the sequence is cut into ``split_sizes(seq_len, 2 * ring_size)`` chunks and ring
      block r is chunk r followed by chunk ``2 * ring_size - 1 - r`` (balanced causal work);
    - Ulysses index u holds piece u of ``split_sizes(len(block), ulysses_size)`` of its ring block's
      positions, in order; shard ``i = r * ulysses_size + u`` (ring index r, Ulysses index u).

    - ``seq_sizes`` (W ints, the keyword and the meaning of ``ulysses_attention``'s `seq_sizes`): shard i holds
      exactly ``seq_sizes[i]`` rows, the contiguous run ``[offset_i, offset_i + seq_sizes[i])`` with ``offset_i =
      sum(seq_sizes[:i])`` (``layout="contiguous"`` only; entries may be 0): a text prefix and the image tokens
      cut where the model wants them, which ring and USP then take as they take any length.

    - ``grid`` (a video DiT's ``(frames, height, width)`` token grid, or any other ints >= 1 whose product is
      `seq_len`): position p is the token at ``numpy.unravel_index(p, grid)``, raster order, frames outermost;
      ``grid_positions(i)`` gives shard i's ``(f, h, w)`` coordinates (3-D RoPE as Wan / HunyuanVideo's). Which
      shard holds a token is the layout's rule above; the grid only names the tokens.

    For a `seq_len` the even layout divides, ``positions(i)`` is row i of `shard_positions`. Frozen and
    hashable: the attention layers and the sequence helpers take it as ``layout=``. torch holds shard i with
    exactly ``sizes[i]`` rows; JAX (one shape on every device) with `max_size` rows, the valid ones first.

    >>> layout = SequenceLayout(10, ring_size=2, layout="zigzag")
    >>> layout.sizes, [layout.positions(i).tolist() for i in range(2)]
    ((5, 5), [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]])
    >>> SequenceLayout(5, ulysses_size=4).sizes  # S = 5 over 4 ranks: two rows on one, one on three
    (2, 1, 1, 1)
    >>> SequenceLayout(3, ring_size=4).sizes  # a shard may hold none
    (1, 1, 1, 0)
    >>> text_and_image = SequenceLayout(10, ring_size=2, seq_sizes=(6, 4))  # rank 0: 5 text + 1 image token
    >>> [text_and_image.positions(i).tolist() for i in range(2)]
    [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    >>> video = SequenceLayout(2 * 2 * 3, ring_size=3, grid=(2, 2, 3))  # 2 frames of 2 x 3 tokens over 3 ranks
    >>> video.positions(1).tolist(), video.grid_positions(1).tolist()  # shard 1: (f, h, w) of its 4 tokens
    ([4, 5, 6, 7], [[0, 1, 1], [0, 1, 2], [1, 0, 0], [1, 0, 1]])

    Raises:
        CommError: `seq_len`, `ring_size` or `ulysses_size` < 1, an unknown `layout`; `seq_sizes` of a length
            other than ``ring_size * ulysses_size``, with a negative entry, not summing to `seq_len`, or with
            ``layout="zigzag"``; a `grid` with an entry < 1 or whose product is not `seq_len`.
        TypeError: `seq_len`, `ring_size` or `ulysses_size` not ints (bools refused), `seq_sizes` or `grid` not
            ints.
    """

    seq_len: int
    ring_size: int = 1
    ulysses_size: int = 1
    layout: str = "contiguous"
    seq_sizes: tuple[int, ...] | None = None  # rows of each shard, contiguous runs in shard order (None: the rule)
    grid: tuple[int, ...] | None = None  # the token grid, e.g. (frames, height, width), raster order (None: none)
    # Derived when built: every shard's global positions, in the order the shard holds them.
    _positions: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        received = dict(
            seq_len=self.seq_len, ring_size=self.ring_size, ulysses_size=self.ulysses_size, layout=self.layout
        )
        for name in ("seq_len", "ring_size", "ulysses_size"):
            value = check_int(_LAYOUT_OP, name, getattr(self, name), received)
            if value < 1:
                raise comm_error(_LAYOUT_OP, f"{name} ({value}) must be >= 1", **received)
            object.__setattr__(self, name, value)
        if not isinstance(self.layout, str):
            raise kind_error(_LAYOUT_OP, f"layout must be a str, not {type(self.layout).__name__}", **received)
        if self.layout not in SEQUENCE_LAYOUTS:
            message = f"layout ({self.layout!r}) must be one of {', '.join(SEQUENCE_LAYOUTS)}"
            raise comm_error(_LAYOUT_OP, message, **received)
        if self.seq_sizes is not None:
            object.__setattr__(self, "seq_sizes", self._checked_sizes(dict(received, seq_sizes=self.seq_sizes)))
        if self.grid is not None:
            object.__setattr__(self, "grid", self._checked_grid(dict(received, grid=self.grid)))
        object.__setattr__(self, "_positions", self._shards())

    def _checked_grid(self, received: dict) -> tuple[int, ...]:
        """`grid` as ints >= 1 whose product is `seq_len`."""
        values = self.grid if isinstance(self.grid, tuple | list) else None
        if not values or any(isinstance(value, bool) or not hasattr(value, "__index__") for value in values):
            raise kind_error(
                _LAYOUT_OP, "grid must be a non-empty sequence of ints, e.g. (frames, height, width)", **received
            )
        grid = tuple(int(value) for value in values)
        for index, value in enumerate(grid):
            if value < 1:
                raise comm_error(_LAYOUT_OP, f"grid[{index}] ({value}) must be >= 1", **received)
        if math.prod(grid) != self.seq_len:
            raise comm_error(
                _LAYOUT_OP, f"prod(grid) ({math.prod(grid)}) must equal seq_len ({self.seq_len})", **received
            )
        return grid

    def _checked_sizes(self, received: dict) -> tuple[int, ...]:
        """`seq_sizes` as W ints >= 0 summing to `seq_len`, of a contiguous layout."""
        sizes = check_sizes(_LAYOUT_OP, Sizes("seq_sizes", self.seq_sizes, "seq"), self.world_size, received)
        if sum(sizes) != self.seq_len:
            message = f"sum(seq_sizes) ({sum(sizes)}) must equal seq_len ({self.seq_len})"
            raise comm_error(_LAYOUT_OP, message, **received)
        if self.layout != "contiguous":
            message = f"seq_sizes needs layout 'contiguous' (shard i holds one run of rows), not {self.layout!r}"
            raise comm_error(_LAYOUT_OP, message, **received)
        return sizes

    def _shards(self) -> tuple[tuple[int, ...], ...]:
        """Every shard's global positions, in the order the shard holds them."""
        if self.seq_sizes is not None:
            starts = np.cumsum((0, *self.seq_sizes)).tolist()
            return tuple(tuple(range(starts[i], starts[i + 1])) for i in range(self.world_size))
        shards: list[tuple[int, ...]] = []
        for block in _blocks(self.seq_len, self.ring_size, self.layout):
            starts = np.cumsum((0, *split_sizes(len(block), self.ulysses_size)))
            shards += [tuple(block[starts[u] : starts[u + 1]]) for u in range(self.ulysses_size)]
        return tuple(shards)

    def __repr__(self) -> str:
        shown = [f"{name}={getattr(self, name)!r}" for name in ("seq_len", "ring_size", "ulysses_size", "layout")]
        shown += [
            f"{name}={getattr(self, name)!r}" for name in ("seq_sizes", "grid") if getattr(self, name) is not None
        ]
        return f"SequenceLayout({', '.join(shown)})"

    @property
    def names_even(self) -> bool:
        """Whether the layout string's even rule (`shard_positions`) gives these shards: `seq_len` divisible by
        ``world_size`` (``2 * world_size`` for zigzag) and every shard of one size."""
        unit = self.world_size * (2 if self.layout == "zigzag" else 1)
        return self.seq_len % unit == 0 and self.is_even

    @property
    def world_size(self) -> int:
        """Shards: ``ring_size * ulysses_size``."""
        return self.ring_size * self.ulysses_size

    @property
    def sizes(self) -> tuple[int, ...]:
        """Rows of each shard."""
        return tuple(len(rows) for rows in self._positions)

    @property
    def max_size(self) -> int:
        """Rows of the largest shard (JAX holds every shard padded to it)."""
        return max(self.sizes)

    @property
    def is_even(self) -> bool:
        """True when every shard holds the same number of rows."""
        return len(set(self.sizes)) == 1

    def positions(self, index: int) -> np.ndarray:
        """int64 ``[sizes[index]]``: the global positions shard `index` holds, in the order it holds them."""
        index = self._index(index, "positions")
        return np.asarray(self._positions[index], dtype=np.int64)

    def grid_positions(self, index: int) -> np.ndarray:
        """int64 ``[sizes[index], len(grid)]``: the grid coordinates (``(f, h, w)`` of a video grid) of the tokens
        shard `index` holds, in the order it holds them (``numpy.unravel_index`` of `positions`); CommError
        without a `grid`."""
        index = self._index(index, "grid_positions")
        if self.grid is None:
            message = "the layout has no grid (build it with grid=(frames, height, width))"
            raise comm_error(f"{_LAYOUT_OP}.grid_positions", message, layout=self)
        coordinates = np.unravel_index(self.positions(index), self.grid)
        return np.stack(coordinates, axis=-1).astype(np.int64).reshape(-1, len(self.grid))

    def shard(self, x: npt.ArrayLike, dim: int = 1, *, padded: bool = False) -> list[np.ndarray]:
        """numpy: the `world_size` shards of a whole sequence `x` (``x.shape[dim] == seq_len``) along `dim`; with
        `padded`, each of `max_size` rows, zeros after its own (JAX's layout)."""
        x = np.asarray(x)
        dim = self._dim(x, dim, "shard")
        if x.shape[dim] != self.seq_len:
            raise comm_error(
                f"{_LAYOUT_OP}.shard",
                f"x.shape[{dim}] ({x.shape[dim]}) must be seq_len ({self.seq_len})",
                shape=x.shape,
                dim=dim,
            )
        shards = [np.take(x, self.positions(i), axis=dim) for i in range(self.world_size)]
        return [_padded(shard, dim, self.max_size) for shard in shards] if padded else shards

    def unshard(self, shards: Iterable[npt.ArrayLike], dim: int = 1, *, padded: bool = False) -> np.ndarray:
        """numpy: the inverse of `shard`: the whole sequence in position order (with `padded`, the rows past each
        shard's own are dropped)."""
        arrays = [np.asarray(shard) for shard in shards]
        name = f"{_LAYOUT_OP}.unshard"
        if len(arrays) != self.world_size:
            raise comm_error(
                name, f"len(shards) ({len(arrays)}) must be world_size ({self.world_size})", shards=len(arrays)
            )
        dim = self._dim(arrays[0], dim, "unshard")
        rows = []
        for index, shard in enumerate(arrays):
            want = self.max_size if padded else self.sizes[index]
            if shard.ndim != arrays[0].ndim or shard.shape[dim] != want:
                raise comm_error(
                    name,
                    f"shard {index}'s dim {dim} ({shard.shape[dim] if shard.ndim > dim else None}) must be {want}",
                    shape=shard.shape,
                    dim=dim,
                    padded=padded,
                )
            rows.append(np.take(shard, np.arange(self.sizes[index]), axis=dim))
        whole = np.concatenate(rows, axis=dim)
        order = np.concatenate([self.positions(i) for i in range(self.world_size)])
        return np.take(whole, np.argsort(order, kind="stable"), axis=dim)

    def _index(self, index: object, method: str) -> int:
        received = dict(index=index, world_size=self.world_size)
        value = check_int(f"{_LAYOUT_OP}.{method}", "index", index, received)
        if not 0 <= value < self.world_size:
            message = f"index ({value}) must be in [0, {self.world_size})"
            raise comm_error(f"{_LAYOUT_OP}.{method}", message, **received)
        return value

    def _dim(self, x: np.ndarray, dim: object, method: str) -> int:
        received = dict(shape=x.shape, dim=dim)
        value = check_int(f"{_LAYOUT_OP}.{method}", "dim", dim, received)
        if not -x.ndim <= value < x.ndim:
            message = f"dim ({value}) must be in [{-x.ndim}, {x.ndim}) for ndim {x.ndim}"
            raise comm_error(f"{_LAYOUT_OP}.{method}", message, **received)
        return value % x.ndim


def _padded(x: np.ndarray, dim: int, rows: int) -> np.ndarray:
    """`x` with zero rows appended along `dim` up to `rows`."""
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, rows - x.shape[dim])
    return np.pad(x, widths)


def ulysses_seq_sizes(op_name: str, layout: object, seq_sizes: object, world_size: int) -> object:
    """The `seq_sizes` of ``ulysses_attention(..., seq_sizes=seq_sizes, layout=layout)`` over `world_size` ranks.

    Ulysses holds the sequence in rank order (rank r the r-th contiguous run of rows): `layout` "contiguous"
    leaves `seq_sizes` as given (None: even); a `SequenceLayout` must hold it so (``ring_size == 1``, or
    ``layout="contiguous"``) over `world_size` shards and gives ``seq_sizes = layout.sizes`` (a `seq_sizes`
    given too must be the same).

    >>> ulysses_seq_sizes("ulysses_attention", SequenceLayout(5, ulysses_size=4), None, 4)
    (2, 1, 1, 1)

    Raises:
        CommError: "zigzag" (Ulysses holds the sequence in order), a layout of another world size, one whose
            shards are not contiguous runs in rank order, `seq_sizes` that differ from the layout's sizes.
        TypeError: a layout neither a string nor a `SequenceLayout`.
    """
    received = dict(layout=layout, seq_sizes=seq_sizes, world_size=world_size)
    if isinstance(layout, str):
        if layout != "contiguous":
            message = (
                f"layout ({layout!r}) must be 'contiguous' or a SequenceLayout (Ulysses holds the sequence "
                "in rank order)"
            )
            raise comm_error(op_name, message, **received)
        return seq_sizes
    if not isinstance(layout, SequenceLayout):
        raise kind_error(
            op_name, f"layout must be a str or a commlib.SequenceLayout, not {type(layout).__name__}", **received
        )
    if layout.world_size != world_size:
        raise comm_error(
            op_name,
            f"layout.world_size ({layout.world_size}) must be the group's world size ({world_size})",
            **received,
        )
    if layout.ring_size > 1 and layout.layout != "contiguous":
        raise comm_error(
            op_name,
            "layout must hold the sequence in rank order (ring_size 1, or layout "
            f"'contiguous'), not {layout.layout!r} over ring_size {layout.ring_size}",
            **received,
        )
    if seq_sizes is not None and _as_tuple(seq_sizes) != layout.sizes:
        raise comm_error(op_name, f"seq_sizes ({seq_sizes}) must be layout.sizes ({layout.sizes})", **received)
    return layout.sizes


def _as_tuple(sizes: object) -> object:
    try:
        return tuple(sizes)  # type: ignore[arg-type]
    except TypeError:
        return sizes
