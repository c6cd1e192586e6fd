"""Pytrees as the parity tools see them (numpy + stdlib only): dicts, lists and tuples of leaves, a leaf being
anything else (an array, a number, None). A leaf's path is its keys and indices joined by dots, as torch names
parameters: ``"layers.0.attention.query.kernel"``; the root's path is ``""``.

>>> flatten({"logits": 1.0, "layers": [{"kernel": 2.0}, {"kernel": 3.0}]})
{'logits': 1.0, 'layers.0.kernel': 2.0, 'layers.1.kernel': 3.0}
>>> unflatten({"b.0": 5, "b.1": 6, "a": 4}, like={"a": None, "b": [None, None]})
{'a': 4, 'b': [5, 6]}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["children", "flatten", "join", "shown", "tree_map", "unflatten"]


def join(path: str, key: object) -> str:
    """The path of child `key` under `path`."""
    return str(key) if path == "" else f"{path}.{key}"


def shown(path: str) -> str:
    """`path` as messages print it (the root is ``(root)``)."""
    return repr(path) if path else "(root)"


def children(tree: Any) -> Iterator[tuple[object, Any]] | None:
    """(key, child) of a dict / list / tuple node in order, None for a leaf."""
    if isinstance(tree, Mapping):
        return iter(tree.items())
    if isinstance(tree, list | tuple):
        return iter(enumerate(tree))
    return None


def flatten(tree: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of `tree` by its dotted path, in order (dict keys in their order, then list indices)."""
    nodes = children(tree)
    if nodes is None:
        return {path: tree}
    flat: dict[str, Any] = {}
    for key, child in nodes:
        flat.update(flatten(child, join(path, key)))
    return flat


def unflatten(flat: Mapping[str, Any], like: Any, path: str = "") -> Any:
    """A tree of `like`'s structure (dicts, lists, tuples) whose leaves are ``flat[path]``.

    Raises KeyError naming the first path of `like` that `flat` lacks; entries of `flat` that `like` has no
    place for are not checked here (`ParameterMap` reports them).
    """
    nodes = children(like)
    if nodes is None:
        if path not in flat:
            raise KeyError(f"unflatten: no value for path {shown(path)}")
        return flat[path]
    built = [(key, unflatten(flat, child, join(path, key))) for key, child in nodes]
    if isinstance(like, Mapping):
        return dict(built)
    values = [value for _, value in built]
    return values if isinstance(like, list) else tuple(values)


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    """`function` of every leaf of `tree`, in `tree`'s structure (dicts, lists, tuples)."""
    nodes = children(tree)
    if nodes is None:
        return function(tree)
    mapped = [(key, tree_map(function, child)) for key, child in nodes]
    if isinstance(tree, Mapping):
        return dict(mapped)
    values = [value for _, value in mapped]
    return values if isinstance(tree, list) else tuple(values)
