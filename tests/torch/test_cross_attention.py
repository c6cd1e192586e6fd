"""`commlib_torch.attention.cross_attention` on real gloo process groups (W = 1-4): every case of
tests/cross_cases.py (replicated and sharded kv, uneven and empty shards, GQA, MQA, batch 2, padded text and
padding queries) against the float64 reference on every rank, values and dq, dk, dv; the collectives each way
(replicated: none; sharded: one all_gather of [k | v] forward, its reduce-scatter backward) and bad calls.
"""

import numpy as np
import pytest

from tests import cross_cases
from tests.torch import cross_jobs as jobs

WORLD_SIZES = (1, 2, 3, 4)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cases_against_the_reference(pool, world_size):
    failed = []
    for case in cross_cases.cases(world_size):
        arrays = cross_cases.arrays(case)
        for rank, (out, grads, forward, backward) in enumerate(pool(world_size).run(jobs.cross_call, case, arrays)):
            errors = {"out": np.abs(out - arrays["out"][rank]).max(initial=0.0)}
            errors |= {f"d{n}": np.abs(grads[n] - arrays[f"d{n}"][rank]).max(initial=0.0) for n in "qkv"}
            if max(errors.values()) > 1e-12:
                failed.append(f"{case.name} rank {rank}: {errors}")
            gathers = case.kv == "sharded" and world_size > 1
            # one c10d call per gather ([k | v], then the kv ids: integers); replicated kv never communicates.
            # (An uneven gather is pairwise batch_isend_irecv, its VJP one all_to_all_single.)
            want = 0 if not gathers else 1 + (case.text is not None)
            if len(forward) != want or len(backward) != (1 if gathers else 0):
                failed.append(f"{case.name} rank {rank}: collectives {forward} / {backward}")
    assert not failed, "\n".join(failed)


def test_padding_keys_get_gradient_zero_and_rows_that_see_nothing_output_zero(pool):
    case = next(case for case in cross_cases.cases(3) if case.name == "sharded-all-padding")
    arrays = cross_cases.arrays(case)
    for rank, (out, grads, _, _) in enumerate(pool(3).run(jobs.cross_call, case, arrays)):
        assert np.all(out[0] == 0) and np.all(grads["q"][0] == 0)  # batch row 0: every key is padding
        padding = arrays["kv_ids"][rank] < 0
        assert np.all(grads["k"][padding] == 0) and np.all(grads["v"][padding] == 0)
        assert np.abs(out[1]).max(initial=1.0) > 0


BAD = [
    ((1, 4, 4, 3), (1, 2, 3, 3), {}, "CommError: cross_attention: heads (4) must be divisible by kv heads (3)"),
    ((1, 4, 4, 3), (1, 2, 2, 3), {"kv": "gathered"}, "CommError: cross_attention: kv ('gathered') must be one of"),
    (
        (1, 4, 4, 3),
        (1, 2, 2, 3),
        {"kv": "sharded", "kv_sizes": (2, 2)},
        "CommError: cross_attention: len(kv_sizes) (2) must equal world_size (4)",
    ),
    (
        (1, 4, 4, 3),
        (1, 2, 2, 3),
        {"kv": "sharded", "kv_sizes": (1, 1, 1, 1)},
        "CommError: cross_attention: k seq (2) must equal kv_sizes[{rank}] (1) on rank {rank}",
    ),
    (
        (1, 4, 4, 3),
        (1, 2, 2, 3),
        {"kv_sizes": (2, 2, 2, 2)},
        'CommError: cross_attention: kv_sizes must be None with kv="replicated"',
    ),
    ((2, 4, 4, 3), (1, 2, 2, 3), {}, "CommError: cross_attention: k batch (1) must equal q batch (2)"),
    ((1, 4, 4, 3), (1, 2, 2, 3), {"kv": 1}, "TypeError: cross_attention: kv must be a str, not int"),
]


@pytest.mark.parametrize(("q_shape", "k_shape", "options", "expected"), BAD)
def test_bad_calls_raise_on_every_rank_before_communicating(pool, q_shape, k_shape, options, expected):
    messages = pool(4).run(jobs.cross_error, q_shape, k_shape, options)
    assert all(message.startswith(expected.format(rank=r)) for r, message in enumerate(messages)), messages
