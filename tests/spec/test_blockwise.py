"""`commlib.blockwise.attend_blocks` / `attend_blocks_vjp` (the keys a block at a time) against the one-block
rules `attend` / `attend_vjp` in float64: every mask kind, segment ids, GQA, block sizes that do and do not divide
the keys, rows that see no key (output 0, LSE -inf, gradient 0) and a NaN score (a NaN row)."""

import math

import numpy as np
import pytest

from commlib import blockwise
from commlib.blockwise import NUMPY
from commlib.masks import segment_mask


def _case(seed: int, rows: int, keys: int, heads: int = 4, kv_heads: int = 2):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, rows, heads, 8))
    k = rng.normal(size=(2, keys, kv_heads, 8))
    v = rng.normal(size=(2, keys, kv_heads, 6))
    d_out = rng.normal(size=(2, rows, heads, 6))
    return q, k, v, d_out


def _dense(mask, q_ids, k_ids):
    """The one-block rule's mask of a name and segment ids."""
    if q_ids is None:
        return mask
    same = segment_mask(q_ids, k_ids)[:, None, None]
    if mask == "causal-diagonal":
        return same & NUMPY.causal_mask(same.shape[-1], same)
    return same if isinstance(mask, str) else same & mask


MASKS = ["full", "causal-diagonal", "dense", "segments", "causal segments"]


@pytest.mark.parametrize("block_size", [1, 3, 4, 16, 64])
@pytest.mark.parametrize("kind", MASKS)
def test_blocks_equal_one_block(kind, block_size):
    rows = keys = 13 if "causal" in kind else 11
    if kind in ("full", "dense", "segments"):
        keys = 9
    q, k, v, d_out = _case(block_size, rows, keys)
    rng = np.random.default_rng(7)
    mask, q_ids, k_ids = kind, None, None
    if kind == "dense":
        mask = rng.random((rows, keys)) < 0.5
        mask[0] = False  # a row that sees no key
    if "segments" in kind:
        mask = "causal-diagonal" if kind.startswith("causal") else "full"
        q_ids = rng.integers(-1, 3, size=(2, rows))
        k_ids = q_ids if rows == keys else rng.integers(-1, 3, size=(2, keys))
    out, lse = blockwise.attend_blocks(NUMPY, q, k, v, 0.4, mask, block_size, q_ids, k_ids)
    want_out, want_lse = blockwise.attend(NUMPY, q, k, v, 0.4, _dense(mask, q_ids, k_ids))
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12)
    delta = blockwise.delta(NUMPY, out, d_out)
    grads = blockwise.attend_blocks_vjp(NUMPY, q, k, v, d_out, lse, delta, 0.4, mask, block_size, q_ids, k_ids)
    wants = blockwise.attend_vjp(NUMPY, q, k, v, d_out, want_lse, delta, 0.4, _dense(mask, q_ids, k_ids))
    for got, want in zip(grads, wants, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    unseen = np.isneginf(lse)
    if unseen.any():  # output 0 and dq 0 where a row sees nothing
        assert not out[unseen].any() and not grads[0][unseen].any()


def test_a_nan_score_gives_a_nan_row():
    q, k, v, _ = _case(0, 6, 6)
    q[0, 2, 1, 0] = math.nan
    out, lse = blockwise.attend_blocks(NUMPY, q, k, v, 1.0, "causal-diagonal", 2)
    assert np.isnan(out[0, 2, 1]).all() and np.isnan(lse[0, 2, 1])
    assert np.isfinite(out[0, 3]).all() and np.isfinite(out[1]).all()


def test_no_keys_gives_zeros():
    q, k, v, _ = _case(0, 4, 0)
    out, lse = blockwise.attend_blocks(NUMPY, q, k, v, 1.0, "full", 8)
    assert out.shape == (2, 4, 4, 6) and not out.any() and np.isneginf(lse).all()


@pytest.mark.parametrize(("value", "error"), [(0, "block_size (0) must be >= 1"), (-3, "block_size (-3) must be >= 1")])
def test_block_size_is_checked(value, error):
    from commlib import CommError

    with pytest.raises(CommError, match=error.replace("(", r"\(").replace(")", r"\)")):
        blockwise.check_block_size("ulysses_attention", value)


@pytest.mark.parametrize("value", [2.0, True, "8"])
def test_block_size_kind(value):
    with pytest.raises(TypeError, match="ulysses_attention: block_size must be an int"):
        blockwise.check_block_size("ulysses_attention", value)
    assert blockwise.check_block_size("ulysses_attention", None) == blockwise.BLOCK_SIZE
