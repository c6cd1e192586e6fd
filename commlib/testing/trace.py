"""Traces of commlib calls (numpy + stdlib only): what ``commlib_torch.testing_trace.record()`` and
``commlib_jax.testing_trace.record()`` collect, and what `commlib.testing.divergence.first_divergence` compares.

A `Trace` is every commlib call a program made while recording, in program order: a `Call` per public op (the
plan it walked: shapes, dtype, convention, step) or per attention layer run through a ``parallel`` context (the
layer's query, key and value), the module that made it (torch: ``model.layers.1.self_attn``, from the
``nn.Module`` frames on the Python stack; JAX: the nnx path, ``layers.1.attention``) and its input and output
arrays, per rank. A call made inside another recorded call (the all-to-alls inside an attention layer) is part
of that call, not a call of its own, so a trace holds the calls the user's code made and two frameworks' traces
line up call for call.

Each torch rank records its own calls; `Trace.merge` joins the ranks' traces (saved with `Trace.save`, read
back with `Trace.load`) into one. JAX records every device's arrays into one trace.

>>> trace = Trace([Call(0, "all_reduce", "model.norm", {"in_shape": "(2,)"}, {"x": {0: np.ones(2)}},
...                     {"out": {0: np.full(2, 4.0)}})])
>>> merged = Trace.merge([trace, Trace([trace[0].replace(inputs={"x": {1: np.zeros(2)}}, outputs={})])])
>>> merged[0].ranks, merged[0].inputs["x"][1]
((0, 1), array([0., 0.]))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

__all__ = ["Call", "Recorder", "Trace", "calling_module", "describe_plan"]

#: ``{name: {rank: array}}``: a call's inputs or outputs.
Arrays = dict[str, dict[int, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Call:
    """One commlib call of a trace."""

    index: int  # its place in the trace (0 first)
    op: str  # the public op or layer: "all_reduce", "ulysses_attention", ...
    module: str  # the module that made the call ("" where no module was on the stack)
    plan: dict[str, str]  # what the call was asked: shapes, dtype, convention, the step, the layer's keywords
    inputs: Arrays  # {"x": {rank: array}} for an op; {"q": ..., "k": ..., "v": ...} for a layer
    outputs: Arrays  # {"out": {rank: array}}

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that recorded this call, in order."""
        return tuple(sorted({rank for arrays in self.inputs.values() for rank in arrays}))

    def replace(self, **changes: Any) -> Call:
        return dataclasses.replace(self, **changes)

    def site(self) -> str:
        """``op at module``, as reports show the call."""
        return f"{self.op} at {self.module or '(no module)'}"


