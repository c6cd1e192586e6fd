"""The workload of the ``testing.run`` tests (torch and JAX) and its float64 numpy reference.

Rank r scales the whole input ``x [W + 1, 3, 5]`` by ``r + 1`` (y), and returns ``all_reduce(y)``, the all_gather of
its row r of y along dim 0, its scalar ``sum(y * y)`` and ``ids + r`` (integers: no cotangent, no gradient).
"""

from __future__ import annotations

import numpy as np

from commlib.testing import cotangents

SHAPE = (3, 5)  # x is [W + 1, *SHAPE]: one more row than ranks


def inputs(world_size: int, dtype: str = "float64"):
    """The ``inputs=`` callable: x and ids from the run's seeded generator."""

    def make(rng: np.random.Generator) -> dict:
        return {"x": rng.standard_normal((world_size + 1, *SHAPE)).astype(dtype), "ids": rng.integers(0, 9, 4)}

    return make


def expected(world_size: int, seed: int = 0, dtype: str = "float64") -> list[dict]:
    """Every rank's outputs and gradients (float64) for ``run(..., inputs=inputs(world_size, dtype), seed=seed)``."""
    arrays = inputs(world_size, dtype)(np.random.default_rng(seed))
    x, ids = arrays["x"].astype(np.float64), arrays["ids"]
    W = world_size
    scales = np.arange(1, W + 1, dtype=np.float64)
    outputs = [
        {
            "reduced": x * scales.sum(),
            "gathered": x[:W] * scales[:, None, None],
            "square": np.float64(scale * scale * (x * x).sum()),
            "ids": ids + rank,
        }
        for rank, scale in enumerate(scales)
    ]
    drawn = [cotangents(output, seed, rank) for rank, output in enumerate(outputs)]
    summed = {name: sum(cotangent[name] for cotangent in drawn) for name in ("reduced", "gathered")}
    results = []
    for rank, scale in enumerate(scales):
        gradient = scale * summed["reduced"] + 2 * scale * scale * x
        gradient[rank] += scale * summed["gathered"][rank]
        results.append({"outputs": outputs[rank], "gradients": {"x": gradient, "ids": None}})
    return results
