"""Uneven sizes in the spec (`commlib.uneven`): the reference in both layouts against naive definitions written
here with np.split / np.concatenate at the ranks' offsets (never a plan), the padded layout against the exact
one on the valid rows (zeros elsewhere, padding ignored), VJPs by the dot-product identity, the plans' passes,
the error messages, and checked mode's fingerprint of the sizes.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from commlib import CommError, check, gradients, plans, reference, split_sizes, uneven
from commlib.layout import Blocks, Take
from tests.strategies import uneven_calls as calls


def _bounds(sizes):
    edges = np.cumsum((0, *sizes))
    return list(itertools.pairwise(edges))


def _split(x, sizes, axis):
    return [np.take(x, range(start, stop), axis=axis) for start, stop in _bounds(sizes)]


# ---------------------------------------------------------------- naive definitions (exact layout)


def naive(op, xs, kwargs):
    W = len(xs)
    if op in ("all_gather", "gather"):
        whole = np.concatenate(xs, axis=kwargs["dim"])
        keep = [op == "all_gather" or rank == kwargs["dst"] for rank in range(W)]
        return [whole if kept else np.zeros_like(whole) for kept in keep]
    if op == "reduce_scatter":
        total = sum(xs) / (W if kwargs.get("op") == "avg" else 1)
        return _split(total, kwargs["sizes"], kwargs["dim"])
    if op == "scatter":
        return _split(xs[kwargs["src"]], kwargs["sizes"], kwargs["dim"])
    scatter_dim, gather_dim = kwargs["scatter_dim"], kwargs["gather_dim"]
    blocks = [_split(x, kwargs["scatter_sizes"], scatter_dim) for x in xs]  # blocks[source][destination]
    return [np.concatenate([blocks[source][rank] for source in range(W)], axis=gather_dim) for rank in range(W)]


# ---------------------------------------------------------------- hypothesis over ops and sizes


def _plan(op, shape, W, kwargs, rank=None):
    return getattr(plans, op)(shape, W, **kwargs, rank=rank, dtype="float64")


def _exact(array, cut):
    return array if cut is None else np.take(array, range(cut[1]), axis=cut[0])


def _normalised(kwargs, ndim):
    """The kwargs with dims non-negative (the naive definitions index with them)."""
    fixed = dict(kwargs)
    for key in ("dim", "scatter_dim", "gather_dim"):
        if key in fixed:
            fixed[key] %= ndim
    return fixed


@given(calls(), st.integers(0, 2**16))
def test_both_layouts_against_naive_definitions(call, seed):
    """Exact: the naive definition. Padded (random values in the padding): the exact result on the valid rows,
    zeros elsewhere. VJPs: the dot-product identity in both layouts (convention "sum"; "replicated": the own
    block); padding gets a gradient of exactly 0 and the padded VJP is the exact one on the valid rows."""
    op, W, shape, kwargs = call
    rng = np.random.default_rng(seed)
    padded = _plan(op, shape, W, kwargs)
    cuts = [uneven.rows(padded, rank) for rank in range(W)]
    xs = [rng.standard_normal(padded.in_shape) for _ in range(W)]
    exact_xs = [_exact(x, cut[0]) for x, cut in zip(xs, cuts, strict=True)]
    exact = _plan(op, exact_xs[0].shape, W, kwargs, rank=0)
    outs = reference.run(exact, exact_xs)
    for rank, (out, want) in enumerate(zip(outs, naive(op, exact_xs, _normalised(kwargs, len(shape))), strict=True)):
        np.testing.assert_allclose(out, want, atol=1e-12, err_msg=f"rank {rank}")
    padded_outs = reference.run(padded, xs)
    cotangents = [rng.standard_normal(out.shape) for out in padded_outs]
    exact_cotangents = [_exact(c, cut[1]) for c, cut in zip(cotangents, cuts, strict=True)]
    grads, exact_grads = reference.vjp(padded, xs, cotangents), reference.vjp(exact, exact_xs, exact_cotangents)
    for rank, (cut_in, cut_out) in enumerate(cuts):
        assert padded_outs[rank].shape == padded.out_shape
        np.testing.assert_allclose(_exact(padded_outs[rank], cut_out), outs[rank], atol=1e-12)
        np.testing.assert_allclose(_exact(grads[rank], cut_in), exact_grads[rank], atol=1e-12)
        if cut_in is not None:  # the padding's gradient is exactly zero
            rest = np.take(grads[rank], range(cut_in[1], padded.in_shape[cut_in[0]]), axis=cut_in[0])
            assert not rest.any(), rank
        if cut_out is not None:  # the output's padding is exactly zero
            rest = np.take(padded_outs[rank], range(cut_out[1], padded.out_shape[cut_out[0]]), axis=cut_out[0])
            assert not rest.any(), rank
    if kwargs.get("convention") == "replicated":  # the gradient is this rank's block of its cotangent
        own = _split(exact_cotangents[0], kwargs["sizes"], kwargs["dim"] % len(shape))[0]
        np.testing.assert_array_equal(exact_grads[0], own)
        return
    for ins, outs_, cts, gs in ((xs, padded_outs, cotangents, grads), (exact_xs, outs, exact_cotangents, exact_grads)):
        forward = sum(float((out * c).sum()) for out, c in zip(outs_, cts, strict=True))
        backward = sum(float((x * g).sum()) for x, g in zip(ins, gs, strict=True))
        assert forward == pytest.approx(backward, abs=1e-9)


@given(calls())
def test_duals_are_uneven_and_involutive(call):
    """The VJP plan of an uneven plan is the dual op with the sizes swapped, in the same layout; twice is the plan
    (convention "sum"); every rank's exact plan makes at most one pass each side."""
    op, W, shape, kwargs = call
    padded = _plan(op, shape, W, kwargs)
    for plan in (padded, *(uneven.for_rank(padded, rank) for rank in range(W))):
        if not plan.is_uneven:
            continue
        dual = gradients.vjp_plan(plan)
        assert (dual.uneven.scatter_sizes, dual.uneven.gather_sizes, getattr(dual.uneven, "rank", None)) == (
            plan.uneven.gather_sizes,
            plan.uneven.scatter_sizes,
            getattr(plan.uneven, "rank", None),
        )
        assert dual.in_shape == plan.out_shape and dual.out_shape == plan.in_shape
        # avg's comes back as sum times 1/W
        if plan.convention.value == "sum" and getattr(plan.step, "op", None) != "avg":
            assert gradients.vjp_plan(dual) == plan
        assert plan.copies <= 2


