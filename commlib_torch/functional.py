"""Differentiable collectives over `torch.distributed` (gloo on CPU, NCCL on CUDA).

Each public function asks the spec for the call's plan (`commlib.plans`, which raises `CommError` /
`TypeError` before any communication), then applies `commlib_torch._op.PlanFunction`, the one autograd Function: its
forward walks the plan (`commlib.gradients.forward`), its backward applies the spec's VJP rule
(`commlib.gradients.vjp`) with collectives that are `PlanFunction`s again, so every higher derivative follows the same
rules. Where the op is the
identity (world size 1) it returns its input itself, with no communication.

``group``: the `torch.distributed.ProcessGroup` the collective runs over, ``None`` for the default (WORLD)
group, a 1-D `DeviceMesh`, or ``(mesh, dim)`` with `dim` one of the mesh's dim names (or an index): the group of
that mesh dim, as ``init_device_mesh("cpu", (sp, tp), mesh_dim_names=("sp", "tp"))`` builds them (a mesh that
is not 1-D needs the dim: `CommError`). W is the group's size and every rank argument (`src`, `dst`, `perm`) is
a group-local rank in [0, W).
Gradients follow ``convention="sum"`` (each rank's loss is its own, the objective is their sum) unless
``convention="replicated"`` is given where the op accepts it; see docs/gradients.md.

Every op raises ``TypeError`` when `x` is not a tensor or `group` none of the kinds above, and `CommError` on a
rank outside `group` or a mesh dim the mesh lacks, all before any communication. A dtype the group's backend
lacks (gloo: int16, uint16/32/64, float8, ...) travels in a wire dtype the spec picks (`commlib.dtypes.wire_dtypes`:
a same-size bit view for data movement, a wider integer for integer reductions) or is refused with a `CommError`
where no wire dtype is exact (docs/ops.md).

Uneven sizes (``sizes=``, ``scatter_sizes=``, ``gather_sizes=``; `commlib.split_sizes` gives the balanced
split) are held exactly: rank r's tensor has ``sizes[r]`` rows along the sharded dim, and nothing is padded on
the wire (`commlib.uneven`).

``async_op=True`` (all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_4d, permute): the same
validation, then the collective started and a `commlib_torch.Handle` returned whose ``wait()`` gives the
result, bit for bit the synchronous call's, differentiable; its backward starts the dual collective when the
cotangent arrives and waits for it where x's gradient is needed (`commlib_torch.handle`; docs/ops.md,
"async_op").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch
import torch.distributed as dist

from commlib import ReduceOp, plan_cache, plans
from commlib_torch._dtypes import dtype_name
from commlib_torch._groups import GroupArgument, ResolvedGroup, group_rank
from commlib_torch._op import apply, at_boundary, plan_inputs
from commlib_torch._walk import run
from commlib_torch.handle import Handle, start

#: What ``op=`` takes: a name ("sum", "avg", "max", "min", "product"), a `commlib.ReduceOp` or its torch twin.
ReduceOpArgument = str | ReduceOp | dist.ReduceOp | dist.ReduceOp.RedOpType
#: What ``accum_dtype=`` takes: a torch dtype or its name; None: x's dtype.
DtypeArgument = torch.dtype | str | None
#: Uneven sizes: W ints (rank r's rows along the sharded dim); None: the even rule.
Sizes = Sequence[int] | None
#: What an op with ``async_op=`` returns: the tensor, or (``async_op=True``) a `Handle` of it.
Result = torch.Tensor | Handle

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_4d",
    "broadcast",
    "gather",
    "scatter",
    "permute",
    "sum_grad",
    "shard",
    "reduce",
]


@overload
def all_reduce(
    x: torch.Tensor,
    op: ReduceOpArgument = ...,
    group: GroupArgument = ...,
    *,
    convention: str = ...,
    accum_dtype: DtypeArgument = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def all_reduce(
    x: torch.Tensor,
    op: ReduceOpArgument = ...,
    group: GroupArgument = ...,
    *,
    convention: str = ...,
    accum_dtype: DtypeArgument = ...,
    async_op: Literal[True],
) -> Handle: ...
@overload
def all_reduce(
    x: torch.Tensor,
    op: ReduceOpArgument = ...,
    group: GroupArgument = ...,
    *,
    convention: str = ...,
    accum_dtype: DtypeArgument = ...,
    async_op: bool,
) -> Result: ...
def all_reduce(
    x: torch.Tensor,
    op: ReduceOpArgument = "sum",
    group: GroupArgument = None,
    *,
    convention: str = "sum",
    accum_dtype: DtypeArgument = None,
    async_op: bool = False,
) -> Result:
    """Reduce `x` over the ranks of `group`; every rank gets the result: ``[*s] -> [*s]``, x's dtype.

    Args:
        x: any shape and strides; floating (differentiable), integer or bool (forward only).
        op: "sum" | "avg" (= sum / W; float16/bfloat16 scale by 1/W before the sum, so an average whose
            sum overflows does not) | "max" | "min" | "product"; a `commlib.ReduceOp` or
            `torch.distributed.ReduceOp` works too. A NaN on any rank makes max/min NaN (as numpy).
        group: the process group (None: WORLD), a 1-D DeviceMesh or ``(mesh, dim_name)``.
        convention: "sum" or "replicated" (the code after the op is replicated: Megatron's g).
        accum_dtype: e.g. ``torch.float32`` for bf16 input: reduce in that dtype (forward and backward),
            return x's dtype.
        async_op: True: start the collective and return a `commlib_torch.Handle` whose ``wait()`` gives the
            result (max / min / product: run at once, a completed Handle).

    Gradient: let g be all_reduce(sum) of the cotangents ("sum") or this rank's own cotangent
    ("replicated"). sum: g; avg: g / W; max/min: g on the rank(s) holding the result, split equally among
    ties (NaN results: among the ranks holding a NaN); product: g times the other ranks' product.

    Raises:
        CommError: unknown op, avg on an integer dtype, sum of bools, max/min/product of complex,
            accum_dtype not floating or narrower than x. TypeError: wrong kinds.

    Example:
        >>> import torch.distributed as dist
        >>> dist.get_world_size()  # these examples run on a WORLD of one rank: W = 1
        1
        >>> all_reduce(torch.tensor([1.0, 2.0]))  # the sum over the one rank
        tensor([1., 2.])
        >>> all_reduce(torch.tensor([1, 5]), op="max")
        tensor([1, 5])
        >>> handle = all_reduce(torch.tensor([1.0, 2.0]), async_op=True)  # started; overlap other work here
        >>> handle.wait()
        tensor([1., 2.])
        >>> all_reduce([1.0, 2.0])
        Traceback (most recent call last):
        ...
        TypeError: all_reduce: x must be a torch.Tensor, not list. Received: type='list'
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("all_reduce", x, group)
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = plans.all_reduce(
        x.shape, size, op, dtype=dtype, backend_dtypes=backend_dtypes, convention=convention, accum_dtype=accum
    )
    return apply(plan, x, group) if async_op is False else start(plan, x, group, async_op)


@overload
def all_gather(
    x: torch.Tensor,
    dim: int = ...,
    group: GroupArgument = ...,
    *,
    convention: str = ...,
    sizes: Sizes = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def all_gather(
    x: torch.Tensor,
    dim: int = ...,
    group: GroupArgument = ...,
    *,
    convention: str = ...,
    sizes: Sizes = ...,
    async_op: Literal[True],
) -> Handle: ...
@overload
def all_gather(
    x: torch.Tensor,
    dim: int = ...,
    group: GroupArgument = ...,
    *,
    convention: str = ...,
    sizes: Sizes = ...,
    async_op: bool,
) -> Result: ...
def all_gather(
    x: torch.Tensor,
    dim: int = -1,
    group: GroupArgument = None,
    *,
    convention: str = "sum",
    sizes: Sizes = None,
    async_op: bool = False,
) -> Result:
    """Concatenate every rank's `x` along `dim` in rank order: ``shape[dim] *= W``, x's dtype.

    `group`: the process group (None: WORLD). `sizes` (uneven): W ints, rank r's `x` has ``sizes[r]`` rows
    along `dim`, the output ``sum(sizes)``. Gradient: "sum" -> reduce_scatter(sum) of the cotangent along
    `dim` (with the same `sizes`); "replicated" -> this rank's block of the cotangent (Megatron's gather).
    Identity: ``reduce_scatter(all_gather(x)) == W * x``. `async_op`: True: started, a `commlib_torch.Handle`
    returned (``wait()`` gives the result).

    Raises:
        CommError: `dim` out of range, unknown convention; `sizes` not W ints >= 0, or
            ``x.shape[dim] != sizes[rank]``.

    Example:
        >>> all_gather(torch.ones(2, 3), dim=0).shape  # shape[dim] *= W
        torch.Size([2, 3])
        >>> all_gather(torch.ones(2, 3), dim=0, async_op=True).wait().shape
        torch.Size([2, 3])
        >>> all_gather(torch.ones(2), dim=1)
        Traceback (most recent call last):
        ...
        commlib.errors.CommError: all_gather: dim (1) must be in [-1, 1) for ndim 1. Received: shape=(2,), dim=1
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("all_gather", x, group)
    plan = plans.all_gather(
        x.shape,
        size,
        dim,
        dtype=dtype,
        backend_dtypes=backend_dtypes,
        convention=convention,
        sizes=sizes,
        rank=None if sizes is None else group_rank(group),
    )
    return apply(plan, x, group) if async_op is False else start(plan, x, group, async_op)


@overload
def reduce_scatter(
    x: torch.Tensor,
    dim: int = ...,
    op: ReduceOpArgument = ...,
    group: GroupArgument = ...,
    *,
    accum_dtype: DtypeArgument = ...,
    sizes: Sizes = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def reduce_scatter(
    x: torch.Tensor,
    dim: int = ...,
    op: ReduceOpArgument = ...,
    group: GroupArgument = ...,
    *,
    accum_dtype: DtypeArgument = ...,
    sizes: Sizes = ...,
    async_op: Literal[True],
) -> Handle: ...
@overload
def reduce_scatter(
    x: torch.Tensor,
    dim: int = ...,
    op: ReduceOpArgument = ...,
    group: GroupArgument = ...,
    *,
    accum_dtype: DtypeArgument = ...,
    sizes: Sizes = ...,
    async_op: bool,
) -> Result: ...
def reduce_scatter(
    x: torch.Tensor,
    dim: int = 0,
    op: ReduceOpArgument = "sum",
    group: GroupArgument = None,
    *,
    accum_dtype: DtypeArgument = None,
    sizes: Sizes = None,
    async_op: bool = False,
) -> Result:
    """Reduce over the ranks of `group` (None: WORLD) and keep block `rank` of `dim`: ``shape[dim] /= W``;
    op in {"sum", "avg"}; x's dtype (`accum_dtype` as in `all_reduce`). `sizes` (uneven): rank r keeps
    ``sizes[r]`` rows (``sum(sizes) == shape[dim]``); the reduction runs as one all_to_all_single and a sum.

    Same value as ``all_reduce(x, op).chunk(W, dim)[rank]``. Gradient: all_gather of the cotangent along
    `dim` (divided by W for avg; with the same `sizes`). `async_op`: True: started, a `commlib_torch.Handle`
    returned (``wait()`` gives the result).

    Raises:
        CommError: ``shape[dim]`` not divisible by W (no `sizes`) or not ``sum(sizes)``, op not sum/avg, avg on
            integers, `sizes` not W ints >= 0.

    Example:
        >>> reduce_scatter(torch.arange(4.0), op="avg")  # shape[0] /= W
        tensor([0., 1., 2., 3.])
        >>> reduce_scatter(torch.arange(4.0), async_op=True).wait()
        tensor([0., 1., 2., 3.])
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("reduce_scatter", x, group)
    accum = None if accum_dtype is None else dtype_name(accum_dtype)
    plan = plans.reduce_scatter(
        x.shape,
        size,
        dim,
        op,
        dtype=dtype,
        backend_dtypes=backend_dtypes,
        accum_dtype=accum,
        sizes=sizes,
        rank=None if sizes is None else group_rank(group),
    )
    return apply(plan, x, group) if async_op is False else start(plan, x, group, async_op)


@overload
def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: GroupArgument = ...,
    *,
    scatter_sizes: Sizes = ...,
    gather_sizes: Sizes = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: GroupArgument = ...,
    *,
    scatter_sizes: Sizes = ...,
    gather_sizes: Sizes = ...,
    async_op: Literal[True],
) -> Handle: ...
@overload
def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: GroupArgument = ...,
    *,
    scatter_sizes: Sizes = ...,
    gather_sizes: Sizes = ...,
    async_op: bool,
) -> Result: ...
def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: GroupArgument = None,
    *,
    scatter_sizes: Sizes = None,
    gather_sizes: Sizes = None,
    async_op: bool = False,
) -> Result:
    """Block j of `scatter_dim` goes to rank j of `group` (None: WORLD); the received blocks are concatenated
    along `gather_dim` in rank order: ``shape[scatter_dim] /= W``, ``shape[gather_dim] *= W``, any ndim,
    x's dtype (``lax.all_to_all(..., tiled=True)``). ``scatter_dim == gather_dim`` keeps the shape: block s
    of rank r's dim goes to rank s, at position r (``dist.all_to_all_single`` on that dim; no local pass on 0).

    Uneven: rank r receives ``scatter_sizes[r]`` rows of `scatter_dim` (``sum == shape[scatter_dim]``) and
    contributes ``gather_sizes[r]`` rows of `gather_dim` (x has ``gather_sizes[rank]``); the output has
    ``scatter_sizes[rank]`` and ``sum(gather_sizes)`` rows. One all_to_all_single with split sizes.

    One local pass before and one after the collective at most, none where the layout allows a view.
    Gradient: all_to_all of the cotangent with the dims (and the sizes) swapped (for equal dims: the same op).
    `async_op`: True: started, a `commlib_torch.Handle` returned (``wait()`` runs the unpack pass and gives the
    result; the backward's all_to_all starts when the cotangent arrives).

    Raises:
        CommError: dims out of range (or equal, with sizes), ``shape[scatter_dim]`` not divisible by W (no
            scatter_sizes) or not ``sum(scatter_sizes)``, ``shape[gather_dim] != gather_sizes[rank]``, sizes not
            W ints >= 0.

    Example:
        >>> all_to_all(torch.ones(4, 6), scatter_dim=0, gather_dim=1).shape  # [4 / W, 6 * W]
        torch.Size([4, 6])
        >>> all_to_all(torch.ones(4, 6), 0, 1, async_op=True).wait().shape
        torch.Size([4, 6])
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("all_to_all", x, group)
    plan = plans.all_to_all(
        x.shape,
        size,
        scatter_dim,
        gather_dim,
        dtype=dtype,
        backend_dtypes=backend_dtypes,
        scatter_sizes=scatter_sizes,
        gather_sizes=gather_sizes,
        rank=None if scatter_sizes is None and gather_sizes is None else group_rank(group),
    )
    return apply(plan, x, group) if async_op is False else start(plan, x, group, async_op)


@overload
def all_to_all_4d(
    x: torch.Tensor,
    scatter_dim: int = ...,
    gather_dim: int = ...,
    group: GroupArgument = ...,
    *,
    scatter_sizes: Sizes = ...,
    gather_sizes: Sizes = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def all_to_all_4d(
    x: torch.Tensor,
    scatter_dim: int = ...,
    gather_dim: int = ...,
    group: GroupArgument = ...,
    *,
    scatter_sizes: Sizes = ...,
    gather_sizes: Sizes = ...,
    async_op: Literal[True],
) -> Handle: ...
@overload
def all_to_all_4d(
    x: torch.Tensor,
    scatter_dim: int = ...,
    gather_dim: int = ...,
    group: GroupArgument = ...,
    *,
    scatter_sizes: Sizes = ...,
    gather_sizes: Sizes = ...,
    async_op: bool,
) -> Result: ...
def all_to_all_4d(
    x: torch.Tensor,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    group: GroupArgument = None,
    *,
    scatter_sizes: Sizes = None,
    gather_sizes: Sizes = None,
    async_op: bool = False,
) -> Result:
    """Ulysses all-to-all on ``[batch, seq, heads, head_dim]`` over `group` (None: WORLD), x's dtype.

    ``(2, 1)``: ``[B, S/W, H, D] -> [B, S, H/W, D]``; ``(1, 2)``: ``[B, S, H/W, D] -> [B, S/W, H, D]``.
    Uneven (any S, any H): ``(2, 1)`` is ``[B, S_r, H, D] -> [B, S, H_r, D]`` with
    ``gather_sizes=(S_0, ..., S_{W-1})``, ``scatter_sizes=(H_0, ...)`` (e.g. ``commlib.split_sizes(S, W)``);
    ``(1, 2)`` the reverse with the two swapped. Gradient: the other direction. At batch 1 one of the two local
    passes is a view. `async_op`: True: started, a `commlib_torch.Handle` returned (``wait()`` gives the result:
    Ulysses' all-to-all behind other work, e.g. another head group's attention).

    Raises:
        CommError: ndim != 4, other dim pairs, heads (or seq) not divisible by W (without sizes), sizes not W
            ints >= 0, a sum that is not the whole dim, a sharded dim that is not ``gather_sizes[rank]``.

    Example:
        >>> x = torch.randn(2, 8, 4, 16)  # [B, S / W, H, D]
        >>> all_to_all_4d(x, scatter_dim=2, gather_dim=1).shape  # [B, S, H / W, D]
        torch.Size([2, 8, 4, 16])
        >>> handle = all_to_all_4d(x, async_op=True)  # started
        >>> torch.equal(handle.wait(), all_to_all_4d(x))
        True
        >>> all_to_all_4d(torch.ones(2, 8, 4))
        Traceback (most recent call last):
        ...
        commlib.errors.CommError: all_to_all_4d: ndim (3) must be 4 ([batch, seq, heads, head_dim]). Received: ...
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("all_to_all_4d", x, group)
    plan = plans.all_to_all_4d(
        x.shape,
        size,
        scatter_dim,
        gather_dim,
        dtype=dtype,
        backend_dtypes=backend_dtypes,
        scatter_sizes=scatter_sizes,
        gather_sizes=gather_sizes,
        rank=None if scatter_sizes is None and gather_sizes is None else group_rank(group),
    )
    return apply(plan, x, group) if async_op is False else start(plan, x, group, async_op)


