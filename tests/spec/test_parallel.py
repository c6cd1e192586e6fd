"""`commlib.parallel`: the plan of a `parallel` context (the layer's layout keywords: the even layout's name where
it gives the same shards, the `SequenceLayout` itself otherwise) and every check with its message."""

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


def _given(group=False, ulysses=False, ring=False):
    return {"group": group, "ulysses_group": ulysses, "ring_group": ring}


NAMES = ("group", "ulysses_group", "ring_group")


@pytest.mark.parametrize(("attention", "given", "message"), [
    ("flash", _given(), "parallel: attention ('flash') must be one of ulysses, ring, usp. Received: attention='flash'"),
    ("usp", _given(ulysses=True), "parallel: attention='usp' needs both ulysses_group and ring_group. Received: "
     "attention='usp', group=None, ulysses_group='given', ring_group=None"),
    ("ring", _given(ring=True), "parallel: ulysses_group and ring_group are for attention='usp'; attention='ring' "
     "runs over group"),
])
def test_group_errors(attention, given, message):
    with pytest.raises(CommError) as raised:
        P.check_groups(attention, given, NAMES)
    assert str(raised.value).startswith(message)


def test_group_required():
    with pytest.raises(CommError, match="attention='ring' needs axis_name"):
        P.check_groups("ring", {"axis_name": False, "ulysses_axis": False, "ring_axis": False},
                       ("axis_name", "ulysses_axis", "ring_axis"), group_required=True)
    with pytest.raises(TypeError, match=r"parallel: attention must be a str, not int"):
        P.check_groups(1, _given(), NAMES)


def test_size_errors():
    with pytest.raises(CommError, match=r"layout.ulysses_size \(2\) must be 4 \(the group's size"):
        P.parallel_plan(SequenceLayout(8, ulysses_size=2), "ulysses", ulysses_size=4, ring_size=1)
    with pytest.raises(CommError, match=r"layout.ulysses_size \(1\) must be 2"):
        P.parallel_plan(SequenceLayout(8, ring_size=2), "ulysses", ulysses_size=2, ring_size=1)
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
    for keywords, message in [(dict(mask=True), r"an attention mask \(padding or custom\) is not supported"),
                              (dict(bias=True), "an attention bias is not supported"),
                              (dict(dropout=0.5), r"dropout \(0.5\) must be 0"),
                              (dict(sliding_window=128), r"sliding_window \(128\) is not supported"),
                              (dict(softcap=50.0), r"softcap \(50.0\) is not supported"),
                              (dict(rows=2, shard=3), r"query rows \(2\) must be layout.sizes\[3\] \(1\)"),
                              (dict(rows=1, shard=None), r"query rows \(1\) must be layout.max_size \(2\)")]:
        arguments = dict(shard=0, rows=2) | keywords
        with pytest.raises(CommError, match=f"^commlib attention: {message}"):
            P.check_call(plan, **arguments)
    with pytest.raises(CommError, match=r"position_ids must be the global positions of shard 1 of the layout \(\[2\]"):
        P.check_positions(plan, 1, False, (1, 1))
    P.check_positions(plan, 1, True, (1, 1))
    assert "called outside a x.parallel(...) context" in str(P.outside_error("commlib attention", "x.parallel"))
