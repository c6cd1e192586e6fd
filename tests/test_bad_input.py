"""The bad-input table (`tests.bad_input`) on the spec, torch (gloo workers) and JAX (CPU devices).

Every row either gives the reference value (and gradient, in grad mode) or the same error text on all
three sides: the spec's `cases.error_text` must start with the row's expected text, and each frontend's
result goes through `commlib.tools.parity.check`, which passes an error only if it is the spec's exact text.
The frontends run through their parity runners' `run_case`, as `commlib parity` does.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from commlib.tools import cases, parity
from tests import bad_input

ROWS = bad_input.table()
#: JAX modes each row runs in (the parity runner's names); pmap covers the other lowering path.
JAX_MODES = ("shard_map[check_vma=True]", "pmap")
#: Grad modes that JAX runs as "constant" (forward only): a row in them compiles the constant row's program again
#: (a compile each, a second or so for ring/USP), so JAX runs the constant rows only; channels_last rows likewise
#: are torch's (JAX has no memory layouts: its runner holds every array contiguous).
_TORCH_ONLY_GRAD_MODES = ("no_grad", "inference_mode")
#: The rows JAX runs: contiguous, and grad or constant.
JAX_ROWS = [row for row in ROWS if row.layout == "contiguous" and row.grad_mode not in _TORCH_ONLY_GRAD_MODES]


def _arrays(row: bad_input.Row) -> dict[str, list[np.ndarray]]:
    return cases.make_arrays(row.case, seed=5)


def _report(row: bad_input.Row, result: parity.Row) -> str:
    errors = f"out {result.out_error} grad {result.grad_error}"
    return f"{row.name} [{result.framework} {result.mode}]: {errors} {result.detail}"


@pytest.fixture(scope="module")
def jax_cpu():
    """JAX on 4 CPU devices with float64 (as tests/jax/conftest.py sets it up); fails, not skips, without."""
    import jax

    with contextlib.suppress(RuntimeError):  # the backend is already up (e.g. tests/jax ran first)
        jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_enable_x64", True)
    assert len(jax.devices("cpu")) >= max(bad_input.WORLD_SIZES), jax.devices("cpu")
    return jax


@pytest.mark.timeout(30)
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_spec(row):
    text = cases.error_text(row.case)
    if row.error is not None:
        assert text is not None and text.startswith(row.error), (text, row.error)
        return
    assert text is None, text
    outputs, gradients = cases.expected(row.case, _arrays(row))
    assert [output.shape for output in outputs] == [row.case.out_shape()] * row.case.world_size
    assert set(gradients) == (set() if not row.case.differentiable else set(row.case.inputs))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_torch(row, pool):
    from commlib_torch.tools.parity_jobs import merge, run_case

    arrays = _arrays(row)
    replies = pool(row.case.world_size).run(
        run_case, row.case, arrays, grad_mode=row.grad_mode, channels_last=row.layout == "channels_last"
    )
    outputs, gradients, error = merge(row.case, replies)
    result = parity.check(row.case, arrays, outputs, gradients, error, "torch", "gloo", forward_only=row.forward_only)
    assert result.passed, _report(row, result)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", JAX_ROWS, ids=lambda row: row.name)
def test_jax(row, jax_cpu):
    from commlib import CommError
    from commlib_jax.tools.parity_runner import modes_for, run_case

    arrays = _arrays(row)
    if row.forward_only:
        arrays.pop("cotangent", None)  # the JAX runner then runs forward only
    for mode in JAX_MODES:
        if mode not in modes_for(row.case.world_size, row.case):  # usp_attention: shard_map on an R x U mesh only
            continue
        try:
            outputs, gradients = run_case(row.case, arrays, mode)
            error = None
        except (CommError, TypeError) as raised:
            outputs, gradients, error = None, None, f"{type(raised).__name__}: {raised}"
        result = parity.check(
            row.case, _arrays(row), outputs, gradients, error, "jax", mode, forward_only=row.forward_only
        )
        assert result.passed, _report(row, result)