def broadcast(x: torch.Tensor, src: int = 0, group: GroupArgument = None) -> torch.Tensor:
    """Every rank of `group` (None: WORLD) gets group rank `src`'s `x`: ``[*s] -> [*s]``, x's dtype.

    Gradient: the cotangents summed on `src`, zeros elsewhere.

    Raises:
        CommError: `src` not in [0, W).

    Example:
        >>> broadcast(torch.tensor([5.0]), src=0)
        tensor([5.])
        >>> broadcast(torch.tensor([5.0]), src=1)
        Traceback (most recent call last):
        ...
        commlib.errors.CommError: broadcast: src (1) must be in [0, 1) for world_size 1. Received: shape=(1,), src=1
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("broadcast", x, group)
    return apply(plans.broadcast(x.shape, size, src, dtype=dtype, backend_dtypes=backend_dtypes), x, group)


def gather(
    x: torch.Tensor, dst: int = 0, dim: int = -1, group: GroupArgument = None, *, sizes: Sizes = None
) -> torch.Tensor:
    """Group rank `dst` gets every rank's `x` concatenated along `dim` (``shape[dim] *= W``); the other ranks
    of `group` (None: WORLD) get zeros of that shape, so every rank can run backward. x's dtype. `sizes`
    (uneven): as in `all_gather` (one all_to_all_single to `dst`).

    Gradient: scatter of `dst`'s cotangent.

    Raises:
        CommError: `dst` not in [0, W), `dim` out of range, `sizes` not W ints >= 0 or not matching x.

    Example:
        >>> gather(torch.ones(2), dst=0)  # rank dst: every rank's x, concatenated
        tensor([1., 1.])
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("gather", x, group)
    plan = plans.gather(
        x.shape,
        size,
        dst,
        dim,
        dtype=dtype,
        backend_dtypes=backend_dtypes,
        sizes=sizes,
        rank=None if sizes is None else group_rank(group),
    )
    return apply(plan, x, group)


