"""`DeviceCommunicator`: the seed's class (FastVideo / vLLM API) on commlib's differentiable plans.

Same constructor and methods as the seed, with its flaws fixed: validation before communication, exact
gradients, one local pass per side of an all-to-all, and `cpu_group` used when `device_group` is None.
All rank arguments (`dst`, `src`) are group-local.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from commlib import frontend_errors, plans
from commlib.layout import Plan
from commlib_torch import functional
from commlib_torch._checked import exchange_pair, is_checked
from commlib_torch._dtypes import dtype_name
from commlib_torch._groups import GroupArgument, backend_dtypes, check_tensor, global_rank, resolve_group, world_size
from commlib_torch.functional import DtypeArgument, ReduceOpArgument, Sizes

__all__ = ["DeviceCommunicator"]


class DeviceCommunicator:
    """Collectives bound to one group, with autograd support.

    Args:
        cpu_group: a process group (gloo) over the participating ranks, or a 1-D DeviceMesh, or
            ``(mesh, dim_name)`` (the group of that mesh dim).
        device: where `recv` allocates; defaults to CPU.
        device_group: the group used for communication (e.g. NCCL), the same kinds; defaults to `cpu_group`.
        unique_name: a label, kept for compatibility.

    Raises:
        CommError: a mesh that is not 1-D given without a dim name, or a dim name the mesh lacks.
        TypeError: a group of another kind.

    Example:
        >>> comm = DeviceCommunicator(None)  # WORLD (one rank in these examples)
        >>> comm.world_size, comm.rank
        (1, 0)
        >>> comm.all_to_all_4D(torch.ones(1, 4, 2, 8)).shape  # [B, S / W, H, D] -> [B, S, H / W, D]
        torch.Size([1, 4, 2, 8])
        >>> comm.gather(torch.ones(2), dst=0)  # the seed's gather: the result on dst, None elsewhere
        tensor([1., 1.])
    """

    def __init__(
        self,
        cpu_group: GroupArgument,
        device: torch.device | None = None,
        device_group: GroupArgument = None,
        unique_name: str = "",
    ) -> None:
        self.device = device or torch.device("cpu")
        self.cpu_group = resolve_group("DeviceCommunicator", cpu_group)
        self.device_group = (
            self.cpu_group if device_group is None else resolve_group("DeviceCommunicator", device_group)
        )
        self.unique_name = unique_name
        self.rank = dist.get_rank(self.cpu_group)
        self.world_size = dist.get_world_size(self.cpu_group)
        self.ranks = dist.get_process_group_ranks(self.cpu_group)
        self.global_rank = dist.get_rank()
        self.global_world_size = dist.get_world_size()
        self.rank_in_group = self.rank

    def all_reduce(
        self,
        input_: torch.Tensor,
        op: ReduceOpArgument | None = "sum",
        *,
        convention: str = "sum",
        accum_dtype: DtypeArgument = None,
    ) -> torch.Tensor:
        """Differentiable all_reduce (op None means sum, as in the seed); see `commlib_torch.all_reduce`."""
        op = "sum" if op is None else op
        return functional.all_reduce(input_, op, self.device_group, convention=convention, accum_dtype=accum_dtype)

    def all_gather(
        self, input_: torch.Tensor, dim: int = -1, *, convention: str = "sum", sizes: Sizes = None
    ) -> torch.Tensor:
        """Differentiable all_gather along `dim`; see `commlib_torch.all_gather`."""
        return functional.all_gather(input_, dim, self.device_group, convention=convention, sizes=sizes)

    def reduce_scatter(
        self,
        input_: torch.Tensor,
        dim: int = 0,
        op: ReduceOpArgument = "sum",
        *,
        accum_dtype: DtypeArgument = None,
        sizes: Sizes = None,
    ) -> torch.Tensor:
        """Differentiable reduce_scatter along `dim`; see `commlib_torch.reduce_scatter`."""
        return functional.reduce_scatter(input_, dim, op, self.device_group, accum_dtype=accum_dtype, sizes=sizes)

    def all_to_all(
        self,
        input_: torch.Tensor,
        scatter_dim: int,
        gather_dim: int,
        *,
        scatter_sizes: Sizes = None,
        gather_sizes: Sizes = None,
    ) -> torch.Tensor:
        """Differentiable all_to_all; see `commlib_torch.all_to_all`."""
        return functional.all_to_all(
            input_, scatter_dim, gather_dim, self.device_group, scatter_sizes=scatter_sizes, gather_sizes=gather_sizes
        )

    def all_to_all_4D(
        self,
        input_: torch.Tensor,
        scatter_dim: int = 2,
        gather_dim: int = 1,
        *,
        scatter_sizes: Sizes = None,
        gather_sizes: Sizes = None,
    ) -> torch.Tensor:
        """Ulysses all-to-all ``[B, S/W, H, D] <-> [B, S, H/W, D]``; see `commlib_torch.all_to_all_4d`."""
        return functional.all_to_all_4d(
            input_, scatter_dim, gather_dim, self.device_group, scatter_sizes=scatter_sizes, gather_sizes=gather_sizes
        )

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Differentiable broadcast from group-local `src`; see `commlib_torch.broadcast`."""
        return functional.broadcast(input_, src, self.device_group)

    def scatter(self, input_: torch.Tensor, src: int = 0, dim: int = 0, *, sizes: Sizes = None) -> torch.Tensor:
        """Differentiable scatter from group-local `src`; see `commlib_torch.scatter`."""
        return functional.scatter(input_, src, dim, self.device_group, sizes=sizes)

    def permute(self, input_: torch.Tensor, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Differentiable (src, dst) permutation; see `commlib_torch.permute`."""
        return functional.permute(input_, perm, self.device_group)

    def sum_grad(self, input_: torch.Tensor) -> torch.Tensor:
        """Identity forward, all_reduce(sum) backward; see `commlib_torch.sum_grad`."""
        return functional.sum_grad(input_, self.device_group)

    def slice(self, input_: torch.Tensor, dim: int = -1, *, scale_grad: bool = False) -> torch.Tensor:
        """This rank's block of the replicated `input_` along `dim`; backward all_gathers the gradients (/ W
        with `scale_grad`): FastVideo's ``slice`` (``GroupCoordinator.shard``); see `commlib_torch.shard`."""
        return functional.shard(input_, dim, self.device_group, scale_grad=scale_grad)

    def reduce(self, input_: torch.Tensor, dst: int = 0, op: ReduceOpArgument = "sum") -> torch.Tensor:
        """Differentiable reduce to group-local `dst` (zeros elsewhere); see `commlib_torch.reduce`."""
        return functional.reduce(input_, dst, op, self.device_group)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenation of every rank's input along `dim` on group-local rank `dst`; None elsewhere.

        Not differentiable (the seed's semantics); `commlib_torch.gather` is the differentiable op.
        """
        return functional.gather_to_root(input_, dst, dim, self.device_group)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send `tensor` to group-local rank `dst` (default: the next rank). In checked mode the receiver's size
        and dtype are compared with the tensor's first (both ends raise the same CommError if they differ)."""
        tensor = check_tensor("send", tensor, "tensor")
        size = world_size("send", self.device_group)
        dst = (self.rank + 1) % size if dst is None else dst
        plan = plans.point_to_point(
            tensor.shape,
            size,
            self.rank,
            dst,
            dtype=dtype_name(tensor.dtype),
            op_name="send",
            backend_dtypes=backend_dtypes(self.device_group, tensor),
        )
        self._transfer(plan, tensor.contiguous(), dst)

    def recv(self, size: int | Sequence[int], dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a tensor of `size` (an int or a shape) and `dtype` from group-local rank `src` (default: the
        previous rank). Checked mode as in `send`."""
        if not isinstance(dtype, torch.dtype):
            raise frontend_errors.wrong_type("recv", "dtype", dtype, "torch.dtype")
        world = world_size("recv", self.device_group)
        src = (self.rank - 1) % world if src is None else src
        shape = (size,) if isinstance(size, int) else tuple(size)
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        plan = plans.point_to_point(
            shape,
            world,
            src,
            self.rank,
            dtype=dtype_name(dtype),
            op_name="recv",
            backend_dtypes=backend_dtypes(self.device_group, tensor),
        )
        self._transfer(plan, tensor, src)
        return tensor

    def _transfer(self, plan: Plan, tensor: torch.Tensor, peer: int) -> None:
        """send (the plan of a "send") or recv into `tensor`, viewed as the plan's wire dtype if it has one."""
        group = self.device_group
        if is_checked():
            exchange_pair(plan, tensor, group)
        wire = tensor if plan.wire_view is None else tensor.view(getattr(torch, plan.wire_view))
        transfer = dist.send if plan.op_name == "send" else dist.recv
        transfer(wire, global_rank(group, peer), group)

    def destroy(self) -> None:
        """Nothing to release: the groups belong to the caller."""
