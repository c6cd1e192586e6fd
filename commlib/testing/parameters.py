"""Parameter names and layouts between a torch module and a JAX pytree (numpy + stdlib only).

A `ParameterMap` is a list of rules, each a pair of name patterns and an optional transpose:
``("model.layers.{layer}.self_attn.q_proj.weight", "layers.{layer}.attention.query.kernel", LINEAR)``. Torch names
are ``named_parameters()``'s; JAX names are a pytree's dotted paths (`commlib.testing.flatten`; an nnx ``State``'s
pure dict, ``layers.0.attention.query.kernel``). A ``{placeholder}`` matches a decimal index. A placeholder of the
torch pattern that the JAX pattern lacks is a **stacked** axis: the JAX array holds every index along a leading
axis (``nnx.scan``'d or ``vmap``'d layers: ``layers.attention.query.kernel`` of shape ``[L, in, out]``), in the
order the placeholders appear. `axes` is the ``numpy.transpose`` taking one torch array to its JAX array
(`LINEAR`, ``(1, 0)``: ``nn.Linear``'s ``[out, in]`` weight against ``nnx.Linear``'s ``[in, out]`` kernel); the way
back uses its inverse.

Both directions check what they can: a name no rule matches, a name two rules match, two names mapped to one, a stacked axis with a
missing index, and, given ``like`` (the other side's names with arrays or shapes), a name nothing maps to, a
name `like` does not have and a shape that differs: one `ParameterMapError` lists them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["LINEAR", "ParameterMap", "ParameterMapError", "Rule"]

LINEAR = (1, 0)  # torch nn.Linear weight [out, in] <-> flax Dense / nnx.Linear kernel [in, out]
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class ParameterMapError(ValueError):
    """Parameters that cannot be mapped: the message lists every name that matches no rule, is missing, is
    left over or has another shape than expected."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One torch name pattern, the JAX path pattern it maps to, and the transpose from torch to JAX."""

    torch: str  # "model.layers.{layer}.mlp.up_proj.weight"
    jax: str  # "layers.{layer}.up.kernel"; without "{layer}": the layers stacked on a leading axis
    axes: tuple[int, ...] | None = None  # numpy.transpose axes of one torch array -> its JAX array

    def __post_init__(self) -> None:
        torch_names, jax_names = _PLACEHOLDER.findall(self.torch), _PLACEHOLDER.findall(self.jax)
        if not set(jax_names) <= set(torch_names) or len(set(torch_names)) != len(torch_names):
            raise ParameterMapError(
                f"Rule: the JAX pattern's placeholders must be among the torch pattern's, each "
                f"once. Received: torch={self.torch!r}, jax={self.jax!r}"
            )

    @property
    def stacked(self) -> tuple[str, ...]:
        """The placeholders stacked on the JAX array's leading axes, in order."""
        in_jax = set(_PLACEHOLDER.findall(self.jax))
        return tuple(name for name in _PLACEHOLDER.findall(self.torch) if name not in in_jax)


def _regex(pattern: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(pattern)  # literal, name, literal, name, ...
    source = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>[0-9]+)" for i, part in enumerate(parts))
    return re.compile(source + r"\Z")


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, tuple) else tuple(np.shape(value))


