"""`commlib_jax.attention.ring_attention` and `usp_attention` on simulated CPU devices: every rank's output and dq,
dk, dv against the float64 reference (`commlib.context.reference`: unsharded GQA attention at the shards' global
positions), the handed case, what the custom_vjp saves for backward, the collectives of the program and their
shapes (k/v travel with H_kv heads), the other modes (pmap, a tuple of axes) and bad input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError, context, shard_positions, shard_sequence
from commlib_jax.attention import ring_attention, usp_attention

_COLLECTIVES = ("all_to_all", "all_gather", "all_reduce", "reduce_scatter", "collective_permute")


def _whole(batch, seq, heads, kv_heads, head_dim, seed=0):
    """Whole-sequence float64 q, k, v and the output cotangent."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, head_dim),
              (batch, seq, heads, head_dim)]
    return [rng.standard_normal(shape) for shape in shapes]


def _mapped(call, mesh, spec, check_vma=True):
    """``(cotangent, q, k, v) -> (outputs, losses)`` over stacked [shards, B, rows, heads, D] arrays."""

    def body(cotangent, q, k, v):
        out = call(q[0], k[0], v[0])
        return out[None], (out.astype(cotangent.dtype) * cotangent[0]).sum()[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec), check_vma=check_vma)


def _ring_mesh(world_size):
    return Mesh(np.array(jax.devices()[:world_size]), ("i",)), P("i")


def _usp_mesh():
    """2 x 2: ring index r (axis "r") and Ulysses index u (axis "u"); device (r, u) holds shard r * 2 + u."""
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("r", "u")), P(("r", "u"))


def _run(mapped, whole, ring_size, layout, ulysses_size=1, dtype=jnp.float64):
    """Every shard's output and (dq, dk, dv) of `mapped` on `whole` cut into the layout's shards (float64 numpy)."""
    shards = [np.stack(shard_sequence(x, 1, ring_size, layout, ulysses_size)) for x in whole]
    cotangent = jnp.asarray(shards[3])

    def total(inputs):
        out, losses = mapped(cotangent, *inputs)
        return losses.sum(), out

    grads, out = jax.jit(jax.grad(total, has_aux=True))([jnp.asarray(x, dtype) for x in shards[:3]])
    return [np.asarray(x, dtype=np.float64) for x in (out, *grads)]


def _errors(got, whole, ring_size, layout, causal, ulysses_size=1):
    """Max abs error of (out, dq, dk, dv) over every shard against the float64 reference."""
    shards = [shard_sequence(x, 1, ring_size, layout, ulysses_size) for x in whole]
    expected = context.reference(*shards, ring_size, causal=causal, layout=layout, ulysses_size=ulysses_size)
    return [max(float(np.abs(mine[i] - theirs[i]).max()) for i in range(len(theirs)))
            for mine, theirs in zip(got, expected, strict=True)]


def _ring_errors(world_size, causal, layout, whole, dtype=jnp.float64, check_vma=True):
    mesh, spec = _ring_mesh(world_size)
    call = lambda q, k, v: ring_attention(q, k, v, "i", causal=causal, layout=layout)  # noqa: E731
    got = _run(_mapped(call, mesh, spec, check_vma), whole, world_size, layout, dtype=dtype)
    return _errors(got, whole, world_size, layout, causal)


#: (W, causal, layout, H_kv) with H = 4: every (causal, layout) at two or more W, MHA (H_kv = 4) and MQA (H_kv = 1)
#: among GQA (H_kv = 2). The handed case (W=4, causal, zigzag) is its own test; the parity table adds more.
RING_CASES = [(1, True, "zigzag", 2), (2, False, "zigzag", 4), (2, True, "contiguous", 2), (3, True, "zigzag", 2),
              (3, False, "contiguous", 1), (4, True, "contiguous", 2), (4, False, "zigzag", 2)]


@pytest.mark.parametrize(("world_size", "causal", "layout", "kv_heads"), RING_CASES)
def test_ring_matches_reference(world_size, causal, layout, kv_heads):
    """Batch 2, float64, v with its own head dim: outputs and dq, dk, dv on every rank within 1e-10."""
    whole = _whole(2, 4 * world_size, 4, kv_heads, 3)
    whole[2] = np.random.default_rng(2).standard_normal((2, 4 * world_size, kv_heads, 5))  # v: D_v = 5
    whole[3] = np.random.default_rng(3).standard_normal((2, 4 * world_size, 4, 5))
    errors = _ring_errors(world_size, causal, layout, whole)
    assert max(errors) < 1e-10, errors


