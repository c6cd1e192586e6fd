"""`commlib_torch.moe` on real gloo groups (W = 1-4): every rank's dispatched rows, combined output and the x /
y / weights gradients against the float64 reference `simulate_moe`, both layouts, even and uneven placement,
K = 1, 2, capacity None / 1 / tight, -1 routes, a rank routing nothing, T = 0 on one rank, non-contiguous x,
per-expert nonlinear experts, NaN in padded rows, bf16; bad indices raise the same CommError on every rank."""

from __future__ import annotations

import pytest

from commlib import moe as spec
from tests.torch import moe_jobs

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_case_against_the_reference(pool, world_size):
    results = pool(world_size).run(moe_jobs.every_case)
    assert len(results) == world_size
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(moe_jobs.cases(world_size))
        for number, got in enumerate(per_case):
            where = (rank, number, got)
            assert got["routing"] == [True, True, True] and got["padded_zero"] and got["finite"], where
            assert got["no_grad"], where
            if got["bf16"]:  # bf16 rows (exact moves), float32 accumulation: to bf16's rounding
                assert got["dtype"] == "torch.bfloat16" and got["dispatched"] == 0.0, where
                assert max(got["combined"], got["w_grad"]) < 0.05, where
                assert got["x_grad"] < 0.02 * got["x_scale"], where  # through the experts' bf16 tanh
            else:
                assert got["dispatched"] == 0.0, where  # rows are moved, never computed
                assert max(got["combined"], got["x_grad"], got["w_grad"]) < 1e-12, where


@pytest.mark.parametrize("world_size", [1, 3])
def test_errors_are_the_same_on_every_rank(pool, world_size):
    results = pool(world_size).run(moe_jobs.errors)
    expected = moe_jobs.expected_errors(world_size)
    # the same on every rank, but the y rows error, which names each rank's own rows
    assert all(messages[:9] + messages[10:] == results[0][:9] + results[0][10:] for messages in results), results
    for got, want in zip(results[0], expected, strict=True):
        if want is not None:
            assert got == want, (got, want)
    messages = results[0]
    for rank_messages in results:
        assert rank_messages[9].startswith("CommError: combine: y has"), rank_messages[9]
    assert messages[3] == "[[2.0, 2.0], [1.0, 1.0], [0.0, 0.0]]", messages[3]
    assert messages[5].startswith("TypeError: route") and "indices" in messages[5], messages[5]
    assert messages[8].startswith("TypeError: dispatch"), messages[8]
    assert messages[9].startswith("CommError: combine") and "y has" in messages[9], messages[9]
    assert messages[11].startswith("TypeError: combine") and "weights" in messages[11], messages[11]


def test_checked_mode_names_what_the_ranks_differ_on(pool):
    results = pool(2).run(moe_jobs.checked_mismatch)
    for messages in results:
        route, dispatch, padded = messages
        assert route.startswith("CommError") and "route" in route and "capacity" in route, route
        assert dispatch.startswith("CommError") and "dispatch" in dispatch and "dtype" in dispatch, dispatch
        assert padded.startswith("CommError: route") and "tokens" in padded, padded


def test_one_row_exchange_per_direction(pool):
    """dispatch + combine forward and backward move rows four times, as the floor of benchmarks/moe.py: the
    weights' gradient reads the rows combine's forward brought back (it exchanged y's rows a fifth time)."""
    for found in pool(2).run(moe_jobs.row_exchanges):
        assert found == {
            "exact weights_grad=True": [2, 2],
            "padded weights_grad=True": [2, 2],
            "exact weights_grad=False": [2, 2],
        }, found


def test_expert_parallel_by_data_parallel_gradients(pool):
    """docs/moe.md's EP x DP recipe on a 2 x 2 mesh, float64, against the model unsharded: the experts'
    gradients synced over the DP group only, the shared layer's and the router's over the world; the two
    natural mistakes (experts over the world, the router over DP only) are visibly wrong."""
    for found in pool(4).run(moe_jobs.ep_dp_gradients):
        assert max(found["shared"], found["router"], found["experts"]) < 1e-10, found
        assert found["mistake: experts over the world"] > 1e-3, found
        assert found["mistake: router over dp only"] > 1e-3, found


@pytest.mark.parametrize("world_size", [1, 2])
def test_padded_route_dispatch_and_combine_compile_with_no_graph_break(pool, world_size):
    """torch.compile(fullgraph=True) of the padded layout's route + dispatch + expert + combine, forward and
    backward: no graph break (torch._dynamo.explain; route read the counts on the host: 17 breaks at W = 1),
    eager's values and gradients bit for bit."""
    for found in pool(world_size).run(moe_jobs.padded_compiled, timeout=300):
        assert found == {"graph_breaks": 0, "same": True}, found


@pytest.mark.parametrize("world_size", [2, 3])
def test_padded_bad_indices_raise_on_every_rank_eager_and_are_counted_compiled(pool, world_size):
    """A bad index on the last rank only: eager (checked or not) every rank raises its CommError, none hangs;
    under torch.compile the entries are counted in routing.invalid and dropped."""
    last = world_size - 1
    expected = [
        spec.bad_route_error(last, 1, 2 * world_size, "range", 2 * world_size),
        spec.bad_route_error(last, 1, -2, "range", 2 * world_size),
        spec.bad_route_error(last, 1, 1, "twice", 2 * world_size),
    ]
    results = pool(world_size).run(moe_jobs.padded_bad_indices, timeout=300)
    for rank, found in enumerate(results):
        for number, error in enumerate(expected):
            assert found[3 * number] == f"CommError: {error}", (rank, found)
            assert found[3 * number + 1] == f"CommError: {error}", (rank, found)
            assert found[3 * number + 2] == [1 if rank == last else 0, True], (rank, found)
        assert found[-1] == str(7.0 * world_size if rank == 0 else 0.0), found  # x rows 0, 0, 1 from each rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_padded_tokens_that_differ_raise_on_every_rank_eager(pool, world_size):
    tokens = [3] + [2] * (world_size - 1)
    error = f"CommError: {spec.padded_tokens_error(tokens)}"
    for rank, messages in enumerate(pool(world_size).run(moe_jobs.padded_tokens_mismatch)):
        assert messages == [error, error, str(2.0 * world_size if rank == 0 else 0.0)], messages
