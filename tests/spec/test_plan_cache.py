"""Plans built once (`commlib.plan_cache`): every builder is cached, a second call builds nothing and returns the
same plan, and the cache never changes what a call raises or which plan it gets."""

import inspect
import pickle

import numpy as np
import pytest

from commlib import gradients, plan_cache, plans
from commlib.errors import CommError
from commlib.reduce_op import ReduceOp
from commlib.tools.cases import ATTENTION, case_table


def _builders():
    return {
        name: getattr(plans, name)
        for name in plans.__all__
        if inspect.isfunction(getattr(plans, name))
        and inspect.signature(getattr(plans, name)).return_annotation in ("Plan", "'Plan'")
    }


def test_every_builder_is_cached():
    builders = _builders()
    assert set(plans.OP_NAMES) <= set(builders)
    for name, builder in builders.items():
        assert name in plan_cache._caches, f"plans.{name} returns a Plan without @cached_plan"
        assert builder.__wrapped__.__name__ == name


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_second_call_builds_nothing(world_size):
    for case in case_table(world_size):
        if case.op == ATTENTION or case.world_size != world_size:
            continue
        plan_cache.clear()
        try:
            first = case.plan()
        except (CommError, TypeError):
            continue
        built = plan_cache.builds()
        assert built >= 1
        assert case.plan() is first, case.name
        assert plan_cache.builds() == built, case.name


def test_keys_tell_types_apart():
    plan_cache.clear()
    valid = plans.all_gather((3, 5), 4, dim=1)
    for bad in (1.0, True, "1"):  # each raises, before and after the valid call, with the same text each time
        with pytest.raises(TypeError) as first:
            plans.all_gather((3, 5), 4, dim=bad)
        with pytest.raises(TypeError) as second:
            plans.all_gather((3, 5), 4, dim=bad)
        assert str(first.value) == str(second.value)
    with pytest.raises(TypeError, match="shape must be a sequence of ints"):
        plans.all_gather((3.0, 5), 4, dim=1)
    with pytest.raises(TypeError, match="shape must be a sequence of ints"):
        plans.all_gather([3.0, 5], 4, dim=1)
    assert plans.all_gather([3, 5], 4, dim=1) == valid
    assert plans.all_gather((np.int64(3), 5), 4, dim=np.int64(1)) == valid
    assert plans.all_reduce((3,), 4, ReduceOp.SUM) == plans.all_reduce((3,), 4, "sum")


def test_errors_are_never_cached():
    plan_cache.clear()
    for _ in range(3):
        with pytest.raises(CommError, match=r"heads \(6\) must be divisible by world_size \(4\)"):
            plans.all_to_all_4d((2, 8, 6, 64), 4)
    assert plans.all_to_all_4d((2, 8, 8, 64), 4).out_shape == (2, 32, 2, 64)


def test_sequences_of_pairs_and_unhashable_arguments():
    plan_cache.clear()
    listed = plans.permute((3,), 4, [(0, 1), (1, 0)])
    assert plans.permute((3,), 4, ((0, 1), (1, 0))) is listed  # lists and tuples key alike
    assert plans.permute((3,), 4, [[0, 1], [1, 0]]) is listed
    built = plan_cache.builds("permute")
    array = np.array([[0, 1], [1, 0]])  # unhashable: built on every call, and right
    assert plans.permute((3,), 4, array) == listed
    assert plans.permute((3,), 4, array) == listed
    assert plan_cache.builds("permute") == built + 2
    with pytest.raises(TypeError):
        plans.permute((3,), 4, [(0.0, 1)])


class Shape(tuple):  # like torch.Size: only ever holds ints
    pass


@pytest.fixture
def trusted_shape():
    plan_cache.trust_sequence_type(Shape)
    yield Shape
    plan_cache._trusted.discard(Shape)
    plan_cache._fast_types.cache_clear()


