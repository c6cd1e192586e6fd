"""The `parallel` context's spec: which attention layer a model's attention call runs, over which groups, for
which `SequenceLayout` -- validated once, when the context is entered -- and the checks of each call an
integration (transformers' attention registry, a Flax model's attention function) makes inside it.

Both frontends' ``sequence.parallel(...)`` build a `ParallelPlan` here on entry and walk it on every call; the
messages below are the only ones they raise, so torch and JAX say the same thing.

>>> plan = parallel_plan(SequenceLayout(37, ulysses_size=4), "ulysses", ulysses_size=4, ring_size=1)
>>> plan.keywords  # what the Ulysses layer is called with: S = 37 is uneven over 4 ranks
{'seq_sizes': (10, 9, 9, 9)}
>>> parallel_plan(SequenceLayout(64, ring_size=4, layout="zigzag"), "ring", ulysses_size=1, ring_size=4).keywords
{'layout': 'zigzag'}
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Generic, TypeVar

import numpy as np

from commlib.errors import comm_error, kind_error
from commlib.sequence import SequenceLayout

__all__ = ["ATTENTIONS", "CALL_OP", "OP_NAME", "ParallelPlan", "check_call", "check_groups", "check_positions",
           "check_sizes", "check_world", "outside_error", "parallel_plan"]

OP_NAME = "parallel"
CALL_OP = "commlib attention"  # the name of an integration's call inside the context (transformers, Flax)
ATTENTIONS = ("ulysses", "ring", "usp")


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """What the code inside a `parallel` context runs: `attention` ("ulysses" | "ring" | "usp") over the
    layout's shards, and the keywords the layer is called with (``seq_sizes`` for Ulysses; ``layout``, the
    even layout's name or the `SequenceLayout` itself, for ring and USP)."""

    layout: SequenceLayout  # the sequence layout every rank's tokens follow
    attention: str  # "ulysses", "ring" or "usp"
    keywords: dict  # the layer's layout keywords (seq_sizes / layout), decided once

    def __hash__(self) -> int:
        return hash((self.layout, self.attention))


def _names_even_layout(layout: SequenceLayout) -> bool:
    """Whether the layout's string name (``"contiguous"`` / ``"zigzag"``) gives the same shards: the even rule
    of `commlib.shard_positions` (S divisible by R * U, by 2 * R * U for zigzag)."""
    chunks = layout.ring_size * layout.ulysses_size * (2 if layout.layout == "zigzag" else 1)
    return layout.seq_len % chunks == 0


def _keywords(layout: SequenceLayout, attention: str) -> dict:
    if attention == "ulysses":
        return {"seq_sizes": None if layout.is_even else layout.sizes}
    return {"layout": layout.layout if _names_even_layout(layout) else layout}


def check_groups(attention: object, given: dict[str, bool], names: tuple[str, str, str], *,
                 group_required: bool = False) -> None:
    """`attention` one of `ATTENTIONS`; USP given both of its groups (axes), Ulysses and ring neither (and, with
    `group_required` -- JAX, where no axis means the world -- their group).

    `names` are the frontend's keywords ``(group, ulysses_group, ring_group)`` (JAX: the axes); `given` says
    which of them the user passed.
    """
    received = {name: ("given" if given[name] else None) for name in names}
    if not isinstance(attention, str):
        raise kind_error(OP_NAME, f"attention must be a str, not {type(attention).__name__}", attention=attention)
    if attention not in ATTENTIONS:
        raise comm_error(OP_NAME, f"attention ({attention!r}) must be one of {', '.join(ATTENTIONS)}",
                         attention=attention)
    _, ulysses, ring = names
    if attention == "usp" and not (given[ulysses] and given[ring]):
        raise comm_error(OP_NAME, f"attention='usp' needs both {ulysses} and {ring}", attention=attention,
                         **received)
    if attention != "usp" and (given[ulysses] or given[ring]):
        raise comm_error(OP_NAME, f"{ulysses} and {ring} are for attention='usp'; attention={attention!r} runs "
                         f"over {names[0]}", attention=attention, **received)
    if attention != "usp" and group_required and not given[names[0]]:
        raise comm_error(OP_NAME, f"attention={attention!r} needs {names[0]}", attention=attention, **received)


def outside_error(op_name: str, context: str):
    """The `CommError` of an integration called outside every ``parallel`` context (`context`: its path)."""
    return comm_error(op_name, f"called outside a {context}(...) context: enter one to choose the layer (ulysses, "
                      "ring, usp), its groups and the sequence layout")