# ---------------------------------------------------------------- the handed case


def test_handed_case_in_both_layouts():
    """W=4, B=2, S=63, H=6, D=3: rank r holds X[:, s_r]; (2, 1) returns X[:, :, h_r]; (1, 2) returns the
    input; the gradient is the reverse all-to-all of the cotangents. Padded: rows to 16, heads to 2."""
    W, B, S, H, D = 4, 2, 63, 6, 3
    seq, heads = split_sizes(S, W), split_sizes(H, W)
    assert (seq, heads) == ((16, 16, 16, 15), (2, 2, 1, 1))
    rng = np.random.default_rng(9)
    X, C = rng.standard_normal((B, S, H, D)), rng.standard_normal((B, S, H, D))
    xs = _split(X, seq, 1)
    forward = dict(scatter_sizes=heads, gather_sizes=seq)
    outs = reference.all_to_all_4d(xs, 2, 1, **forward)
    for rank, out in enumerate(outs):
        np.testing.assert_array_equal(out, _split(X, heads, 2)[rank])
    back = reference.all_to_all_4d(outs, 1, 2, scatter_sizes=seq, gather_sizes=heads)
    for rank, out in enumerate(back):
        np.testing.assert_array_equal(out, xs[rank])
    plan = plans.all_to_all_4d(xs[0].shape, W, **forward, rank=0)
    for rank, grad in enumerate(reference.vjp(plan, xs, _split(C, heads, 2))):
        np.testing.assert_array_equal(grad, _split(C, seq, 1)[rank])
    padded_xs = [np.concatenate([x, rng.standard_normal((B, 16 - x.shape[1], H, D))], axis=1) for x in xs]
    padded = reference.all_to_all_4d(padded_xs, 2, 1, **forward, padded=True)
    for rank, out in enumerate(padded):
        assert out.shape == (B, S, 2, D)
        np.testing.assert_array_equal(out[:, :, : heads[rank]], _split(X, heads, 2)[rank])
        assert not out[:, :, heads[rank] :].any()


