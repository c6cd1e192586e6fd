"""The state of `commlib_torch.sequence.parallel`: the innermost context of this thread (a contextvar, so
nested contexts restore the outer one on exit), its plan from the spec, its resolved groups and this rank's
shard, decided once on entry; `current` and `Parallel.attend` are what an integration calls per layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commlib import CommError
from commlib import parallel as spec
from commlib.masks import MaskRule
from commlib_torch import _failures
from commlib_torch._checked import is_checked
from commlib_torch._groups import ResolvedGroup, group_rank, resolve_group, world_size
from commlib_torch.attention import ring_attention, ulysses_attention, usp_attention
from commlib_torch.testing_trace import ACTIVE, recorded_layer


@dataclasses.dataclass
class Parallel:
    """One entered context: the spec's plan, the layer's groups, this rank's shard index ``r * U + u`` and its
    global positions (a tensor per device, made on first use)."""

    plan: spec.ParallelPlan
    group: ResolvedGroup  # Ulysses or ring: the layer's group
    ulysses_group: ResolvedGroup
    ring_group: ResolvedGroup
    shard: int
    _positions: dict = dataclasses.field(default_factory=dict)
    packed: bool = False  # position_ids of packed documents (restarting at each one): the layer masks by them

    def positions(self, device: torch.device) -> torch.Tensor:
        """int64 ``[1, sizes[shard]]``: the global positions of this rank's shard, on `device`."""
        if device not in self._positions:
            self._positions[device] = torch.as_tensor(self.plan.layout.positions(self.shard), device=device)[None]
        return self._positions[device]

    def groups(self) -> tuple[ResolvedGroup, ...]:
        """The groups whose ranks run the layer together: Ulysses' or ring's group; USP's whole group if given,
        else its Ulysses and ring groups (a flag reduced over one, then the other, reaches every rank of both)."""
        if self.plan.attention != "usp" or self.group is not None:
            return (self.group,)
        return (self.ulysses_group, self.ring_group)

    def refuse_together(self, checks: Callable[[], None], device: torch.device) -> None:
        """Run an integration call's `checks` (they raise the spec's `CommError`). In checked mode
        (``COMMLIB_CHECK=1``) the ranks of the layer first exchange whether each refused (one int64 all_reduce
        per group), so every rank raises -- the refusing ones their own error, the others
        `commlib.parallel.refused_elsewhere_error` -- instead of the passing ones entering the collective alone.
        Off: `checks` alone, each rank deciding from its own shard."""
        if not is_checked():
            checks()
            return
        refusal = None
        try:
            checks()
        except CommError as error:
            refusal = error
        flag = torch.tensor([int(refusal is not None)], dtype=torch.int64, device=device)
        for group in self.groups():
            _failures.all_reduce(flag, dist.ReduceOp.MAX, group, spec.CALL_OP)
        if refusal is not None:
            raise refusal
        if flag.item():
            raise spec.refused_elsewhere_error()

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float | None,
        segment_ids: torch.Tensor | None = None,
        mask: MaskRule | None = None,
    ) -> torch.Tensor:
        """The plan's layer on this rank's ``[B, S_r, H, D]`` / ``[B, S_r, H_kv, D]`` shards (and segment ids
        ``[B, S_r]``; None: no segment mask; `mask` a rule on global positions, None: none); one call of a
        `commlib_torch.testing.record()` trace while recording."""
        if ACTIVE:
            return recorded_layer(
                f"{self.plan.attention}_attention",
                self._layer,
                q,
                k,
                v,
                causal=causal,
                scale=scale,
                segment_ids=segment_ids,
                **({} if mask is None else {"mask": mask}),
            )
        return self._layer(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids, mask=mask)

    def attend_joint(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        *,
        joint_position: str,
        causal: bool,
        scale: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's layer with joint tensors ``joint = (joint_q, joint_k, joint_v)``, each ``[B, S_j, H, D]``
        and the same on every rank: ``(out, joint_out)``, as the layers return them."""
        joint_q, joint_k, joint_v = joint
        keywords = dict(joint_q=joint_q, joint_k=joint_k, joint_v=joint_v, joint_position=joint_position)
        return self._call(q, k, v, causal=causal, scale=scale, keywords={**self.plan.keywords, **keywords})

    def _layer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float | None,
        segment_ids: torch.Tensor | None = None,
        mask: MaskRule | None = None,
    ) -> torch.Tensor:
        keywords = self.plan.keywords if segment_ids is None else {**self.plan.keywords, "segment_ids": segment_ids}
        if mask is not None:
            keywords = {**keywords, "mask": mask}
        return self._call(q, k, v, causal=causal, scale=scale, keywords=keywords)

    def _call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float | None,
        keywords: dict[str, Any],
    ) -> Any:
        """The plan's layer (ulysses_attention, ring_attention or usp_attention over this context's groups)."""
        if self.plan.attention == "ulysses":
            return ulysses_attention(q, k, v, self.group, causal=causal, scale=scale, **keywords)
        if self.plan.attention == "ring":
            return ring_attention(q, k, v, self.group, causal=causal, scale=scale, **keywords)
        return usp_attention(q, k, v, self.ulysses_group, self.ring_group, causal=causal, scale=scale, **keywords)


#: The entered contexts of this thread; `current(op_name)` is the innermost (the spec's error outside every one).
CONTEXTS = spec.Contexts[Parallel]("commlib_torch_parallel", "commlib_torch.sequence.parallel")
current = CONTEXTS.current
_NAMES = ("group", "ulysses_group", "ring_group")


def enter(layout: object, group: object, attention: str, ulysses_group: object, ring_group: object) -> Parallel:
    """The context of ``parallel(layout, group, attention=..., ...)``: checked by the spec, groups resolved."""
    shown = (None if value is None else type(value).__name__ for value in (group, ulysses_group, ring_group))
    spec.check_groups(attention, dict(zip(_NAMES, shown, strict=True)), _NAMES)
    if attention == "usp":
        ulysses, ring = (resolve_group(spec.OP_NAME, g) for g in (ulysses_group, ring_group))
        sizes = dict(ulysses_size=world_size(spec.OP_NAME, ulysses), ring_size=world_size(spec.OP_NAME, ring))
        plan = spec.parallel_plan(layout, attention, **sizes)
        whole = resolve_group(spec.OP_NAME, group) if group is not None else None
        if whole is not None:
            spec.check_world(plan.layout, world_size(spec.OP_NAME, whole))
        spec.check_every_shard_has_tokens(plan)
        shard = group_rank(ring) * sizes["ulysses_size"] + group_rank(ulysses)
        return Parallel(plan, whole, ulysses, ring, shard)
    resolved = resolve_group(spec.OP_NAME, group)
    size = world_size(spec.OP_NAME, resolved)
    sizes = dict(ulysses_size=size, ring_size=1) if attention == "ulysses" else dict(ulysses_size=1, ring_size=size)
    plan = spec.parallel_plan(layout, attention, **sizes)
    spec.check_every_shard_has_tokens(plan)
    return Parallel(plan, resolved, None, None, group_rank(resolved))
