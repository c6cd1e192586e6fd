"""`commlib.attention`: the head and position bookkeeping of Ulysses attention, its validation, and the float64
reference -- against naive definitions written here (sets of heads, loops over queries, finite differences).

`commlib.reference.ulysses.simulate_ulysses` runs the frontends' own walk (`commlib.ulysses.walk`: one send buffer
per exchange, the all-to-all, the receive offsets, the kv indexing, attention per rank, the return all-to-all) on
W simulated numpy ranks, so the plans themselves are checked against unsharded attention here, for both layouts,
before any framework runs.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import CommError
from commlib import attention as A
from commlib.reference.ulysses import simulate_ulysses

WORLD_SIZES = (1, 2, 3, 4)


@st.composite
def _heads(draw, max_world_size=4):
    """(heads, kv_heads, world_size): kv heads 1..4, a GQA group 1..4 (MHA, GQA, MQA), H below and above W."""
    kv_heads, group = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return kv_heads * group, kv_heads, draw(st.integers(1, max_world_size))


@given(_heads())
def test_head_split(setting):
    """q heads: split_sizes(H, W), contiguous, in rank order. kv heads: exactly those the rank's q heads use."""
    heads, kv_heads, world_size = setting
    split = A.head_split(heads, kv_heads, world_size)
    assert split.q_sizes == tuple(len(part) for part in np.array_split(np.arange(heads), world_size))
    assert [head for start, stop in split.q_ranges for head in range(start, stop)] == list(range(heads))
    for rank, ((start, stop), (kv_start, kv_stop)) in enumerate(zip(split.q_ranges, split.kv_ranges, strict=True)):
        used = sorted({head // (heads // kv_heads) for head in range(start, stop)})
        assert list(range(kv_start, kv_stop)) == used
        assert [kv_start + kv for kv in split.local_kv(rank)] == [head // split.group for head in range(start, stop)]
        group = split.local_group(rank)
        if group is not None:
            assert all(kv == i // group for i, kv in enumerate(split.local_kv(rank)))
    assert split.min_kv_heads == sum(split.kv_sizes)


def test_head_split_shares_a_kv_head():
    """The handed case: 6 q heads over 2 kv heads at W=4; kv head 0 serves ranks 0 and 1, kv head 1 ranks 1-3."""
    split = A.head_split(6, 2, 4)
    assert split.q_ranges == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert split.kv_ranges == ((0, 1), (0, 2), (1, 2), (1, 2))
    assert split.min_kv_heads == 5
    assert A.head_split(8, 2, 3).local_group(1) is None  # q heads 3, 4, 5 use kv heads 0, 1, 1: not even


def _exact_plans(shapes, world_size, seq_sizes, **kwargs):
    return [
        A.ulysses_plan(
            *((shape[0], rows, *shape[2:]) for shape in shapes), world_size, rank=rank, seq_sizes=seq_sizes, **kwargs
        )
        for rank, rows in enumerate(seq_sizes)
    ]


@given(_heads(), st.booleans())
def test_send_buffer(setting, same_value_dim):
    """Exact layout: destination j's block is its q heads, then its k heads, then its v heads (exactly those),
    and the runs rebuild the index. Padded layout: every block padded to the largest counts."""
    heads, kv_heads, world_size = setting
    value_dim = 3 if same_value_dim else 5
    shapes = ((1, 2, heads, 3), (1, 2, kv_heads, 3), (1, 2, kv_heads, value_dim))
    split = A.head_split(heads, kv_heads, world_size)
    for plan in _exact_plans(shapes, world_size, (2,) * world_size):
        assert plan.fused == same_value_dim
        for exchange in plan.exchanges:
            offsets = dict(zip(exchange.inputs, np.cumsum((0, *exchange.heads)), strict=False))
            ranges = {"q": split.q_ranges, "k": split.kv_ranges, "v": split.kv_ranges}
            expected = [
                offsets[name] + head
                for j in range(world_size)
                for name in exchange.inputs
                for head in range(*ranges[name][j])
            ]
            assert list(exchange.send_index) == expected
            rebuilt = [offsets[name] + head for name, start, stop in exchange.send_runs for head in range(start, stop)]
            assert rebuilt == expected
            widths = [
                sum(ranges[name][j][1] - ranges[name][j][0] for name in exchange.inputs) for j in range(world_size)
            ]
            assert (exchange.scatter_sizes or (widths[0],) * world_size) == tuple(widths)
            assert sum(stop - start for _, start, stop in exchange.receive) == widths[plan.rank]
    padded = A.ulysses_plan(*shapes, world_size, layout="padded")
    width = sum(max(sizes) for sizes in (split.q_sizes, split.kv_sizes, split.kv_sizes))
    assert sum(len(exchange.send_index) for exchange in padded.exchanges) == world_size * width
    assert all(exchange.scatter_sizes is None for exchange in padded.exchanges)


@st.composite
def _problem(draw):
    """A whole Ulysses problem: heads, uneven seq_sizes (zeros included), batch, head dims, causal, scale."""
    heads, kv_heads, world_size = draw(_heads())
    seq_sizes = tuple(draw(st.lists(st.integers(0, 3), min_size=world_size, max_size=world_size)))
    if sum(seq_sizes) == 0:
        seq_sizes = (1, *seq_sizes[1:])
    head_dim = draw(st.integers(1, 3))
    value_dim = draw(st.sampled_from([head_dim, head_dim + 1]))
    options = dict(causal=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.7])))
    return world_size, draw(st.integers(1, 2)), seq_sizes, heads, kv_heads, head_dim, value_dim, options


def _draw_problem(problem, seed=0):
    _, batch, seq_sizes, heads, kv_heads, head_dim, value_dim, _ = problem
    rng = np.random.default_rng(seed)
    seq = sum(seq_sizes)
    shapes = ((batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, value_dim))
    return [rng.standard_normal(shape) for shape in shapes]


def _rows(x, seq_sizes):
    return np.split(x, np.cumsum(seq_sizes)[:-1], axis=1)


def _padded(parts, rows):
    """Every rank's rows padded to `rows` with values the walk must never read."""
    return [
        np.concatenate([part, np.full((part.shape[0], rows - part.shape[1], *part.shape[2:]), np.nan)], axis=1)
        for part in parts
    ]


@given(_problem(), st.data())
def test_simulated_ulysses_is_attention(problem, data):
    """Both layouts' plans, walked on simulated ranks, give unsharded GQA attention cut into every rank's rows,
    in one head group or in any number `chunks` allows."""
    world_size, _, seq_sizes, heads, *_, options = problem
    chunks = data.draw(st.integers(1, max(A.head_split(heads, 1, world_size).q_sizes)), label="chunks")
    q, k, v = _draw_problem(problem)
    expected = _rows(A.attention(q, k, v, **options), seq_sizes)
    exact = _exact_plans([x.shape for x in (q, k, v)], world_size, seq_sizes, chunks=chunks, **options)
    got = simulate_ulysses(exact, *(_rows(x, seq_sizes) for x in (q, k, v)))
    for out, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    rows = max(seq_sizes)
    padded = A.ulysses_plan(
        *((x.shape[0], rows, *x.shape[2:]) for x in (q, k, v)),
        world_size,
        seq_sizes=seq_sizes,
        layout="padded",
        chunks=chunks,
        **options,
    )
    got = simulate_ulysses([padded] * world_size, *(_padded(_rows(x, seq_sizes), rows) for x in (q, k, v)))
    for out, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@given(_problem(), st.data())
def test_simulated_ulysses_with_segment_ids(problem, data):
    """The walk's segment ids (all-gathered once, the mask of every group's attention) on simulated ranks give
    unsharded attention with the same ids: documents, and padding (-1) that sees and is seen by nothing."""
    world_size, batch, seq_sizes, heads, *_, options = problem
    chunks = data.draw(st.integers(1, max(A.head_split(heads, 1, world_size).q_sizes)), label="chunks")
    q, k, v = _draw_problem(problem)
    ids = np.asarray(data.draw(st.lists(st.integers(-1, 1), min_size=q.shape[1] * batch, max_size=q.shape[1] * batch)))
    ids = ids.reshape(batch, q.shape[1])
    expected = _rows(A.attention(q, k, v, q_segments=ids, k_segments=ids, **options), seq_sizes)
    plans = [
        A.ulysses_plan(
            *((x.shape[0], rows, *x.shape[2:]) for x in (q, k, v)),
            world_size,
            rank=rank,
            seq_sizes=seq_sizes,
            chunks=chunks,
            segment_ids=((batch, rows), "int64"),
            **options,
        )
        for rank, rows in enumerate(seq_sizes)
    ]
    got = simulate_ulysses(plans, *(_rows(x, seq_sizes) for x in (q, k, v)), segment_ids=_rows(ids, seq_sizes))
    for out, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@given(_heads(), st.data())
def test_head_groups(setting, data):
    """Group c holds piece c of split_sizes(h_r, chunks) of rank r's q heads, in order, and exactly the kv heads
    those use; the result's runs put every rank's heads back in head order; chunks=1 is the call's one group."""
    heads, kv_heads, world_size = setting
    split = A.head_split(heads, kv_heads, world_size)
    chunks = data.draw(st.integers(1, max(split.q_sizes)), label="chunks")
    groups = A.head_groups(split, chunks)
    assert len(groups) == chunks and A.head_groups(split, 1) == (split,)
    for rank, (start, stop) in enumerate(split.q_ranges):
        pieces = [group.q_ranges[rank] for group in groups]
        assert [head for first, last in pieces for head in range(first, last)] == list(range(start, stop))
        assert [last - first for first, last in pieces] == list(A.split_sizes(stop - start, chunks))
        for group in groups:
            first, last = group.q_ranges[rank]
            used = sorted({head // (heads // kv_heads) for head in range(first, last)})
            assert list(range(*group.kv_ranges[rank])) == used
    shapes = ((1, 2, heads, 3), (1, 2, kv_heads, 3), (1, 2, kv_heads, 3))
    plan = A.ulysses_plan(*shapes, world_size, rank=0, chunks=chunks)
    assert plan.chunks == chunks and [group.heads for group in plan.groups] == list(groups)
    if chunks == 1:
        assert plan.out_runs is None and plan.groups[0].heads == split
        return
    owners = [
        (index, source) for source in range(world_size) for index in range(chunks) if groups[index].q_sizes[source]
    ]
    assert [(index, stop - start) for index, start, stop in plan.out_runs] == [
        (index, groups[index].q_sizes[source]) for index, source in owners
    ]
    assert sum(stop - start for _, start, stop in plan.out_runs) == heads


def test_chunked_handed_case_plan():
    """The handed case (H=6, H_kv=2, W=4) in 2 groups: rank r's first head, then its second (ranks 2 and 3 have
    one: empty in group 1); each group's all-to-all carries exactly its heads and their kv heads; the output
    runs take rank 0's heads from groups 0 and 1, then rank 1's, then ranks 2 and 3's from group 0."""
    plan = A.ulysses_plan((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, rank=1, seq_sizes=(3, 3, 2, 2), chunks=2)
    first, second = plan.groups
    assert first.heads.q_ranges == ((0, 1), (2, 3), (4, 5), (5, 6)) and second.heads.q_ranges[2:] == ((5, 5), (6, 6))
    # group 0: 3 heads (q, k, v) to every rank (even: None); group 1: none to ranks 2 and 3
    assert first.exchanges[0].scatter_sizes is None and second.exchanges[0].scatter_sizes == (3, 3, 0, 0)
    assert (first.local_heads, second.local_heads) == (1, 1)  # rank 1: q head 2 (kv 0), then q head 3 (kv 1)
    assert (first.out_gather_sizes, second.out_gather_sizes) == (None, (1, 1, 0, 0))
    assert plan.out_runs == ((0, 0, 1), (1, 0, 1), (0, 1, 2), (1, 1, 2), (0, 2, 3), (0, 3, 4))
    assert plan.kv_wire_heads() == 4 + 2  # each group's kv heads: kv 0 goes to rank 0 in both groups
    assert (
        A.ulysses_plan(
            (1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, seq_sizes=(3, 3, 2, 2), layout="padded", chunks=2
        ).kv_wire_heads()
        == 4 + 4
    )


def _naive_attention(q, k, v, causal, scale, q_positions, k_positions):
    """Loops over batch, q head and query: softmax over the visible keys of the kv head i // group."""
    group = q.shape[2] // k.shape[2]
    out = np.zeros((*q.shape[:3], v.shape[-1]))
    for b in range(q.shape[0]):
        for head in range(q.shape[2]):
            for i in range(q.shape[1]):
                seen = [j for j in range(k.shape[1]) if not causal or k_positions[j] <= q_positions[i]]
                if not seen:
                    continue
                scores = np.array([q[b, i, head] @ k[b, j, head // group] * scale for j in seen])
                weights = np.exp(scores - scores.max())
                out[b, i, head] = sum(
                    w * v[b, j, head // group] for w, j in zip(weights / weights.sum(), seen, strict=True)
                )
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (3, 1)])
def test_attention_reference(heads, kv_heads, causal):
    """GQA attention against loops, with positions that are not in order and a query that sees no key."""
    rng = np.random.default_rng(3)
    q, k, v = (
        rng.standard_normal((2, 5, heads, 3)),
        rng.standard_normal((2, 4, kv_heads, 3)),
        rng.standard_normal((2, 4, kv_heads, 2)),
    )
    q_positions, k_positions = [4, 0, 7, 2, -1], [3, 0, 6, 1]
    got = A.attention(q, k, v, causal=causal, scale=0.6, q_positions=q_positions, k_positions=k_positions)
    np.testing.assert_allclose(got, _naive_attention(q, k, v, causal, 0.6, q_positions, k_positions), atol=1e-14)
    if causal:
        np.testing.assert_array_equal(got[:, 4], 0.0)  # position -1 sees no key: zeros, not NaN
    default = A.attention(q[:, :4], k, v, causal=causal)
    np.testing.assert_allclose(
        default, _naive_attention(q[:, :4], k, v, causal, 1 / math.sqrt(3), range(4), range(4)), atol=1e-14
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (6, 2), (3, 1)])
def test_attention_vjp_finite_differences(heads, kv_heads, causal):
    """dq, dk, dv against central differences of ``sum(attention * cotangent)`` (float64)."""
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.standard_normal((1, 4, heads, 3)),
        rng.standard_normal((1, 4, kv_heads, 3)),
        rng.standard_normal((1, 4, kv_heads, 2)),
    )
    cotangent = rng.standard_normal((1, 4, heads, 2))
    grads = A.attention_vjp(q, k, v, cotangent, causal=causal, scale=0.8)
    inputs = [q, k, v]
    for index, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for position in np.ndindex(grad.shape):
            values = []
            for step in (1e-6, -1e-6):
                moved = [x.copy() for x in inputs]
                moved[index][position] += step
                values.append(np.sum(A.attention(*moved, causal=causal, scale=0.8) * cotangent))
            numeric[position] = (values[0] - values[1]) / 2e-6
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8, err_msg="qkv"[index])


def test_contiguous_positions_and_mask():
    positions = A.contiguous_positions((3, 0, 2))
    assert [list(shard) for shard in positions] == [[0, 1, 2], [], [3, 4]]
    plan = A.ulysses_plan((1, 3, 2, 2), (1, 3, 2, 2), (1, 3, 2, 2), 3, rank=0, seq_sizes=(3, 0, 2))
    assert plan.positions == (0, 1, 2, 3, 4)  # the gathered sequence is in global order: plain causal applies
    np.testing.assert_array_equal(A.causal_mask(range(3), range(3)), np.tril(np.ones((3, 3), dtype=bool)))


def test_handed_case_plan():
    """W=4, S=10, H=6, H_kv=2, seq_sizes (3, 3, 2, 2): one all-to-all of 4, 6, 3, 3 heads; 5 kv heads on the wire
    (the minimum) in the exact layout, 8 padded; the return all-to-all gathers 2, 2, 1, 1 heads."""
    plans = _exact_plans([(1, 10, 6, 4), (1, 10, 2, 4), (1, 10, 2, 4)], 4, (3, 3, 2, 2))
    assert all(plan.fused and plan.chunks == 1 and plan.groups[0].kv_index is None for plan in plans)
    assert plans[0].exchanges[0].scatter_sizes == (4, 6, 3, 3)
    assert plans[0].exchanges[0].gather_sizes == (3, 3, 2, 2)
    assert plans[1].exchanges[0].receive == (("q", 0, 2), ("k", 2, 4), ("v", 4, 6))
    assert (plans[0].out_scatter_sizes, plans[0].groups[0].out_gather_sizes) == ((3, 3, 2, 2), (2, 2, 1, 1))
    assert plans[0].out_runs is None  # one group: its output is the result
    assert plans[0].kv_wire_heads() == plans[0].heads.min_kv_heads == 5
    padded = A.ulysses_plan((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, seq_sizes=(3, 3, 2, 2), layout="padded")
    assert padded.kv_wire_heads() == 8
    assert padded.groups[0].kv_index == ((0, 0), (0, 1), (0, 0), (0, 0))  # rank 0's 2 q heads share one kv head
    assert A.ulysses_plan((1, 3, 8, 4), (1, 3, 2, 4), (1, 3, 2, 4), 4, layout="padded").groups[0].kv_index is None


@pytest.mark.parametrize(
    ("shapes", "kwargs", "error", "message"),
    [
        (((1, 3, 6, 4), (1, 3, 4, 4), (1, 3, 4, 4)), {}, CommError, "heads (6) must be divisible by kv heads (4)"),
        (
            ((1, 3, 6), (1, 3, 2, 4), (1, 3, 2, 4)),
            {},
            CommError,
            "q ndim (3) must be 4 ([batch, seq, heads, head_dim])",
        ),
        (((1, 3, 6, 4), (2, 3, 2, 4), (2, 3, 2, 4)), {}, CommError, "k batch (2) must equal q batch (1)"),
        (((1, 3, 6, 4), (1, 3, 2, 4), (1, 2, 2, 4)), {}, CommError, "v seq (2) must equal q seq (3)"),
        (((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 3, 4)), {}, CommError, "v heads (3) must equal k heads (2)"),
        (((1, 3, 6, 4), (1, 3, 2, 5), (1, 3, 2, 4)), {}, CommError, "k head_dim (5) must equal q head_dim (4)"),
        (((1, 3, 6, 4), (1, 3, 0, 4), (1, 3, 0, 4)), {}, CommError, "heads (6) and kv heads (0) must be >= 1"),
        (None, dict(seq_sizes=(3, 3, 2)), CommError, "len(seq_sizes) (3) must equal world_size (4)"),
        (None, dict(seq_sizes=(3, 3, -1, 2)), CommError, "seq_sizes[2] (-1) must be >= 0"),
        (None, dict(seq_sizes=(2, 3, 3, 2)), CommError, "seq (3) must equal seq_sizes[0] (2) on rank 0"),
        (None, dict(seq_sizes=(3, 3, 2.0, 2)), TypeError, "seq_sizes must be a sequence of ints"),
        (None, dict(seq_sizes=(3, 3, True, 2)), TypeError, "seq_sizes must be a sequence of ints"),
        (None, dict(seq_sizes=3), TypeError, "seq_sizes must be a sequence of ints"),
        (
            None,
            dict(dtypes=("float32", "float32", "bfloat16")),
            CommError,
            "q, k, v dtypes (float32, float32, bfloat16) must be equal",
        ),
        (
            None,
            dict(dtypes=("int32",) * 3),
            CommError,
            "q, k, v dtype (int32) must be floating (bfloat16, float16, float32, float64)",
        ),
        (None, dict(causal=1), TypeError, "causal must be a bool, not int"),
        (None, dict(scale="0.5"), TypeError, "scale must be a number, not str"),
        (None, dict(scale=float("inf")), CommError, "scale (inf) must be finite"),
        (None, dict(chunks="2"), TypeError, "chunks must be an int, not str"),
        (None, dict(chunks=2.0), TypeError, "chunks must be an int, not float"),
        (None, dict(chunks=True), TypeError, "chunks must be an int, not bool"),
        (None, dict(chunks=0), CommError, "chunks (0) must be >= 1"),
        (
            None,
            dict(chunks=3),
            CommError,
            "chunks (3) must be <= the most q heads a rank attends with (2: "
            "split_sizes(heads=6, world_size=4) = (2, 2, 1, 1))",
        ),
    ],
)
def test_errors(shapes, kwargs, error, message):
    """Each bad call raises before anything else, in the house format (op, quantity, numbers, Received)."""
    shapes = shapes or ((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4))
    with pytest.raises(error) as raised:
        A.ulysses_plan(*shapes, 4, rank=0, **kwargs)
    assert str(raised.value).startswith(f"ulysses_attention: {message}. Received: q_shape={shapes[0]!r}")


@pytest.mark.parametrize("kv_shape", [(1, 2, 2, 4), (1, 2, 8, 4)])
def test_a_q_in_sdpa_order_gets_a_layout_hint(kv_shape):
    """A q in SDPA's [B, H, S, D] order (k and v in either order) fails on seq with a hint of
    the layout, not a bare "k seq (2) must equal q seq (8)"."""
    q = (1, 8, 2, 4)
    with pytest.raises(CommError) as raised:
        A.ulysses_plan(q, kv_shape, kv_shape, 4, rank=0)
    assert str(raised.value).startswith(
        f"ulysses_attention: k seq ({kv_shape[1]}) must equal q seq (8) (q, k and v are [batch, seq, heads, "
        f"head_dim]: SDPA's [batch, heads, seq, head_dim] needs .transpose(1, 2)). Received: q_shape={q!r}"
    )


def test_padded_errors():
    """JAX's layout: every rank holds max(seq_sizes) rows."""
    shapes = ((1, 3, 6, 4), (1, 3, 2, 4), (1, 3, 2, 4))
    with pytest.raises(CommError, match=r"seq \(3\) must equal max\(seq_sizes\) \(4\) in the padded layout"):
        A.ulysses_plan(*shapes, 4, seq_sizes=(4, 3, 2, 1), layout="padded")
    assert A.ulysses_plan(*shapes, 4, seq_sizes=(3, 3, 2, 2), layout="padded").rank is None
