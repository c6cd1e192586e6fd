"""Expert parallelism (MoE) over `jax.lax` (inside ``shard_map`` / ``pmap``): `route`, `dispatch`, `combine`.

The spec (`commlib.moe`) owns the routing walk and the three VJP rules; this module implements its
`commlib.moe.MoeBackend` on one rank's jax arrays and calls that walk. JAX is always ``layout="padded"``: one
trace runs on every rank, so every shape is static (`commlib.moe.RoutePlan.padded_rows`) and the split sizes
live on device: the tables are the spec's static-shape `commlib.moe.padded_routing` / `commlib.moe.padded_tables`
on jnp (`traced_routing`, `traced_tables`), tested equal to `commlib.moe.rank_tables` on the valid entries.
The padded layout of the tables: the send buffer holds W chunks of
``C = max(experts_per_rank) * slot`` rows, destination d's rows first in its chunk (the spec's send order), the
rest zero; the row exchange is one dense all-to-all of it; receive position ``s * C + j`` is source s's j-th
row (the spec's receive order within the chunk).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.typing import DTypeLike

from commlib import check
from commlib import moe as spec
from commlib.errors import comm_error, kind_error
from commlib.frontend_errors import wrong_type
from commlib.layer_check import moe_call
from commlib_jax._checked import exchange_layer, is_checked
from commlib_jax._dtypes import dtype_name
from commlib_jax._op import axis_size
from commlib_jax._types import ARRAY_NAME, ARRAY_TYPES, Array, AxisName
from commlib_jax._vma import axes_of, axis_arg, to_varying
from commlib_jax.functional import all_to_all

__all__ = ["Routing", "route", "dispatch", "combine", "traced_routing", "traced_tables"]

_TABLE_FIELDS = ("send_copy", "send_token", "send_sizes", "recv_sizes", "unpack", "pack_back", "token_slot")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Routing:
    """What `route` gives `dispatch` and `combine` (a pytree: its arrays are leaves, the plan and the axes are
    static). The public fields, on this rank:

    - ``tokens_per_expert``: int32 ``[max(experts_per_rank)]``, rows received for each of this rank's experts
      (0 past this rank's count of experts);
    - ``rows``: int32 ``[]``, the valid rows of the dispatched output (the rest of ``plan.padded_rows`` is 0);
    - ``dropped``: int32 ``[]``, routes this rank dropped by capacity;
    - ``invalid``: int32 ``[]``, bad entries of this rank's indices (outside ``[-1, E)``, or an expert given
      again in its row: the later copy), dropped and not routed.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:2], ("ep",))
    >>> f = jax.shard_map(lambda i: route(i[0], 4, "ep").tokens_per_expert[None], mesh=mesh,
    ...                   in_specs=P("ep"), out_specs=P("ep"))
    >>> f(jnp.array([[[0], [1], [1]], [[3], [1], [0]]])).tolist()  # [rank, local expert]
    [[2, 3], [0, 1]]
    """

    plan: spec.RoutePlan
    axes: tuple[str, ...]
    tables: dict[str, jax.Array]
    tokens_per_expert: jax.Array
    rows: jax.Array
    dropped: jax.Array
    invalid: jax.Array

    def tree_flatten(self) -> tuple[tuple, tuple]:
        names = tuple(sorted(self.tables))
        leaves = (tuple(self.tables[n] for n in names), self.tokens_per_expert, self.rows, self.dropped, self.invalid)
        return leaves, (self.plan, self.axes, names)

    @classmethod
    def tree_unflatten(cls, aux: tuple, leaves: tuple) -> Routing:
        plan, axes, names = aux
        tables, *rest = leaves
        return cls(plan, axes, dict(zip(names, tables, strict=True)), *rest)

    def rank_tables(self) -> spec.RankTables:
        """The spec's `commlib.moe.RankTables` of this rank, in the padded layout (module docstring)."""
        return spec.RankTables(
            **{name: self.tables[name] for name in _TABLE_FIELDS},
            tokens_per_expert=self.tokens_per_expert,
            rows=self.rows,
            dropped=self.dropped,
        )


