"""`commlib_jax.attention.ring_attention` and `usp_attention` on simulated CPU devices: every rank's output and dq,
dk, dv against the float64 reference (`commlib.reference.ring.reference`: unsharded GQA attention at the shards' global
positions), the handed case, the parity table's ring and USP rows, what the custom_vjp saves for backward, the
collectives of the program and their shapes (k/v travel with H_kv heads) and the modes the table leaves out.
Bad input: the table of tests/bad_input.py (tests/test_bad_input.py), the same text in both frontends.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError, ring, shard_positions, shard_sequence
from commlib.reference import ring as ring_reference
from commlib.tools import cases, parity
from commlib_jax.attention import ring_attention
from commlib_jax.tools import parity_runner
from tests.jax.dependencies import subjaxprs

MODE = "shard_map[check_vma=True]"

_COLLECTIVES = ("all_to_all", "all_gather", "all_reduce", "reduce_scatter", "collective_permute")


def _whole(batch, seq, heads, kv_heads, head_dim, seed=0):
    """Whole-sequence float64 q, k, v and the output cotangent."""
    rng = np.random.default_rng(seed)
    shapes = [
        (batch, seq, heads, head_dim),
        (batch, seq, kv_heads, head_dim),
        (batch, seq, kv_heads, head_dim),
        (batch, seq, heads, head_dim),
    ]
    return [rng.standard_normal(shape) for shape in shapes]


def _mapped(call, mesh, spec, check_vma=True):
    """``(cotangent, q, k, v) -> (outputs, losses)`` over stacked [shards, B, rows, heads, D] arrays."""

    def body(cotangent, q, k, v):
        out = call(q[0], k[0], v[0])
        return out[None], (out.astype(cotangent.dtype) * cotangent[0]).sum()[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec), check_vma=check_vma)


def _ring_mesh(world_size):
    return Mesh(np.array(jax.devices()[:world_size]), ("i",)), P("i")


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
    expected = ring_reference.reference(*shards, ring_size, causal=causal, layout=layout, ulysses_size=ulysses_size)
    return [
        max(float(np.abs(mine[i] - theirs[i]).max()) for i in range(len(theirs)))
        for mine, theirs in zip(got, expected, strict=True)
    ]


def _ring_errors(world_size, causal, layout, whole, dtype=jnp.float64, check_vma=True):
    mesh, spec = _ring_mesh(world_size)
    call = lambda q, k, v: ring_attention(q, k, v, "i", causal=causal, layout=layout)  # noqa: E731
    got = _run(_mapped(call, mesh, spec, check_vma), whole, world_size, layout, dtype=dtype)
    return _errors(got, whole, world_size, layout, causal)


#: (W, causal, layout, H_kv) with H = 4 at W = 1-3 (W = 4: the parity table's rows, below): every (causal, layout)
#: pair, MHA (H_kv = 4), GQA and MQA (H_kv = 1).
RING_CASES = [
    (1, True, "zigzag", 2),
    (2, False, "zigzag", 4),
    (2, True, "contiguous", 2),
    (3, True, "zigzag", 2),
    (3, False, "contiguous", 1),
]


@pytest.mark.parametrize(("world_size", "causal", "layout", "kv_heads"), RING_CASES)
def test_ring_matches_reference(world_size, causal, layout, kv_heads):
    """Batch 2, float64, v with its own head dim: outputs and dq, dk, dv on every rank within 1e-10."""
    whole = _whole(2, 4 * world_size, 4, kv_heads, 3)
    whole[2] = np.random.default_rng(2).standard_normal((2, 4 * world_size, kv_heads, 5))  # v: D_v = 5
    whole[3] = np.random.default_rng(3).standard_normal((2, 4 * world_size, 4, 5))
    errors = _ring_errors(world_size, causal, layout, whole)
    assert max(errors) < 1e-10, errors


def _table_row(case: cases.Case) -> parity.Row:
    """`case` run by the parity runner (check_vma on) and compared with the float64 reference by `parity.check`."""
    arrays = cases.make_arrays(case, 0)
    try:
        outputs, gradients = parity_runner.run_case(case, arrays, MODE)
    except (CommError, TypeError) as error:
        return parity.check(case, arrays, None, None, f"{type(error).__name__}: {error}", "jax", MODE)
    return parity.check(case, arrays, outputs, gradients, None, "jax", MODE)


def test_handed_case():
    """The ring's handed case, the first row of the parity table at W=4: B=2, S=16, H=4, H_kv=2, D=3, float64, causal,
    zigzag; rank 0 holds positions 0, 1, 14, 15. Outputs and dq/dk/dv within 1e-10 of unsharded causal GQA
    attention at those positions: printed as `commlib parity` shows them (relative to max(1, max |reference|)) and
    as absolute errors."""
    case = cases.context_table(4)[0]
    assert case == cases.context_case(4, (2, 16, 4, 3), kv_heads=2, causal=True, layout="zigzag")
    assert shard_positions(16, 4, "zigzag")[0].tolist() == [0, 1, 14, 15]
    arrays = cases.make_arrays(case, 0)
    outputs, gradients = parity_runner.run_case(case, arrays, MODE)
    row = parity.check(case, arrays, outputs, gradients, None, "jax", MODE)
    expected_outputs, expected_gradients = cases.expected(case, arrays)
    errors = {"out": max(np.abs(mine - theirs).max() for mine, theirs in zip(outputs, expected_outputs, strict=True))}
    errors.update(
        {
            f"d{name}": max(
                np.abs(mine - theirs).max()
                for mine, theirs in zip(gradients[name], expected_gradients[name], strict=True)
            )
            for name in "qkv"
        }
    )
    print(
        f"handed case (JAX): parity errors out {row.out_error:.2e} grad {row.grad_error:.2e}; max abs errors "
        + ", ".join(f"{name} {error:.2e}" for name, error in errors.items())
    )
    assert row.passed and max(errors.values()) < 1e-10, (row, errors)


def test_parity_table():
    """Every other row of the parity table's ring and USP rows at W=4 (`commlib.tools.cases.context_table`: GQA,
    MHA, MQA, v's own head dim, float32, bfloat16; USP on the 2 x 2 mesh; invalid calls) with check_vma on, as
    `commlib parity` runs them (it adds check_vma off, pmap and the ("x", "y") mesh)."""
    rows = [_table_row(case) for case in cases.context_table(4)[1:]]
    failed = [f"{row.case}: out {row.out_error} grad {row.grad_error} {row.detail}" for row in rows if not row.passed]
    assert not failed, "\n".join(failed)
    assert {"ring_attention", "usp_attention"} <= {row.case.split("[")[0].split("!")[0] for row in rows}


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
    expected = [
        ((B, S // W, H, D), dtype),
        ((B, S // W, H_kv, D), dtype),
        ((B, S // W, H_kv, D), dtype),
        ((B, S // W, H, D), dtype),
        ((B, S // W, H), compute),
    ]
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
    plan = ring.ring_plan(
        (B, S // W, H, D), (B, S // W, H_kv, D), (B, S // W, H_kv, D), W, causal=True, layout="zigzag"
    )
    assert plan.wire_elements() == B * (S // W) * H_kv * 2 * D


def _permute_inputs_computed(jaxpr, tainted: set) -> list[bool]:
    """For every ``ppermute`` the program runs (in order), whether its operand depends on a ``dot_general`` (the
    attention of a step); `tainted`: the invars of `jaxpr` that do (updated with every var that does)."""
    found = []
    for eqn in jaxpr.eqns:
        computed = any(not isinstance(var, core.Literal) and var in tainted for var in eqn.invars)
        if eqn.primitive.name == "ppermute":
            found.append(computed)
        out_tainted = [computed or eqn.primitive.name == "dot_general"] * len(eqn.outvars)
        for inner, feeding in subjaxprs(eqn):
            inner_tainted = {
                var
                for var, outer in zip(inner.invars, feeding, strict=True)
                if not isinstance(outer, core.Literal) and outer in tainted
            }
            found += _permute_inputs_computed(inner, inner_tainted)
            if len(inner.outvars) == len(eqn.outvars) and eqn.primitive.name != "scan":  # output i from output i
                inner_out = [not isinstance(var, core.Literal) and var in inner_tainted for var in inner.outvars]
                out_tainted = [was or now for was, now in zip(out_tainted, inner_out, strict=True)]
            elif _computes(inner):
                out_tainted = [True] * len(eqn.outvars)
        tainted.update(var for var, flag in zip(eqn.outvars, out_tainted, strict=True) if flag)
    return found


def _computes(jaxpr) -> bool:
    return any(
        eqn.primitive.name == "dot_general" or any(_computes(inner) for inner, _ in subjaxprs(eqn))
        for eqn in jaxpr.eqns
    )


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_permutes_do_not_wait_for_the_step(layout):
    """The forward's permute of step t reads the k/v block step t attends with, never a result of that (or any)
    step's attention: XLA may overlap them (the DESIGN's Overlap). The backward's k/v permutes neither; its
    dk/dv permutes (a step's sums) do, each after its step's k/v: the gradient's program runs the forward's
    2 (W - 1), then per step k, v (independent) and dk, dv (computed), and dk, dv home."""
    W, B, S, H, H_kv, D = 4, 2, 16, 4, 2, 3
    mesh, spec = _ring_mesh(W)
    call = lambda q, k, v: ring_attention(q, k, v, "i", causal=True, layout=layout)  # noqa: E731
    mapped = _mapped(call, mesh, spec)
    inputs = [jnp.zeros((W, B, S // W, heads, D)) for heads in (H, H_kv, H_kv)]
    cotangent = jnp.zeros((W, B, S // W, H, D))
    forward = jax.make_jaxpr(lambda *xs: mapped(cotangent, *xs)[0])(*inputs)
    assert _permute_inputs_computed(forward.jaxpr, set()) == [False] * 2 * (W - 1)
    gradient = jax.make_jaxpr(jax.grad(lambda xs: mapped(cotangent, *xs)[1].sum()))(inputs)
    backward = [False, False, True, True] * (W - 1) + [True, True]
    found = _permute_inputs_computed(gradient.jaxpr, set())
    assert found == [False] * 2 * (W - 1) + backward, str(found)
