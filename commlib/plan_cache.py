"""Plans built once: `cached_plan`, the decorator every plan builder of `commlib.plans` wears.

A plan depends only on its builder's arguments (shape, world size, dtype name, dims, reduce op, convention,
accum_dtype, sizes, ranks, perm, ...), so the first call with given arguments builds and validates the
`Plan` and every later call returns that same object: a frontend's host time per call is one look-up, not
the validation and layout math.

Two caches per builder, each of at most `MAX_PLANS` plans:

- the fast one, a `functools.lru_cache` looked up first, at C speed. It is ``typed``: each value is keyed
  with its type, so ``dim=1.0`` or ``dim=True`` (which the builder refuses) never finds the plan of
  ``dim=1``, and ``ReduceOp.SUM`` and ``"sum"`` are two keys of equal plans. Types only tell apart what is
  at the top level, so it holds only calls whose arguments are scalars or sequences of a type registered
  with `trust_sequence_type` (``torch.Size``: its items are always ints; `Pairs`, a perm of exact-int pairs
  that `pairs` makes of a list); it never stores a call with a plain tuple, so no such call can find one.
- the general one, a dictionary (oldest plan first out) for the rest (a plain tuple or a list as shape, perm
  or sizes): the arguments are first made hashable (`key`: sequences become tuples, every value but an exact
  int, str or None is keyed with its type), so a ``(3.0, 5)`` shape never finds the plan of ``(3, 5)``. A
  call with an unhashable argument (a numpy array as perm, say) is built every time.

Bounded by bytes as well as count: every plan built, and every object the spec and frontends derive and keep
per plan or shape (layouts, VJP plans, torch's walks: `held_cache`), is charged its `estimated_bytes`; past
`MAX_BYTES` (4 MiB) since the last flush every cache is flushed at once. A training run's handful of shapes
never comes near it (100% hits); a stream of new shapes (60,000 reduce_scatter shapes: 131 MiB of heap
under the count bound alone) keeps a few MiB and pays the estimate (tens of us) on each miss.

A call that raises caches nothing, so a mistake raises the same error, with the same text, every time.
Under torch.compile, Dynamo skips ``lru_cache`` and traces the builder itself; what runs on a miss, and the
general cache, first ask the frontends' `bypass_while` tests, so a tracer never traces the key making or a
change to the dictionary.

>>> from commlib import plans
>>> clear()
>>> first = plans.all_gather((3, 5), 4, dim=0)
>>> plans.all_gather([3, 5], 4, dim=0) is first, builds("all_gather")
(True, 1)
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import itertools
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = [
    "MAX_BYTES",
    "MAX_PLANS",
    "Pairs",
    "builds",
    "bypass_while",
    "cached_plan",
    "charge",
    "clear",
    "clear_also",
    "estimated_bytes",
    "flushes",
    "held_bytes",
    "held_cache",
    "key",
    "pairs",
    "trust_sequence_type",
]

MAX_PLANS = 4096  # plans kept per builder and cache
MAX_BYTES = 4 * 2**20  # estimated bytes of what every cache holds (plans, and what frontends keep per plan)

_EXACT = frozenset({int, str, type(None)})  # values keyed as themselves (no other type compares equal to them)
_INTS = frozenset({int})  # (perm pairs)
_PAIRS = frozenset({tuple, list})
_TWO = frozenset({2})
_CONTAINERS = (tuple, list, dict, set, frozenset, bytearray)  # keyed item by item, unless trusted
_trusted: set[type] = set()  # sequence types whose items are always exact ints or pairs of them (trust_sequence_type)
_bypass: list[Callable[[], bool]] = []  # see bypass_while
_also_cleared: list[Callable[[], object]] = []  # see clear_also
_caches: dict[str, tuple[Any, dict]] = {}  # builder name -> its (fast lru_cache function, general dictionary)
_builds: collections.Counter[str] = collections.Counter()  # builder name -> times it ran
_held = [0, 0]  # [estimated bytes charged since the last flush, flushes since the last `clear`]
_LEAVES = (str, bytes, int, float, complex, type(None), enum.Enum, type, types.ModuleType, types.BuiltinFunctionType)

Builder = TypeVar("Builder", bound=Callable[..., Any])


class _Untrusted(Exception):
    """Raised inside the fast cache for a call it must not hold (so it stores nothing)."""


def trust_sequence_type(kind: type) -> None:
    """Key `kind`'s values as they are, on the fast cache: for sequence types whose items are always exact
    ints (torch: ``torch.Size``). Registered by a frontend when it is imported."""
    _trusted.add(kind)
    _fast_types.cache_clear()


class Pairs(tuple):
    """A perm whose items are all ``(src, dst)`` pairs of exact ints (made by `pairs`): a sequence the fast
    cache trusts, as it trusts ``torch.Size``. Its repr is that of the perm the caller gave (`received`), so an
    error message quotes what the caller passed, as the reference's does."""

    received: object  # (a tuple subclass cannot have __slots__ of its own: in the instance's __dict__)

    def __repr__(self) -> str:
        return repr(self.received)