# ---------------------------------------------------------------- plans: passes, views, splits, even sizes


def test_exact_ulysses_plan_makes_one_pass_each_side_and_a_view_at_batch_1():
    plan = plans.all_to_all_4d(
        (1, 15, 6, 4), 4, 2, 1, scatter_sizes=(2, 2, 1, 1), gather_sizes=(16, 16, 16, 15), rank=3
    )
    assert plan.is_exact and plan.step.name == "all_to_all"
    # the seq gather is a view
    assert not plan.layout.pack.is_identity and plan.layout.unpack.is_identity and plan.copies == 1
    assert plan.layout.pack.counts == (120, 120, 60, 60) and plan.layout.unpack.counts == (64, 64, 64, 60)
    assert plan.out_shape == (1, 63, 1, 4)
    reverse = gradients.vjp_plan(plan)
    # batch 1: the seq scatter is a view
    assert reverse.layout.pack.is_identity and not reverse.layout.unpack.is_identity
    batch_2 = plans.all_to_all_4d(
        (2, 15, 6, 4), 4, 2, 1, scatter_sizes=(2, 2, 1, 1), gather_sizes=(16, 16, 16, 15), rank=3
    )
    assert batch_2.copies == 2


def test_exact_gather_scatter_and_reduce_scatter_blocks():
    gather = plans.gather((3, 2), 4, 1, 0, sizes=(0, 3, 2, 2), rank=1)  # rank 1 sends its 3 rows to dst 1 only
    assert gather.layout.pack.counts == (0, 6, 0, 0) and gather.layout.pack.is_identity
    assert gather.layout.unpack.counts == (0, 6, 4, 4) and gather.layout.unpack.is_identity
    off_root = uneven.for_rank(gather, 2)
    assert off_root.layout.pack.counts == (0, 4, 0, 0) and off_root.layout.unpack.counts == (0, 0, 0, 0)
    assert not off_root.layout.unpack.covers  # no block lands: zeros
    scatter = plans.scatter((7, 3), 4, 2, sizes=(0, 3, 2, 2), rank=2)
    assert scatter.layout.pack.counts == (0, 9, 6, 6) and scatter.layout.unpack.counts == (0, 0, 6, 0)
    assert uneven.for_rank(scatter, 0).layout.pack.counts == (0, 0, 0, 0)  # other ranks send nothing
    reduce = plans.reduce_scatter((2, 7), 4, 1, sizes=(0, 3, 2, 2), rank=1)
    assert reduce.layout.unpack.reduce and reduce.layout.unpack.counts == (6, 6, 6, 6) and reduce.out_shape == (2, 3)


def test_equal_sizes_are_the_even_plan():
    assert plans.all_gather((3, 2), 4, 0, sizes=(3, 3, 3, 3), rank=1) == plans.all_gather((3, 2), 4, 0)
    assert plans.reduce_scatter((8, 2), 4, sizes=[2] * 4) == plans.reduce_scatter((8, 2), 4)
    assert plans.all_to_all_4d((2, 4, 8, 3), 4, scatter_sizes=(2,) * 4, gather_sizes=(4,) * 4) == plans.all_to_all_4d(
        (2, 4, 8, 3), 4
    )


