"""The torch frontend's docstring examples run and every public function has one (`tests.doctest_runner`: a fresh
process whose WORLD is a 1-rank gloo group)."""

from tests.doctest_runner import check


def test_docstring_examples():
    check("torch")
