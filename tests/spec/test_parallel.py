"""`commlib.parallel`: the plan of a `parallel` context (the layer's layout keywords: the even layout's name where
it gives the same shards, the `SequenceLayout` itself otherwise) and every check with its message."""

import numpy as np
import pytest

from commlib import CommError, SequenceLayout, shard_positions
from commlib import parallel as P


@pytest.mark.parametrize(("seq_len", "sizes"), [(36, None), (37, (10, 9, 9, 9)), (5, (2, 1, 1, 1))])
def test_ulysses_keywords(seq_len, sizes):
    plan = P.parallel_plan(SequenceLayout(seq_len, ulysses_size=4), "ulysses", ulysses_size=4, ring_size=1)
    assert plan.keywords == {"seq_sizes": sizes}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("seq_len", "ring", "ulysses"), [(64, 4, 1), (36, 4, 1), (37, 4, 1), (16, 2, 2), (12, 2, 2)])
def test_ring_and_usp_keywords(layout, seq_len, ring, ulysses):
    """The string exactly where `shard_positions` gives the layout's shards (zigzag at S = 36, W = 4 has even
    shards of 9 rows, but not the string layout's positions)."""
    sequence = SequenceLayout(seq_len, ring_size=ring, ulysses_size=ulysses, layout=layout)
    attention = "ring" if ulysses == 1 else "usp"
    keyword = P.parallel_plan(sequence, attention, ulysses_size=ulysses, ring_size=ring).keywords["layout"]
    if isinstance(keyword, str):
        assert keyword == layout
        rows = shard_positions(seq_len, ring, layout, ulysses)
        assert all((rows[i] == sequence.positions(i)).all() for i in range(ring * ulysses))
    else:
        assert keyword is sequence
        assert seq_len % (ring * ulysses * (2 if layout == "zigzag" else 1))


def test_plan_is_hashable():
    plan = P.parallel_plan(SequenceLayout(37, ring_size=4), "ring", ulysses_size=1, ring_size=4)
    assert hash(plan) == hash(P.parallel_plan(SequenceLayout(37, ring_size=4), "ring", ulysses_size=1, ring_size=4))


def _given(group=None, ulysses=None, ring=None):
    """What the user passed, as the message shows it (None: not given)."""
    return {"group": group, "ulysses_group": ulysses, "ring_group": ring}


NAMES = ("group", "ulysses_group", "ring_group")


@pytest.mark.parametrize(
    ("attention", "given", "message"),
    [
        (
            "flash",
            _given(),
            "parallel: attention ('flash') must be one of ulysses, ring, usp. Received: attention='flash'",
        ),
        (
            "usp",
            _given(ulysses="ProcessGroup"),
            "parallel: attention='usp' needs both ulysses_group and ring_group. "
            "Received: attention='usp', group=None, ulysses_group='ProcessGroup', ring_group=None",
        ),
        (
            "ring",
            _given(ring="ProcessGroup"),
            "parallel: ulysses_group and ring_group are for attention='usp'; attention='ring' runs over group",
        ),
    ],
)
def test_group_errors(attention, given, message):
    with pytest.raises(CommError) as raised:
        P.check_groups(attention, given, NAMES)
    assert str(raised.value).startswith(message)


def test_group_required():
    names = ("axis_name", "ulysses_axis", "ring_axis")
    with pytest.raises(CommError, match="attention='ring' needs axis_name"):
        P.check_groups("ring", dict.fromkeys(names), names, group_required=True)
    with pytest.raises(CommError) as raised:  # JAX USP without ring_axis: the axis names shown, not 'given'
        P.check_groups("usp", {"axis_name": None, "ulysses_axis": ("u", "v"), "ring_axis": None}, names)
    assert str(raised.value).endswith(
        "Received: attention='usp', axis_name=None, ulysses_axis=('u', 'v'), ring_axis=None"
    )
    with pytest.raises(TypeError, match=r"parallel: attention must be a str, not int"):
        P.check_groups(1, _given(), NAMES)


