"""Fast layout pass for CUDA tensors: a Triton kernel, or torch's copy over wide words, for every plan pass.

Each local pass of an all_to_all, all_gather or reduce_scatter plan merges (`commlib.Rearrange.merged`) to
a batched transpose of rows, ``[A, B, C] -> [B, A, C]`` with rows of C elements contiguous in the source
and in the destination (e.g. the Ulysses pack ``[B*S/W, W, H/W*D] -> [W, B*S/W, H/W*D]``). Torch's eager
``copy_`` from the permuted view moves one bf16 element at a time and runs at ~2.6x the time of a plain
copy on an H200. Measured there (benchmarks/pack_probe.py), for a 192 MiB bf16 pass:

- the Triton kernel below (rows moved as 4-byte words, 16-byte accesses): 1.04x a copy;
- torch's ``copy_`` of the same permutation over the rows viewed as int64 words: 1.11x.

The host's time per pass, though, is ~10 us for a plain ``copy_`` and ~25 us more for the kernel's launch
(plus a few us of views for either fast way). So `copy_into` takes the kernel for passes of `KERNEL_MIN_BYTES`
or more (where device time dominates), the word copy from `WORDS_MIN_BYTES` (and when Triton is missing, or
for good after the kernel's first failure, with one warning), and returns False -- the caller then runs torch's plain
``copy_`` -- for smaller passes, on the CPU (where neither helps), under ``torch.compile`` (Inductor fuses the
permute itself), when the pass also casts, for a non-contiguous source, and when ``COMMLIB_PACK=eager``;
``COMMLIB_PACK=words`` skips the kernel.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from commlib import Rearrange

__all__ = ["KERNEL_MIN_BYTES", "WORDS_MIN_BYTES", "copy_into", "copy_words", "row_transpose", "transpose_rows"]

KERNEL_MIN_BYTES = 16 << 20  # below this the kernel's longer launch outweighs its faster pass
WORDS_MIN_BYTES = 1 << 20  # below this torch's plain copy_: the pass takes a few us, the host's time dominates
_MODE_ENV = "COMMLIB_PACK"  # "auto" (default), "words" (no Triton kernel), "eager" (torch's plain copy_)
_TILE_WORDS = 4096  # 4-byte words one program moves (16 KiB): tile sizes 1-8 Ki all measured within 2%
_TRITON_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
_state = {"kernel_failed": False}


@functools.lru_cache(maxsize=1024)
def row_transpose(step: Rearrange) -> tuple[int, int, int] | None:
    """``(A, B, C)`` when `step` on a contiguous source is ``[A, B, C] -> [B, A, C]``, else None."""
    shape, perm = step.merged()
    if perm == (1, 0, 2):
        return shape  # type: ignore[return-value]  # merged() keeps 3 dims for this perm
    if perm == (1, 0):
        return (*shape, 1)  # type: ignore[return-value]  # merged() keeps 2 dims for this perm
    return None


def copy_into(out: torch.Tensor, x: torch.Tensor, step: Rearrange) -> bool:
    """Write `step` of `x` into the contiguous `out` by the fastest way; False where none applies."""
    if _compiling() or x.device.type != "cuda" or out.dtype != x.dtype or not x.is_contiguous():
        return False
    mode, nbytes = os.environ.get(_MODE_ENV, "auto"), x.numel() * x.element_size()
    dims = row_transpose(step)
    if mode == "eager" or dims is None or nbytes < max(1, WORDS_MIN_BYTES):
        return False
    if mode != "words" and nbytes >= KERNEL_MIN_BYTES and _launch(x, out, dims):
        return True
    copy_words(x, out, *dims)
    return True


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _launch(x: torch.Tensor, out: torch.Tensor, dims: tuple[int, int, int]) -> bool:
    """Run the kernel on x's device; False (after one warning) once it has failed."""
    if _state["kernel_failed"] or x.dtype not in _TRITON_DTYPES:
        return False
    try:
        if x.device.index in (None, torch.cuda.current_device()):
            transpose_rows(x, out, *dims)
        else:  # Triton launches on the current device
            with torch.cuda.device(x.device):
                transpose_rows(x, out, *dims)
    except Exception as error:  # no Triton, no compiler, an unsupported GPU: torch's word copy from now on
        _state["kernel_failed"] = True
        warnings.warn(
            f"commlib: Triton pack kernel unavailable, using torch's copy ({type(error).__name__}: {error})",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _word(row_bytes: int, widths: tuple[int, ...], *tensors: torch.Tensor) -> int:
    """The widest of `widths` (bytes) that divides a row and every tensor's address."""
    for width in widths:
        if row_bytes % width == 0 and all(tensor.data_ptr() % width == 0 for tensor in tensors):
            return width
    return 1


_TORCH_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def copy_words(x: torch.Tensor, out: torch.Tensor, rows: int, columns: int, row_size: int) -> None:
    """``out[b, a, :] = x[a, b, :]`` by torch's ``copy_`` over the rows viewed as the widest int words."""
    word = _TORCH_WORDS[_word(row_size * x.element_size(), (8, 4, 2), x, out)]
    source = x.view(rows, columns, row_size).view(word).transpose(0, 1)
    out.view(columns, rows, row_size).view(word).copy_(source)


def transpose_rows(
    x: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    columns: int,
    row_size: int,
    *,
    tile_words: int = _TILE_WORDS,
    num_warps: int = 4,
) -> None:
    """``out[b, a, :] = x[a, b, :]`` by the Triton kernel, for contiguous `x` and `out` viewed as
    ``[rows, columns, row_size]`` and ``[columns, rows, row_size]`` (rows moved as raw words)."""
    kernel, word_types = _kernel()
    width = _word(row_size * x.element_size(), (4, 2), x, out)
    words = row_size * x.element_size() // width
    if x.dtype == torch.bool:  # Triton types bool pointers as i1
        x, out = x.view(torch.uint8), out.view(torch.uint8)
    block_words = min(tile_words, 1 << (words - 1).bit_length())
    block_rows = max(1, tile_words // block_words)
    word_blocks = -(-words // block_words)
    grid = (-(-rows * columns // block_rows) * word_blocks,)
    kernel[grid](
        x,
        out,
        rows,
        columns,
        words,
        word_blocks,
        WORD=word_types[width],
        BLOCK_ROWS=block_rows,
        BLOCK_WORDS=block_words,
        num_warps=num_warps,
    )


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    # (Triton reads a parameter's annotation as its own type: the pointers and sizes stay unannotated)
    def _transpose_rows(  # type: ignore[no-untyped-def]  # Triton types
        source,
        destination,
        rows,
        columns,
        words,
        word_blocks,
        WORD: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_WORDS: tl.constexpr,
    ):
        # one tile: BLOCK_ROWS destination rows x BLOCK_WORDS words; destination row b * rows + a is
        # source row a * columns + b; both buffers are read and written as WORD-sized integers
        source = source.to(tl.pointer_type(WORD))
        destination = destination.to(tl.pointer_type(WORD))
        tile = tl.program_id(0).to(tl.int64)
        row = (tile // word_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        word = (tile % word_blocks) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
        b = row // rows
        a = row - b * rows
        mask = (row < rows * columns)[:, None] & (word < words)[None, :]
        values = tl.load(source + (a * columns + b)[:, None] * words + word[None, :], mask=mask)
        tl.store(destination + row[:, None] * words + word[None, :], values, mask=mask)

    return _transpose_rows, {4: tl.int32, 2: tl.int16, 1: tl.int8}