_trusted.add(Pairs)


def pairs(perm: object) -> object:
    """`perm` (a list or tuple of pairs) as `Pairs` where every item is a pair of exact ints, so a permute call
    finds its plan in the fast cache (keying a list of pairs in the general cache costs ~2.5 us); anything else
    (a bool or a numpy int among the ranks, an array, an iterator) as it is, for the general cache to key and
    the builder to judge. The torch frontend calls it on the user's perm (JAX's shapes are plain tuples, which
    the fast cache never holds: there it would only add a step)."""
    if type(perm) not in _PAIRS or not _PAIRS.issuperset(map(type, cast(list, perm))):  # (read an item that is
        return perm  # an iterator, and the builder would find it empty)
    items = tuple(map(tuple, cast(list, perm)))
    if _INTS.issuperset(map(type, itertools.chain.from_iterable(items))) and _TWO.issuperset(map(len, items)):
        key = Pairs(items)
        key.received = perm
        return key
    return perm


def bypass_while(predicate: Callable[[], bool]) -> None:
    """Run the builder itself, uncached, on a fast-cache miss while `predicate()` is true: a frontend
    registers its tracer's test (torch: ``torch.compiler.is_dynamo_compiling``), so a tracer (which skips
    ``lru_cache``) traces the builder and never the key making or the general cache."""
    if predicate not in _bypass:
        _bypass.append(predicate)


def _tracing() -> bool:
    """True while a frontend's `bypass_while` test says a tracer runs."""
    return any(tracing() for tracing in _bypass)  # (Dynamo traces this; it cannot trace operator.call)


@functools.lru_cache(maxsize=1024)
def _fast_types(*types: type) -> bool:
    """True when values of `types` may key the fast (typed) cache as they are."""
    return all(kind in _trusted or not issubclass(kind, _CONTAINERS) for kind in types)


def _hashable(value: object) -> object:
    """`value` as a key: exact ints, strings and None as themselves, sequences as tuples, the rest typed."""
    kind = type(value)
    if kind in _EXACT:
        return value
    if isinstance(value, (tuple, list)):
        if _EXACT.issuperset(map(type, value)):  # a shape, sizes, or keyword values: checked at C speed
            return tuple(value)
        if _PAIRS.issuperset(map(type, value)) and _INTS.issuperset(map(type, itertools.chain.from_iterable(value))):
            return tuple(map(tuple, value))  # a perm: (src, dst) pairs of ints
        return tuple(map(_hashable, value))
    return (kind, value)


def key(args: tuple, kwargs: dict) -> tuple:
    """The general cache's key of a builder call: `args`' and `kwargs`' values made hashable, and the
    keyword names (looking it up raises TypeError where an argument is unhashable)."""
    return _hashable(args), tuple(kwargs), _hashable(tuple(kwargs.values()))


def cached_plan(builder: Builder) -> Builder:
    """Build each plan once: later calls with the same arguments return the same `Plan` (module docstring)."""
    name = builder.__qualname__
    general: collections.OrderedDict[tuple, Any] = collections.OrderedDict()  # `key` -> plan, oldest first

    def run(*args, **kwargs):
        _builds[name] += 1
        plan = builder(*args, **kwargs)
        charge(estimated_bytes(plan))
        return plan

    @functools.lru_cache(maxsize=MAX_PLANS, typed=True)
    def fast(*args, **kwargs):
        if _tracing():
            return builder(*args, **kwargs)
        if not _fast_types(*map(type, args), *map(type, kwargs.values())):
            raise _Untrusted
        return run(*args, **kwargs)

    _caches[name] = (fast, general)

    @functools.wraps(builder)
    def build(*args, **kwargs):
        try:
            return fast(*args, **kwargs)
        except (_Untrusted, TypeError):  # a plain sequence, an unhashable value, or the builder's TypeError
            pass
        if _tracing():
            return builder(*args, **kwargs)
        try:
            call_key = key(args, kwargs)
            return general[call_key]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument: build it every time
            return run(*args, **kwargs)
        plan = run(*args, **kwargs)  # the caller's own arguments: errors quote what it passed
        if len(general) >= MAX_PLANS:
            general.popitem(last=False)
        general[call_key] = plan
        return plan

    return build  # type: ignore[return-value]


