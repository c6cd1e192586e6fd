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

from commlib.errors import CommError, comm_error, kind_error
from commlib.masks import SlidingWindow
from commlib.sequence import SequenceLayout

__all__ = [
    "ATTENTIONS",
    "CALL_OP",
    "OP_NAME",
    "ParallelPlan",
    "check_call",
    "check_groups",
    "check_positions_shape",
    "check_sizes",
    "check_world",
    "check_every_shard_has_tokens",
    "helper_axes",
    "helper_layout",
    "outside_error",
    "parallel_plan",
    "positions_error",
    "refused_elsewhere_error",
    "window_rule",
]

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
    return layout.names_even


def _keywords(layout: SequenceLayout, attention: str) -> dict:
    if attention == "ulysses":
        return {"seq_sizes": None if layout.is_even else layout.sizes}
    return {"layout": layout.layout if _names_even_layout(layout) else layout}


def check_groups(
    attention: object, received: dict[str, object], names: tuple[str, str, str], *, group_required: bool = False
) -> None:
    """`attention` one of `ATTENTIONS`; USP given both of its groups (axes), Ulysses and ring neither (and, with
    `group_required` -- JAX, where no axis means the world -- their group).

    `names` are the frontend's keywords ``(group, ulysses_group, ring_group)`` (JAX: the axes); `received` maps
    each to what the user passed as the message shows it (JAX: the axis names; torch: the group's kind), None
    where it was not given.
    """
    given = {name: received[name] is not None for name in names}
    if not isinstance(attention, str):
        raise kind_error(OP_NAME, f"attention must be a str, not {type(attention).__name__}", attention=attention)
    if attention not in ATTENTIONS:
        raise comm_error(
            OP_NAME, f"attention ({attention!r}) must be one of {', '.join(ATTENTIONS)}", attention=attention
        )
    _, ulysses, ring = names
    shown = {name: received[name] for name in names}
    if attention == "usp" and not (given[ulysses] and given[ring]):
        raise comm_error(OP_NAME, f"attention='usp' needs both {ulysses} and {ring}", attention=attention, **shown)
    if attention != "usp" and (given[ulysses] or given[ring]):
        raise comm_error(
            OP_NAME,
            f"{ulysses} and {ring} are for attention='usp'; attention={attention!r} runs over {names[0]}",
            attention=attention,
            **shown,
        )
    if attention != "usp" and group_required and not given[names[0]]:
        raise comm_error(OP_NAME, f"attention={attention!r} needs {names[0]}", attention=attention, **shown)


def outside_error(op_name: str, context: str) -> CommError:
    """The `CommError` of an integration called outside every ``parallel`` context (`context`: its path)."""
    return comm_error(
        op_name,
        f"called outside a {context}(...) context: enter one to choose the layer (ulysses, "
        "ring, usp), its groups and the sequence layout (with gradient checkpointing the backward "
        "runs the attention again: call backward inside the context too)",
    )


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
        raise kind_error(
            OP_NAME, f"layout must be a commlib.SequenceLayout, not {type(layout).__name__}", layout=layout
        )
    check_sizes(layout, attention, ulysses_size=ulysses_size, ring_size=ring_size)
    return ParallelPlan(layout, attention, _keywords(layout, attention))


#: Why each layer wants each of the layout's sizes: (attention, size name) -> the expected value's meaning.
_SIZE_MEANINGS = {
    ("ulysses", "ulysses_size"): "the group's size for attention='ulysses'",
    ("ulysses", "ring_size"): "attention='ulysses' runs no ring: a ring layout needs attention='ring' or 'usp'",
    ("ring", "ring_size"): "the group's size for attention='ring'",
    ("ring", "ulysses_size"): "attention='ring' runs no Ulysses all-to-all: Ulysses pieces need attention='usp'",
    ("usp", "ulysses_size"): "the Ulysses group's size for attention='usp'",
    ("usp", "ring_size"): "the ring group's size for attention='usp'",
}