def scatter(
    x: torch.Tensor, src: int = 0, dim: int = 0, group: GroupArgument = None, *, sizes: Sizes = None
) -> torch.Tensor:
    """Rank r of `group` (None: WORLD) gets block r of group rank `src`'s `x` along `dim`
    (``shape[dim] /= W``); the other ranks' `x` is not read (its gradient is zero). x's dtype. `sizes`
    (uneven): rank r gets ``sizes[r]`` rows (``sum(sizes) == shape[dim]``).

    Gradient: gather of the cotangents to `src`.

    Raises:
        CommError: `src` not in [0, W), `dim` out of range, ``shape[dim]`` not divisible by W (no `sizes`) or not
            ``sum(sizes)``.

    Example:
        >>> scatter(torch.arange(3.0), src=0)  # rank r: block r of src's x
        tensor([0., 1., 2.])
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("scatter", x, group)
    plan = plans.scatter(
        x.shape,
        size,
        src,
        dim,
        dtype=dtype,
        backend_dtypes=backend_dtypes,
        sizes=sizes,
        rank=None if sizes is None else group_rank(group),
    )
    return apply(plan, x, group)


@overload
def permute(
    x: torch.Tensor, perm: Sequence[tuple[int, int]], group: GroupArgument = ..., *, async_op: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def permute(
    x: torch.Tensor, perm: Sequence[tuple[int, int]], group: GroupArgument = ..., *, async_op: Literal[True]
) -> Handle: ...
@overload
def permute(
    x: torch.Tensor, perm: Sequence[tuple[int, int]], group: GroupArgument = ..., *, async_op: bool
) -> Result: ...
def permute(
    x: torch.Tensor, perm: Sequence[tuple[int, int]], group: GroupArgument = None, *, async_op: bool = False
) -> Result:
    """For each ``(src, dst)`` in `perm` (group ranks of `group`, None: WORLD), rank dst gets rank src's `x`
    (``lax.ppermute`` semantics); a rank that is no destination gets zeros. ``[*s] -> [*s]``, x's dtype.

    Gradient: the inverse permutation of the cotangents. `async_op`: True: started, a `commlib_torch.Handle`
    returned (``wait()`` gives the result).

    Raises:
        CommError: a rank out of range, a repeated source or destination. TypeError: `perm` not pairs.

    Example:
        >>> permute(torch.tensor([7.0]), [(0, 0)])  # (src, dst) pairs
        tensor([7.])
        >>> permute(torch.tensor([7.0]), [(0, 0)], async_op=True).wait()
        tensor([7.])
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("permute", x, group)
    plan = plans.permute(x.shape, size, plan_cache.pairs(perm), dtype=dtype, backend_dtypes=backend_dtypes)
    return apply(plan, x, group) if async_op is False else start(plan, x, group, async_op)