def estimated_bytes(root: object) -> int:
    """``sys.getsizeof`` summed over `root` and every object it reaches once (tuples, lists, dicts, sets, the
    attributes of records, a closure's cells, a bound method's object; numpy arrays with their buffers);
    strings, numbers, enum members, classes and modules are counted but not entered. Shared objects (small ints,
    interned names) count every time they are reached from a new owner: an upper estimate, costing microseconds
    per plan (paid on a miss)."""
    seen: set[int] = set()
    stack, total = [root], 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item) + int(getattr(item, "nbytes", 0) if hasattr(item, "__array__") else 0)
        if isinstance(item, _LEAVES):
            continue
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (tuple, list, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, types.FunctionType):
            stack.extend(cell.cell_contents for cell in item.__closure__ or () if _filled(cell))
        elif isinstance(item, types.MethodType):  # (a record's bound method: torch's asynchronous walks)
            stack.append(item.__self__)
        else:
            stack.extend(_attributes(item))
    return total


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _attributes(item: object) -> list[object]:
    """The values of a record's fields (a dataclass's fields, every ``__slots__`` of its classes), read one by
    one: reading ``__dict__`` would make Python materialize a dict the object did not have (3.11+). Other
    objects (a backend's option struct) are not entered."""
    kind: Any = type(item)  # (a class is hashable: mypy types type(item) as type[object])
    return [getattr(item, name) for name in _fields(kind) if hasattr(item, name)]


@functools.lru_cache(maxsize=256)
def _fields(kind: type) -> tuple[str, ...]:
    """The field names of `kind`: its dataclass fields and the ``__slots__`` of it and its bases."""
    names = [field.name for field in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else []
    for base in kind.__mro__:
        group = getattr(base, "__slots__", ())
        names.extend(
            name
            for name in ((group,) if isinstance(group, str) else group)
            if name not in ("__dict__", "__weakref__") and name not in names
        )
    return tuple(names)


def charge(nbytes: int) -> None:
    """Count `nbytes` more held by the caches (each plan built, and each per-plan object a frontend keeps);
    past `MAX_BYTES` since the last flush, every cache is flushed (`clear`, the build counts kept). A real
    training run's handful of shapes never comes near it (a 100% hit rate); a stream of new shapes is held
    in at most `MAX_BYTES` (estimated), not in `MAX_PLANS` plans per builder and walk."""
    _held[0] += nbytes
    if _held[0] > MAX_BYTES:
        _forget()
        _held[1] += 1


def held_cache(maxsize: int) -> Callable[[Builder], Builder]:
    """``functools.lru_cache(maxsize)`` for what the spec and frontends derive from a plan or shape (layouts,
    VJP plans, torch's walks): each result made is charged (`charge`), and every flush and `clear` forgets it."""

    def decorate(function: Builder) -> Builder:
        @functools.wraps(function)
        def charged(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            if not _tracing():  # (Dynamo traces through lru_cache: it must not trace the estimate)
                charge(estimated_bytes(result))
            return result

        cached = functools.lru_cache(maxsize=maxsize)(charged)
        clear_also(cached.cache_clear)
        return cast(Builder, cached)

    return decorate


def held_bytes() -> int:
    """Estimated bytes charged since the last flush (an upper bound of what the caches hold)."""
    return _held[0]


def flushes() -> int:
    """Times the caches were flushed for `MAX_BYTES` since the last `clear`."""
    return _held[1]


def builds(name: str | None = None) -> int:
    """Times the builder `name` (or any builder) ran since the last `clear`: the cache misses."""
    return _builds[name] if name is not None else sum(_builds.values())


def clear_also(forget: Callable[[], object]) -> None:
    """Call `forget` on every `clear` too: a frontend registers its caches keyed by plans (torch: the walks)."""
    if forget not in _also_cleared:
        _also_cleared.append(forget)


def _forget() -> None:
    for fast, general in _caches.values():
        fast.cache_clear()
        general.clear()
    for forget in _also_cleared:
        forget()
    _held[0] = 0


def clear() -> None:
    """Forget every cached plan (and what frontends keep per plan, `clear_also`) and reset the build counts."""
    _forget()
    _held[1] = 0
    _builds.clear()