class Trace(Sequence[Call]):
    """The calls of one recording, in order (a sequence of `Call`). Filled while its ``record()`` block runs."""

    def __init__(self, calls: Iterable[Call] = ()) -> None:
        self.calls = list(calls)

    def __getitem__(self, index):
        return self.calls[index]

    def __len__(self) -> int:
        return len(self.calls)

    def __repr__(self) -> str:
        return f"Trace({len(self)} calls: {', '.join(call.site() for call in self.calls[:4])}" + (
            ", ...)" if len(self) > 4 else ")"
        )

    def save(self, path: str | Path) -> None:
        """Write the trace as one ``.npz`` (the arrays, and the calls' fields as JSON)."""
        arrays, table = {}, []
        for call in self.calls:
            for role in ("inputs", "outputs"):
                for name, ranks in getattr(call, role).items():
                    arrays.update({f"{call.index}/{role}/{name}/{rank}": value for rank, value in ranks.items()})
            table.append({"index": call.index, "op": call.op, "module": call.module, "plan": call.plan})
        np.savez(path, __calls__=np.array(json.dumps(table)), **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """The trace `save` wrote."""
        with np.load(path) as stored:
            table = json.loads(str(stored["__calls__"]))
            found: dict[tuple[int, str], Arrays] = {}
            for key in stored.files:
                if key != "__calls__":
                    index, role, name, rank = key.rsplit("/", 3)
                    found.setdefault((int(index), role), {}).setdefault(name, {})[int(rank)] = stored[key]
        return cls(
            Call(
                row["index"],
                row["op"],
                row["module"],
                row["plan"],
                found.get((row["index"], "inputs"), {}),
                found.get((row["index"], "outputs"), {}),
            )
            for row in table
        )

    @classmethod
    def merge(cls, traces: Sequence[Trace]) -> Trace:
        """One trace from every rank's own (torch: one per process): the calls must agree in number, op and
        module, else ValueError naming the first rank and call that differ."""
        first = traces[0]
        for number, trace in enumerate(traces):
            if [(c.op, c.module) for c in trace] != [(c.op, c.module) for c in first]:
                raise ValueError(f"Trace.merge: trace {number} ({trace!r}) does not make trace 0's calls ({first!r})")
        return cls(_merged(calls) for calls in zip(*traces, strict=True))


def _merged(calls: Sequence[Call]) -> Call:
    """One call whose arrays are every given call's (one per rank)."""
    inputs: Arrays = {}
    outputs: Arrays = {}
    for call in calls:
        for name, ranks in call.inputs.items():
            inputs.setdefault(name, {}).update(ranks)
        for name, ranks in call.outputs.items():
            outputs.setdefault(name, {}).update(ranks)
    return calls[0].replace(inputs=inputs, outputs=outputs)


class Recorder:
    """What a frontend's ``record()`` writes into while it is active: `open` a call (its place is decided
    then, in program order, also under ``jax.jit`` where the arrays arrive later through callbacks), `store`
    its arrays (thread-safe: JAX callbacks may run on other threads), and `inside` a call, where the calls it
    makes are not recorded.

    >>> recorder = Recorder()
    >>> index = recorder.open("all_reduce", "model.norm", {})
    >>> recorder.store(index, "inputs", "x", 1, np.ones(2))
    >>> recorder.trace[0].inputs
    {'x': {1: array([1., 1.])}}
    """

    def __init__(self) -> None:
        self.trace = Trace()
        self.depth = 0  # > 0 inside a recorded call
        self._lock = threading.Lock()
        self._names: dict[int, tuple[object, dict[int, str]]] = {}  # id(root module) -> (root, its names)

    def open(
        self,
        op: str,
        module: str,
        plan: dict[str, str],
        inputs: Sequence[str] = ("x",),
        outputs: Sequence[str] = ("out",),
    ) -> int:
        """A new call (its arrays named `inputs` and `outputs`, in that order, to come): its index."""
        with self._lock:
            index = len(self.trace.calls)
            self.trace.calls.append(
                Call(index, op, module, plan, {name: {} for name in inputs}, {name: {} for name in outputs})
            )
        return index

    def store(self, index: int, role: str, name: str, rank: int, array: Any) -> None:
        """Keep `array` (a copy) as input or output `name` of call `index` on `rank`; the first value stays
        (a jitted function run again does not overwrite its first run)."""
        value = np.array(array, copy=True)
        with self._lock:
            getattr(self.trace.calls[index], role).setdefault(name, {}).setdefault(int(rank), value)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def module_names(self, root: object, named: Callable[[object], Iterable[tuple[str, object]]]) -> dict[int, str]:
        """``{id(module): name}`` of `root`'s modules, made once per root while recording (the root is held,
        so its id is not reused)."""
        if id(root) not in self._names:
            self._names[id(root)] = (root, {id(module): name for name, module in named(root)})
        return self._names[id(root)][1]


def calling_module(
    recorder: Recorder, is_module: Callable[[object], bool], named: Callable[[object], Iterable[tuple[str, object]]]
) -> str:
    """The name of the innermost module on the Python stack (a frame whose ``self`` `is_module`), relative to
    the outermost one (the root, as ``named(root)`` names its modules: torch ``named_modules``, the nnx graph);
    the root itself is shown by its class name, no module on the stack as ``""``.

    >>> class Module:
    ...     def __init__(self, **children):
    ...         self.children = children
    ...     def call(self, name=None):
    ...         return self.children[name].call() if name else calling_module(Recorder(), is_module, named)
    >>> is_module = lambda owner: isinstance(owner, Module)
    >>> named = lambda root: [("", root), *root.children.items()]
    >>> Module(mlp=Module()).call("mlp")
    'mlp'
    """
    modules: list[object] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and is_module(owner) and (not modules or modules[-1] is not owner):
            modules.append(owner)
        frame = frame.f_back
    if not modules:
        return ""
    name = recorder.module_names(modules[-1], named).get(id(modules[0]), "")
    return name or type(modules[0]).__name__


def describe_plan(plan: Any) -> dict[str, str]:
    """What a `commlib.layout.Plan` was asked, as a trace keeps it: world size, shapes, dtype, convention, step.

    >>> from commlib import plans
    >>> describe_plan(plans.all_gather((3, 5), 4, dim=0))["out_shape"]
    '(12, 5)'
    """
    return {
        "world_size": str(plan.world_size),
        "in_shape": str(tuple(plan.in_shape)),
        "out_shape": str(tuple(plan.out_shape)),
        "dtype": plan.dtype,
        "convention": str(plan.convention.value),
        "step": repr(plan.step),
    }