def parallel_plan(layout: object, attention: str, *, ulysses_size: int | None, ring_size: int | None) -> ParallelPlan:
    """The plan of ``parallel(layout, attention=...)`` over groups of `ulysses_size` and `ring_size` ranks (None:
    not known yet -- a JAX axis outside its ``shard_map`` -- checked again at the call).

    Ulysses runs over ``ulysses_size`` ranks (ring 1), ring over ``ring_size`` (Ulysses 1), USP over both:
    the layout's ``ulysses_size`` and ``ring_size`` must be those.

    Raises:
        TypeError: `layout` not a `commlib.SequenceLayout`.
        CommError: a layout whose Ulysses or ring size is not its group's.
    """
    if not isinstance(layout, SequenceLayout):
        raise kind_error(OP_NAME, f"layout must be a commlib.SequenceLayout, not {type(layout).__name__}",
                         layout=layout)
    check_sizes(layout, attention, ulysses_size=ulysses_size, ring_size=ring_size)
    return ParallelPlan(layout, attention, _keywords(layout, attention))


def check_sizes(layout: SequenceLayout, attention: str, *, ulysses_size: int | None, ring_size: int | None) -> None:
    """The layout's ``ulysses_size`` / ``ring_size`` equal to the groups' (sizes None are skipped)."""
    for name, size in (("ulysses_size", ulysses_size), ("ring_size", ring_size)):
        if size is not None and getattr(layout, name) != size:
            groups = {"ulysses": "the group's size", "ring": "the group's size", "usp": "its group's size"}
            raise comm_error(OP_NAME, f"layout.{name} ({getattr(layout, name)}) must be {size} ({groups[attention]} "
                             f"for attention={attention!r})", layout=layout, attention=attention)


def check_world(layout: SequenceLayout, world_size: int) -> None:
    """USP's optional whole sequence group: its size must be ``layout.world_size``."""
    if world_size != layout.world_size:
        raise comm_error(OP_NAME, f"group's size ({world_size}) must be layout.world_size ({layout.world_size})",
                         layout=layout, attention="usp")


def check_call(plan: ParallelPlan, *, shard: int | None, rows: int, mask: bool = False, bias: bool = False,
               dropout: float = 0.0, sliding_window: object = None, softcap: object = None) -> None:
    """One integration call inside the context: nothing it cannot honour, and q holding the layout's rows.

    `shard` is this rank's shard index (torch: exactly ``layout.sizes[shard]`` rows); None for JAX, which
    holds every shard padded to ``layout.max_size``. `mask` / `bias`: whether one was given (commlib owns the
    causal mask only).

    Raises:
        CommError: a mask, a bias, dropout > 0, a sliding window, softcapping, q rows not the layout's.
    """
    refused = [(mask, "an attention mask (padding or custom) is not supported: commlib applies the causal mask "
                      "only; drop padding or pack documents without one"),
               (bias, "an attention bias is not supported"),
               (dropout != 0.0, f"dropout ({dropout}) must be 0"),
               (sliding_window is not None, f"sliding_window ({sliding_window}) is not supported"),
               (softcap is not None, f"softcap ({softcap}) is not supported")]
    for refuse, message in refused:
        if refuse:
            raise comm_error(CALL_OP, message, attention=plan.attention, layout=plan.layout)
    want = plan.layout.max_size if shard is None else plan.layout.sizes[shard]
    if rows != want:
        where = "layout.max_size" if shard is None else f"layout.sizes[{shard}]"
        raise comm_error(CALL_OP, f"query rows ({rows}) must be {where} ({want})", layout=plan.layout,
                         attention=plan.attention)


def check_positions(plan: ParallelPlan, shard: int, matches: bool, received: object) -> None:
    """The model's ``position_ids`` equal to the global positions of this rank's shard (RoPE fed local
    positions, or a layout other than the context's, is silently wrong).

    Raises:
        CommError: `matches` False.
    """
    if not matches:
        want = np.array2string(plan.layout.positions(shard), threshold=12)
        raise comm_error(CALL_OP, f"position_ids must be the global positions of shard {shard} of the layout "
                         f"({want}; sequence.shard_tokens gives them)", position_ids=received,
                         layout=plan.layout)


State = TypeVar("State")


class Contexts(Generic[State]):
    """A frontend's entered `parallel` contexts, per thread (a contextvar): the innermost wins, and leaving one
    restores the one around it. `context` names the frontend's context manager in the outside-every-context
    error."""

    def __init__(self, name: str, context: str) -> None:
        self._innermost: contextvars.ContextVar[State | None] = contextvars.ContextVar(name, default=None)
        self.context = context

    @contextlib.contextmanager
    def entered(self, state: State) -> Iterator[State]:
        """`state` is the innermost context inside the ``with``."""
        token = self._innermost.set(state)
        try:
            yield state
        finally:
            self._innermost.reset(token)

    def innermost(self) -> State | None:
        """The innermost entered context, None outside every one."""
        return self._innermost.get()

    def current(self, op_name: str) -> State:
        """The innermost entered context; `outside_error` (op `op_name`) outside every one."""
        state = self._innermost.get()
        if state is None:
            raise outside_error(op_name, self.context)
        return state