def test_one_side_uneven_all_to_all_makes_the_other_side_explicit():
    plan = plans.all_to_all_4d((2, 16, 8, 3), 4, gather_sizes=(16, 16, 16, 15))
    sized = plan.uneven
    assert sized.scatter_sizes == (2, 2, 2, 2) and sized.before is None and sized.after.kind == "unpad"
    plan = plans.all_to_all_4d((2, 4, 6, 3), 4, scatter_sizes=(2, 2, 1, 1))
    sized = plan.uneven
    assert sized.gather_sizes == (4, 4, 4, 4) and sized.after is None and sized.before.kind == "pad"


def test_take_maps_and_blocks():
    sizes = (2, 0, 3)  # M = 3, N = 5
    assert Take(0, "pad", sizes).index().tolist() == [0, 1, 5, 5, 5, 5, 2, 3, 4]
    assert Take(0, "unpad", sizes).index().tolist() == [0, 1, 6, 7, 8]
    assert Take(0, "slice", sizes).table().tolist() == [[0, 1, 5], [5, 5, 5], [2, 3, 4]]
    assert Take(0, "place", sizes).table().tolist() == [[0, 1, 3, 3, 3], [3, 3, 3, 3, 3], [3, 3, 0, 1, 2]]
    assert Take(0, "pad", sizes).source_size == 5 and Take(0, "place", sizes).source_size == 3
    blocks = Blocks((2, 5, 3), 1, (0, 2, 2), (2, 0, 3))
    assert blocks.counts == (12, 0, 18) and blocks.covers and not blocks.is_identity  # batch 2: not one range
    assert Blocks((1, 5, 3), 1, (0, 2, 2), (2, 0, 3)).is_identity
    assert not Blocks((1, 5, 3), 1, (2, 0), (3, 2)).is_identity  # out of order
    assert not Blocks((1, 5, 3), 1, (0,), (2,)).covers


@given(st.lists(st.integers(0, 4), min_size=1, max_size=5), st.sampled_from(["pad", "unpad"]))
def test_take_runs_are_the_index_map(sizes, kind):
    """The runs (static slices and zeros, what JAX concatenates) spell out the same map as the index."""
    take = Take(0, kind, tuple(sizes))
    spelled = [
        source + row if source is not None else take.source_size for source, rows in take.runs() for row in range(rows)
    ]
    assert spelled == take.index().tolist()


def test_split_sizes_is_array_split():
    for n in range(20):
        for world_size in (1, 2, 3, 4):
            assert split_sizes(n, world_size) == tuple(len(part) for part in np.array_split(np.arange(n), world_size))
    with pytest.raises(CommError, match=r"split_sizes: n \(-1\) must be >= 0"):
        split_sizes(-1, 2)


@pytest.mark.parametrize(
    ("n", "world_size", "message"),
    [
        (True, 2, "n must be an int, not bool. Received: n=True, world_size=2"),
        (4, False, "world_size must be an int, not bool. Received: n=4, world_size=False"),
        (4.0, 2, "n must be an int, not float. Received: n=4.0, world_size=2"),
        (4, "2", "world_size must be an int, not str. Received: n=4, world_size='2'"),
    ],
)
def test_split_sizes_kind_errors(n, world_size, message):
    """Bools are no counts, and a float or str gets the house format."""
    with pytest.raises(TypeError) as raised:
        split_sizes(n, world_size)
    assert str(raised.value) == f"split_sizes: {message}"


