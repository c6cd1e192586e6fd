"""The CUDA layout pass (commlib_torch/_pack.py) gives exactly torch's eager result, and the walk takes the
way the module promises: the Triton kernel for large passes, the wide-word copy for small ones and without
the kernel, torch's plain copy on the CPU and where neither applies.

The kernel tests run on a CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``
with Triton installed); elsewhere they skip. The word copy and the selection run everywhere they can.
"""

import os

import pytest
import torch

from commlib import plans
from commlib_torch import _pack, _walk

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

CUDA = torch.cuda.is_available()
INTERPRETED = HAVE_TRITON and not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
needs_kernel = pytest.mark.skipif(
    not (HAVE_TRITON and (CUDA or INTERPRETED)), reason="needs Triton and CUDA (or TRITON_INTERPRET=1 on the CPU)"
)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

DTYPES = (torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.bool, torch.float16)
SHAPES = ((6, 4, 384), (5, 3, 7), (1, 8, 3), (7, 2, 1), (3, 3, 2), (2, 8, 4099), (33, 5, 64))


def _random(shape, dtype, device=DEVICE):
    values = torch.randn(shape, device=device) * 50
    return values > 0 if dtype is torch.bool else values.to(dtype)


def _poisoned(shape, dtype, device=DEVICE):
    out = torch.empty(shape, dtype=dtype, device=device)
    out.view(torch.uint8).fill_(0xA5)  # every element must be written
    return out


def _steps():
    """Every non-identity pass of the Ulysses, all_to_all, all_gather and reduce_scatter plans at W = 4:
    (step, output shape, source shape)."""
    chosen = [plans.all_to_all_4d((batch, 8, 8, 6), 4, 2, 1) for batch in (1, 3)]
    chosen += [plans.all_to_all_4d((batch, 8, 2, 6), 4, 1, 2) for batch in (1, 3)]
    chosen += [
        plans.all_to_all((4, 3, 8), 4, 2, 0),
        plans.all_gather((3, 5, 2), 4, 1),
        plans.reduce_scatter((3, 8), 4, 1),
    ]
    for plan in chosen:
        for step, shape, source in (
            (plan.layout.pack, plan.layout.send_shape, plan.in_shape),
            (plan.layout.unpack, plan.out_shape, plan.layout.recv_shape),
        ):
            if not step.is_identity:
                yield step, shape, source


STEPS = list(_steps())


def test_every_plan_pass_is_a_row_transpose():
    """The fast ways cover every non-identity pass the plans make: all merge to [A, B, C] -> [B, A, C]."""
    assert len(STEPS) >= 8
    for step, _, _ in STEPS:
        assert _pack.row_transpose(step) is not None, step


def test_cpu_tensors_take_torchs_copy():
    step, _, source = STEPS[0]
    assert not _pack.copy_into(torch.empty(step.out_shape), torch.randn(source), step)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_word_copy_matches_permute(shape, dtype):
    rows, columns, size = shape
    x = _random(shape, dtype)
    out = _poisoned((columns, rows, size), dtype)
    _pack.copy_words(x, out, rows, columns, size)
    assert torch.equal(out, x.permute(1, 0, 2))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_permute(shape, dtype):
    rows, columns, size = shape
    x = _random(shape, dtype)
    out = _poisoned((columns, rows, size), dtype)
    _pack.transpose_rows(x, out, rows, columns, size)
    assert torch.equal(out, x.permute(1, 0, 2))


@needs_kernel
@pytest.mark.parametrize("tile_words", [64, 1024, 8192])
def test_kernel_tiles_and_long_rows(tile_words):
    """Rows longer than a tile (the batch > 1 unpack) and tiles of many rows give the same result."""
    for rows, columns, size in ((8, 2, 20_003), (300, 8, 384)):
        x = _random((rows, columns, size), torch.bfloat16)
        out = _poisoned((columns, rows, size), torch.bfloat16)
        _pack.transpose_rows(x, out, rows, columns, size, tile_words=tile_words)
        assert torch.equal(out, x.permute(1, 0, 2))


@needs_kernel
def test_unaligned_views():
    """A source starting at an odd element offset falls back to narrower words, still exact."""
    base = _random((1 + 6 * 4 * 5,), torch.bfloat16)
    x = base[1:].view(6, 4, 5)
    out = _poisoned((4, 6, 5), torch.bfloat16)
    _pack.transpose_rows(x, out, 6, 4, 5)
    assert torch.equal(out, x.permute(1, 0, 2))
    out = _poisoned((4, 6, 5), torch.bfloat16)
    _pack.copy_words(x, out, 6, 4, 5)
    assert torch.equal(out, x.permute(1, 0, 2))


def _rearranged(step, shape, x, mode, monkeypatch):
    monkeypatch.setenv(_pack._MODE_ENV, mode)
    return _walk.rearrange(x, step, shape, x.dtype)


@needs_cuda
@pytest.mark.parametrize("index", range(len(STEPS)))
def test_walk_ways_agree(index, monkeypatch):
    """`_walk.rearrange` on CUDA: the kernel (every size, forced), the word copy and torch's copy agree."""
    step, shape, source = STEPS[index]
    monkeypatch.setattr(_pack, "KERNEL_MIN_BYTES", 0)
    monkeypatch.setattr(_pack, "WORDS_MIN_BYTES", 0)
    for dtype in (torch.bfloat16, torch.float32):
        x = _random(source, dtype, "cuda")
        ways = {mode: _rearranged(step, shape, x, mode, monkeypatch) for mode in ("auto", "words", "eager")}
        assert torch.equal(ways["auto"], ways["eager"]) and torch.equal(ways["words"], ways["eager"])


@needs_cuda
@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_walk_chooses_by_size(monkeypatch):
    launched = []
    launch = _pack.transpose_rows

    def counted(*args, **kwargs):
        launched.append(args[2:])
        return launch(*args, **kwargs)

    copied = []
    copy_words = _pack.copy_words
    monkeypatch.setattr(_pack, "transpose_rows", counted)
    monkeypatch.setattr(_pack, "copy_words", lambda *args: copied.append(args[2:]) or copy_words(*args))
    step, shape, source = STEPS[0]
    x = _random(source, torch.bfloat16, "cuda")
    _walk.rearrange(x, step, shape, x.dtype)
    assert launched == copied == []  # a tiny pass: torch's plain copy_
    monkeypatch.setattr(_pack, "WORDS_MIN_BYTES", 0)
    _walk.rearrange(x, step, shape, x.dtype)
    assert launched == [] and copied == [_pack.row_transpose(step)]  # a small pass: the word copy
    monkeypatch.setattr(_pack, "KERNEL_MIN_BYTES", 0)
    _walk.rearrange(x, step, shape, x.dtype)
    assert launched == [_pack.row_transpose(step)]  # a large pass: the kernel


@needs_cuda
def test_walk_declines_casts_and_strided_sources():
    step, shape, source = STEPS[1]
    x = torch.randn(source, device="cuda")
    assert not _pack.copy_into(torch.empty(step.out_shape, device="cuda", dtype=torch.float64), x, step)
    strided = torch.randn(tuple(reversed(source)), device="cuda").permute(*reversed(range(len(source))))
    assert not _pack.copy_into(torch.empty(step.out_shape, device="cuda"), strided, step)
    expected = strided.reshape(step.split_shape).permute(step.perm).contiguous()
    assert torch.equal(_walk.rearrange(strided, step, shape, strided.dtype).view(expected.shape), expected)