def check_sizes(layout: SequenceLayout, attention: str, *, ulysses_size: int | None, ring_size: int | None) -> None:
    """The layout's ``ulysses_size`` / ``ring_size`` equal to the groups' (sizes None are skipped).

    >>> check_sizes(SequenceLayout(8, ring_size=2), "ulysses", ulysses_size=1, ring_size=1)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: parallel: layout.ring_size (2) must be 1 (attention='ulysses' runs no ring: ...
    """
    for name, size in (("ulysses_size", ulysses_size), ("ring_size", ring_size)):
        if size is not None and getattr(layout, name) != size:
            raise comm_error(
                OP_NAME,
                f"layout.{name} ({getattr(layout, name)}) must be {size} ({_SIZE_MEANINGS[attention, name]})",
                layout=layout,
                attention=attention,
            )


def check_world(layout: SequenceLayout, world_size: int) -> None:
    """USP's optional whole sequence group: its size must be ``layout.world_size``."""
    if world_size != layout.world_size:
        raise comm_error(
            OP_NAME,
            f"group's size ({world_size}) must be layout.world_size ({layout.world_size})",
            layout=layout,
            attention="usp",
        )


def check_every_shard_has_tokens(plan: ParallelPlan) -> None:
    """torch's `parallel`: every rank must hold at least one token, ``seq_len >= layout.world_size`` (else shard
    ``i`` has 0 rows: `SequenceLayout` allows it, the layers run it, but the model an integration runs on that rank
    cannot -- transformers 5.x fails inside its own code on an empty sequence, and the ranks beside it are left in
    a collective). Decided from the layout alone, so every rank refuses alike before anything is communicated.

    >>> check_every_shard_has_tokens(parallel_plan(SequenceLayout(3, ring_size=4), "ring", ulysses_size=1,
    ...                                            ring_size=4))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: parallel: seq_len (3) must be at least the world size (4) for attention='ring': ...
    """
    layout = plan.layout
    if layout.seq_len < layout.world_size:
        raise comm_error(
            OP_NAME,
            f"seq_len ({layout.seq_len}) must be at least the world size ({layout.world_size}) for "
            f"attention={plan.attention!r}: a rank with no tokens cannot run the model (transformers fails on an "
            f"empty sequence); use seq_len >= {layout.world_size} or fewer ranks",
            layout=layout,
            attention=plan.attention,
            sizes=layout.sizes,
        )


def check_call(
    plan: ParallelPlan,
    *,
    shard: int | None,
    rows: int,
    mask: bool = False,
    bias: bool = False,
    dropout: float = 0.0,
    sliding_window: object = None,
    softcap: object = None,
) -> None:
    """One integration call inside the context: nothing it cannot honour, and q holding the layout's rows.

    `shard` is this rank's shard index (torch: exactly ``layout.sizes[shard]`` rows); None for JAX, which
    holds every shard padded to ``layout.max_size``. `mask` / `bias`: whether one was given (commlib owns the
    causal mask only).

    `sliding_window`: a model's window (transformers' ``sliding_window``, a causal window of that many
    positions), which the layer masks by (`window_rule`).

    Raises:
        CommError: a dense mask, a bias, dropout > 0, a sliding window not an int >= 1, softcapping, q rows not
            the layout's.
    """
    refused = [
        (
            mask,
            "a dense attention mask is not supported: commlib masks by the causal rule and segment ids "
            "(padding and packed documents: segment_ids=, or in transformers a 2-D padding attention_mask "
            "or packed position_ids with parallel(..., packed=True))",
        ),
        (bias, "an attention bias is not supported"),
        (dropout != 0.0, f"dropout ({dropout}) must be 0"),
        (softcap is not None, f"softcap ({softcap}) is not supported"),
    ]
    for refuse, message in refused:
        if refuse:
            raise comm_error(CALL_OP, message, attention=plan.attention, layout=plan.layout)
    window_rule(sliding_window, plan)
    want = plan.layout.max_size if shard is None else plan.layout.sizes[shard]
    if rows != want:
        where = "layout.max_size" if shard is None else f"layout.sizes[{shard}]"
        raise comm_error(
            CALL_OP, f"query rows ({rows}) must be {where} ({want})", layout=plan.layout, attention=plan.attention
        )