# ---------------------------------------------------------------------------------------------------------
# The routing tables with static shapes: the spec's padded_routing / padded_tables on jnp
# ---------------------------------------------------------------------------------------------------------


class _TableMath:
    """`commlib.moe.TableMath` on traced jnp arrays, int32 (the spec's `padded_routing` / `padded_tables`)."""

    def constant(self, values: Any) -> jax.Array:
        return jnp.asarray(values, jnp.int32)

    def as_int(self, values: Any) -> jax.Array:
        return jnp.asarray(values).astype(jnp.int32)

    def arange(self, size: int) -> jax.Array:
        return jnp.arange(size, dtype=jnp.int32)

    def argsort(self, values: jax.Array) -> jax.Array:
        return jnp.argsort(values, stable=True).astype(jnp.int32)

    def searchsorted(self, ordered: jax.Array, values: jax.Array) -> jax.Array:
        return jnp.searchsorted(ordered, values, side="right").astype(jnp.int32)

    def cumsum(self, values: jax.Array, axis: int) -> jax.Array:
        return jnp.cumsum(values, axis=axis)

    def concatenate(self, arrays: Any) -> jax.Array:
        return jnp.concatenate(arrays)

    def where(self, condition: jax.Array, a: Any, b: Any) -> jax.Array:
        return jnp.where(condition, a, b)

    def minimum(self, a: Any, b: Any) -> jax.Array:
        return jnp.minimum(a, b)

    def total(self, values: jax.Array, axis: int | None = None) -> jax.Array:
        return jnp.sum(values, axis=axis).astype(jnp.int32)

    def any(self, values: jax.Array, axis: int) -> jax.Array:
        return jnp.any(values, axis=axis)

    def scatter(self, size: int, index: jax.Array, values: jax.Array) -> jax.Array:
        return jnp.full(size, -1, jnp.int32).at[index].set(values.astype(jnp.int32), mode="drop")


_MATH = _TableMath()


def traced_routing(indices: jax.Array, plan: spec.RoutePlan) -> dict[str, jax.Array]:
    """The spec's `commlib.moe.padded_routing` (`commlib.moe.local_routing` with static shapes) on traced
    `indices` ``[T, K]``, int32.

    >>> plan = spec.route_plan((3, 2), "int64", 4, 2)
    >>> local = traced_routing(jnp.array([[1, 0], [0, -1], [3, 0]]), plan)
    >>> local["order"][local["keep"]].tolist(), local["counts"].tolist(), int(local["invalid"])
    ([1, 2, 5, 0, 4], [3, 1, 0, 1], 0)
    """
    return spec.padded_routing(_MATH, indices, plan)


def traced_tables(plan: spec.RoutePlan, local: dict[str, jax.Array], received: jax.Array) -> dict[str, jax.Array]:
    """The spec's `commlib.moe.padded_tables` (`commlib.moe.rank_tables` with static shapes, the padded
    layout: module docstring) from `traced_routing` and `received` ``[W, max(experts_per_rank)]``.

    >>> plan = spec.route_plan((3, 1), "int64", 2, 1)
    >>> local = traced_routing(jnp.array([[1], [0], [1]]), plan)
    >>> tables = traced_tables(plan, local, local["send"])
    >>> tables["send_copy"].tolist(), tables["unpack"].tolist(), tables["token_slot"][:, 0].tolist()
    ([1, 0, 2, -1, -1, -1], [0, 1, 2, -1, -1, -1], [1, 0, 2])
    """
    return spec.padded_tables(_MATH, plan, local, received)


# ---------------------------------------------------------------------------------------------------------
# The backend: one rank's jax arrays
# ---------------------------------------------------------------------------------------------------------


