"""Expert parallelism (MoE) in torch: `route`, `dispatch`, `combine` on one rank of a process group.

The routing walk, both layouts and the VJP rules are the spec's (`commlib.moe`): this module implements its
`MoeBackend` for this rank's tensors (`TorchMoeBackend`: an index-select with zero rows for -1, the uneven
``dist.all_to_all_single`` of rows, the fixed-order k-sum) and hands the spec's `dispatch` / `combine` /
`dispatch_vjp` / `combine_vjp` to two autograd Functions. `route` validates with `route_plan` before any
communication, sorts locally (`local_routing`), exchanges the per-expert counts once (one all_to_all that also
carries each rank's first bad index and its T, so every rank raises the same `CommError`), and builds the
spec's `RankTables` as tensors on the indices' device.

The exact layout reads the counts on the host once in `route` (the exchanged counts size the rows). The
`padded` layout builds the spec's static-shape tables on the indices' device (`commlib.moe.padded_routing` /
`commlib.moe.padded_tables`, as JAX) and the rows travel in W equal chunks of
``max(experts_per_rank) * (capacity or T)`` rows. Eager, its one host read is the flags received with the
counts (each rank's first bad row, found on the device by `commlib.moe.padded_bad_route`, and its T), so every
rank raises the same `CommError` for a bad index or a T that differs, before any row moves. Under
``torch.compile`` it reads nothing on the host: bad entries are counted in `Routing.invalid` and dropped (as
JAX inside jit), T is not compared, and route + dispatch + combine compile with
``torch.compile(fullgraph=True)``, forward and backward, with no graph break (tests/torch/test_moe.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from commlib import layer_check
from commlib import moe as spec
from commlib.errors import kind_error
from commlib_torch._checked import exchange_layer, is_checked
from commlib_torch._dtypes import dtype_name
from commlib_torch._groups import GroupArgument, ResolvedGroup, check_tensor, group_rank, resolve_group, world_size

__all__ = ["Routing", "TorchMoeBackend", "route", "dispatch", "combine"]

_HALF = (torch.float16, torch.bfloat16)  # accumulated in float32 by default
_NOT_INDICES = ("send_sizes", "recv_sizes", "tokens_per_expert")  # the tables `take` does not read


@dataclasses.dataclass(frozen=True)
class Routing:
    """What `route` gives: `tokens_per_expert` (int64 ``[this rank's experts]``: rows received per local
    expert), `rows` (valid rows
    of `dispatch`'s output), `dropped` (routes this rank dropped by capacity), `invalid` (bad entries of this
    rank's indices, dropped: the padded layout under ``torch.compile``; 0 where route raises them: the exact
    layout, the padded one eager), the spec's `plan`, this
    rank's `tables` (`commlib.moe.RankTables`, its index tables `_MaskedIndex` on the indices' device), the
    group and this rank. In the padded layout `rows`, `dropped` and `invalid` are 0-d int64 tensors on the
    indices' device (never read on the host); in the exact one, ints.

    Example:
        >>> routing = route(torch.tensor([[0], [1], [-1]]), 2)
        >>> routing.tokens_per_expert.tolist(), routing.rows, routing.dropped
        ([1, 1], 2, 0)
    """

    tokens_per_expert: torch.Tensor
    rows: int | torch.Tensor
    dropped: int | torch.Tensor
    plan: spec.RoutePlan
    tables: spec.RankTables
    group: ResolvedGroup
    rank: int
    invalid: int | torch.Tensor = 0

    @property
    def output_rows(self) -> int:
        """Rows of `dispatch`'s output (and of `combine`'s y): `rows` (exact) or ``plan.padded_rows`` (padded)."""
        return int(self.rows) if self.plan.layout == "exact" else self.plan.padded_rows


class _MaskedIndex(NamedTuple):
    """A routing table as `route` stores it on the device: `safe` (its -1 entries read row 0) and `unrouted`
    (where it holds -1; None where it holds none, which `route` knows from the host tables), so
    `TorchMoeBackend.take` makes one gather and zeroes only the unrouted rows."""

    safe: torch.Tensor
    unrouted: torch.Tensor | None


class TorchMoeBackend:
    """The spec's `commlib.moe.MoeBackend` on this rank's tensors: rows are dim 0, index -1 reads a zero row
    (the row is never read, so NaN there reaches nothing), sums accumulate in `accum_dtype` (None: the
    tensor's dtype) in fixed k order.

    Example:
        >>> backend = TorchMoeBackend(None, top_k=2)
        >>> backend.take(torch.tensor([[1.0], [2.0]]), torch.tensor([1, -1, 0])).tolist()
        [[2.0], [0.0], [1.0]]
    """

    def __init__(
        self, group: ResolvedGroup, top_k: int, accum_dtype: torch.dtype | None = None, world_size: int = 1
    ) -> None:
        self.group, self.top_k, self.accum_dtype, self.world_size = group, top_k, accum_dtype, world_size

    def _accum(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.accum_dtype is None else x.to(self.accum_dtype)

    def take(self, x: torch.Tensor, index: torch.Tensor | _MaskedIndex) -> torch.Tensor:
        if isinstance(index, _MaskedIndex):  # one gather, then the -1 rows (if any) written 0: NaN stays out
            if x.shape[0] == 0:  # nothing to read (every entry is -1)
                return x.new_zeros((*index.safe.shape, *x.shape[1:]))
            rows = x.index_select(0, index.safe.reshape(-1)).reshape(*index.safe.shape, *x.shape[1:])
            if index.unrouted is None:
                return rows
            return rows.masked_fill_(index.unrouted.reshape(*index.safe.shape, *[1] * (x.ndim - 1)), 0)
        zero = x.new_zeros((1, *x.shape[1:]))
        safe = torch.where(index < 0, x.shape[0], index).reshape(-1)
        return torch.cat([x, zero]).index_select(0, safe).reshape(*index.shape, *x.shape[1:])

    def exchange(self, x: torch.Tensor, send_sizes: Any, recv_sizes: Any) -> torch.Tensor:
        if send_sizes is None:  # the padded layout: W equal chunks (static shapes, no host sizes)
            out = x.new_empty(x.shape)
            if self.world_size == 1:
                return out.copy_(x)
            dist.all_to_all_single(out, x.contiguous(), group=self.group)
            return out
        send, recv = [int(v) for v in send_sizes], [int(v) for v in recv_sizes]
        out = x.new_empty((sum(recv), *x.shape[1:]))
        if len(send) == 1:
            return out.copy_(x)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def _scale(self, weights: torch.Tensor, ndim: int) -> torch.Tensor:
        return weights.reshape(*weights.shape, *[1] * (ndim - weights.ndim))

    def k_sum(self, rows: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        total = self._accum(rows.new_zeros((rows.shape[0], *rows.shape[2:])))
        for k in range(rows.shape[1]):  # fixed k order, no atomics
            copy = self._accum(rows[:, k])
            total = total + (copy if weights is None else self._scale(self._accum(weights[:, k]), copy.ndim) * copy)
        return total.to(rows.dtype)

    def spread(self, out_bar: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        shape = (out_bar.shape[0] * self.top_k, *out_bar.shape[1:])
        if weights is None:
            return out_bar[:, None].expand(out_bar.shape[0], self.top_k, *out_bar.shape[1:]).reshape(shape)
        copies = self._scale(self._accum(weights), out_bar.ndim + 1) * self._accum(out_bar)[:, None]
        return copies.reshape(shape).to(out_bar.dtype)

    def inner(self, out_bar: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        product = self._accum(out_bar)[:, None] * self._accum(rows)
        features = tuple(range(2, product.ndim))
        return product.sum(dim=features) if features else product


def _check_integer(indices: object) -> torch.Tensor:
    indices = check_tensor(spec.ROUTE_OP, indices, "indices")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        name = dtype_name(indices.dtype)
        raise kind_error(
            spec.ROUTE_OP,
            f"indices must be an integer array, not {name}",  # the spec's text (numpy has no bfloat16)
            shape=tuple(indices.shape),
            dtype=name,
        )
    return indices


def route(
    indices: torch.Tensor,
    num_experts: int,
    group: GroupArgument = None,
    *,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    experts_per_rank: Sequence[int] | None = None,
    layout: str = "exact",
) -> Routing:
    """Route this rank's token copies to the experts, placed in contiguous blocks over the ranks of `group`
    (None: WORLD): the spec's walk (`commlib.moe`), one counts exchange.

    `indices`: an integer tensor ``[T, K]`` in ``[-1, E)``, -1 = not routed, an expert at most once per row.
    `experts_per_rank`: W ints (None: E / W, refused when E % W != 0: pass ``split_sizes(E, W)``).
    `capacity`: most routes kept per (source rank, expert), in token-major (t, k) order; `capacity_factor` f
    gives ``ceil(T * K / E * f)``; both None: dropless. `layout`: ``"exact"`` (only valid rows) or
    ``"padded"`` (``plan.padded_rows`` rows, zero past `rows`; every rank must have the same T; `rows`,
    `dropped`, `invalid` are 0-d tensors, the tables are built on the device; eager, the one host read is the
    flags received with the counts; under ``torch.compile``, none).
    Not differentiable (indices are integers): the router's gradient flows through `combine`'s weights.

    Errors, before any communication: TypeError for indices that are not an integer tensor, the spec's
    `route_plan` errors (shape, K > E, placement, capacity, layout). After the counts exchange, on every rank
    alike: the `CommError` of the first rank with a bad row (a value >= E or < -1, an expert twice in a row;
    `commlib.moe.bad_route_error`), in both layouts; in the padded one, `commlib.moe.padded_tokens_error` where
    the ranks' T differ (before any row moves; checked mode compares T first). Under ``torch.compile`` the
    padded layout reads nothing on the host and raises neither (checked mode is eager only): bad entries are
    counted in `Routing.invalid` and dropped, as JAX inside jit, and a T that differs is not seen (with
    `capacity` the chunks do not hold T; without, the row all-to-all mismatches: gloo aborts a rank).

    Example:
        >>> routing = route(torch.tensor([[1, 0], [0, -1]]), 2)  # W = 1: both experts here
        >>> routing.tokens_per_expert.tolist(), routing.rows
        ([2, 1], 3)
        >>> padded = route(torch.tensor([[1, 0], [0, -1]]), 2, layout="padded")  # device scalars
        >>> padded.rows, padded.plan.padded_rows, padded.invalid
        (tensor(3), 4, tensor(0))
        >>> route(torch.tensor([[1, 1]]), 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        commlib.errors.CommError: route: indices[0] on rank 0 routes to expert 1 twice...
        >>> route(torch.tensor([[0], [2]]), 2, layout="padded")  # eager: raised too  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        commlib.errors.CommError: route: indices[1] on rank 0 holds expert 2, outside [-1, 2)...
    """
    indices = _check_integer(indices)
    resolved = resolve_group(spec.ROUTE_OP, group)
    world = world_size(spec.ROUTE_OP, resolved)
    plan = spec.route_plan(
        tuple(indices.shape),
        dtype_name(indices.dtype),
        num_experts,
        world,
        capacity=capacity,
        capacity_factor=capacity_factor,
        experts_per_rank=experts_per_rank,
        layout=layout,
    )
    if is_checked() and not torch.compiler.is_compiling():  # the ranks compare the options first
        exchange_layer(
            layer_check.moe_call(spec.ROUTE_OP, plan, indices.shape, dtype_name(indices.dtype)),
            (resolved,),
            indices.device,
        )
    rank = group_rank(resolved)
    if plan.layout == "padded":
        return _route_padded(indices, plan, resolved, rank)
    host = indices.detach().cpu().numpy().astype(np.int64)  # the one host read of the routing
    bad = spec.bad_route(host, num_experts)
    order, send_counts, dropped = (np.zeros(0, np.int64), np.zeros(num_experts, np.int64), 0)
    if bad is None:
        order, send_counts, dropped = spec.local_routing(host, plan)
    # one counts exchange: to each rank, the counts of its experts, then (bad flag, token, value, why, T)
    offsets, width = plan.expert_offsets, max(plan.experts_per_rank)
    message = np.zeros((world, width), dtype=np.int64)
    for destination in range(world):
        chunk = send_counts[offsets[destination] : offsets[destination + 1]]
        message[destination, : chunk.size] = chunk
    message = np.concatenate([message, _flags(bad, plan)], axis=1)
    got = _exchange_counts(torch.from_numpy(message).to(indices.device), resolved, world).cpu().numpy()
    _raise_flagged(got[:, width:], plan)
    tables = spec.rank_tables(plan, rank, order, send_counts, dropped, got[:, : plan.experts_per_rank[rank]])
    device = indices.device

    def on_device(field: str, value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            return value
        if value.ndim == 0 or field in _NOT_INDICES:
            return torch.from_numpy(np.ascontiguousarray(value)).to(device)
        unrouted = value < 0  # read on the host, where the tables are built: no device sync
        safe = torch.from_numpy(np.ascontiguousarray(np.where(unrouted, 0, value))).to(device)
        return _MaskedIndex(safe, torch.from_numpy(unrouted).to(device) if unrouted.any() else None)

    torch_tables = spec.RankTables(
        **{f.name: on_device(f.name, getattr(tables, f.name)) for f in dataclasses.fields(spec.RankTables)}
    )
    # the split sizes stay host ints (all_to_all_single takes lists)
    torch_tables = dataclasses.replace(
        torch_tables, send_sizes=tables.send_sizes.tolist(), recv_sizes=tables.recv_sizes.tolist()
    )
    return Routing(
        torch_tables.tokens_per_expert, int(tables.rows), int(tables.dropped), plan, torch_tables, resolved, rank
    )


def _flags(bad: tuple[int, int, str] | None, plan: spec.RoutePlan) -> np.ndarray:
    """The counts message's last columns, the same to every rank: (bad flag, token, value, why, T)."""
    flags = np.zeros((plan.world_size, 5), dtype=np.int64)
    if bad is not None:
        flags[:, :4] = [1, bad[0], bad[1], spec.BAD_WHY.index(bad[2])]
    flags[:, 4] = plan.tokens
    return flags


def _exchange_counts(message: torch.Tensor, group: ResolvedGroup, world: int) -> torch.Tensor:
    """The one counts exchange: row d of `message` to rank d; row s of the result from rank s."""
    received = torch.empty_like(message)
    if world == 1:
        return received.copy_(message)
    dist.all_to_all_single(received, message, group=group)
    return received


def _raise_flagged(flags: np.ndarray, plan: spec.RoutePlan) -> None:
    """Every rank raises the first bad rank's error (`_flags` of each source, on the host), and the padded
    layout's `padded_tokens_error` where T differs."""
    for source in range(plan.world_size):
        if flags[source, 0]:
            token, value, why = (int(v) for v in flags[source, 1:4])
            raise spec.bad_route_error(source, token, value, spec.BAD_WHY[why], plan.num_experts)
    if plan.layout == "padded" and len(set(flags[:, 4].tolist())) > 1:
        raise spec.padded_tokens_error(flags[:, 4].tolist())


class _TableMath:
    """`commlib.moe.TableMath` on int64 tensors of one device: the padded layout's tables, no host read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def constant(self, values: Sequence[Any]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def as_int(self, values: Any) -> torch.Tensor:
        return values.to(torch.int64)

    def arange(self, size: int) -> torch.Tensor:
        return torch.arange(size, dtype=torch.int64, device=self.device)

    def argsort(self, values: torch.Tensor) -> torch.Tensor:
        return torch.argsort(values, stable=True)

    def searchsorted(self, ordered: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(ordered, values, right=True)

    def cumsum(self, values: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.cumsum(values, dim=axis)

    def concatenate(self, arrays: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(arrays))

    def where(self, condition: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
        return torch.where(condition, a, b)

    def minimum(self, a: torch.Tensor, b: Any) -> torch.Tensor:
        return torch.clamp(a, max=b) if isinstance(b, int) else torch.minimum(a, b)

    def total(self, values: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        return (values.sum() if axis is None else values.sum(dim=axis)).to(torch.int64)

    def any(self, values: torch.Tensor, axis: int) -> torch.Tensor:
        return values.any(dim=axis)

    def scatter(self, size: int, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = torch.full((size + 1,), -1, dtype=torch.int64, device=self.device)
        return out.index_put_((index,), values.to(torch.int64))[:size]


def _masked(index: torch.Tensor) -> _MaskedIndex:
    unrouted = index < 0
    return _MaskedIndex(torch.where(unrouted, 0, index), unrouted)


def _route_padded(indices: torch.Tensor, plan: spec.RoutePlan, group: ResolvedGroup, rank: int) -> Routing:
    """The padded layout's route on the indices' device, static shapes: the spec's `padded_routing` /
    `padded_tables`, one counts exchange. Eager, the message also carries this rank's first bad row
    (`commlib.moe.padded_bad_route`, found on the device) and T, and the received flags are read on the host
    once: every rank raises the first bad rank's error, or `padded_tokens_error`, before any row moves. Under
    ``torch.compile`` nothing is read on the host: bad entries are counted in `Routing.invalid` and dropped,
    as JAX inside jit."""
    math, width, world = _TableMath(indices.device), max(plan.experts_per_rank), plan.world_size
    local = spec.padded_routing(math, indices, plan)
    eager = not torch.compiler.is_compiling()
    message = local["send"]
    if eager:  # (found, token, value, why, T) to every rank
        tokens = math.constant([plan.tokens])
        flags = torch.cat([spec.padded_bad_route(math, indices, plan), tokens]).expand(world, 5)
        message = torch.cat([message, flags], dim=1)
    received = _exchange_counts(message, group, world)
    if eager:  # the one host read: every rank sees every rank's flags
        _raise_flagged(received[:, width:].cpu().numpy(), plan)
    tables = spec.padded_tables(math, plan, local, received[:, :width])
    tables["tokens_per_expert"] = tables["tokens_per_expert"][: plan.experts_per_rank[rank]]
    fields = {
        name: value if name in _NOT_INDICES or name == "rows" else _masked(value) for name, value in tables.items()
    }
    rank_tables = spec.RankTables(**fields, dropped=local["dropped"])
    rank_tables = dataclasses.replace(rank_tables, send_sizes=None, recv_sizes=None)  # W equal chunks
    return Routing(
        tables["tokens_per_expert"], tables["rows"], local["dropped"], plan, rank_tables, group, rank, local["invalid"]
    )


def _check_routing(op_name: str, routing: object) -> Routing:
    if not isinstance(routing, Routing):
        kind = type(routing).__name__
        raise kind_error(op_name, f"routing must be a Routing (from route), not {kind}", type=kind)
    return routing


def _accum_dtype(dtype: torch.dtype, accum_dtype: torch.dtype | None) -> torch.dtype | None:
    if accum_dtype is not None:
        return accum_dtype
    return torch.float32 if dtype in _HALF else None


def _backend(routing: Routing, accum: torch.dtype | None) -> TorchMoeBackend:
    return TorchMoeBackend(routing.group, routing.plan.top_k, accum, routing.plan.world_size)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ctx.routing = routing
        backend = _backend(routing, _accum_dtype(x.dtype, None))
        return spec.dispatch(backend, x, routing.tables, routing.plan.top_k)

    @staticmethod
    def backward(ctx: Any, out_bar: torch.Tensor) -> tuple[torch.Tensor, None]:
        routing = ctx.routing
        backend = _backend(routing, _accum_dtype(out_bar.dtype, None))
        return spec.dispatch_vjp(backend, out_bar.contiguous(), routing.tables), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, weights: torch.Tensor | None, routing: Routing, accum: torch.dtype | None
    ) -> torch.Tensor:
        ctx.routing, ctx.accum, ctx.y_dtype = routing, accum, y.dtype
        backend = _backend(routing, accum)
        out, returned = spec.combine_rows(backend, y, routing.tables, weights)
        # the weights' gradient reads the rows this forward brought back: saved, not exchanged again
        ctx.save_for_backward(returned if weights is not None and ctx.needs_input_grad[1] else None, weights)
        return out

    @staticmethod
    def backward(ctx: Any, out_bar: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        returned, weights = ctx.saved_tensors
        routing = ctx.routing
        backend = _backend(routing, ctx.accum)
        y_bar, w_bar = spec.combine_vjp(
            backend, out_bar.contiguous(), None, routing.tables, weights, returned, weights_grad=returned is not None
        )
        if w_bar is not None:
            w_bar = w_bar.to(weights.dtype)
        return y_bar.to(ctx.y_dtype), w_bar, None, None


def dispatch(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Send each kept copy ``(t, k)`` of x's rows to its expert's rank: ``x [T, *F] -> [R, *F]``, x's dtype,
    expert-major (expert, then source rank, then (t, k)); R is ``routing.rows`` (exact) or
    ``routing.plan.padded_rows`` (padded: rows past `rows` are exactly 0).

    Gradient: the spec's `dispatch_vjp`, an unweighted combine of the cotangent (padded rows ignored, NaN
    included; dropped and -1 routes give 0). Errors (before communicating): TypeError for x not a tensor or
    routing not a `Routing`; the spec's `check_rows` CommError when x does not have T rows.

    Example:
        >>> routing = route(torch.tensor([[1], [0]]), 2)
        >>> dispatch(torch.tensor([[10.0], [20.0]]), routing).tolist()  # expert 0's row, then expert 1's
        [[20.0], [10.0]]
    """
    x = check_tensor(spec.DISPATCH_OP, x)
    routing = _check_routing(spec.DISPATCH_OP, routing)
    spec.check_rows(spec.DISPATCH_OP, "x", tuple(x.shape), routing.plan.tokens, "tokens T")
    if is_checked() and not torch.compiler.is_compiling():  # the ranks compare the options first
        exchange_layer(
            layer_check.moe_call(spec.DISPATCH_OP, routing.plan, x.shape, dtype_name(x.dtype)),
            (routing.group,),
            x.device,
        )
    return _Dispatch.apply(x, routing)


def combine(
    y: torch.Tensor, routing: Routing, weights: torch.Tensor | None = None, *, accum_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Bring each copy's row of ``y [R, *F]`` back to its token and sum them: ``-> [T, *F]``, y's dtype,
    ``sum_k weights[t, k] * row(t, k)`` in fixed k order at the source (weights None: 1), accumulated in
    `accum_dtype` (None: float32 for float16 / bfloat16, else y's dtype); dropped and -1 routes add 0, padded
    rows of y are never read.

    Gradient (the spec's `combine_vjp`): ``y_bar = dispatch(weights * out_bar)`` (padded rows 0),
    ``weights_bar[t, k] = <out_bar[t], row(t, k)>`` (0 for dropped and -1 routes), so the router's gradient
    reaches the weights. Errors (before communicating): TypeError for y / weights not tensors; the spec's
    `check_rows` (y's rows) and `check_weights` (weights ``[T, K]``) CommErrors.

    Example:
        >>> routing = route(torch.tensor([[1, 0]]), 2)
        >>> y = dispatch(torch.tensor([[3.0]]), routing) * torch.tensor([[1.0], [2.0]])  # expert e: (e + 1) *
        >>> combine(y, routing, torch.tensor([[0.5, 0.25]])).tolist()  # 0.5 * 6 + 0.25 * 3
        [[3.75]]
    """
    y = check_tensor(spec.COMBINE_OP, y, "y")
    routing = _check_routing(spec.COMBINE_OP, routing)
    if weights is not None:
        weights = check_tensor(spec.COMBINE_OP, weights, "weights")
    exact = routing.plan.layout == "exact"
    spec.check_rows(spec.COMBINE_OP, "y", tuple(y.shape), routing.output_rows, "rows" if exact else "padded rows")
    spec.check_weights(None if weights is None else tuple(weights.shape), routing.plan)
    if is_checked() and not torch.compiler.is_compiling():  # the ranks compare the options first
        exchange_layer(
            layer_check.moe_call(spec.COMBINE_OP, routing.plan, y.shape, dtype_name(y.dtype)),
            (routing.group,),
            y.device,
        )
    return _Combine.apply(y, weights, routing, _accum_dtype(y.dtype, accum_dtype))