def window_rule(sliding_window: object, plan: ParallelPlan | None = None) -> SlidingWindow | None:
    """The layer's ``mask=`` of a model's ``sliding_window`` (transformers 5.x: key k seen by query q iff
    ``q - sliding_window < k <= q``, `commlib.masks.SlidingWindow`'s rule); None for None.

    >>> window_rule(4096)
    SlidingWindow(window=4096)
    >>> window_rule(0)
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: commlib attention: sliding_window (0) must be an int >= 1. Received: sliding_window=0
    """
    if sliding_window is None:
        return None
    if (
        not isinstance(sliding_window, (int, np.integer))
        or isinstance(sliding_window, (bool, np.bool_))
        or sliding_window < 1
    ):
        where = {} if plan is None else dict(attention=plan.attention, layout=plan.layout)
        message = f"sliding_window ({sliding_window}) must be an int >= 1"
        raise comm_error(CALL_OP, message, **where, sliding_window=sliding_window)
    return SlidingWindow(int(sliding_window))


def _listed(values: np.ndarray) -> str:
    """Up to `_SHOWN` values as a list, ``...`` after it when there are more."""
    shown = ", ".join(str(int(value)) for value in values[:_SHOWN])
    return f"[{shown}{', ...' if len(values) > _SHOWN else ''}]"


_SHOWN = 8  # positions shown from the first difference on


def positions_error(plan: ParallelPlan, shard: int, received: np.ndarray, *, name: str = "position_ids") -> CommError:
    """The `CommError` of a model's ``position_ids`` that are not the global positions of shard `shard` (RoPE fed
    local positions, or tokens sharded by another layout than the context's, is silently wrong): the first
    differing positions, expected against received. `received` ``[..., n]``: the shard's valid rows (JAX: the
    padding rows dropped); `name`: the argument (transformers' ``position_ids``, JAX's ``positions``).

    >>> plan = parallel_plan(SequenceLayout(8, ulysses_size=2), "ulysses", ulysses_size=2, ring_size=1)
    >>> print(str(positions_error(plan, 1, np.arange(4)[None])).split("): ")[1])  # RoPE fed local positions
    from row 0 of batch row 0, expected [4, 5, 6, 7], received [0, 1, 2, 3]. Received: position_ids_shape=(1, 4), ...
    """
    want = plan.layout.positions(shard)
    rows = np.asarray(received).reshape(-1, np.shape(received)[-1] if np.ndim(received) else 1)
    what = (
        f"{name} must be the global positions of shard {shard} of the layout (layout.positions({shard}); "
        "sequence.shard_tokens and sequence.position_ids give them)"
    )
    if rows.shape[1] != len(want):
        return comm_error(
            CALL_OP,
            f"{what}: {name}.shape[-1] ({rows.shape[1]}) must be the shard's rows ({len(want)})",
            **{f"{name}_shape": tuple(np.shape(received))},
            layout=plan.layout,
        )
    batch, row = (int(index[0]) for index in np.nonzero(rows != want))
    return comm_error(
        CALL_OP,
        f"{what}: from row {row} of batch row {batch}, expected {_listed(want[row:])}, "
        f"received {_listed(rows[batch, row:])}",
        **{f"{name}_shape": tuple(np.shape(received))},
        layout=plan.layout,
    )


