"""`commlib.sequence`, `commlib.ring`, `commlib.blockwise`, `commlib.reference.ring`: the sequence layouts, the
ring schedule and its step rules, on W simulated numpy ranks.

The layouts are checked against their definitions written here (chunk lists); the case table against the causal
mask at global positions (every piece exactly the visible part of its pair, nothing visible left out); the
schedule walked by `simulate_ring` (online softmax, LSE merge, dk/dv around the ring) against unsharded float64
attention, for ring sizes 1-4, both layouts, causal and not, GQA/MQA/MHA and USP sub-shards.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import commlib
from commlib import CommError
from commlib import attention as A
from commlib.blockwise import NUMPY, attend, attend_vjp, delta, merge
from commlib.reference.ring import reference, simulate_ring
from commlib.ring import USP_OP, ring_plan
from commlib.sequence import SEQUENCE_LAYOUTS

TOLERANCE = 1e-10


def _chunks(seq, ring_size, layout):
    """Ring block r's positions from the definition: contiguous blocks, or chunks r and 2W-1-r of 2W."""
    if layout == "contiguous":
        return [list(range(r * seq // ring_size, (r + 1) * seq // ring_size)) for r in range(ring_size)]
    size = seq // (2 * ring_size)
    chunk = lambda c: list(range(c * size, (c + 1) * size))  # noqa: E731
    return [chunk(r) + chunk(2 * ring_size - 1 - r) for r in range(ring_size)]


@st.composite
def _layouts(draw):
    """(S, W, layout, U) with S cut evenly."""
    ring_size, ulysses_size = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    layout = draw(st.sampled_from(SEQUENCE_LAYOUTS))
    unit = ring_size * ulysses_size * (2 if layout == "zigzag" else 1)
    return unit * draw(st.integers(1, 3)), ring_size, layout, ulysses_size


@given(_layouts())
def test_shard_positions(setting):
    """Row r*U+u: piece u of ring block r (U equal contiguous pieces); every position exactly once."""
    seq, ring_size, layout, ulysses_size = setting
    positions = commlib.shard_positions(seq, ring_size, layout, ulysses_size)
    shards = ring_size * ulysses_size
    assert positions.dtype == np.int64 and positions.shape == (shards, seq // shards)
    for block, chunk in enumerate(_chunks(seq, ring_size, layout)):
        pieces = np.split(np.asarray(chunk), ulysses_size)
        for piece, row in enumerate(pieces):
            assert positions[block * ulysses_size + piece].tolist() == row.tolist()
    assert sorted(positions.reshape(-1).tolist()) == list(range(seq))


def test_handed_positions():
    assert commlib.shard_positions(16, 4, "zigzag").tolist() == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert commlib.shard_positions(8, 2).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@given(_layouts(), st.integers(0, 2))
def test_shard_unshard(setting, dim):
    seq, ring_size, layout, ulysses_size = setting
    shape = [2, 3, 2]
    shape[dim] = seq
    x = np.arange(np.prod(shape)).reshape(shape)
    shards = commlib.shard_sequence(x, dim, ring_size, layout, ulysses_size)
    positions = commlib.shard_positions(seq, ring_size, layout, ulysses_size)
    for shard, row in zip(shards, positions, strict=True):
        np.testing.assert_array_equal(shard, np.take(x, row, axis=dim))
    np.testing.assert_array_equal(commlib.unshard_sequence(shards, dim, ring_size, layout, ulysses_size), x)


@given(st.integers(1, 5), st.sampled_from(SEQUENCE_LAYOUTS), st.booleans(), st.integers(1, 3))
def test_cases_are_the_visible_parts(ring_size, layout, causal, half):
    """Every (q block, kv block) pair: the pieces of its case cover exactly the pairs of positions the mask lets
    through, each piece's own mask exactly so; a rank's own block (step 0) gives every row a visible key."""
    rows = 2 * half
    shape = (1, rows, 2, 2)
    plan = ring_plan(shape, shape, shape, ring_size, causal=causal, layout=layout)
    assert plan.case_table.shape == (ring_size, ring_size) and plan.case_table.dtype == np.int32
    assert plan.perm == tuple((r, (r + 1) % ring_size) for r in range(ring_size))
    for step in range(ring_size):
        for rank in range(ring_size):
            block = plan.kv_block(step, rank)
            assert block == (rank - step) % ring_size
            q_pos, kv_pos = plan.positions(rank), plan.positions(block)
            visible = A.causal_mask(q_pos, kv_pos) if causal else np.ones((rows, rows), bool)
            covered = np.zeros((rows, rows), int)
            for piece in plan.cases[plan.case_table[step, rank]]:
                q_rows, kv_rows = slice(*piece.q), slice(*piece.kv)
                part = visible[q_rows, kv_rows]
                if piece.mask == "full":
                    assert part.all()
                else:
                    assert piece.q == piece.kv and (part == np.tril(np.ones_like(part))).all()
                covered[q_rows, kv_rows] += part
            np.testing.assert_array_equal(covered, visible.astype(int))
            if step == 0:
                assert covered.any(axis=1).all()
    assert plan.positions(0).tolist() == commlib.shard_positions(rows * ring_size, ring_size, layout)[0].tolist()


@st.composite
def _rings(draw):
    """A ring call: W 1-4, layout, causal, kv heads 1-2 with a GQA group 1-3, batch 1-2, D 1-3, D_v 1-3."""
    ring_size = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(SEQUENCE_LAYOUTS))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    rows = draw(st.integers(1, 3)) * (2 if layout == "zigzag" else 1)
    return dict(
        ring_size=ring_size,
        layout=layout,
        causal=draw(st.booleans()),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        batch=draw(st.integers(1, 2)),
        seq=rows * ring_size,
        head_dim=draw(st.integers(1, 3)),
        value_dim=draw(st.integers(1, 3)),
    )


def _draw_inputs(rng, batch, seq, heads, kv_heads, head_dim, value_dim):
    return (
        rng.standard_normal((batch, seq, heads, head_dim)),
        rng.standard_normal((batch, seq, kv_heads, head_dim)),
        rng.standard_normal((batch, seq, kv_heads, value_dim)),
        rng.standard_normal((batch, seq, heads, value_dim)),
    )


def _errors(got, want):
    return [
        max(float(np.max(np.abs(g - w), initial=0.0)) for g, w in zip(gs, ws, strict=True))
        for gs, ws in zip(got, want, strict=True)
    ]


@given(_rings(), st.integers(0, 2**16))
def test_simulated_ring_equals_attention(call, seed):
    """The schedule walked on W numpy ranks (online softmax, LSE merge, blockwise backward with dk/dv around
    the ring) equals unsharded attention at the shards' global positions: outputs and dq/dk/dv."""
    W, layout, causal = call["ring_size"], call["layout"], call["causal"]
    whole = _draw_inputs(
        np.random.default_rng(seed),
        call["batch"],
        call["seq"],
        call["heads"],
        call["kv_heads"],
        call["head_dim"],
        call["value_dim"],
    )
    shards = [commlib.shard_sequence(x, 1, W, layout) for x in whole]
    plan = ring_plan(*(s[0].shape for s in shards[:3]), W, causal=causal, layout=layout, dtypes=("float64",) * 3)
    got = simulate_ring(plan, *shards)
    want = reference(*shards, W, causal=causal, layout=layout)
    assert max(_errors(got, want)) <= TOLERANCE
    # and the reference itself is attention at the shards' positions
    positions = commlib.shard_positions(call["seq"], W, layout)
    for rank in range(W):
        at_positions = A.attention(shards[0][rank], whole[1], whole[2], causal=causal, q_positions=positions[rank])
        np.testing.assert_allclose(want[0][rank], at_positions, atol=TOLERANCE)


def test_handed_case():
    """W=4, B=2, S=16, H=4, H_kv=2, D=3, float64, causal, zigzag (rank 0 holds positions 0, 1, 14, 15)."""
    whole = _draw_inputs(np.random.default_rng(12), 2, 16, 4, 2, 3, 3)
    shards = [commlib.shard_sequence(x, 1, 4, "zigzag") for x in whole]
    plan = ring_plan(
        shards[0][0].shape,
        shards[1][0].shape,
        shards[2][0].shape,
        4,
        causal=True,
        layout="zigzag",
        dtypes=("float64",) * 3,
    )
    assert plan.case_names == ("diagonal", "first-half", "second-half")
    assert plan.wire_elements() == 2 * 4 * 2 * (3 + 3)  # k and v unrepeated: B * S/W * H_kv * (D + D_v)
    errors = _errors(simulate_ring(plan, *shards), reference(*shards, 4, causal=True, layout="zigzag"))
    print("handed case (simulated ranks) max errors out, dq, dk, dv:", errors)
    assert max(errors) <= TOLERANCE


@given(st.integers(1, 2), st.integers(1, 3), st.sampled_from(SEQUENCE_LAYOUTS), st.booleans(), st.integers(0, 2**16))
def test_simulated_usp_equals_attention(ring_size, ulysses_size, layout, causal, seed):
    """USP on W * U numpy ranks: the Ulysses all-to-all over the U shards of ring index r gathers ring block r
    (heads split U ways), the ring runs per head slice, the inverse all-to-all cuts it back."""
    heads, kv_heads = 2 * ulysses_size, ulysses_size
    rows = 2 * ulysses_size
    whole = _draw_inputs(np.random.default_rng(seed), 2, rows * ring_size, heads, kv_heads, 2, 2)
    shards = [commlib.shard_sequence(x, 1, ring_size, layout, ulysses_size) for x in whole]
    plan = ring_plan(
        *(s[0].shape for s in shards[:3]),
        ring_size,
        causal=causal,
        layout=layout,
        ulysses_size=ulysses_size,
        op_name=USP_OP,
        dtypes=("float64",) * 3,
    )
    assert (plan.rows, plan.heads, plan.kv_heads) == (rows, 2, 1)
    gathered = [
        [
            [
                np.concatenate(
                    [np.array_split(x[r * ulysses_size + u], ulysses_size, axis=2)[h] for u in range(ulysses_size)],
                    axis=1,
                )
                for r in range(ring_size)
            ]
            for h in range(ulysses_size)
        ]
        for x in shards
    ]
    results = [simulate_ring(plan, *(gathered[i][h] for i in range(4))) for h in range(ulysses_size)]
    got = [
        [
            np.concatenate(
                [np.array_split(results[h][i][r], ulysses_size, axis=1)[u] for h in range(ulysses_size)], axis=2
            )
            for r in range(ring_size)
            for u in range(ulysses_size)
        ]
        for i in range(4)
    ]
    want = reference(*shards, ring_size, causal=causal, layout=layout, ulysses_size=ulysses_size)
    assert max(_errors(got, want)) <= TOLERANCE


def test_step_rules_on_one_piece():
    """`attend` + `attend_vjp` on a single causal piece equal the reference on that piece; `merge` of two
    halves of the keys equals attention over both."""
    rng = np.random.default_rng(3)
    q, k, v, d_out = _draw_inputs(rng, 2, 5, 4, 2, 3, 2)
    out, lse = attend(NUMPY, q, k, v, 0.5, "causal-diagonal")
    np.testing.assert_allclose(out, A.attention(q, k, v, causal=True, scale=0.5), atol=TOLERANCE)
    grads = attend_vjp(NUMPY, q, k, v, d_out, lse, delta(NUMPY, out, d_out), 0.5, "causal-diagonal")
    for got, want in zip(grads, A.attention_vjp(q, k, v, d_out, causal=True, scale=0.5), strict=True):
        np.testing.assert_allclose(got, want, atol=TOLERANCE)
    first, second = attend(NUMPY, q, k[:, :2], v[:, :2], 0.5, "full"), attend(NUMPY, q, k[:, 2:], v[:, 2:], 0.5, "full")
    merged, _ = merge(NUMPY, *first, *second)
    np.testing.assert_allclose(merged, A.attention(q, k, v, scale=0.5), atol=TOLERANCE)


def test_compute_dtype():
    shape = (1, 2, 2, 2)
    assert ring_plan(shape, shape, shape, 2, dtypes=("bfloat16",) * 3).compute_dtype == "float32"
    assert ring_plan(shape, shape, shape, 2, dtypes=("float64",) * 3).compute_dtype == "float64"


_Q, _KV = (1, 4, 4, 2), (1, 4, 2, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: ring_plan((1, 3, 2, 2), (1, 3, 2, 2), (1, 3, 2, 2), 2, layout="zigzag"),
            "ring_attention: seq (6) must be divisible by 2 * ring_size * ulysses_size (4) for layout 'zigzag'",
        ),
        (
            lambda: ring_plan(_Q, _KV, _KV, 2, layout="ring"),
            "ring_attention: layout ('ring') must be one of contiguous, zigzag",
        ),
        (
            lambda: ring_plan(_Q, (1, 4, 3, 2), (1, 4, 3, 2), 2),
            "ring_attention: heads (4) must be divisible by kv heads (3)",
        ),
        (
            lambda: ring_plan(_Q, _KV, _KV, 2, ulysses_size=8, op_name=USP_OP),
            "usp_attention: ulysses_size (8) must be <= heads (4)",
        ),
        (
            lambda: ring_plan(_Q, _KV, _KV, 2, ulysses_size=4, op_name=USP_OP),
            "usp_attention: kv heads (2) must be divisible by ulysses_size (4)",
        ),
        (
            lambda: ring_plan((1, 4, 6, 2), (1, 4, 6, 2), (1, 4, 6, 2), 2, ulysses_size=4, op_name=USP_OP),
            "usp_attention: heads (6) must be divisible by ulysses_size (4)",
        ),
        (lambda: ring_plan(_Q, _KV, _KV, 0), "ring_attention: ring_size (0) must be >= 1"),
        (lambda: ring_plan((1, 0, 4, 2), (1, 0, 2, 2), (1, 0, 2, 2), 2), "ring_attention: seq (0) must be >= 1"),
        (lambda: ring_plan(_Q, (1, 3, 2, 2), _KV, 2), "ring_attention: k seq (3) must equal q seq (4)"),
        (
            lambda: ring_plan(_Q, _KV, _KV, 2, dtypes=("float32", "float64", "float32")),
            "ring_attention: q, k, v dtypes (float32, float64, float32) must be equal",
        ),
        (
            lambda: commlib.shard_positions(10, 4),
            "shard_positions: seq (10) must be divisible by ring_size * ulysses_size (4)",
        ),
        (
            lambda: commlib.shard_positions(12, 4, "zigzag"),
            "shard_positions: seq (12) must be divisible by 2 * ring_size * ulysses_size (8) for layout 'zigzag'",
        ),
        (
            lambda: commlib.shard_sequence(np.zeros((2, 6)), 1, 2, "zigzag", 2),
            "shard_positions: seq (6) must be divisible by 2 * ring_size * ulysses_size (8)",
        ),
    ],
)
def test_errors(call, message):
    with pytest.raises(CommError) as raised:
        call()
    assert str(raised.value).startswith(message), str(raised.value)


def test_kind_errors():
    with pytest.raises(TypeError, match="ring_attention: causal must be a bool, not int"):
        ring_plan(_Q, _KV, _KV, 2, causal=1)
    with pytest.raises(TypeError, match="shard_positions: ring_size must be an int, not float"):
        commlib.shard_positions(8, 2.0)
