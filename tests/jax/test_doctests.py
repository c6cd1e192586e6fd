"""The JAX frontend's docstring examples run and every public function has one (`tests.doctest_runner`: a fresh
process with 4 CPU devices; each example builds its own mesh and ``jax.shard_map``)."""

from tests.doctest_runner import check


def test_docstring_examples():
    check("jax")