def check_positions_shape(plan: ParallelPlan, shape: tuple[int, ...]) -> None:
    """JAX's `dot_product_attention(..., positions=)`: ``[..., layout.max_size]`` (each shard padded).

    >>> plan = parallel_plan(SequenceLayout(10, ulysses_size=4), "ulysses", ulysses_size=4, ring_size=None)
    >>> check_positions_shape(plan, (2, 10))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: commlib attention: positions.shape[-1] (10) must be layout.max_size (3): ...
    """
    if not shape or shape[-1] != plan.layout.max_size:
        rows = shape[-1] if shape else None
        raise comm_error(
            CALL_OP,
            f"positions.shape[-1] ({rows}) must be layout.max_size ({plan.layout.max_size}): "
            "this rank's positions, padded as its tokens (sequence.shard_tokens gives them)",
            positions_shape=shape,
            layout=plan.layout,
        )


def helper_layout(op_name: str, plan: ParallelPlan | None, layout: object) -> object:
    """The layout a sequence helper (`op_name`: shard_tokens, position_ids, ...) runs on: `layout`, or, given
    None, the innermost `parallel` context's (`plan`; None outside every context). Inside a context a
    `SequenceLayout` other than the context's is refused: tokens, positions or a sequence sharded one way and
    attended another are silently wrong.

    >>> plan = parallel_plan(SequenceLayout(8, ring_size=2), "ring", ulysses_size=1, ring_size=2)
    >>> helper_layout("shard_tokens", plan, None)
    SequenceLayout(seq_len=8, ring_size=2, ulysses_size=1, layout='contiguous')
    >>> helper_layout("shard_tokens", plan, SequenceLayout(8, ring_size=2, layout="zigzag"))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: shard_tokens: layout (SequenceLayout(seq_len=8, ring_size=2, ulysses_size=1, ...
    """
    if layout is None:
        if plan is None:
            raise comm_error(op_name, "layout is required outside a parallel(...) context", layout=None)
        return plan.layout
    if plan is not None and isinstance(layout, SequenceLayout) and layout != plan.layout:
        raise comm_error(
            op_name,
            f"layout ({layout}) must be the parallel context's layout ({plan.layout}): "
            f"what {op_name} shards must be what the attention layer attends (pass layout=None to "
            "take the context's)",
            layout=layout,
            context_layout=plan.layout,
        )
    return layout


def helper_axes(op_name: str, context_axes: tuple | None, axes: tuple | None) -> tuple:
    """JAX: the axes a sequence helper shards over: `axes`, or, given None (an empty tuple), the innermost
    context's sequence axes `context_axes` (USP: ``ring_axis`` then ``ulysses_axis``: shard ``r * U + u``); None
    outside every context. Inside a context other axes, or the same in another order, are refused.

    >>> helper_axes("shard_tokens", ("ring", "ulysses"), ("ulysses", "ring"))
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: shard_tokens: axis_name (('ulysses', 'ring')) must be the parallel context's ...
    """
    if not axes:
        if context_axes is None:
            raise comm_error(op_name, "axis_name is required outside a parallel(...) context", axis_name=None)
        return context_axes
    if context_axes is not None and tuple(axes) != tuple(context_axes):
        raise comm_error(
            op_name,
            f"axis_name ({tuple(axes)}) must be the parallel context's sequence axes "
            f"({tuple(context_axes)}) in that order (USP: ring axis, then Ulysses axis; shard "
            "r * U + u): sharded over other axes, the tokens are not the ones the layer attends",
            axis_name=tuple(axes),
            context_axes=tuple(context_axes),
        )
    return tuple(axes)


def refused_elsewhere_error() -> CommError:
    """Checked mode: the `CommError` raised by a rank whose own call passed when another rank of the layer's
    groups refused its call (so no rank enters the collective alone and waits for the timeout).

    >>> refused_elsewhere_error()  # doctest: +ELLIPSIS
    CommError('commlib attention: another rank of the layer refused this call (its own error says why): ...')
    """
    return comm_error(
        CALL_OP,
        "another rank of the layer refused this call (its own error says why): every rank "
        "raises rather than one entering the collective alone",
    )


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