class ParameterMap:
    """Rules taking torch parameter names to JAX pytree paths and back (see the module docstring).

    >>> import numpy as np
    >>> mapping = ParameterMap([("layers.{i}.proj.weight", "layers.{i}.proj.kernel", LINEAR),
    ...                         ("norm.weight", "norm.scale")])
    >>> torch_named = {"layers.0.proj.weight": np.zeros((3, 2)), "layers.1.proj.weight": np.ones((3, 2)),
    ...                "norm.weight": np.ones(3)}
    >>> {name: array.shape for name, array in mapping.to_jax(torch_named).items()}
    {'layers.0.proj.kernel': (2, 3), 'layers.1.proj.kernel': (2, 3), 'norm.scale': (3,)}
    >>> stacked = ParameterMap([("layers.{i}.proj.weight", "layers.proj.kernel", LINEAR)])
    >>> stacked.to_jax({k: v for k, v in torch_named.items() if k != "norm.weight"})["layers.proj.kernel"].shape
    (2, 2, 3)
    >>> mapping.to_jax(torch_named, like={"norm.scale": (3,), "layers.0.proj.kernel": (3, 2)})
    Traceback (most recent call last):
    ...
    commlib.testing.parameters.ParameterMapError: ParameterMap.to_jax: parameters cannot be mapped:
      shape differs: 'layers.0.proj.kernel' is (2, 3) from 'layers.0.proj.weight', like has (3, 2) (its transpose: check the rule's axes)
      not in like: 'layers.1.proj.kernel' (from 'layers.1.proj.weight')
    """

    def __init__(self, rules: Iterable[Rule | tuple]):
        self.rules = tuple(rule if isinstance(rule, Rule) else Rule(*rule) for rule in rules)
        self._torch = [_regex(rule.torch) for rule in self.rules]
        self._jax = [_regex(rule.jax) for rule in self.rules]

    def to_jax(self, named: Mapping[str, Any], like: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Torch `named` arrays (``named_parameters()`` names) -> JAX paths; `like`: the JAX side's paths with
        arrays or shapes, to check against (and order by). Raises `ParameterMapError`."""
        problems: list[str] = []
        pieces: dict[str, tuple[Rule, dict[tuple[int, ...], tuple[str, np.ndarray]]]] = {}
        for name, value in named.items():
            found = self._match(self._torch, name, "torch name", problems)
            if found is None:
                continue
            rule, indices = found
            target = rule.jax.format(**indices)
            stack_index = tuple(int(indices[key]) for key in rule.stacked)
            entry = pieces.setdefault(target, (rule, {}))[1]
            if stack_index in entry:
                problems.append(f"two torch names map to {target!r}: {entry[stack_index][0]!r} and {name!r}")
            array = np.asarray(value)
            entry[stack_index] = (name, array if rule.axes is None else np.transpose(array, rule.axes))
        mapped = {target: self._stack(target, rule, entry, problems) for target, (rule, entry) in pieces.items()}
        sources = {target: next(iter(entry.values()))[0] for target, (_, entry) in pieces.items()}
        return self._finish("to_jax", mapped, sources, like, problems)

    def to_torch(self, flat: Mapping[str, Any], like: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """JAX `flat` arrays (dotted paths) -> torch names; `like`: the torch side's names with arrays or shapes
        (``named_parameters()``), to check against (and order by). Raises `ParameterMapError`."""
        problems: list[str] = []
        mapped: dict[str, np.ndarray] = {}
        sources: dict[str, str] = {}
        for path, value in flat.items():
            found = self._match(self._jax, path, "JAX path", problems)
            if found is None:
                continue
            rule, indices = found
            array = np.asarray(value)
            stacked = rule.stacked
            inverse = None if rule.axes is None else tuple(int(i) for i in np.argsort(rule.axes))
            for stack_index in np.ndindex(*array.shape[: len(stacked)]):
                name = rule.torch.format(**indices, **dict(zip(stacked, map(str, stack_index), strict=True)))
                piece = array[stack_index]
                mapped[name] = piece if inverse is None else np.transpose(piece, inverse)
                sources[name] = path
        return self._finish("to_torch", mapped, sources, like, problems)

    def _match(
        self, patterns: list[re.Pattern[str]], name: str, what: str, problems: list[str]
    ) -> tuple[Rule, dict[str, str]] | None:
        """The one rule whose pattern matches `name`; None, with a problem, where none or several do (taking the
        first of two silently maps by rule order, which a reader of the rules cannot see)."""
        found = [
            (rule, matched.groupdict())
            for rule, pattern in zip(self.rules, patterns, strict=True)
            if (matched := pattern.match(name))
        ]
        if len(found) == 1:
            return found[0]
        if not found:
            problems.append(f"no rule matches {what} {name!r}")
        else:
            listed = " and ".join(f"{rule.torch!r} -> {rule.jax!r}" for rule, _ in found)
            problems.append(f"{what} {name!r} matches {len(found)} rules: {listed}")
        return None

    @staticmethod
    def _stack(
        target: str, rule: Rule, entry: dict[tuple[int, ...], tuple[str, np.ndarray]], problems: list[str]
    ) -> np.ndarray:
        """The JAX array of `target`: its one piece, or the pieces stacked on the leading axes of `rule.stacked`."""
        if not rule.stacked:
            return entry[()][1]
        extent = [max(index[axis] for index in entry) + 1 for axis in range(len(rule.stacked))]
        missing = [index for index in itertools.product(*map(range, extent)) if index not in entry]
        shapes = {piece.shape for _, piece in entry.values()}
        if missing or len(shapes) > 1:
            what = f"indices {missing} of {rule.stacked} missing" if missing else f"pieces of shapes {sorted(shapes)}"
            problems.append(f"cannot stack {target!r}: {what}")
            return np.empty((0,))
        pieces = np.stack([entry[index][1] for index in itertools.product(*map(range, extent))])
        return pieces.reshape(*extent, *pieces.shape[1:])

    @staticmethod
    def _finish(
        direction: str,
        mapped: dict[str, np.ndarray],
        sources: dict[str, str],
        like: Mapping[str, Any] | None,
        problems: list[str],
    ) -> dict[str, np.ndarray]:
        if like is not None:
            problems += [f"nothing maps to {name!r}" for name in like if name not in mapped]
            for name, array in mapped.items():
                if name not in like:
                    problems.append(f"not in like: {name!r} (from {sources[name]!r})")
                elif array.shape != _shape(like[name]):
                    want = _shape(like[name])
                    hint = " (its transpose: check the rule's axes)" if array.shape == want[::-1] else ""
                    problems.append(
                        f"shape differs: {name!r} is {array.shape} from {sources[name]!r}, like has {want}{hint}"
                    )
            mapped = {name: mapped[name] for name in like if name in mapped} | mapped
        if problems:
            listed = "\n  ".join(problems)
            raise ParameterMapError(f"ParameterMap.{direction}: parameters cannot be mapped:\n  {listed}")
        return mapped