def test_pairs_of_exact_ints_key_the_fast_cache(trusted_shape):
    """`plan_cache.pairs` (what the frontends pass as perm) makes a list of exact-int pairs a key of the fast
    cache; anything else is left as it is, for the general cache and the builder."""
    plan_cache.clear()
    fast, general = plan_cache._caches["permute"]
    plan = plans.permute(Shape((3,)), 4, plan_cache.pairs([(0, 1), (1, 0)]))
    assert plans.permute(Shape((3,)), 4, plan_cache.pairs([[0, 1], [1, 0]])) is plan
    assert plans.permute(Shape((3,)), 4, plan_cache.pairs(((0, 1), (1, 0)))) is plan
    assert fast.cache_info().hits == 2 and not general and plan_cache.builds("permute") == 1
    assert plans.permute((3,), 4, [(0, 1), (1, 0)]) == plan  # the general cache still keys a list
    for other in (
        [(True, 1)],
        [(0.0, 1)],
        [(np.int64(0), 1)],
        [(0, 1, 2)],
        [0, 1],
        "01",
        iter([(0, 1)]),
        None,
        [iter((0, 1))],
        [np.array([0, 1])],
    ):
        assert plan_cache.pairs(other) is other
    with pytest.raises(TypeError, match="src must be an int, not bool"):
        plans.permute((3,), 4, plan_cache.pairs([(True, 1)]))
    with pytest.raises(TypeError, match="src must be an int, not float"):  # an item that is an iterator: unread
        plans.permute((3,), 4, plan_cache.pairs([iter((0.5, 1))]))
    with pytest.raises(CommError, match=r"dst \(5\) must be in \[0, 4\).*perm=\[\(0, 1\), \(1, 5\)\]$"):
        plans.permute((3,), 4, plan_cache.pairs([(0, 1), (1, 5)]))  # the message quotes the caller's list


def test_trusted_sequence_types_key_as_they_are(trusted_shape):
    plan_cache.clear()
    plan = plans.reduce_scatter(Shape((8, 3)), 4)
    assert plans.reduce_scatter(Shape((8, 3)), 4) is plan
    assert plan_cache.builds() == 1
    assert plans.reduce_scatter((8, 3), 4) == plan


def test_plans_hash_once_and_pickle_as_equals():
    plan = plans.all_to_all_4d((2, 8, 12, 64), 4)
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and hash(again) == hash(plan) and again.copies == plan.copies == 2
    dual = gradients.vjp_plan(plan)
    assert dual.replace() == dual and hash(dual.replace()) == hash(dual)


class _Recorder:
    """A `gradients.Backend` that only records the collectives it is asked for."""

    def __init__(self):
        self.calls = []

    def collective(self, plan, x):
        self.calls.append((plan, x))
        return ("walked", plan)


@pytest.mark.parametrize("world_size", [2, 4])
def test_forward_of_plans_without_primal_is_the_walk(world_size):
    """What lets a frontend walk such plans directly (`gradients.forward`'s docstring)."""
    for case in case_table(world_size):
        if case.op == ATTENTION:
            continue
        try:
            plan = case.plan()
        except (CommError, TypeError):
            continue
        if gradients.needs_primal(plan):
            continue
        backend = _Recorder()
        assert gradients.forward(backend, plan, "x") == ("walked", plan)
        assert backend.calls == [(plan, "x")]


def test_caches_flush_past_their_byte_bound(monkeypatch):
    """Every plan built (and layout, VJP plan, walk) is charged its estimated bytes; past
    MAX_BYTES every cache is flushed, so a stream of new shapes keeps a bounded heap, while repeated shapes
    keep hitting."""
    plan_cache.clear()
    one = plan_cache.estimated_bytes(plans.reduce_scatter((4, 3), 4, dim=0))
    assert 500 < one < 10_000
    monkeypatch.setattr(plan_cache, "MAX_BYTES", 20 * one)
    for n in range(1, 200):
        plans.reduce_scatter((4, n), 4, dim=0)
        assert plan_cache.held_bytes() <= plan_cache.MAX_BYTES
    assert plan_cache.flushes() >= 5
    first = plans.all_gather((3, 5), 4, dim=0)
    builds = plan_cache.builds()
    assert all(plans.all_gather((3, 5), 4, dim=0) is first for _ in range(100)) and plan_cache.builds() == builds