def test_handed_case():
    """Issue 12's case: W=4, B=2, S=16, H=4, H_kv=2, D=3, float64, causal, zigzag; rank 0 holds positions 0, 1,
    14, 15. Outputs and dq/dk/dv within 1e-10 of unsharded causal GQA attention at those positions."""
    assert shard_positions(16, 4, "zigzag")[0].tolist() == [0, 1, 14, 15]
    errors = _ring_errors(4, True, "zigzag", _whole(2, 16, 4, 2, 3))
    print("handed case (JAX) max errors: " + ", ".join(f"{name} {error:.2e}" for name, error in
                                                       zip(("out", "dq", "dk", "dv"), errors, strict=True)))
    assert max(errors) < 1e-10, errors


@pytest.mark.parametrize(("causal", "layout"), [(False, "contiguous"), (True, "zigzag")])
def test_usp_matches_reference(causal, layout):
    """USP on a 2 x 2 mesh (Ulysses axis "u", ring axis "r"), GQA H=4, H_kv=2, batch 2, float64, within 1e-10."""
    mesh, spec = _usp_mesh()
    call = lambda q, k, v: usp_attention(q, k, v, "u", "r", causal=causal, layout=layout)  # noqa: E731
    whole = _whole(2, 16, 4, 2, 3)
    errors = _errors(_run(_mapped(call, mesh, spec), whole, 2, layout, 2), whole, 2, layout, causal, 2)
    assert max(errors) < 1e-10, errors


@pytest.mark.parametrize(("dtype", "tolerance"), [(jnp.bfloat16, 3e-2)])
def test_half_precision(dtype, tolerance):
    """bfloat16 inputs (the softmax, LSE and accumulators in float32), causal zigzag at W=4, against the float64
    reference on the same (rounded) values; relative to the largest reference value."""
    whole = [np.asarray(jnp.asarray(x, dtype), dtype=np.float64) for x in _whole(2, 16, 4, 2, 8)]
    errors = _ring_errors(4, True, "zigzag", whole, dtype=dtype)
    shards = [shard_sequence(x, 1, 4, "zigzag") for x in whole]
    largest = max(max(float(np.abs(x).max()) for x in xs) for xs in context.reference(*shards, 4, causal=True,
                                                                                       layout="zigzag"))
    assert max(errors) < tolerance * max(1.0, largest), errors


def test_other_modes():
    """pmap, and a ring over a tuple of mesh axes given in the reverse of the mesh's order (ranks row-major in the
    order given): the handed case within 1e-10 (the parity table runs check_vma off and the ("x", "y") mesh)."""
    whole = _whole(2, 16, 4, 2, 3)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    call = lambda q, k, v: ring_attention(q, k, v, ("y", "x"), causal=True, layout="zigzag")  # noqa: E731
    errors = _errors(_run(_mapped(call, mesh, P(("y", "x"))), whole, 4, "zigzag"), whole, 4, "zigzag", True)
    assert max(errors) < 1e-10, errors

    def body(cotangent, q, k, v):
        out = ring_attention(q, k, v, "i", causal=True, layout="zigzag")
        return out, (out * cotangent).sum()

    errors = _errors(_run(jax.pmap(body, axis_name="i"), whole, 4, "zigzag"), whole, 4, "zigzag", True)
    assert max(errors) < 1e-10, errors