def test_size_errors():
    with pytest.raises(CommError, match=r"layout.ulysses_size \(2\) must be 4 \(the group's size"):
        P.parallel_plan(SequenceLayout(8, ulysses_size=2), "ulysses", ulysses_size=4, ring_size=1)
    with pytest.raises(CommError, match=r"layout.ulysses_size \(1\) must be 2"):
        P.parallel_plan(SequenceLayout(8, ring_size=2), "ulysses", ulysses_size=2, ring_size=1)
    with pytest.raises(
        CommError,
        match=r"layout.ring_size \(2\) must be 1 \(attention='ulysses' runs no ring: a "
        r"ring layout needs attention='ring' or 'usp'\)",
    ):
        P.parallel_plan(SequenceLayout(8, ring_size=2), "ulysses", ulysses_size=1, ring_size=1)
    with pytest.raises(CommError, match=r"layout.ulysses_size \(2\) must be 1 \(attention='ring' runs no Ulysses"):
        P.parallel_plan(SequenceLayout(8, ulysses_size=2), "ring", ulysses_size=1, ring_size=1)
    with pytest.raises(CommError, match=r"layout.ring_size \(2\) must be 4 \(the ring group's size for "):
        P.parallel_plan(SequenceLayout(8, ring_size=2, ulysses_size=2), "usp", ulysses_size=2, ring_size=4)
    P.parallel_plan(SequenceLayout(8, ring_size=2), "ring", ulysses_size=1, ring_size=None)  # unknown: at the call
    with pytest.raises(CommError, match=r"group's size \(3\) must be layout.world_size \(4\)"):
        P.check_world(SequenceLayout(8, ring_size=2, ulysses_size=2), 3)
    with pytest.raises(TypeError, match=r"layout must be a commlib\.SequenceLayout, not int"):
        P.parallel_plan(8, "ring", ulysses_size=1, ring_size=1)


def test_call_checks():
    plan = P.parallel_plan(SequenceLayout(5, ulysses_size=4), "ulysses", ulysses_size=4, ring_size=1)
    P.check_call(plan, shard=0, rows=2)
    P.check_call(plan, shard=3, rows=1)
    P.check_call(plan, shard=None, rows=2)  # JAX: padded to max_size
    for keywords, message in [
        (dict(mask=True), r"a dense attention mask is not supported"),
        (dict(bias=True), "an attention bias is not supported"),
        (dict(dropout=0.5), r"dropout \(0.5\) must be 0"),
        (dict(sliding_window=0), r"sliding_window \(0\) must be an int >= 1"),
        (dict(sliding_window=2.5), r"sliding_window \(2.5\) must be an int >= 1"),
        (dict(softcap=50.0), r"softcap \(50.0\) is not supported"),
        (dict(rows=2, shard=3), r"query rows \(2\) must be layout.sizes\[3\] \(1\)"),
        (dict(rows=1, shard=None), r"query rows \(1\) must be layout.max_size \(2\)"),
    ]:
        arguments = dict(shard=0, rows=2) | keywords
        with pytest.raises(CommError, match=f"^commlib attention: {message}"):
            P.check_call(plan, **arguments)

    assert "called outside a x.parallel(...) context" in str(P.outside_error("commlib attention", "x.parallel"))


def test_positions_error_shows_the_first_differing_positions():
    """Expected against received from the first difference on (8 shown, then "..."), not a shape."""
    plan = P.parallel_plan(SequenceLayout(40, ring_size=2, layout="zigzag"), "ring", ulysses_size=1, ring_size=2)
    received = np.stack([plan.layout.positions(1), np.arange(20)])  # batch row 1: local positions
    text = str(P.positions_error(plan, 1, received))
    assert text.startswith(
        "commlib attention: position_ids must be the global positions of shard 1 of the layout "
        "(layout.positions(1); sequence.shard_tokens and sequence.position_ids give them): from "
        "row 0 of batch row 1, expected [10, 11, 12, 13, 14, 15, 16, 17, ...], received [0, 1, 2, "
        "3, 4, 5, 6, 7, ...]. Received: position_ids_shape=(2, 20), layout="
    ), text
    local = np.arange(20)
    local[:3] = plan.layout.positions(1)[:3]  # the same start, then local
    assert "from row 3 of batch row 0, expected [13, 14, 15, 16, 17, 18, 19, 20, ...], received [3, 4," in str(
        P.positions_error(plan, 1, local[None])
    )
    assert "positions.shape[-1] (3) must be the shard's rows (20)" in str(
        P.positions_error(plan, 0, np.arange(3)[None], name="positions")
    )
    with pytest.raises(
        CommError,
        match=r"^commlib attention: positions.shape\[-1\] \(40\) must be layout.max_size "
        r"\(20\)",
    ):
        P.check_positions_shape(plan, (1, 40))
    P.check_positions_shape(plan, (1, 20))


