"""The pictures in docs/, drawn from the spec and from stored results (needs matplotlib: ``commlib[bench]``).

    python docs/figures.py            # rewrites docs/ulysses.png, docs/layouts.png, docs/sequence-layouts.png,
                                      # docs/benchmarks-cpu.png
    python docs/figures.py --out DIR  # the same files into DIR

- ``ulysses.png``: the Ulysses exchange ``all_to_all_4d(x, scatter_dim=2, gather_dim=1)`` at W = 4, S = 8, H = 4,
  computed by the spec's numpy reference on inputs that name their own cell: before, rank r holds positions
  2r, 2r+1 of every head; after, every position of head r. Colour: the rank that held the cell before.
- ``layouts.png``: which shard holds each of S = 16 positions (`commlib.shard_positions`) for the contiguous and
  zigzag rings of 4 and the USP meshes (ring 2 x Ulysses 2), with the causal work of each ring block.
- ``sequence-layouts.png``: each shard's positions of a `commlib.SequenceLayout` (contiguous and zigzag rings of
  4, USP ring 2 x Ulysses 2, an uneven length, and S = 3 over 4 shards: one empty), from ``layout.positions(i)``,
  with each shard's rows as torch holds them (exact) and as JAX does (padded to ``max_size``).
- ``benchmarks-cpu.png``: `commlib.tools.bench.plot` of the stored full sweep
  (``benchmarks/results/cpu-2026-11-30/full.json``), what ``commlib bench --plot`` draws.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import commlib
from commlib import plans, reference
from commlib.tools import bench

DOCS = Path(__file__).resolve().parent
FULL = DOCS.parent / "benchmarks" / "results" / "cpu-2026-11-30" / "full.json"
W, S, H = 4, 8, 4  # the Ulysses picture: ranks, sequence length, heads


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(axis, cells: np.ndarray, title: str, ranks_per_position: int) -> None:
    """One rank's [positions, heads] block; each cell's value is ``position * H + head``."""
    positions, heads = cells // H, cells % H
    axis.imshow(positions // ranks_per_position, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for (row, column), position in np.ndenumerate(positions):
        axis.text(column, row, f"s{position}\nh{heads[row, column]}", ha="center", va="center", fontsize=7)
    axis.set_xticks(range(cells.shape[1]), [f"h{h}" for h in heads[0]], fontsize=7)
    axis.set_yticks([])
    axis.set_title(title, fontsize=9)


def ulysses(path: Path) -> None:
    """Before and after the Ulysses all-to-all, every rank, from the spec's reference."""
    shard = S // W
    inputs = [np.arange(S * H).reshape(1, S, H, 1)[:, r * shard : (r + 1) * shard] for r in range(W)]
    outputs = reference.forward(plans.all_to_all_4d(inputs[0].shape, W, 2, 1), inputs)
    plt = _pyplot()
    figure, axes = plt.subplots(2, W, figsize=(2.3 * W, 7.2), gridspec_kw={"height_ratios": [shard, S]})
    for rank in range(W):
        _grid(axes[0, rank], inputs[rank][0, :, :, 0], f"rank {rank} before: [B, S/W, H, D]", shard)
        _grid(
            axes[1, rank],
            np.asarray(outputs[rank])[0, :, :, 0].astype(int),
            f"rank {rank} after: [B, S, H/W, D]",
            shard,
        )
    figure.suptitle(
        "Ulysses: all_to_all_4d(x, scatter_dim=2, gather_dim=1), W = 4: each rank sends head chunk j "
        "to rank j\nand receives every rank's positions of its heads (colour: the rank that held the "
        "cell before; (1, 2) is the reverse)",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


LAYOUTS = (("contiguous", 4, 1), ("zigzag", 4, 1), ("contiguous", 2, 2), ("zigzag", 2, 2))


def _causal_work(positions: np.ndarray, ring_size: int, ulysses_size: int) -> list[int]:
    """Per ring block: the (query, key) pairs at or below the diagonal its queries attend (causal)."""
    blocks = positions.reshape(ring_size, ulysses_size * positions.shape[1])
    return [int(sum(position + 1 for position in block)) for block in blocks]


def layouts(path: Path, seq: int = 16) -> None:
    """Which shard holds each position, per layout, from `commlib.shard_positions`."""
    plt = _pyplot()
    figure, axes = plt.subplots(len(LAYOUTS), 1, figsize=(9, 1.25 * len(LAYOUTS) + 0.6))
    for axis, (layout, ring_size, ulysses_size) in zip(axes, LAYOUTS, strict=True):
        positions = commlib.shard_positions(seq, ring_size, layout, ulysses_size)
        owner = np.empty(seq, dtype=int)
        for shard, held in enumerate(positions):
            owner[held] = shard
        axis.imshow(owner[None], cmap="tab10", vmin=0, vmax=9, aspect="auto")
        for position, shard in enumerate(owner):
            ring, piece = divmod(int(shard), ulysses_size)
            label = f"r{ring}" if ulysses_size == 1 else f"r{ring}u{piece}"
            axis.text(position, 0, f"{position}\n{label}", ha="center", va="center", fontsize=7)
        axis.set(xticks=[], yticks=[])
        mesh = f"ring {ring_size}" if ulysses_size == 1 else f"USP: ring {ring_size} x Ulysses {ulysses_size}"
        work = _causal_work(positions, ring_size, ulysses_size)
        axis.set_title(
            f"{layout}, {mesh}: shard r*U+u holds the cells marked r,u; causal (query, key) pairs per "
            f"ring block {work}",
            fontsize=8,
        )
    figure.suptitle(
        f"Sequence layouts, S = {seq}: commlib.shard_positions(S, ring_size, layout, ulysses_size)", fontsize=9
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


SEQUENCE_LAYOUTS = (
    commlib.SequenceLayout(16, ring_size=4),
    commlib.SequenceLayout(16, ring_size=4, layout="zigzag"),
    commlib.SequenceLayout(16, ring_size=2, ulysses_size=2, layout="zigzag"),
    commlib.SequenceLayout(13, ring_size=4, layout="zigzag"),
    commlib.SequenceLayout(3, ring_size=4, layout="zigzag"),
)


def _shard_rows(axis, layout: commlib.SequenceLayout) -> None:
    """Right panel: shard i's rows in order (``positions(i)``), padding rows (JAX) hatched."""
    rows = np.full((layout.world_size, layout.max_size), -1)
    for index in range(layout.world_size):
        rows[index, : layout.sizes[index]] = layout.positions(index)
    owner = np.where(rows >= 0, np.arange(layout.world_size)[:, None], -1)
    axis.imshow(np.ma.masked_less(owner, 0), cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for (index, row), position in np.ndenumerate(rows):
        axis.text(
            row,
            index,
            "pad" if position < 0 else str(position),
            ha="center",
            va="center",
            fontsize=7,
            color="grey" if position < 0 else "black",
        )
    axis.set_xticks(range(layout.max_size), [str(row) for row in range(layout.max_size)], fontsize=6)
    axis.set_yticks(range(layout.world_size), [f"shard {index}" for index in range(layout.world_size)], fontsize=7)
    axis.set_title(f"rows per shard: sizes {layout.sizes}, max_size {layout.max_size}", fontsize=8)


def sequence_layouts(path: Path) -> None:
    """Which shard holds each position (left) and each shard's rows (right), per `SequenceLayout`."""
    plt = _pyplot()
    figure, axes = plt.subplots(
        len(SEQUENCE_LAYOUTS), 2, figsize=(12, 1.6 * len(SEQUENCE_LAYOUTS) + 0.6), gridspec_kw={"width_ratios": [3, 2]}
    )
    for (left, right), layout in zip(axes, SEQUENCE_LAYOUTS, strict=True):
        owner = np.empty(layout.seq_len, dtype=int)
        for index in range(layout.world_size):
            owner[layout.positions(index)] = index
        left.imshow(owner[None], cmap="tab10", vmin=0, vmax=9, aspect="auto")
        for position, index in enumerate(owner):
            left.text(position, 0, f"{position}\ns{index}", ha="center", va="center", fontsize=7)
        left.set(xticks=[], yticks=[])
        mesh = f"ring {layout.ring_size}" + (f" x Ulysses {layout.ulysses_size}" if layout.ulysses_size > 1 else "")
        left.set_title(
            f"SequenceLayout({layout.seq_len}, ring_size={layout.ring_size}, ulysses_size="
            f"{layout.ulysses_size}, layout={layout.layout!r}): {mesh}",
            fontsize=8,
        )
        _shard_rows(right, layout)
    figure.suptitle(
        "Sequence layouts: position p is held by shard s (left, 'p / s'); shard i's rows are "
        "layout.positions(i) (right; torch holds sizes[i] rows, JAX pads to max_size)",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def benchmarks(path: Path) -> None:
    rows = [bench.Row(**row) for row in json.loads(FULL.read_text())["rows"]]
    bench.plot(rows, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/figures.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DOCS, help="folder of the PNG files (default: docs/)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ulysses(args.out / "ulysses.png")
    layouts(args.out / "layouts.png")
    sequence_layouts(args.out / "sequence-layouts.png")
    benchmarks(args.out / "benchmarks-cpu.png")
    print(f"wrote ulysses.png, layouts.png, sequence-layouts.png, benchmarks-cpu.png in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
