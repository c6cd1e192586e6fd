"""`commlib_jax.attention.ulysses_attention` on 4 simulated CPU devices: every rank's output and dq, dk, dv
against the float64 reference (`commlib.attention`), the padded layout (rows past a rank's size are ignored
whatever they hold, get gradient exactly 0 and give zeros), the collectives of the program (one all-to-all
each way) and their bytes, a custom `attn_fn` and bad input.

The parity table (tests/jax/test_ops.py) runs the handed case, MQA and bfloat16 at W 1-4 in every mode; here
are the other shapes (tests/attention_cases.py) and what the table cannot see.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError
from commlib import attention as A
from commlib.tools import cases, parity
from commlib_jax.attention import ulysses_attention
from commlib_jax.tools import parity_runner
from tests.attention_cases import extra_cases, handed_case, headless_cases

MODE = "shard_map[check_vma=True]"
_ALL_TO_ALL = re.compile(r'"stablehlo\.all_to_all".*: \(tensor<([0-9x]+)xf64>\) -> tensor<([0-9x]+)xf64>')
_COLLECTIVES = ("all_to_all", "all_gather", "all_reduce", "reduce_scatter", "collective_permute")


@pytest.mark.parametrize("world_size", [3, 4])
def test_more_shapes(world_size):
    """Fewer heads than ranks, a rank with no rows, uneven kv grouping, even sizes, v's own head dim, float32
    (padded rows must come back zero: the parity runner checks it). W 3 and 4 only: each case compiles a
    program of its own (~1 s); torch runs them at W 1-4."""
    failed = []
    for case in extra_cases(world_size):
        arrays = cases.make_arrays(case, 0)
        row = parity.check(case, arrays, *parity_runner.run_case(case, arrays, MODE), None, "jax", MODE)
        failed += [] if row.passed else [f"{row.case}: {row.out_error} {row.grad_error} {row.detail}"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("world_size", [2, 3])
def test_headless_ranks(world_size):
    """The torch hang's shapes (tests/torch/test_attention.py): a rank with no heads in a group while v has its
    own head dim, H < W and chunks above a rank's heads; every rank's output and dq, dk, dv equal the reference."""
    failed = []
    for case in headless_cases(world_size):
        arrays = cases.make_arrays(case, 0)
        row = parity.check(case, arrays, *parity_runner.run_case(case, arrays, MODE), None, "jax", MODE)
        failed += [] if row.passed else [f"{row.case}: {row.out_error} {row.grad_error} {row.detail}"]
    assert len(headless_cases(world_size)) > 1 and not failed, "\n".join(failed)


def _program(case: cases.Case, attn_fn=None, world_size: int = 4):
    """``(cotangent, q, k, v) -> (outputs, losses)`` over stacked [W, B, rows, H, D] arrays, check_vma on."""

    def body(cotangent, q, k, v):
        out = ulysses_attention(q[0], k[0], v[0], "i", attn_fn=attn_fn, **cases.attention_kwargs(case))
        return out[None], (out * cotangent[0]).sum()[None]

    mesh = Mesh(np.array(jax.devices()[:world_size]), ("i",))
    return jax.shard_map(body, mesh=mesh, in_specs=(P("i"),) * 4, out_specs=(P("i"), P("i")))


def _padded(case: cases.Case, arrays, name: str, fill: float):
    """Every rank's rows as stacked [W, B, max rows, ...], the rows past a rank's size set to `fill`."""
    values = [value.copy() for value in arrays[name]]
    for value, rows in zip(values, cases.attention_rows(case), strict=True):
        value[:, rows:] = fill
    return jnp.asarray(np.stack(values))


def _gradients(program, inputs, cotangent):
    def total(inputs):
        out, losses = program(cotangent, *inputs)
        return losses.sum(), out

    return jax.jit(jax.grad(total, has_aux=True))(inputs)


@pytest.mark.parametrize("causal", [False, True])
def test_handed_case_padding(causal):
    """The handed uneven case within 1e-10 of the reference, with NaN in every padded row of q, k, v and the
    cotangent: those rows are never read (every valid value is finite), their gradients are exactly 0 and the
    output rows there are zeros."""
    case = handed_case(causal)
    arrays = cases.make_arrays(case, 0)
    inputs = [_padded(case, arrays, name, np.nan) for name in "qkv"]
    grads, out = _gradients(_program(case), inputs, _padded(case, arrays, "cotangent", np.nan))
    ranks = lambda a: list(np.asarray(a))  # noqa: E731
    row = parity.check(case, arrays, ranks(out), dict(zip("qkv", map(ranks, grads), strict=True)), None)
    assert row.passed and row.out_error < 1e-10 and row.grad_error < 1e-10, row
    for rank in (2, 3):  # the ranks with 2 of 3 rows: row 2 is padding (the reference holds zeros there too)
        assert np.all(np.asarray(out)[rank][:, 2:] == 0)
        for grad in grads:
            assert np.all(np.asarray(grad)[rank][:, 2:] == 0)


def _collectives(text: str) -> dict[str, int]:
    return {name: text.count(f'"stablehlo.{name}"') for name in _COLLECTIVES if f'"stablehlo.{name}"' in text}


def test_one_all_to_all_each_way():
    """The handed case's program: forward = 2 all-to-alls (q, k, v together; the output), gradient = 2 more, no
    other collective. Each rank sends one [W * (max h + 2 max kv), B, max rows, D] buffer: the kv heads padded
    to the largest rank's count (8 on the wire for the 5 the ranks need), the rows to the longest shard."""
    case = handed_case()
    arrays = cases.make_arrays(case, 0)
    program = _program(case)
    inputs = [_padded(case, arrays, name, 0.0) for name in "qkv"]
    cotangent = _padded(case, arrays, "cotangent", 0.0)
    forward = jax.jit(lambda *xs: program(cotangent, *xs)[0]).lower(*inputs).as_text()

    def total(inputs):
        return program(cotangent, *inputs)[1].sum()

    gradient = jax.jit(jax.value_and_grad(total)).lower(inputs).as_text()  # the value keeps the forward's output
    assert _collectives(forward) == {"all_to_all": 2}
    assert _collectives(gradient) == {"all_to_all": 4}
    shapes = [tuple(int(size) for size in match.group(1).split("x")) for match in _ALL_TO_ALL.finditer(forward)]
    plan = A.ulysses_plan((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, seq_sizes=(3, 3, 2, 2), layout="padded")
    assert shapes[0] == (4 * (2 + 2 * 2), 1, 3, 4)  # W x (max q heads + 2 max kv heads), B, max rows, D
    assert plan.kv_wire_heads() == 8 and plan.heads.min_kv_heads == 5


def test_custom_attn_fn():
    """attn_fn gets q [B, S, max h, D] and kv heads grouped as GQA (or indexed per q head where some rank's q
    heads do not group evenly: here rank 0's two q heads share its one kv head), causal and the scale."""
    case = cases.attention_case(4, (1, 10, 6, 4), kv_heads=2, seq_sizes=(3, 3, 2, 2), causal=True, scale=0.4)
    calls = []

    def attend(q, k, v, *, causal, scale):
        calls.append((q.shape, k.shape, v.shape, causal, scale))
        return jnp.zeros(q.shape, q.dtype) + jnp.mean(k) + jnp.mean(v)  # any function of q, k, v will do

    arrays = cases.make_arrays(case, 0)
    inputs = [_padded(case, arrays, name, 0.0) for name in "qkv"]
    cotangent = _padded(case, arrays, "cotangent", 0.0)
    jax.jit(lambda *xs: _program(case, attend)(cotangent, *xs)[0])(*inputs)
    assert calls == [((1, 10, 2, 4), (1, 10, 2, 4), (1, 10, 2, 4), True, 0.4)]


@pytest.mark.parametrize(
    ("shapes", "kwargs", "message"),
    [
        (
            ((1, 3, 6, 4), (1, 3, 4, 4), (1, 3, 4, 4)),
            {},
            "heads (6) must be divisible by kv heads (4). Received: "
            "q_shape=(1, 3, 6, 4), k_shape=(1, 3, 4, 4), v_shape=(1, 3, 4, 4), seq_sizes=None",
        ),
        (
            ((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4)),
            dict(seq_sizes=(3, 3, 3)),
            "len(seq_sizes) (3) must equal world_size (4)",
        ),
        (((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4)), dict(causal="yes"), "causal must be a bool, not str"),
        (
            ((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4)),
            dict(seq_sizes=(4, 3, 2, 1)),
            "seq (3) must equal max(seq_sizes) (4) in the padded layout",
        ),
    ],
)
def test_bad_input(shapes, kwargs, message):
    """The spec's text (the same as torch's for the same mistake), raised while tracing."""

    def body(q, k, v):
        return ulysses_attention(q[0], k[0], v[0], "i", **kwargs)[None]

    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("i"),) * 3, out_specs=P("i"))
    with pytest.raises((CommError, TypeError)) as raised:
        jax.jit(mapped).trace(*(jnp.zeros((4, *shape)) for shape in shapes))
    assert str(raised.value).startswith(f"ulysses_attention: {message}")


def test_integer_inputs_are_refused():
    """JAX's softmax of integer scores gave zeros; the spec refuses it while tracing, with torch's text."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    mapped = jax.shard_map(
        lambda q, k, v: ulysses_attention(q[0], k[0], v[0], "i")[None],
        mesh=mesh,
        in_specs=(P("i"),) * 3,
        out_specs=P("i"),
    )
    with pytest.raises(CommError) as raised:
        jax.jit(mapped).trace(*(jnp.ones((4, 1, 3, heads, 4), jnp.int32) for heads in (6, 2, 2)))
    assert str(raised.value).startswith(
        "ulysses_attention: q, k, v dtype (int32) must be floating (bfloat16, float16, float32, float64). Received: "
    )
