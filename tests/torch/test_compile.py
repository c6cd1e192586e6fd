"""Every autograd Function stays traceable by torch.compile(fullgraph=True) and gives the eager result."""

import pytest
import torch

from commlib_torch.tools.pool import WorkerError
from tests.torch import compile_jobs


@pytest.mark.parametrize("name", sorted(compile_jobs.OPS))
def test_fullgraph_matches_eager(pool, name):
    per_rank = pool(2).run(compile_jobs.eager_vs_compiled, name, "aot_eager", timeout=300)
    assert all(out == 0.0 and grad == 0.0 for out, grad in per_rank), per_rank


def test_outputs_can_be_modified_in_place(pool):
    """Every op's output but sum_grad's and max's is a tensor of its own (no view of a buffer made inside the
    Function, which autograd would refuse to change in place): doubled in place, it doubles the gradient."""
    for name in compile_jobs.IN_PLACE:
        per_rank = pool(2).run(compile_jobs.in_place_eagerly, name)
        assert all(out == 0.0 and grad == 0.0 for out, grad in per_rank), (name, per_rank)


@pytest.mark.parametrize("name", compile_jobs.IN_PLACE)
def test_outputs_modified_in_place_as_eagerly(pool, name):
    """An output eager autograd lets one modify in place can be modified in place under torch.compile too, with
    the eager values and gradients (the compiled walk's output is not a view)."""
    per_rank = pool(2).run(compile_jobs.in_place_eager_vs_compiled, name, "aot_eager", timeout=300)
    assert all(out == 0.0 and grad == 0.0 for out, grad in per_rank), per_rank


@pytest.mark.parametrize("backend", ["inductor"])  # aot_eager: every rooted op above
def test_rooted_ops_compile_on_three_ranks(pool, backend):
    """broadcast, scatter, gather (and reduce, broadcast's backward) with roots other than 0 and a permute that
    leaves a rank without a source: no graph break, the eager values and gradients on every rank (1e-6: the
    reduce sums three values in another order than gloo's, inductor's sin is not eager's to the last bit)."""
    per_rank = pool(3).run(compile_jobs.chain_eager_vs_compiled, backend, timeout=300)
    assert all(breaks == 0 and out < 1e-6 and grad < 1e-6 for breaks, out, grad in per_rank), per_rank


# torch 2.11's Inductor fails in its own CPU flash-attention backward on float64 ("expected scalar type Double but
# found Float", pytorch/pytorch#185539; aot_eager gives the eager values there)
_INDUCTOR_SDPA_FLOAT64 = pytest.mark.xfail(
    tuple(map(int, torch.__version__.split(".")[:2])) < (2, 13),
    reason="pytorch/pytorch#185539",
    raises=WorkerError,
    strict=False,
)


@pytest.mark.parametrize(
    ("backend", "group_kind"),
    [("aot_eager", "mesh dims"), pytest.param("inductor", "process groups", marks=_INDUCTOR_SDPA_FLOAT64)],
)
def test_training_block_compiles_whole(pool, backend, group_kind):
    """The training block's forward and backward (RMSNorm, Ulysses attention over SP, Megatron f/g over TP) on a
    2 x 2 mesh: one graph, no break, the eager losses and gradients over three SGD steps (float64)."""
    per_rank = pool(4).run(compile_jobs.block_eager_vs_compiled, backend, group_kind, timeout=300)
    for breaks, graphs, loss_error, grad_error in per_rank:
        assert (breaks, graphs) == (0, 1) and loss_error < 1e-12 and grad_error < 1e-12, per_rank