def test_sent_elements():
    exact = plans.all_to_all_4d((1, 15, 6, 4), 4, scatter_sizes=(2, 2, 1, 1), gather_sizes=(16, 16, 16, 15), rank=3)
    assert uneven.sent_elements(exact, 3) == 120 + 120 + 60  # its own block stays
    assert uneven.sent_elements(exact, 0) == 16 * 4 * (2 + 1 + 1)  # 16 rows; it keeps 2 of its 6 heads
    padded = uneven.padded(exact)
    assert uneven.sent_elements(padded, 0) == 16 * 8 * 4 * 3 // 4  # heads padded to 2 per rank
    assert uneven.sent_elements(plans.all_gather((3, 2), 4, 0, sizes=(3, 2, 1, 0), rank=0), 0) == 3 * 6


# ---------------------------------------------------------------- errors

HANDED = dict(scatter_sizes=(2, 2, 1, 1), gather_sizes=(16, 16, 16, 15))
EXACT_ERRORS = [
    (
        lambda: plans.all_gather((3, 2), 4, 0, sizes=(3, 3, 3)),
        "all_gather: len(sizes) (3) must equal world_size (4). Received: dim=0, sizes=(3, 3, 3)",
    ),
    (
        lambda: plans.all_gather((3, 2), 4, 0, sizes=(3, -1, 3, 3), rank=0),
        "all_gather: sizes[1] (-1) must be >= 0. Received: dim=0, sizes=(3, -1, 3, 3)",
    ),
    (
        lambda: plans.reduce_scatter((8, 2), 4, sizes=(2, 2, 2, 1)),
        "reduce_scatter: sum(sizes) (7) must equal the size of dim 0 (8). Received: dim=0, "
        "op='sum', sizes=(2, 2, 2, 1)",
    ),
    (
        lambda: plans.all_to_all_4d((2, 16, 6, 3), 4, scatter_sizes=(2, 2, 1, 0), gather_sizes=HANDED["gather_sizes"]),
        "all_to_all_4d: sum(scatter_sizes) (5) must equal heads (6). Received: scatter_dim=2, gather_dim=1, "
        "scatter_sizes=(2, 2, 1, 0), gather_sizes=(16, 16, 16, 15)",
    ),
    (
        lambda: plans.all_to_all_4d((2, 16, 6, 3), 4, **HANDED, rank=3),
        "all_to_all_4d: seq (16) must equal gather_sizes[3] (15) on rank 3. Received: shape=(2, 16, 6, 3), "
        "scatter_dim=2, gather_dim=1, scatter_sizes=(2, 2, 1, 1), gather_sizes=(16, 16, 16, 15)",
    ),
    (
        lambda: plans.all_to_all_4d((2, 15, 6, 3), 4, **HANDED),
        "all_to_all_4d: seq (15) must equal max(gather_sizes) (16) in the padded layout. Received: "
        "shape=(2, 15, 6, 3), scatter_dim=2, gather_dim=1, scatter_sizes=(2, 2, 1, 1), gather_sizes=(16, 16, 16, 15)",
    ),
    (
        lambda: plans.all_to_all((5, 2), 2, 0, 1, gather_sizes=(2, 1)),
        "all_to_all: size of scatter_dim 0 (5) must be divisible by world_size (2). Received: shape=(5, 2), "
        "scatter_dim=0, gather_dim=1",
    ),  # the even side keeps today's error exactly
    (
        lambda: plans.gather((2, 3), 2, 0, 0, sizes=(2, 1), rank=2),
        "gather: rank (2) must be in [0, 2) for world_size 2. Received: dst=0, dim=0, sizes=(2, 1), rank=2",
    ),
    (
        lambda: plans.all_to_all((4, 2), 2, 0, -2, scatter_sizes=(3, 1)),
        "all_to_all: scatter_dim (0) must differ from gather_dim (0) with uneven sizes. Received: shape=(4, 2), "
        "scatter_dim=0, gather_dim=-2",
    ),
    (
        lambda: plans.scatter((3,), 2, 1, sizes=(1, 1)),
        "scatter: sum(sizes) (2) must equal the size of dim 0 (3). Received: src=1, dim=0, sizes=(1, 1)",
    ),
]


