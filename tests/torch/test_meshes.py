"""``group=`` a DeviceMesh: every op over each dim of a 2 x 2 mesh (``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("sp", "tp"))`` on a world-4 gloo pool), given as ``(mesh, name)`` and as the 1-D sub-mesh
``mesh[name]``; every member's output and input gradient against the reference computed for its group alone.
A mesh that is not 1-D without a dim, or a dim the mesh lacks, is the spec's CommError on every rank.
"""

import pytest

from commlib import plans
from commlib.tools import cases, parity
from commlib_torch.tools.parity_jobs import merge
from tests.torch import mesh_jobs

DIMS, FORMS = ("sp", "tp"), ("tuple", "1-D")


def _case(op_name, shape, dtype="float64", **kwargs):
    args = ",".join(f"{key}={value}" for key, value in kwargs.items())
    return cases.Case(f"mesh:{op_name}[{shape},{args}]", op_name, 2, tuple(shape), dtype, tuple(kwargs.items()))


#: One call of every op at W = 2 (ranks given as 1, the second rank of each group, where an op takes one).
MESH_CASES = [
    _case("all_reduce", (2, 3), op="max"),
    _case("all_reduce", (2, 3), convention="replicated"),
    _case("all_gather", (2, 3), dim=-1),
    _case("reduce_scatter", (4, 3), dim=0, op="avg"),
    _case("all_to_all", (2, 4, 3), scatter_dim=1, gather_dim=2),
    _case("all_to_all_4d", (2, 3, 4, 2), scatter_dim=2, gather_dim=1),
    _case("broadcast", (3,), src=1),
    _case("gather", (2, 3), dst=1, dim=0),
    _case("scatter", (4, 3), src=1, dim=0),
    _case("permute", (2, 3), perm=[[1, 0]]),
    _case("sum_grad", (3,)),
    _case("shard", (2, 4), dim=-1),
    _case("reduce", (2, 3), dst=1, op="avg"),
]


def test_mesh_cases_cover_every_op():
    assert {case.op for case in MESH_CASES} == set(plans.OP_NAMES)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dim", DIMS)
def test_every_op_over_a_mesh_dim(pool, dim, form):
    failed = []
    for case in MESH_CASES:
        arrays = [cases.make_arrays(case, seed) for seed in range(2)]
        replies = pool(4).run(mesh_jobs.run_case_on_mesh, dim, form, case, arrays)
        for index, members in enumerate(mesh_jobs.partition(dim)):
            outputs, gradients, error = merge(case, [replies[rank][1] for rank in members])
            assert all(replies[rank][0] == index for rank in members)
            row = parity.check(case, arrays[index], outputs, gradients, error)
            if not row.passed:
                failed.append(f"{dim} {form} {members} {case.name}: {row.out_error} {row.grad_error} {row.detail}")
    assert not failed, "\n".join(failed)


def test_the_mesh_groups_are_the_mesh_dims(pool):
    """The check can fail: the "tp" groups' results checked against the "sp" groups' arrays do not pass."""
    case = _case("all_gather", (2, 3), dim=0)
    arrays = [cases.make_arrays(case, seed) for seed in range(2)]
    replies = pool(4).run(mesh_jobs.run_case_on_mesh, "tp", "tuple", case, arrays)
    outputs, gradients, error = merge(case, [replies[rank][1] for rank in (0, 1)])
    assert parity.check(case, arrays[0], outputs, gradients, error).passed
    assert not parity.check(case, arrays[1], outputs, gradients, error).passed


_MESH = "mesh_shape=(2, 2), mesh_dim_names=('sp', 'tp')"
_REJECTED = {
    "2-D": "CommError: {op}: mesh ndim (2) must be 1 when group is a mesh without a dim: pass (mesh, name) with name "
    f"one of ('sp', 'tp'). Received: {_MESH}",
    "unknown": f"CommError: {{op}}: mesh dim ('dp') must be one of the mesh's dim names ('sp', 'tp'). Received: {_MESH}"
    ", dim='dp'",
    "index": f"CommError: {{op}}: mesh dim (2) must be in [-2, 2) for ndim 2. Received: {_MESH}, dim=2",
    "list": "TypeError: {op}: group must be a ProcessGroup, DeviceMesh, (DeviceMesh, dim) or None, not list. "
    "Received: type='list'",
}


@pytest.mark.parametrize("group_spec", _REJECTED)
def test_bad_mesh_groups_are_refused_by_every_op(pool, group_spec):
    for op in (*plans.OP_NAMES, "DeviceCommunicator", "ulysses_attention"):
        assert pool(4).run(mesh_jobs.rejected, op, group_spec) == [_REJECTED[group_spec].format(op=op)] * 4, op


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dim", DIMS)
def test_communicator_over_a_mesh_dim(pool, dim, form):
    per_rank = pool(4).run(mesh_jobs.communicator_on_mesh, dim, form)
    for members in mesh_jobs.partition(dim):
        for local, rank in enumerate(members):
            assert per_rank[rank] == (local, 2, [float(member) for member in members])


@pytest.mark.parametrize("form", FORMS)
def test_attention_over_a_mesh_dim(pool, form):
    assert pool(4).run(mesh_jobs.attention_on_mesh, form) == [(0.0, 0.0, 2)] * 4
