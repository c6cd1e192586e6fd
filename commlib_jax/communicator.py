"""`Communicator(axis_name)`: the methods of `commlib_torch.DeviceCommunicator`, bound to a mesh axis.

Use it inside `jax.shard_map` / `jax.pmap` over `axis_name`. SPMD runs one program on every rank, so two
methods differ from the torch class: `gather` returns zeros (not None) off `dst`, and one-sided
`send` / `recv` do not exist -- `permute` (``lax.ppermute``) is the point-to-point op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import jax
from jax.typing import DTypeLike

from commlib import ReduceOp
from commlib_jax import functional
from commlib_jax._op import axis_size
from commlib_jax._vma import axes_of
from commlib_jax.functional import Array, AxisName, ReduceOpArgument, Sizes

__all__ = ["Communicator"]


class Communicator:
    """Collectives over `axis_name` (a mesh axis name or a tuple of them), with exact gradients.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(jax.devices()[:4], ("x",))  # W = 4
        >>> comm = Communicator("x")
        >>> f = jax.shard_map(lambda x: comm.all_reduce(x, "max") + comm.world_size, mesh=mesh, in_specs=P("x"),
        ...                   out_specs=P("x"))
        >>> f(jnp.arange(4.0))  # rank r holds [r]
        Array([7., 7., 7., 7.], dtype=float32)
    """

    def __init__(self, axis_name: AxisName, unique_name: str = "") -> None:
        self.axis_name = axis_name
        self.unique_name = unique_name

    @property
    def world_size(self) -> int:
        """Ranks along the axis (only inside shard_map / pmap; elsewhere the spec's CommError)."""
        return axis_size("world_size", axes_of(self.axis_name))

    def all_reduce(
        self,
        input_: Array,
        op: ReduceOpArgument | None = ReduceOp.SUM,
        *,
        convention: str = "sum",
        accum_dtype: DTypeLike | None = None,
    ) -> jax.Array:
        """See `commlib_jax.all_reduce` (op None means sum, as in the torch class)."""
        op = ReduceOp.SUM if op is None else op
        return functional.all_reduce(input_, self.axis_name, op, convention=convention, accum_dtype=accum_dtype)

    def all_gather(self, input_: Array, dim: int = -1, *, convention: str = "sum", sizes: Sizes = None) -> jax.Array:
        """See `commlib_jax.all_gather`."""
        return functional.all_gather(input_, self.axis_name, dim, convention=convention, sizes=sizes)

    def reduce_scatter(
        self,
        input_: Array,
        dim: int = 0,
        op: ReduceOpArgument = ReduceOp.SUM,
        *,
        accum_dtype: DTypeLike | None = None,
        sizes: Sizes = None,
    ) -> jax.Array:
        """See `commlib_jax.reduce_scatter`."""
        return functional.reduce_scatter(input_, self.axis_name, dim, op, accum_dtype=accum_dtype, sizes=sizes)

    def all_to_all(
        self,
        input_: Array,
        scatter_dim: int,
        gather_dim: int,
        *,
        scatter_sizes: Sizes = None,
        gather_sizes: Sizes = None,
    ) -> jax.Array:
        """See `commlib_jax.all_to_all`."""
        return functional.all_to_all(
            input_, self.axis_name, scatter_dim, gather_dim, scatter_sizes=scatter_sizes, gather_sizes=gather_sizes
        )

    def all_to_all_4D(
        self,
        input_: Array,
        scatter_dim: int = 2,
        gather_dim: int = 1,
        *,
        scatter_sizes: Sizes = None,
        gather_sizes: Sizes = None,
    ) -> jax.Array:
        """Ulysses all-to-all ``[B, S/W, H, D] <-> [B, S, H/W, D]``; see `commlib_jax.all_to_all_4d`."""
        return functional.all_to_all_4d(
            input_, self.axis_name, scatter_dim, gather_dim, scatter_sizes=scatter_sizes, gather_sizes=gather_sizes
        )

    def broadcast(self, input_: Array, src: int = 0) -> jax.Array:
        """See `commlib_jax.broadcast`."""
        return functional.broadcast(input_, self.axis_name, src)

    def gather(self, input_: Array, dst: int = 0, dim: int = -1) -> jax.Array:
        """The concatenation along `dim` on rank `dst`, zeros elsewhere; see `commlib_jax.gather`."""
        return functional.gather(input_, self.axis_name, dst, dim)

    def scatter(self, input_: Array, src: int = 0, dim: int = 0, *, sizes: Sizes = None) -> jax.Array:
        """See `commlib_jax.scatter`."""
        return functional.scatter(input_, self.axis_name, src, dim, sizes=sizes)

    def permute(self, input_: Array, perm: Sequence[tuple[int, int]]) -> jax.Array:
        """See `commlib_jax.permute`."""
        return functional.permute(input_, self.axis_name, perm)

    def sum_grad(self, input_: Array) -> jax.Array:
        """See `commlib_jax.sum_grad`."""
        return functional.sum_grad(input_, self.axis_name)

    def slice(self, input_: Array, dim: int = -1, *, scale_grad: bool = False) -> jax.Array:
        """This rank's block of the replicated `input_` along `dim` (FastVideo's ``slice``); see
        `commlib_jax.shard`."""
        return functional.shard(input_, self.axis_name, dim, scale_grad=scale_grad)

    def reduce(self, input_: Array, dst: int = 0, op: ReduceOpArgument = ReduceOp.SUM) -> jax.Array:
        """The reduction on rank `dst`, zeros elsewhere; see `commlib_jax.reduce`."""
        return functional.reduce(input_, self.axis_name, dst, op)

    def send(self, tensor: object, dst: int | None = None) -> NoReturn:
        """Not available in SPMD: every rank runs the same program. Use `permute`."""
        raise NotImplementedError("Communicator.send: SPMD has no one-sided send; use permute(x, [(src, dst)])")

    def recv(self, size: object, dtype: object, src: int | None = None) -> NoReturn:
        """Not available in SPMD: every rank runs the same program. Use `permute`."""
        raise NotImplementedError("Communicator.recv: SPMD has no one-sided recv; use permute(x, [(src, dst)])")

    def destroy(self) -> None:
        """Nothing to release."""
