"""The ring of `commlib.context.RingPlan` walked with `jax.lax` inside ``shard_map`` / ``pmap``: one
`jax.custom_vjp` whose forward passes k/v around the ring with `permute` and merges each step's partial
attention into (out, lse), and whose backward passes dk/dv the same way, recomputing the probabilities of each
step from the saved LSE. What it saves for backward is q, k, v, out and the LSE: O(S/W) per rank.

The plan is the same on every rank; which case a rank computes at step t is ``plan.case_table[t, rank]``,
indexed with the traced ``lax.axis_index`` and dispatched by ``lax.switch`` over the plan's static cases (a
skipped case is a branch that returns its accumulators unchanged). The step math is the spec's
(`commlib.context.attend`, `merge`, `attend_vjp`, `delta`) over jax.numpy, in `RingPlan.compute_dtype`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from commlib import context
from commlib_jax._vma import axis_arg, to_varying, varying_axes
from commlib_jax._walk import rank
from commlib_jax.functional import permute

__all__ = ["ring"]

MATH = context.ArrayMath(jnp)


def ring(plan: context.RingPlan, axes: tuple, q, k, v):
    """Rank's output ``[B, rows, H, D_v]`` (q's dtype) of the ring over `axes` (a tuple of mesh axis names):
    q ``[B, rows, H, D]``, k ``[B, rows, H_kv, D]``, v ``[B, rows, H_kv, D_v]`` this rank's ring block."""
    varying = tuple(sorted(set(axes) | varying_axes(q) | varying_axes(k) | varying_axes(v), key=str))
    q, k, v = (to_varying(x, varying) for x in (q, k, v))
    return _ring(plan, axes, q, k, v)


def _send(plan: context.RingPlan, axes: tuple, *xs):
    """One ring step: every array to the next rank (`plan.perm`)."""
    return tuple(permute(x, axis_arg(axes), plan.perm) for x in xs)


def _zeros(shape, dtype, like, fill=0.0):
    """A constant typed varying as `like` (the branches of ``lax.switch`` must agree on it)."""
    return to_varying(jnp.full(shape, fill, dtype), tuple(varying_axes(like)))


def _cases(plan: context.RingPlan, axes: tuple):
    """int32 ``[W]``: this rank's case at each step (its column of the plan's table, indexed by the traced rank)."""
    return jnp.asarray(plan.case_table)[:, rank(axes)]


def _forward_case(plan: context.RingPlan, pieces, q, k, v, out, lse):
    """Merge the pieces of one case into this rank's (out, lse) (compute dtype throughout)."""
    for piece in pieces:
        rows, keys = slice(*piece.q), slice(*piece.kv)
        part = context.attend(MATH, q[:, rows], k[:, keys], v[:, keys], plan.scale, piece.mask)
        merged = context.merge(MATH, out[:, rows], lse[:, rows], *part)
        out, lse = out.at[:, rows].set(merged[0]), lse.at[:, rows].set(merged[1])
    return out, lse


def _forward(plan: context.RingPlan, axes: tuple, q, k, v):
    """(out in q's dtype, lse ``[B, rows, H]`` in the compute dtype)."""
    compute = plan.compute_dtype
    batch, rows, heads, _ = q.shape
    query = q.astype(compute)
    out = _zeros((batch, rows, heads, v.shape[-1]), compute, q)
    # lse starts at -inf: merging the first piece into it gives that piece exactly (weights exp(-inf) = 0 and
    # exp(0) = 1, logaddexp(-inf, x) = x); step 0's own block then gives every row a finite LSE.
    lse = _zeros((batch, rows, heads), compute, q, -jnp.inf)
    branches = [functools.partial(_forward_case, plan, pieces) for pieces in plan.cases]

    def attend(case, k, v, out, lse):
        return jax.lax.switch(case, branches, query, k.astype(compute), v.astype(compute), out, lse)

    def step(carry, case):  # steps 0 .. W-2: attend to the block held while passing it on
        k, v, out, lse = carry
        return (*_send(plan, axes, k, v), *attend(case, k, v, out, lse)), None

    cases = _cases(plan, axes)
    (k, v, out, lse), _ = jax.lax.scan(step, (k, v, out, lse), cases[:-1])
    out, lse = attend(cases[-1], k, v, out, lse)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(plan: context.RingPlan, axes: tuple, q, k, v):
    return _forward(plan, axes, q, k, v)[0]


def _ring_forward(plan: context.RingPlan, axes: tuple, q, k, v):
    out, lse = _forward(plan, axes, q, k, v)
    return out, (q, k, v, out, lse)


def _backward_case(plan: context.RingPlan, pieces, q, k, v, d_out, lse, delta, dq, dk, dv):
    for piece in pieces:
        rows, keys = slice(*piece.q), slice(*piece.kv)
        parts = context.attend_vjp(MATH, q[:, rows], k[:, keys], v[:, keys], d_out[:, rows], lse[:, rows],
                                   delta[:, rows], plan.scale, piece.mask)
        dq, dk, dv = dq.at[:, rows].add(parts[0]), dk.at[:, keys].add(parts[1]), dv.at[:, keys].add(parts[2])
    return dq, dk, dv


def _ring_backward(plan: context.RingPlan, axes: tuple, residuals, cotangent):
    q, k, v, out, lse = residuals
    compute = plan.compute_dtype
    query, d_out = q.astype(compute), cotangent.astype(compute)
    delta = context.delta(MATH, out.astype(compute), d_out)
    dq, dk, dv = (_zeros(x.shape, compute, q) for x in (q, k, v))
    branches = [functools.partial(_backward_case, plan, pieces) for pieces in plan.cases]

    def attend(case, k, v, dq, dk, dv):
        return jax.lax.switch(case, branches, query, k.astype(compute), v.astype(compute), d_out, lse, delta, dq,
                              dk, dv)

    def step(carry, case):  # steps 0 .. W-2: dk/dv travel with the k/v block they belong to
        k, v, dq, dk, dv = carry
        dq, dk, dv = attend(case, k, v, dq, dk, dv)
        return (*_send(plan, axes, k, v), dq, *_send(plan, axes, dk, dv)), None

    cases = _cases(plan, axes)
    (k, v, dq, dk, dv), _ = jax.lax.scan(step, (k, v, dq, dk, dv), cases[:-1])
    dq, dk, dv = attend(cases[-1], k, v, dq, dk, dv)
    dk, dv = _send(plan, axes, dk, dv)  # the last hop brings them home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_forward, _ring_backward)