def _saved(call, mesh, spec, shapes, dtype):
    """(shape, dtype) of every array `jax.vjp` of `call` keeps for the backward, on one rank."""
    saved = []

    def body(q, k, v):
        out, backward = jax.vjp(call, q[0], k[0], v[0])
        saved.extend((leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(backward))
        return out[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    jax.jit(mapped).trace(*(jax.ShapeDtypeStruct(shape, dtype) for shape in shapes))
    return saved


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16])
def test_saves_q_k_v_out_and_lse(dtype):
    """What the backward keeps is exactly q, k, v, the output (their dtype) and the LSE ``[B, S/W, H]`` (the
    compute dtype): O(S/W) per rank, no k/v block of another rank and no score matrix."""
    W, B, S, H, H_kv, D = 4, 2, 64, 4, 2, 8
    mesh, spec = _ring_mesh(W)
    call = lambda q, k, v: ring_attention(q, k, v, "i", causal=True, layout="zigzag")  # noqa: E731
    shapes = [(W, B, S // W, H, D), (W, B, S // W, H_kv, D), (W, B, S // W, H_kv, D)]
    compute = jnp.float64 if dtype == jnp.float64 else jnp.float32
    expected = [((B, S // W, H, D), dtype), ((B, S // W, H_kv, D), dtype), ((B, S // W, H_kv, D), dtype),
                ((B, S // W, H, D), dtype), ((B, S // W, H), compute)]
    assert _saved(call, mesh, spec, shapes, dtype) == expected


def _permutes(jaxpr, times: int = 1) -> list[tuple[int, ...]]:
    """The operand shape of every ``ppermute`` the program runs (a scan's body counted `length` times)."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            shapes += [tuple(var.aval.shape) for var in eqn.invars] * times
        repeat = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(inner, (core.Jaxpr, core.ClosedJaxpr)):
                    shapes += _permutes(getattr(inner, "jaxpr", inner), repeat)
    return shapes


def test_permutes_and_wire():
    """The handed case's program: forward = W-1 permutes each of k and v with H_kv heads (never repeated), and no
    other collective; gradient = those, W-1 more of k and v and W of dk and dv (the last brings them home)."""
    W, B, S, H, H_kv, D = 4, 2, 16, 4, 2, 3
    mesh, spec = _ring_mesh(W)
    call = lambda q, k, v: ring_attention(q, k, v, "i", causal=True, layout="zigzag")  # noqa: E731
    mapped = _mapped(call, mesh, spec)
    inputs = [jnp.zeros((W, B, S // W, heads, D)) for heads in (H, H_kv, H_kv)]
    cotangent = jnp.zeros((W, B, S // W, H, D))
    forward = jax.make_jaxpr(lambda *xs: mapped(cotangent, *xs)[0])(*inputs)
    gradient = jax.make_jaxpr(jax.grad(lambda xs: mapped(cotangent, *xs)[1].sum()))(inputs)
    block = (B, S // W, H_kv, D)
    assert _permutes(forward.jaxpr) == [block] * 2 * (W - 1)
    assert _permutes(gradient.jaxpr) == [block] * (2 * (W - 1) + 2 * (W - 1) + 2 * W)
    text = jax.jit(jax.grad(lambda xs: mapped(cotangent, *xs)[1].sum())).lower(inputs).as_text()
    assert [name for name in _COLLECTIVES if f'"stablehlo.{name}"' in text] == ["collective_permute"]
    plan = context.ring_plan((B, S // W, H, D), (B, S // W, H_kv, D), (B, S // W, H_kv, D), W, causal=True,
                             layout="zigzag")
    assert plan.wire_elements() == B * (S // W) * H_kv * 2 * D


def _trace(call, shapes, mesh, spec):
    def body(q, k, v):
        return call(q[0], k[0], v[0])[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    jax.jit(mapped).trace(*(jnp.zeros((4, *shape)) for shape in shapes))


@pytest.mark.parametrize(("op", "shapes", "kwargs", "message"), [
    ("ring_attention", [(1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4)], {}, "ring_attention: seq (12) must be divisible "
     "by 2 * ring_size * ulysses_size (8) for layout 'zigzag'"),
    ("ring_attention", [(1, 2, 6, 4), (1, 2, 4, 4), (1, 2, 4, 4)], dict(layout="contiguous"),
     "ring_attention: heads (6) must be divisible by kv heads (4)"),
    ("ring_attention", [(1, 2, 2, 4), (1, 2, 2, 4), (1, 2, 2, 4)], dict(layout="spiral"),
     "ring_attention: layout ('spiral') must be one of contiguous, zigzag"),
    ("usp_attention", [(1, 2, 1, 4), (1, 2, 1, 4), (1, 2, 1, 4)], dict(layout="contiguous"),
     "usp_attention: ulysses_size (2) must be <= heads (1)"),
])
def test_bad_input(op, shapes, kwargs, message):
    """The spec's text (the same as torch's for the same mistake), raised while tracing, before any collective."""
    kwargs = {"layout": "zigzag", **kwargs}
    if op == "ring_attention":
        mesh, spec = _ring_mesh(4)
        call = lambda q, k, v: ring_attention(q, k, v, "i", **kwargs)  # noqa: E731
    else:
        mesh, spec = _usp_mesh()
        call = lambda q, k, v: usp_attention(q, k, v, "u", "r", **kwargs)  # noqa: E731
    with pytest.raises(CommError) as raised:
        _trace(call, shapes, mesh, spec)
    assert str(raised.value).startswith(message)