class _Backend:
    """`commlib.moe.MoeBackend` on one rank: dense all-to-all of padded per-destination chunks; sums in
    `accum` (the output cast back by the caller)."""

    def __init__(self, axes: tuple[str, ...], top_k: int, accum: Any) -> None:
        self.axes, self.top_k, self.accum = axes, top_k, accum

    def take(self, x: jax.Array, index: jax.Array) -> jax.Array:
        if x.shape[0] == 0:  # capacity 0: every index is -1
            return to_varying(jnp.zeros((*index.shape, *x.shape[1:]), x.dtype), self.axes)
        safe = jnp.where(index >= 0, index, x.shape[0])  # out of bounds: filled with 0, never read
        return jnp.take(x, safe, axis=0, mode="fill", fill_value=0)

    def exchange(self, x: jax.Array, send_sizes: jax.Array, recv_sizes: jax.Array) -> jax.Array:
        if x.shape[0] == 0:  # capacity 0: nothing to move
            return x
        return all_to_all(x, self.axes, 0, 0)  # chunk d (its first send_sizes[d] rows valid) to rank d

    def k_sum(self, rows: jax.Array, weights: jax.Array | None) -> jax.Array:
        total = jnp.zeros((rows.shape[0], *rows.shape[2:]), self.accum)
        for k in range(rows.shape[1]):  # fixed k order
            term = rows[:, k].astype(self.accum)
            if weights is not None:
                term = _column(weights[:, k].astype(self.accum), term.ndim) * term
            total = total + term
        return total

    def spread(self, out_bar: jax.Array, weights: jax.Array | None) -> jax.Array:
        copies = jnp.broadcast_to(out_bar[:, None], (out_bar.shape[0], self.top_k, *out_bar.shape[1:]))
        if weights is not None:
            copies = (_column(weights.astype(self.accum), copies.ndim) * copies.astype(self.accum)).astype(
                out_bar.dtype
            )
        return copies.reshape(out_bar.shape[0] * self.top_k, *out_bar.shape[1:])

    def inner(self, out_bar: jax.Array, rows: jax.Array) -> jax.Array:
        product = out_bar[:, None].astype(self.accum) * rows.astype(self.accum)
        return jnp.sum(product, axis=tuple(range(2, rows.ndim)))


def _column(values: jax.Array, ndim: int) -> jax.Array:
    return values.reshape(*values.shape, *[1] * (ndim - values.ndim))


def _accum(dtype: Any, accum_dtype: DTypeLike | None) -> Any:
    if accum_dtype is not None:
        return jnp.dtype(accum_dtype)
    return jnp.promote_types(dtype, jnp.float32) if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def _no_gradient(tree: Any) -> Any:
    return jax.tree.map(lambda a: np.zeros(a.shape, dtype=jax.dtypes.float0), tree)


# ---------------------------------------------------------------------------------------------------------
# dispatch and combine: jax.custom_vjp over the spec's walk
# ---------------------------------------------------------------------------------------------------------


