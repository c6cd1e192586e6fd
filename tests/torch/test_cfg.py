"""`commlib_torch.cfg`: a CFG step on a cfg group of 2 x a sequence group of 2 (4 gloo ranks) against the
one-group step (each rank alone, both passes as one batch), values and gradients; the validation."""

import numpy as np
import pytest

from tests.torch import cfg_jobs as jobs


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    channels = jobs.HEADS * jobs.HEAD_DIM
    names = ("q", "k", "v", "o", "cq", "ck", "cv", "co")
    return {
        "x": rng.standard_normal((2, 7, channels)),  # 7 video tokens: 4 and 3 rows on the sequence ranks
        "uncond": rng.standard_normal((2, 4, channels)),  # 4 text tokens
        "cond": rng.standard_normal((2, 4, channels)),
        "cotangent": rng.standard_normal((2, 7, channels)),
        "weights": {name: rng.standard_normal((channels, channels)) / channels for name in names},
    }


def test_cfg_parallel_equals_the_one_group_step(pool):
    arrays = _arrays()
    single = pool(4).run(jobs.cfg_step, arrays, 4.5, False)[0]
    parallel = pool(4).run(jobs.cfg_step, arrays, 4.5, True)
    rows = np.array_split(np.arange(7), 2)
    for rank, (guided, *_) in enumerate(parallel):
        np.testing.assert_allclose(guided, single[0][:, rows[rank % 2]], rtol=0, atol=1e-13)
    for s in range(2):  # x is shared by the cfg pair (c * 2 + s): its gradient is their sum
        np.testing.assert_allclose(parallel[s][1] + parallel[2 + s][1], single[1][:, rows[s]], rtol=0, atol=1e-13)
    for c in range(2):  # each rank's uncond / cond gradient comes from its sequence rows' queries
        for index in (2, 3):
            total = parallel[2 * c][index] + parallel[2 * c + 1][index]
            np.testing.assert_allclose(total, single[index], rtol=0, atol=1e-13)
    assert np.abs(single[2]).max() > 0 and np.abs(single[3]).max() > 0


def test_guidance_scale_reaches_the_result(pool):
    """Scale 1 gives the conditional pass and 0 the unconditional, each the block run alone on that embedding."""
    arrays = _arrays(1)
    rows = np.array_split(np.arange(7), 2)
    for scale, name in ((1.0, "cond"), (0.0, "uncond")):
        alone = pool(4).run(jobs.plain_pass, arrays, name)[0]
        for rank, (guided, *_) in enumerate(pool(4).run(jobs.cfg_step, arrays, scale, True)):
            np.testing.assert_allclose(guided, alone[:, rows[rank % 2]], rtol=0, atol=1e-13)
    assert np.abs(alone - pool(4).run(jobs.plain_pass, arrays, "cond")[0]).max() > 1e-3


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("split4", "CommError: cfg_split: world_size (4) must be 1 or 2 (the unconditional and the conditional pass)"),
        ("shapes", "CommError: cfg_split: cond shape (2, 3) must equal uncond shape (1, 3)"),
        ("odd", "CommError: cfg_combine: shape[dim] (3) must be even at world_size 1 (the uncond and cond halves)"),
        ("scale", "TypeError: cfg_combine: guidance_scale must be a number, not str"),
    ],
)
def test_bad_calls(pool, call, expected):
    assert all(message.startswith(expected) for message in pool(4).run(jobs.cfg_error, call))