def sum_grad(x: torch.Tensor, group: GroupArgument = None) -> torch.Tensor:
    """Identity forward; backward all_reduce(sum) of the cotangent over `group` (None: WORLD): Megatron's f,
    the conjugate of ``all_reduce(..., convention="replicated")``; JAX's ``pcast(x, to="varying")``. The output
    is x itself to autograd (no copy, as Megatron's f): autograd refuses to modify it in place (RuntimeError);
    every other op's output is a tensor of its own at world size 2 and more (docs/ops.md, "Layout").

    Raises:
        CommError / TypeError: only for a malformed shape or world size (never for a tensor).

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> y = sum_grad(x)
        >>> y is x  # the identity forward: x itself
        True
        >>> (2 * y).sum().backward()
        >>> x.grad  # the cotangents summed over the W ranks
        tensor([2., 2., 2.])
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("sum_grad", x, group)
    return apply(plans.sum_grad(x.shape, size, dtype=dtype, backend_dtypes=backend_dtypes), x, group)


def shard(x: torch.Tensor, dim: int = -1, group: GroupArgument = None, *, scale_grad: bool = False) -> torch.Tensor:
    """Rank r of `group` (None: WORLD) keeps block r of its replicated `x` along `dim`: ``shape[dim] /= W``
    (``[B, S, H, D] -> [B, S/W, H, D]`` on dim 1), x's dtype; no communication forward (Megatron's split,
    FastVideo's ``slice``); a fresh tensor. Gradient: all_gather of the cotangents along `dim` (every rank
    gets the gradient of the one replicated x), / W when `scale_grad`; the conjugate of
    ``all_gather(..., convention="replicated")``.

    Raises:
        CommError: `dim` out of range, ``shape[dim]`` not divisible by W. TypeError: `scale_grad` not a bool.

    Example:
        >>> shard(torch.arange(4.0))  # rank r keeps block r of dim -1
        tensor([0., 1., 2., 3.])
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("shard", x, group)
    plan = plans.shard(x.shape, size, dim, scale_grad=scale_grad, dtype=dtype, backend_dtypes=backend_dtypes)
    return apply(plan, x, group)