def _tables(static: tuple, tables: dict) -> spec.RankTables:
    """The spec's tables for the walk (its counts are not read by it)."""
    return spec.RankTables(
        **{name: tables[name] for name in _TABLE_FIELDS}, tokens_per_expert=None, rows=None, dropped=None
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(static: tuple, x: jax.Array, tables: dict) -> jax.Array:
    plan, axes, accum, _ = static
    return spec.dispatch(_Backend(axes, plan.top_k, accum), x, _tables(static, tables), plan.top_k)


def _dispatch_forward(static: tuple, x: jax.Array, tables: dict) -> tuple[jax.Array, dict]:
    return _dispatch(static, x, tables), tables


def _dispatch_backward(static: tuple, tables: dict, out_bar: jax.Array) -> tuple:
    plan, axes, accum, dtype = static
    x_bar = spec.dispatch_vjp(_Backend(axes, plan.top_k, accum), out_bar, _tables(static, tables))
    return x_bar.astype(dtype), _no_gradient(tables)


_dispatch.defvjp(_dispatch_forward, _dispatch_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(static: tuple, y: jax.Array, weights: jax.Array | None, tables: dict) -> jax.Array:
    plan, axes, accum = static
    out = spec.combine(_Backend(axes, plan.top_k, accum), y, _tables(static, tables), weights)
    return out.astype(y.dtype)


def _combine_forward(static: tuple, y: jax.Array, weights: jax.Array | None, tables: dict) -> tuple[jax.Array, tuple]:
    plan, axes, accum = static
    out, returned = spec.combine_rows(_Backend(axes, plan.top_k, accum), y, _tables(static, tables), weights)
    # the weights' gradient reads the rows this forward brought back: saved, not exchanged again
    return out.astype(y.dtype), (None if weights is None else returned, weights, tables)


def _combine_backward(static: tuple, residuals: tuple, out_bar: jax.Array) -> tuple:
    plan, axes, accum = static
    returned, weights, tables = residuals
    backend = _Backend(axes, plan.top_k, accum)
    y_bar, w_bar = spec.combine_vjp(backend, out_bar, None, _tables(static, tables), weights, returned)
    w_grad = None if weights is None or w_bar is None else w_bar.astype(weights.dtype)
    return y_bar.astype(out_bar.dtype), w_grad, _no_gradient(tables)  # out_bar has y's dtype


_combine.defvjp(_combine_forward, _combine_backward)


# ---------------------------------------------------------------------------------------------------------
# The public ops
# ---------------------------------------------------------------------------------------------------------


def route(
    indices: Array,
    num_experts: int,
    axis_name: AxisName,
    *,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    experts_per_rank: tuple[int, ...] | list[int] | None = None,
    layout: str = "padded",
) -> Routing:
    """Route this rank's token copies to the experts of `axis_name`'s ranks: one all-to-all of the counts
    (``[W, max(experts_per_rank)]`` int32); no host sync.

    Args:
        indices: integers ``[T, K]`` in ``[-1, E)``, each row's experts distinct; -1: not routed. The same T on
            every rank (one trace). A bad entry (outside ``[-1, E)``, or an expert again in its row) is data:
            counted in ``Routing.invalid`` and dropped.
        num_experts: E, placed in contiguous blocks in rank order.
        axis_name: a mesh axis name of the enclosing ``shard_map`` / ``pmap``, or a tuple of them (W ranks,
            row-major).
        capacity: most routes kept per (source rank, expert), in token-major (t, k) order; the rest are dropped
            (``Routing.dropped``). ``capacity_factor`` f gives ``ceil(T * K / E * f)``; both None: dropless.
        experts_per_rank: W ints summing to E (None: E / W each, refused when E % W != 0: pass
            ``commlib.split_sizes(E, W)``).
        layout: "padded" only (JAX's shapes are static): the dispatched rows are ``plan.padded_rows =
            max(experts_per_rank) * W * (capacity or T)``, the rows past ``Routing.rows`` zero.

    Returns:
        `Routing` (a pytree; no gradient flows through it: the router's gradient reaches it through `combine`'s
        weights).

    Raises:
        CommError: indices not ``[T, K]``, K > E, E or W < 1, a placement that does not sum to E or has not W
            entries, E % W != 0 without one, capacity < 0, capacity and capacity_factor both given,
            ``layout != "padded"``; `axis_name` not bound; in checked mode (several processes), ranks whose
            calls differ (`commlib.layer_check.moe_call`).
        jax.errors.JaxRuntimeError: (when run, checked mode: ``COMMLIB_CHECK=1``, any number of processes) a bad
            index on some rank, carrying the spec's `bad_route_error` text of the first such rank on every
            device (rank, token, value); it costs an all_gather of the indices (``W * T * K`` ints) and a host
            callback. Unchecked, bad entries are counted in ``Routing.invalid`` and dropped.
        TypeError: indices not a jax / numpy array or not integers, capacity not an int.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:2], ("ep",))
    >>> def counts(i):
    ...     routing = route(i[0], 4, "ep", capacity=1)
    ...     return jnp.stack([routing.rows, routing.dropped, routing.invalid])[None]
    >>> f = jax.shard_map(counts, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    >>> f(jnp.array([[[0], [0], [9]], [[0], [3], [-1]]])).tolist()  # rows, dropped, invalid per rank
    [[2, 1, 1], [1, 0, 0]]
    """
    if not isinstance(indices, ARRAY_TYPES):
        raise wrong_type(spec.ROUTE_OP, "indices", indices, ARRAY_NAME)
    if layout != "padded":
        raise comm_error(
            spec.ROUTE_OP,
            f"JAX is always layout='padded' (static shapes inside jit), not {layout!r}",
            layout=layout,
        )
    axes = axes_of(axis_name)
    size = axis_size(spec.ROUTE_OP, axes)
    plan = spec.route_plan(
        indices.shape,
        dtype_name(indices.dtype),
        num_experts,
        size,
        capacity=capacity,
        capacity_factor=capacity_factor,
        experts_per_rank=experts_per_rank,
        layout=layout,
    )
    if is_checked():  # several processes: they compare the options first (commlib_jax._checked)
        exchange_layer(moe_call(spec.ROUTE_OP, plan, indices.shape, dtype_name(indices.dtype)))
    varying = to_varying(jnp.asarray(indices), axes)
    if check.says_checked(os.environ.get(check.ENV_VARIABLE)):  # bad indices raise, when the step runs
        everyone = varying[None] if size == 1 else lax.all_gather(varying, axis_arg(axes))  # [W, T, K]
        io_callback(functools.partial(_refuse_bad_indices, num_experts), None, everyone, ordered=False)
    local = traced_routing(varying, plan)
    received = local["send"] if size == 1 else all_to_all(local["send"], axes, 0, 0)
    tables = traced_tables(plan, local, received)
    return Routing(
        plan,
        axes,
        {name: tables[name] for name in _TABLE_FIELDS},
        tables["tokens_per_expert"],
        tables["rows"],
        local["dropped"],
        local["invalid"],
    )


def _refuse_bad_indices(num_experts: int, everyone: Any) -> None:
    """Host side of checked mode's index check: every rank's indices ``[W, T, K]``; the spec's `bad_route_error`
    of the first rank with a bad row (the same on every device)."""
    for rank, rows in enumerate(np.asarray(everyone)):
        found = spec.bad_route(rows, num_experts)
        if found is not None:
            raise spec.bad_route_error(rank, *found, num_experts)


def _check_routing(op_name: str, routing: object) -> Routing:
    if not isinstance(routing, Routing):
        raise kind_error(op_name, f"routing must be a commlib_jax.moe.Routing, not {type(routing).__name__}")
    return routing


def _check_float(op_name: str, name: str, x: Any) -> None:
    if not isinstance(x, ARRAY_TYPES):
        raise wrong_type(op_name, name, x, ARRAY_NAME)
    dtype = np.dtype(x.dtype)  # type: ignore[attr-defined]  # an array: checked above
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise kind_error(op_name, f"{name} must be a floating array, not {dtype}", dtype=str(dtype))


def dispatch(x: Array, routing: Routing) -> jax.Array:
    """Send each token's rows to its experts: x ``[T, *F]`` -> ``[plan.padded_rows, *F]`` expert-major (this
    rank's expert, then source rank, then (t, k)), x's dtype; rows past ``routing.rows`` are exactly 0.

    Gradient: the unweighted combine of the cotangent (`commlib.moe.dispatch_vjp`): padded rows' cotangents are
    never read; dropped and -1 routes give 0.

    Raises:
        CommError: x without T rows; in checked mode, ranks whose calls differ.
        TypeError: x not a floating jax / numpy array, routing not a `Routing`.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:2], ("ep",))
    >>> f = jax.shard_map(lambda x, i: dispatch(x[0], route(i[0], 2, "ep"))[None], mesh=mesh,
    ...                   in_specs=P("ep"), out_specs=P("ep"))
    >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])[..., None]  # rank r's tokens
    >>> f(x, jnp.array([[[1], [0]], [[1], [-1]]]))[..., 0].tolist()  # rank 1 gets 1.0 and 3.0: expert 1
    [[2.0, 0.0, 0.0, 0.0], [1.0, 3.0, 0.0, 0.0]]
    """
    routing = _check_routing(spec.DISPATCH_OP, routing)
    _check_float(spec.DISPATCH_OP, "x", x)
    plan = routing.plan
    spec.check_rows(spec.DISPATCH_OP, "x", x.shape, plan.tokens, "tokens T")
    if is_checked():
        exchange_layer(moe_call(spec.DISPATCH_OP, plan, x.shape, dtype_name(x.dtype)))
    x = to_varying(jnp.asarray(x), routing.axes)
    return _dispatch((plan, routing.axes, _accum(x.dtype, None), x.dtype.name), x, routing.tables)


def combine(
    y: Array, routing: Routing, weights: Array | None = None, *, accum_dtype: DTypeLike | None = None
) -> jax.Array:
    """Bring the experts' rows back and sum each token's top-k at its source: y ``[plan.padded_rows, *F]``
    (what `dispatch` gave, after the experts) -> ``[T, *F]``, y's dtype: ``sum_k weights[t, k] * row(t, k)`` in
    fixed k order, in `accum_dtype` (default: float32 for half inputs, else y's dtype); dropped and -1 routes
    contribute 0; y's rows past ``routing.rows`` are never read (NaN there reaches nothing).

    Gradient (`commlib.moe.combine_vjp`): ``y_bar = dispatch(weights * out_bar)`` (0 past ``routing.rows``),
    ``weights_bar[t, k] = <out_bar[t], row(t, k)>`` at the source (0 for dropped and -1 routes): the router's
    gradient, with no extra communication.

    Raises:
        CommError: y without ``plan.padded_rows`` rows, weights not ``[T, K]``; in checked mode, ranks whose
            calls differ.
        TypeError: y or weights not floating jax / numpy arrays, routing not a `Routing`.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:2], ("ep",))
    >>> def layer(x, i, w):
    ...     routing = route(i[0], 2, "ep")
    ...     y = dispatch(x[0], routing) * (1.0 + jax.lax.axis_index("ep"))  # expert e scales by e + 1
    ...     return combine(y, routing, w[0])[None]
    >>> f = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    >>> x, w = jnp.ones((2, 1, 1)), jnp.array([[[0.5, 0.5]], [[1.0, 0.0]]])
    >>> f(x, jnp.array([[[0, 1]], [[1, -1]]]), w)[..., 0].tolist()  # 0.5 * 1 + 0.5 * 2; 1.0 * 2
    [[1.5], [2.0]]
    """
    routing = _check_routing(spec.COMBINE_OP, routing)
    _check_float(spec.COMBINE_OP, "y", y)
    plan = routing.plan
    if weights is not None:
        _check_float(spec.COMBINE_OP, "weights", weights)
    spec.check_rows(spec.COMBINE_OP, "y", y.shape, plan.padded_rows, "padded rows")
    spec.check_weights(None if weights is None else weights.shape, plan)
    if is_checked():
        exchange_layer(moe_call(spec.COMBINE_OP, plan, y.shape, dtype_name(y.dtype)))
    y = to_varying(jnp.asarray(y), routing.axes)
    weights = None if weights is None else to_varying(jnp.asarray(weights), routing.axes)
    return _combine((plan, routing.axes, _accum(y.dtype, accum_dtype)), y, weights, routing.tables)
