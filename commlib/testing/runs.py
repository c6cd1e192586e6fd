"""What the frontends' ``testing.run`` share (numpy + stdlib only): the seeded inputs every rank gets, the seeded
cotangents of each rank's outputs, the per-rank result and the error naming failed ranks.

The gradients ``run`` returns are those of each rank's loss ``sum over its floating outputs of sum(output *
cotangent)`` with convention "sum" (the objective is the sum of every rank's loss: a rank's input gradient
includes what reached it through collectives from the other ranks' losses). A 0-d output's cotangent is 1, so
a function returning its loss gets that loss's gradient; an array output's cotangent is a seeded standard
normal array, drawn from ``(seed, rank, crc32 of the leaf's path)``: the same in both frameworks for the same
output paths and shapes (whatever order a framework keeps a dict's keys in).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from commlib.testing.trees import flatten, unflatten

__all__ = ["RankError", "RunResult", "cotangents", "is_floating", "seeded_inputs"]


class RankError(RuntimeError):
    """One or more ranks (or devices) raised, died or did not answer within the timeout; `ranks` names them."""

    def __init__(self, message: str, ranks: Sequence[int]):
        super().__init__(message)
        self.ranks = tuple(ranks)


class RunResult(list):
    """Every rank's result of ``testing.run``, a list in rank order of ``{"outputs": ..., "gradients": ...}``
    (numpy pytrees): `assert_parity` compares two of them rank by rank, path by path (``outputs.logits``,
    ``gradients.params.head.kernel``). `outputs` / `gradients` are the per-rank lists of each part.

    >>> result = RunResult([{"outputs": 1.0, "gradients": {"x": 2.0}}, {"outputs": 3.0, "gradients": {"x": 4.0}}])
    >>> result.outputs, result.gradients
    ([1.0, 3.0], [{'x': 2.0}, {'x': 4.0}])
    """

    @property
    def outputs(self) -> list:
        return [rank["outputs"] for rank in self]

    @property
    def gradients(self) -> list:
        return [rank["gradients"] for rank in self]


def is_floating(value: Any) -> bool:
    """Whether a numpy array (or dtype-carrying value) is floating or complex: it gets gradients."""
    dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype
    return dtype.kind in "fc" or dtype.name == "bfloat16"


def seeded_inputs(inputs: Any, seed: int, caller: str) -> dict | tuple:
    """The arrays every rank gets: `inputs` is None (no arguments), a dict (keyword arguments) or a tuple / list
    (positional arguments) of numpy pytrees, or a callable ``inputs(rng)`` returning one, given
    ``numpy.random.default_rng(seed)``. Leaves become numpy arrays. TypeError for anything else.

    >>> seeded_inputs(lambda rng: {"x": rng.standard_normal(2)}, 0, "run")["x"].shape
    (2,)
    """
    made = inputs(np.random.default_rng(seed)) if callable(inputs) else inputs
    if made is None:
        return {}
    if not isinstance(made, Mapping | list | tuple):
        raise TypeError(
            f"{caller}: inputs must be a dict (keyword arguments of fn), a tuple (positional "
            f"arguments) or a callable rng -> one of them. Received: {type(made).__name__}"
        )
    if isinstance(made, Mapping) and not all(isinstance(key, str) for key in made):
        raise TypeError(
            f"{caller}: the keys of a dict of inputs name fn's keyword arguments and must be "
            f"strings. Received: {list(made)}"
        )
    flat = {path: np.asarray(leaf) for path, leaf in flatten(made).items()}
    tree = unflatten(flat, made)
    return dict(tree) if isinstance(made, Mapping) else tuple(tree)


def cotangents(outputs: Any, seed: int, rank: int) -> Any:
    """The cotangent of each leaf of one rank's `outputs` (a pytree of arrays, given by shape and dtype): float64
    1.0 for a 0-d floating leaf, a seeded standard normal float64 array for other floating leaves, None for
    the rest (integers, bools, None). The frontends cast each to its output's dtype.

    >>> cotangents({"loss": np.float32(2.0), "ids": np.arange(3)}, seed=0, rank=1)
    {'loss': array(1.), 'ids': None}
    """
    flat = flatten(outputs)
    drawn = {path: _cotangent(leaf, (seed, rank, zlib.crc32(path.encode()))) for path, leaf in flat.items()}
    return unflatten(drawn, outputs)


def _cotangent(leaf: Any, key: tuple[int, int, int]) -> np.ndarray | None:
    if leaf is None or not is_floating(leaf):
        return None
    shape = tuple(np.shape(leaf))
    if shape == ():
        return np.array(1.0)
    return np.random.default_rng(key).standard_normal(shape)
