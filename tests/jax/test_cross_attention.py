"""`commlib_jax.attention.cross_attention` under ``jax.shard_map`` on simulated CPU devices (W = 1-4, check_vma
True and False): every case of tests/cross_cases.py against the float64 reference on every rank, values and dq,
dk, dv (the padded layout: every rank holds the largest shard, rows past a rank's size ignored, gradient 0); the
program's collectives (replicated: none; sharded: all_gather forward, reduce-scatter backward); bad calls.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError
from commlib_jax.attention import cross_attention
from tests import cross_cases


def _padded(shards: list, rows: int, fill=0.0) -> np.ndarray:
    """Per-rank arrays ``[B, n_r, ...]`` padded along dim 1 to `rows` and stacked: ``[W, B, rows, ...]``."""
    return np.stack(
        [np.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=fill) for x in shards]
    )


def _run(case, arrays, check_vma):
    """Every rank's output, dq, dk, dv (padded rows included) and the jaxpr text of the gradient program."""
    mesh = Mesh(np.array(jax.devices()[: case.world_size]), ("x",))
    q_rows = max(case.q_sizes)
    kv_rows = max(x.shape[1] for x in arrays["k"])
    inputs = [_padded(arrays["q"], q_rows), _padded(arrays["k"], kv_rows), _padded(arrays["v"], kv_rows)]
    cotangent = _padded(arrays["cotangent"], q_rows)
    q_ids = None if arrays["q_ids"][0] is None else _padded(arrays["q_ids"], q_rows, fill=-1)
    if q_ids is None and q_rows * case.world_size != sum(case.q_sizes):  # JAX padding rows of q: mark them
        q_ids = _padded([np.zeros(x.shape[:2], np.int32) for x in arrays["q"]], q_rows, fill=-1)
    kv_ids = None if arrays["kv_ids"][0] is None else _padded(arrays["kv_ids"], kv_rows, fill=-1)
    ids = [x for x in (q_ids, kv_ids) if x is not None]
    kv_sizes = case.kv_sizes if case.kv == "sharded" else None

    def body(cot, q, k, v, *ids):
        given = iter(ids)
        q_id = next(given)[0] if q_ids is not None else None
        kv_id = next(given)[0] if kv_ids is not None else None
        out = cross_attention(
            q[0], k[0], v[0], "x", kv=case.kv, kv_sizes=kv_sizes, segment_ids=q_id, kv_segment_ids=kv_id
        )
        return out[None], (out * cot[0]).sum()[None]

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P("x"),) * (4 + len(ids)), out_specs=(P("x"), P("x")), check_vma=check_vma
    )

    def total(q, k, v):
        out, losses = mapped(cotangent, q, k, v, *ids)
        return losses.sum(), out

    (_, out), grads = jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True)(*map(jnp.asarray, inputs))
    program = str(jax.make_jaxpr(jax.grad(lambda *xs: total(*xs)[0], argnums=(0, 1, 2)))(*inputs))
    return np.asarray(out), [np.asarray(g) for g in grads], program


@pytest.mark.parametrize(("world_size", "check_vma"), [(1, True), (2, True), (3, True), (4, True), (4, False)])
def test_cases_against_the_reference(world_size, check_vma):
    failed = []
    for case in cross_cases.cases(world_size):
        arrays = cross_cases.arrays(case)
        out, (dq, dk, dv), program = _run(case, arrays, check_vma)
        for rank in range(world_size):
            q_rows, kv_rows = case.q_sizes[rank], arrays["k"][rank].shape[1]
            errors = {
                "out": np.abs(out[rank][:, :q_rows] - arrays["out"][rank]).max(initial=0.0),
                "dq": np.abs(dq[rank][:, :q_rows] - arrays["dq"][rank]).max(initial=0.0),
                "dk": np.abs(dk[rank][:, :kv_rows] - arrays["dk"][rank]).max(initial=0.0),
                "dv": np.abs(dv[rank][:, :kv_rows] - arrays["dv"][rank]).max(initial=0.0),
                "padding": max(
                    np.abs(x[rank][:, rows:]).max(initial=0.0)
                    for x, rows in ((out, q_rows), (dq, q_rows), (dk, kv_rows), (dv, kv_rows))
                ),
            }
            if max(errors.values()) > 1e-12:
                failed.append(f"{case.name} rank {rank}: {errors}")
        gathers = case.kv == "sharded" and world_size > 1
        if gathers != ("all_gather" in program) or gathers != (
            "reduce_scatter" in program or "psum_scatter" in program
        ):
            failed.append(f"{case.name}: collectives in the gradient program do not match kv={case.kv!r}")
    assert not failed, "\n".join(failed)


def _call_in_mesh(q_shape, k_shape, **options):
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    body = lambda q, k: cross_attention(q[0], k[0], k[0], "x", **options)[None]  # noqa: E731
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    return mapped(jnp.zeros((4, *q_shape)), jnp.zeros((4, *k_shape)))


def test_bad_calls_name_cross_attention_and_both_numbers():
    with pytest.raises(CommError, match=r"cross_attention: heads \(4\) must be divisible by kv heads \(3\)"):
        _call_in_mesh((1, 4, 4, 3), (1, 2, 3, 3))
    with pytest.raises(CommError, match=r"cross_attention: len\(kv_sizes\) \(2\) must equal world_size \(4\)"):
        _call_in_mesh((1, 4, 4, 3), (1, 2, 2, 3), kv="sharded", kv_sizes=(2, 2))
    with pytest.raises(CommError, match=r"k seq \(2\) must equal max\(kv_sizes\) \(3\) in the padded layout"):
        _call_in_mesh((1, 4, 4, 3), (1, 2, 2, 3), kv="sharded", kv_sizes=(3, 0, 1, 1))
    with pytest.raises(TypeError, match="cross_attention: kv must be a str, not int"):
        _call_in_mesh((1, 4, 4, 3), (1, 2, 2, 3), kv=1)
    with pytest.raises(TypeError, match=r"cross_attention: kv_segment_ids dtype \(float(32|64)\) must be an integer"):
        _call_in_mesh((1, 4, 4, 3), (1, 2, 2, 3), kv_segment_ids=jnp.zeros((1, 2)))