def reduce(x: torch.Tensor, dst: int = 0, op: ReduceOpArgument = "sum", group: GroupArgument = None) -> torch.Tensor:
    """Group rank `dst` gets the reduction of every rank's `x` over `group` (None: WORLD); the other ranks get
    zeros, so every rank can run backward. ``[*s] -> [*s]``, x's dtype. op in {"sum", "avg"} (avg = sum / W,
    half precision scaled before the sum as in `all_reduce`; a string, `commlib.ReduceOp` or its torch twin).

    Gradient: broadcast of `dst`'s cotangent (/ W for avg); the other ranks' cotangents are unused.

    Raises:
        CommError: `dst` not in [0, W), op not sum/avg, avg on integers, sum of bools.

    Example:
        >>> reduce(torch.tensor([1.0, 2.0]), dst=0)
        tensor([1., 2.])
        >>> reduce(torch.ones(2), op="max")
        Traceback (most recent call last):
        ...
        commlib.errors.CommError: reduce: op ('max') must be one of sum, avg. Received: shape=(2,), dst=0, op='max'
    """
    x, group, size, dtype, backend_dtypes = plan_inputs("reduce", x, group)
    return apply(plans.reduce(x.shape, size, dst, op, dtype=dtype, backend_dtypes=backend_dtypes), x, group)


def gather_to_root(x: torch.Tensor, dst: int, dim: int, group: ResolvedGroup) -> torch.Tensor | None:
    """Forward-only gather (the seed's semantics): the concatenation on `dst`, None on other ranks."""
    x, group, size, dtype, backend_dtypes = plan_inputs("gather", x, group)
    plan = plans.gather(x.shape, size, dst, dim, dtype=dtype, backend_dtypes=backend_dtypes)
    with torch.no_grad():
        if plan.is_trivial:
            out = x.detach().clone(memory_format=torch.contiguous_format)
        else:  # checked mode's exchange and the failure translation, as every collective
            out = at_boundary(run, plan, x, group, None)
    return out if group_rank(group) == plan.step.root else None  # type: ignore[union-attr]  # a Gather step