def test_helpers_agree_with_the_context():
    """A helper's layout: the given one, or the context's; another one than the context's is refused. JAX's axes:
    the same, in the context's order."""
    contiguous = SequenceLayout(12, ring_size=2)
    plan = P.parallel_plan(contiguous, "ring", ulysses_size=1, ring_size=2)
    zigzag = SequenceLayout(12, ring_size=2, layout="zigzag")
    assert P.helper_layout("shard_tokens", plan, None) is contiguous
    assert P.helper_layout("shard_tokens", plan, SequenceLayout(12, ring_size=2)) == contiguous
    assert P.helper_layout("shard_tokens", None, zigzag) is zigzag
    assert P.helper_layout("shard_tokens", plan, 12) == 12  # not a layout: the helper's own TypeError follows
    with pytest.raises(CommError) as raised:
        P.helper_layout("position_ids", plan, zigzag)
    assert str(raised.value).startswith(
        f"position_ids: layout ({zigzag!r}) must be the parallel context's layout ({contiguous!r})"
    )
    with pytest.raises(CommError, match=r"^shard_sequence: layout is required outside a parallel"):
        P.helper_layout("shard_sequence", None, None)
    assert P.helper_axes("shard_tokens", ("ring", "ulysses"), ()) == ("ring", "ulysses")
    assert P.helper_axes("shard_tokens", None, ("x",)) == ("x",)
    assert P.helper_axes("shard_tokens", ("x",), ("x",)) == ("x",)
    with pytest.raises(
        CommError,
        match=r"^gather_sequence: axis_name \(\('y',\)\) must be the parallel context's "
        r"sequence axes \(\('x',\)\)",
    ):
        P.helper_axes("gather_sequence", ("x",), ("y",))
    with pytest.raises(CommError, match=r"^shard_tokens: axis_name is required outside a parallel"):
        P.helper_axes("shard_tokens", None, ())
    assert str(P.refused_elsewhere_error()).startswith("commlib attention: another rank of the layer refused this call")


@pytest.mark.parametrize(
    ("layout", "attention"),
    [
        (SequenceLayout(3, ring_size=4), "ring"),
        (SequenceLayout(3, ring_size=4, layout="zigzag"), "ring"),
        (SequenceLayout(1, ulysses_size=2), "ulysses"),
        (SequenceLayout(3, ring_size=2, ulysses_size=2), "usp"),
    ],
    ids=repr,
)
def test_an_empty_shard_is_refused_by_torch_parallel(layout, attention):
    """Issue 34 item 10: a rank with no tokens crashed inside transformers 5.x and left its peers in gloo; torch's
    `parallel` refuses it from the layout (every rank alike), naming the length, the world size and the minimum."""
    plan = P.parallel_plan(layout, attention, ulysses_size=layout.ulysses_size, ring_size=layout.ring_size)
    with pytest.raises(CommError) as raised:
        P.check_every_shard_has_tokens(plan)
    W = layout.world_size
    assert str(raised.value).startswith(
        f"parallel: seq_len ({layout.seq_len}) must be at least the world size ({W}) for attention={attention!r}: "
        f"a rank with no tokens cannot run the model (transformers fails on an empty sequence); use seq_len >= {W} "
        f"or fewer ranks. Received: layout={layout!r}, attention={attention!r}, sizes={layout.sizes}"
    )
    full = SequenceLayout(W, layout.ring_size, layout.ulysses_size, layout.layout)
    P.check_every_shard_has_tokens(
        P.parallel_plan(full, attention, ulysses_size=full.ulysses_size, ring_size=full.ring_size)
    )  # one token a rank: accepted
