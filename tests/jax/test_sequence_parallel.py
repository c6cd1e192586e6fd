"""`commlib_jax.sequence.parallel` and `dot_product_attention` on 4 simulated CPU devices: every shard's output and
dq/dk/dv (padded layout: rows past a shard's own are zeros with gradient 0) against the float64 reference
(`commlib.attention`: unsharded GQA attention) for Ulysses at odd lengths, ring zigzag and USP 2 x 2; every refusal
with its message; nested contexts; a context entered inside the shard_map body.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commlib
from commlib import CommError
from commlib import attention as A
from commlib_jax import _parallel
from commlib_jax.sequence import dot_product_attention, parallel

TOLERANCE = 1e-10
SCALE = 0.3


def _whole(seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """float64 q ``[2, S, 8, 4]``, k and v ``[2, S, 2, 4]`` (GQA) and the output cotangent."""
    rng = np.random.default_rng(seed)
    shapes = [(2, seq_len, 8, 4), (2, seq_len, 2, 4), (2, seq_len, 2, 4), (2, seq_len, 8, 4)]
    return [rng.standard_normal(shape) for shape in shapes]


def _mesh(layout: commlib.SequenceLayout, attention: str):
    """The mesh and the shard spec: one axis "x", or USP's ("ring", "ulysses") so shard r * U + u sits at row-major
    position (r, u)."""
    devices = np.array(jax.devices()[:layout.world_size])
    if attention == "usp":
        return Mesh(devices.reshape(layout.ring_size, layout.ulysses_size), ("ring", "ulysses")), \
            P(None, ("ring", "ulysses"))
    return Mesh(devices, ("x",)), P(None, "x")


def _context(layout, attention):
    if attention == "usp":
        return parallel(layout, attention="usp", ulysses_axis="ulysses", ring_axis="ring")
    return parallel(layout, "x", attention=attention)


def _run(layout: commlib.SequenceLayout, attention: str, causal: bool, check_vma: bool = True):
    """Every shard's output and (dq, dk, dv), padded rows dropped, and the gradients of the padded rows."""
    whole = _whole(layout.seq_len)
    cut = [jnp.asarray(np.concatenate(layout.shard(x, padded=True), axis=1)) for x in whole]
    mesh, spec = _mesh(layout, attention)

    def body(cotangent, q, k, v):
        out = dot_product_attention(q, k, v, scale=SCALE, is_causal=causal)
        return out, (out * cotangent).sum()[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, P(spec[1])), check_vma=check_vma)

    def total(q, k, v):
        out, losses = mapped(cut[3], q, k, v)
        return losses.sum(), out

    with _context(layout, attention):
        grads, out = jax.jit(jax.grad(total, argnums=(0, 1, 2), has_aux=True))(*cut[:3])
    split = lambda x: np.split(np.asarray(x), layout.world_size, axis=1)  # noqa: E731
    return [layout.unshard(split(x), padded=True) for x in (out, *grads)], [split(x) for x in (out, *grads)], whole


def _check(layout, attention, causal, check_vma=True):
    got, padded, whole = _run(layout, attention, causal, check_vma)
    want = [A.attention(*whole[:3], causal=causal, scale=SCALE), *A.attention_vjp(*whole, causal=causal, scale=SCALE)]
    for name, value, wanted in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(value, wanted, rtol=0, atol=TOLERANCE, err_msg=name)
    for x in padded:  # rows past each shard's own: zeros (output) and gradient exactly 0
        for shard, size in zip(x, layout.sizes, strict=True):
            assert not shard[:, size:].any()


@pytest.mark.parametrize("seq_len", [5, 37])
def test_ulysses_any_length(seq_len):
    _check(commlib.SequenceLayout(seq_len, ulysses_size=4), "ulysses", causal=True)


def test_ulysses_check_vma_false():
    _check(commlib.SequenceLayout(37, ulysses_size=4), "ulysses", causal=False, check_vma=False)


def test_ring_zigzag():
    _check(commlib.SequenceLayout(16, ring_size=4, layout="zigzag"), "ring", causal=True)


def test_usp_two_by_two():
    _check(commlib.SequenceLayout(16, ring_size=2, ulysses_size=2, layout="zigzag"), "usp", causal=True)


def _error(call) -> str:
    with pytest.raises((CommError, TypeError)) as raised:
        call()
    return str(raised.value)


def _enter(*args, **kwargs):
    with parallel(*args, **kwargs):
        pass


def _traced(layout, **kwargs):
    """`dot_product_attention` traced inside a W = 4 shard_map with `kwargs`."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    q = jnp.ones((1, 4 * kwargs.pop("rows", layout.max_size), 4, 8))
    body = lambda q: dot_product_attention(q, q, q, **kwargs)  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=P(None, "x"), out_specs=P(None, "x"))(q)


def test_refusals():
    layout = commlib.SequenceLayout(10, ulysses_size=4)
    assert _error(lambda: _traced(layout)).startswith("commlib attention: called outside a "
                                                      "commlib_jax.sequence.parallel(...) context")
    with parallel(layout, "x"):
        assert "an attention bias is not supported" in _error(lambda: _traced(layout, bias=jnp.zeros((1, 4, 3, 3))))
        assert "an attention mask (padding or custom) is not supported" in \
            _error(lambda: _traced(layout, mask=jnp.ones((1, 4, 3, 3), bool)))
        assert "query rows (4) must be layout.max_size (3)" in _error(lambda: _traced(layout, rows=4))
    two = commlib.SequenceLayout(10, ulysses_size=2)
    with parallel(two, "x"):  # checked when traced: the axis has 4
        assert "layout.ulysses_size (2) must be 4" in _error(lambda: _traced(two))
    assert "attention='ulysses' needs axis_name" in _error(lambda: _enter(layout))
    assert "attention='usp' needs both ulysses_axis and ring_axis" in \
        _error(lambda: _enter(layout, attention="usp", ring_axis="x"))
    assert "attention ('flash') must be one of ulysses, ring, usp" in _error(lambda: _enter(layout, "x",
                                                                                           attention="flash"))
    assert "layout must be a commlib.SequenceLayout, not int" in _error(lambda: _enter(10, "x"))


def test_checked_on_entry_inside_shard_map():
    """Entered inside the body, the layout's size is checked against the axis at once."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def body(q):
        with parallel(commlib.SequenceLayout(8, ring_size=2), "x", attention="ring"):
            return q

    text = _error(lambda: jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.ones(4)))
    assert "parallel: layout.ring_size (2) must be 4 (the group's size for attention='ring')" in text


def test_nesting():
    outer, inner = commlib.SequenceLayout(8, ulysses_size=4), commlib.SequenceLayout(8, ring_size=4)
    seen = []
    with parallel(outer, "x"):
        seen.append(_parallel.current("test").plan.attention)
        with parallel(inner, "x", attention="ring") as plan:
            seen.append(_parallel.current("test").plan.attention)
            assert plan.keywords == {"layout": "contiguous"}
        seen.append(_parallel.current("test").plan.attention)
    assert seen == ["ulysses", "ring", "ulysses"]
    assert _parallel.CONTEXTS.innermost() is None
