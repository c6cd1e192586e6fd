"""Every autograd Function stays traceable by torch.compile(fullgraph=True) and gives the eager result."""

import pytest

from tests.torch import compile_jobs


@pytest.mark.parametrize("name", sorted(compile_jobs.OPS))
def test_fullgraph_matches_eager(pool, name):
    per_rank = pool(2).run(compile_jobs.eager_vs_compiled, name, "aot_eager", timeout=300)
    assert all(out == 0.0 and grad == 0.0 for out, grad in per_rank), per_rank
