"""What a traced program's collectives read, for the overlap tests (DESIGN "Overlap": JAX leaves scheduling to
XLA, so a collective that reads no result of some compute may run during it). Shared by tests/jax/test_ring.py
and tests/jax/test_chunks.py."""

from __future__ import annotations

import itertools

from jax.extend import core

__all__ = ["collective_sources", "subjaxprs"]


def subjaxprs(eqn):
    """(jaxpr, the eqn's invars feeding its invars) of every jaxpr inside `eqn` (cond: the branches take the
    operands after the index)."""
    for value in eqn.params.values():
        for inner in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(inner, (core.Jaxpr, core.ClosedJaxpr)):
                jaxpr = getattr(inner, "jaxpr", inner)
                yield jaxpr, eqn.invars[len(eqn.invars) - len(jaxpr.invars) :]


def collective_sources(jaxpr, primitive: str) -> list[frozenset[int]]:
    """For every `primitive` equation the program runs, in program order (inside sub-jaxprs too), the
    ``dot_general``\\ s its operands depend on, numbered in program order. An equation whose sub-jaxprs do not
    map outputs one to one is taken to depend on everything it reads and computes."""
    found: list[frozenset[int]] = []
    numbers = itertools.count()

    def read(sources: dict, variables) -> frozenset[int]:
        return frozenset().union(
            *(sources.get(var, frozenset()) for var in variables if not isinstance(var, core.Literal))
        )

    def walk(jaxpr, sources: dict) -> list[frozenset[int]]:
        for eqn in jaxpr.eqns:
            inputs = read(sources, eqn.invars)
            if eqn.primitive.name == primitive:
                found.append(inputs)
            outputs = [inputs | ({next(numbers)} if eqn.primitive.name == "dot_general" else set())] * len(eqn.outvars)
            for inner, feeding in subjaxprs(eqn):
                inner_sources = {var: read(sources, [outer]) for var, outer in zip(inner.invars, feeding, strict=True)}
                inner_outputs = walk(inner, inner_sources)
                if len(inner_outputs) == len(eqn.outvars):
                    outputs = inner_outputs
                else:
                    outputs = [inputs.union(*inner_outputs)] * len(eqn.outvars)
            sources.update(zip(eqn.outvars, outputs, strict=True))
        return [read(sources, [var]) for var in jaxpr.outvars]

    walk(jaxpr, {})
    return found