@pytest.mark.parametrize(("call", "message"), EXACT_ERRORS)
def test_error_messages(call, message):
    with pytest.raises(CommError) as info:
        call()
    assert type(info.value) is CommError and str(info.value) == message
    assert re.fullmatch(r"\w+: [^.]+(\.[^.]+)*\. Received: \w+=.+", message)


@pytest.mark.parametrize("sizes", [3, (1.5, 1.5), (True, 2), "ab", None.__class__])
def test_sizes_of_the_wrong_kind_are_a_type_error(sizes):
    with pytest.raises(TypeError) as info:
        plans.all_gather((3, 2), 2, 0, sizes=sizes)
    assert type(info.value) is TypeError
    assert str(info.value).startswith("all_gather: sizes must be a sequence of ints. Received: dim=0, sizes=")


def test_none_keeps_the_even_rule_and_its_error():
    with pytest.raises(CommError) as info:
        plans.all_to_all_4d((2, 8, 6, 64), 4, scatter_sizes=None, gather_sizes=None, rank=1)
    assert str(info.value) == (
        "all_to_all_4d: heads (6) must be divisible by world_size (4). Received: "
        "shape=(2, 8, 6, 64), scatter_dim=2, gather_dim=1"
    )
    assert plans.reduce_scatter((8, 2), 4, sizes=None, rank=3) == plans.reduce_scatter((8, 2), 4)


# ---------------------------------------------------------------- checked mode


def _rows(plans_):
    return np.stack([check.fingerprint(plan, "float32") for plan in plans_])


def test_ranks_that_agree_on_sizes_pass_though_their_shapes_differ():
    padded = plans.all_to_all_4d((2, 16, 6, 3), 4, **HANDED)
    ranks = [uneven.for_rank(padded, rank) for rank in range(4)]
    assert len({plan.in_shape for plan in ranks}) == 2
    for rank in range(4):
        check.compare(_rows(ranks), rank)
    call = check.decode(_rows(ranks)[3])
    assert (call.shape, call.scatter_sizes, call.gather_sizes) == ((2, 16, 6, 3), (2, 2, 1, 1), (16, 16, 16, 15))


def test_ranks_that_disagree_on_sizes_all_raise():
    agreed = plans.all_gather((3, 2), 4, 0, sizes=(3, 3, 2, 1), rank=0)
    other = plans.all_gather((3, 2), 4, 0, sizes=(3, 2, 3, 1), rank=0)
    rows = _rows([agreed, uneven.for_rank(agreed, 1), uneven.for_rank(other, 2), uneven.for_rank(agreed, 3)])
    messages = set()
    for rank in range(4):
        with pytest.raises(CommError) as info:
            check.compare(rows, rank)
        messages.add(str(info.value).split(". Received")[0])
    assert messages == {
        "all_gather: ranks disagree on gather_sizes: ranks 0, 1, 3 have (3, 3, 2, 1), rank 2 has (3, 2, 3, 1)"
    }
    even = plans.all_gather((3, 2), 4, 0)  # one rank forgot the sizes
    with pytest.raises(CommError, match="on gather_sizes: rank 0 has None, ranks 1, 2, 3 have"):
        check.compare(_rows([even, *(uneven.for_rank(agreed, rank) for rank in (1, 2, 3))]), 0)


def test_fingerprint_of_sizes_over_eight_ranks_keeps_a_hash():
    sizes = split_sizes(21, 10)
    first = plans.all_gather((3,), 10, 0, sizes=sizes, rank=0)
    second = plans.all_gather((3,), 10, 0, sizes=(*sizes[:9], sizes[9] + 1), rank=0)
    assert "[10 sizes, hash" in str(check.decode(check.fingerprint(first, "float32")).gather_sizes)
    with pytest.raises(CommError, match="disagree on gather_sizes"):
        check.compare(_rows([first] * 9 + [second]), 0)
