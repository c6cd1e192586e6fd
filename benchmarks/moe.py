"""MoE dispatch and combine, forward and backward, side by side (issue 33 item 6): route + dispatch + a trivial
expert + combine at T tokens of H features per rank, E experts, top-K, over W gloo ranks, in one run:

- ``commlib exact``: `commlib_torch.moe` (`route`, `dispatch`, `combine`), the exact layout (dropless);
- ``commlib padded cf``: the same with ``layout="padded"`` and the capacity factor of the DeepSpeed variant;
- ``torchtitan-style``: the dispatch torchtitan writes (written here): the counts all_to_all, the splits read on
  the host, ``torch.distributed.nn.functional.all_to_all_single`` (autograd) for the rows, a permute to
  expert-major and its unpermute, the weighted k-sum by ``scatter_add`` (in float32);
- ``deepspeed cf``: DeepSpeed's ``_AllToAll`` (``deepspeed.moe.sharded_moe``) of an ``[E * C, H]`` buffer padded
  to capacity C = ceil(T * K / E * cf), cf = 1.25 (the first C routes per expert in token-major order, as
  commlib's capacity); the buffer is filled by an index copy and read back by a gather, not by DeepSpeed's
  ``[S, E, C]`` einsum masks (dense matmuls that would dominate here), so this is its wire and padding cost
  only -- favourable to DeepSpeed. Reported "not installed" when DeepSpeed does not import;
- ``floor``: the same counts exchange and row exchanges (one per direction, forward and backward) on
  preallocated buffers, one gather into the send buffer and one out of the receive buffer per side, the
  combine's returned rows saved for the weights' gradient.

Every variant computes the same thing: router logits ``x @ w_router``, a float32 softmax, top-K; each local
expert e scales its rows by ``1 + e / (2 E)``; the weighted k-sum (float32 accumulation for bfloat16); then
backward from a fixed cotangent, to x and the router. The outputs and gradients of every variant are compared
with commlib exact's before timing (the capacity-padded ones drop the routes over C, so they are compared with
``commlib padded cf``). Then the variants run interleaved, repeat after repeat (the order rotating), each step
timed between two barriers as the slowest rank's seconds. Rows on the wire are counted by wrapping
``torch.distributed.all_to_all_single`` for one step of each variant (rows in the send buffers of the row
exchanges, the chunk a rank keeps included, and the valid rows among them). Progress to stderr (tqdm).

DeepSpeed is not a commlib dependency: run it in a venv of its own (README of the result's folder):

    torchrun --standalone --nproc-per-node 4 benchmarks/moe.py --json benchmarks/results/<dir>/moe.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnnf

from commlib_torch import moe

try:  # DeepSpeed is optional: the bench runs without it and says so
    import deepspeed
    from deepspeed.moe.sharded_moe import _AllToAll
except ImportError:  # pragma: no cover - depends on the environment
    deepspeed = None
    _AllToAll = None


class Setup:
    """One rank's inputs and the sizes every variant shares."""

    def __init__(self, args: argparse.Namespace, dtype: torch.dtype) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.T, self.H, self.E, self.K, self.dtype = args.tokens, args.hidden, args.experts, args.top_k, dtype
        self.cf = args.capacity_factor
        self.local = self.E // self.world
        self.capacity = math.ceil(self.T * self.K / self.E * self.cf)
        rng = torch.Generator().manual_seed(1000 + self.rank)
        self.x0 = torch.randn(self.T, self.H, generator=rng).to(dtype)
        self.g = torch.randn(self.T, self.H, generator=rng).to(dtype)  # the cotangent of the output
        shared = torch.Generator().manual_seed(0)
        self.router0 = (torch.randn(self.H, self.E, generator=shared) / self.H**0.5).to(dtype)
        scales = 1 + torch.arange(self.E, dtype=torch.float32) / (2 * self.E)
        self.scale = scales[self.rank * self.local : (self.rank + 1) * self.local].to(dtype)  # this rank's experts
        self.accum = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x0.clone().requires_grad_(), self.router0.clone().requires_grad_()

    def gate(self, x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, K], indices int64 [T, K]): the router's softmax top-K."""
        return torch.softmax((x @ router).float(), dim=-1).topk(self.K, dim=-1)

    def expert_rows(self, counts: torch.Tensor, rows: int, padded_to: int | None = None) -> torch.Tensor:
        """[rows or padded_to, 1]: each expert-major row's expert scale (0 past `rows`)."""
        scale = torch.repeat_interleave(self.scale, counts, output_size=rows)
        if padded_to is not None:
            scale = torch.cat([scale, scale.new_zeros(padded_to - rows)])
        return scale[:, None]


# ---- the variants: each returns (out, x, router) after backward --------------------------------------------


def commlib_variant(s: Setup, layout: str) -> Callable[[], tuple]:
    cf = None if layout == "exact" else s.cf

    def step():
        x, router = s.leaves()
        weights, indices = s.gate(x, router)
        routing = moe.route(indices, s.E, capacity_factor=cf, layout=layout)
        rows = moe.dispatch(x, routing)
        padded = None if layout == "exact" else rows.shape[0]
        y = rows * s.expert_rows(routing.tokens_per_expert, int(routing.rows), padded)  # padded: a 0-d tensor
        out = moe.combine(y, routing, weights)
        out.backward(s.g)
        return out, x, router

    return step


def _counts(s: Setup, flat: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """The counts all_to_all: (received counts [W, E_local], input splits, output splits), read on the host."""
    counts = torch.bincount(flat, minlength=s.E)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    received = received.view(s.world, s.local)
    return received, counts.view(s.world, s.local).sum(1).tolist(), received.sum(1).tolist()


def _expert_major(received: torch.Tensor) -> torch.Tensor:
    """Receive position of each expert-major row: received rows come (source, expert), experts want (expert,
    source) -- torchtitan's ``generate_permute_indices``, on the device."""
    sizes = received.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view(received.shape)  # source-major block starts
    major_sizes = received.t().reshape(-1)
    major_starts = torch.cumsum(major_sizes, 0) - major_sizes
    rows = int(sizes.sum())
    shift = torch.repeat_interleave(starts.t().reshape(-1) - major_starts, major_sizes, output_size=rows)
    return torch.arange(rows) + shift


def torchtitan_variant(s: Setup) -> Callable[[], tuple]:
    def step():
        x, router = s.leaves()
        weights, indices = s.gate(x, router)
        flat = indices.reshape(-1)
        received, input_splits, output_splits = _counts(s, flat)
        order = torch.argsort(flat, stable=True)
        token = order // s.K
        send = x[token]  # permute: the sorted copies
        recv = dnnf.all_to_all_single(x.new_empty(sum(output_splits), s.H), send, output_splits, input_splits)
        permute = _expert_major(received)
        routed = recv[permute]  # expert-major
        y = routed * s.expert_rows(received.sum(0), routed.shape[0])
        unpermuted = y.new_empty(y.shape)
        unpermuted[permute] = y  # back to receive order
        back = dnnf.all_to_all_single(x.new_empty(sum(input_splits), s.H), unpermuted, input_splits, output_splits)
        contributions = back.to(s.accum) * weights.reshape(-1)[order][:, None]
        total = torch.zeros(s.T, s.H, dtype=s.accum).scatter_add(0, token[:, None].expand(-1, s.H), contributions)
        out = total.to(s.dtype)
        out.backward(s.g)
        return out, x, router

    return step


def deepspeed_variant(s: Setup) -> Callable[[], tuple]:
    group = dist.group.WORLD

    def step():
        x, router = s.leaves()
        weights, indices = s.gate(x, router)
        flat = indices.reshape(-1)  # token-major (t, k)
        one_hot = torch.nn.functional.one_hot(flat, s.E)
        position = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # place within its expert
        keep = position < s.capacity
        slot = torch.where(keep, flat * s.capacity + position, s.E * s.capacity)  # dropped: a scratch row
        buffer = x.new_zeros(s.E * s.capacity + 1, s.H).index_copy(0, slot, x.repeat_interleave(s.K, 0))
        dispatched = _AllToAll.apply(group, buffer[:-1])  # [W sources, E_local, C, H]
        y = dispatched.view(s.world, s.local, s.capacity, s.H) * s.scale[None, :, None, None]
        back = _AllToAll.apply(group, y.reshape(s.E * s.capacity, s.H))
        rows = torch.cat([back, back.new_zeros(1, s.H)]).index_select(0, slot).view(s.T, s.K, s.H)
        out = (rows.to(s.accum) * weights[..., None]).sum(1).to(s.dtype)
        out.backward(s.g)
        return out, x, router

    return step


class _Buffers:
    """The floor's preallocated buffers, grown when a step needs more rows."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.store: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.s.dtype
        have = self.store.get(name)
        if have is None or have.shape[0] < rows or have.dtype != dtype:
            have = self.store[name] = torch.empty(max(rows, self.s.T * self.s.K), self.s.H, dtype=dtype)
        return have[:rows]


def floor_variant(s: Setup) -> Callable[[], tuple]:
    buffers = _Buffers(s)

    def exchange(send: torch.Tensor, out: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        dist.all_to_all_single(out, send, out_splits, in_splits)

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, plan):
            ctx.plan = plan
            send = torch.index_select(x, 0, plan["token"], out=buffers.get("send", plan["sent"]))
            recv = buffers.get("recv", plan["rows"])
            exchange(send, recv, plan["out"], plan["in"])
            return torch.index_select(recv, 0, plan["permute"], out=buffers.get("rows", plan["rows"]))

        @staticmethod
        def backward(ctx, rows_bar):
            plan = ctx.plan
            recv = torch.index_select(rows_bar, 0, plan["unpermute"], out=buffers.get("recv_bar", plan["rows"]))
            send = buffers.get("send_bar", plan["sent"])
            exchange(recv, send, plan["in"], plan["out"])
            copies = torch.index_select(send, 0, plan["slot"]).view(s.T, s.K, s.H)
            return copies.sum(1, dtype=s.accum).to(s.dtype), None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, weights, plan):
            ctx.plan = plan
            recv = torch.index_select(y, 0, plan["unpermute"], out=buffers.get("back", plan["rows"]))
            back = buffers.get("returned", plan["sent"])
            exchange(recv, back, plan["in"], plan["out"])
            returned = torch.index_select(back, 0, plan["slot"]).view(s.T, s.K, s.H)
            ctx.save_for_backward(returned, weights)
            return (returned.to(s.accum) * weights[..., None]).sum(1).to(s.dtype)

        @staticmethod
        def backward(ctx, out_bar):
            plan = ctx.plan
            returned, weights = ctx.saved_tensors
            send = torch.index_select(out_bar, 0, plan["token"], out=buffers.get("send_y", plan["sent"]))
            if s.accum == s.dtype:
                send.mul_(plan["sorted_weights"](weights))
            else:  # weighted in float32, as the other variants
                send.copy_(send.to(s.accum) * plan["sorted_weights"](weights))
            recv = buffers.get("recv_y", plan["rows"])
            exchange(send, recv, plan["out"], plan["in"])
            y_bar = torch.index_select(recv, 0, plan["permute"])
            w_bar = (returned.to(s.accum) * out_bar.to(s.accum)[:, None]).sum(-1)
            return y_bar, w_bar, None

    def step():
        x, router = s.leaves()
        weights, indices = s.gate(x, router)
        flat = indices.reshape(-1)
        received, input_splits, output_splits = _counts(s, flat)
        order = torch.argsort(flat, stable=True)
        permute = _expert_major(received)
        plan = {
            "token": order // s.K,
            "slot": torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())),
            "permute": permute,
            "unpermute": torch.empty_like(permute).scatter_(0, permute, torch.arange(permute.numel())),
            "sent": sum(input_splits),
            "rows": sum(output_splits),
            "in": input_splits,
            "out": output_splits,
            "sorted_weights": lambda w: w.detach().reshape(-1)[order][:, None].to(s.accum),
        }
        rows = Dispatch.apply(x, plan)
        y = rows * s.expert_rows(received.sum(0), rows.shape[0])
        out = Combine.apply(y, weights, plan)
        out.backward(s.g)
        return out, x, router

    return step


# ---- measuring ----------------------------------------------------------------------------------------------


def timed(run: Callable[[], object]) -> float:
    """The slowest rank's seconds for `run()`, between two barriers."""
    dist.barrier()
    start = time.perf_counter()
    run()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def wire(run: Callable[[], object], hidden: int) -> dict[str, int]:
    """One step's row exchanges, summed over the ranks: calls, rows in the send buffers (the kept chunk
    included) and rows sent to other ranks. A row exchange is an all_to_all_single of [rows, H] tensors."""
    seen = {"row_exchanges": 0, "rows_sent": 0, "rows_to_other_ranks": 0, "other_calls": 0}
    original = dist.all_to_all_single
    rank, world = dist.get_rank(), dist.get_world_size()

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input.dim() == 2 and input.shape[1] == hidden:
            splits = input_split_sizes or [input.shape[0] // world] * world
            seen["row_exchanges"] += 1
            seen["rows_sent"] += int(input.shape[0])
            seen["rows_to_other_ranks"] += int(input.shape[0]) - int(splits[rank])
        else:
            seen["other_calls"] += 1
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        run()
    finally:
        dist.all_to_all_single = original
    totals = torch.tensor([seen[key] for key in sorted(seen)], dtype=torch.int64)
    dist.all_reduce(totals)
    return dict(zip(sorted(seen), (int(v) for v in totals), strict=True))


def largest_difference(a: tuple, b: tuple) -> float:
    """The largest |a - b| / max|b| over out, x's and the router's gradients, over the ranks."""
    pairs = [(a[0].detach(), b[0].detach()), (a[1].grad, b[1].grad), (a[2].grad, b[2].grad)]
    worst = max(
        float((p.double() - q.double()).abs().max() / q.double().abs().max().clamp_min(1e-30)) for p, q in pairs
    )
    value = torch.tensor(worst, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def run_dtype(args: argparse.Namespace, dtype: torch.dtype, progress) -> dict:
    s = Setup(args, dtype)
    cf = f"cf {args.capacity_factor:g}"
    variants: dict[str, Callable[[], tuple]] = {
        "commlib exact": commlib_variant(s, "exact"),
        f"commlib padded {cf}": commlib_variant(s, "padded"),
        "torchtitan-style": torchtitan_variant(s),
        "floor": floor_variant(s),
    }
    if _AllToAll is not None:
        variants[f"deepspeed {cf}"] = deepspeed_variant(s)
    reference = {name: step() for name, step in variants.items()}
    valid = torch.tensor(s.T * s.K, dtype=torch.int64)  # the routes (dropless: every one a row), all ranks
    dist.all_reduce(valid)
    compared = {
        name: largest_difference(
            result, reference["commlib exact" if not name.endswith(cf) else f"commlib padded {cf}"]
        )
        for name, result in reference.items()
    }
    wires = {name: wire(step, s.H) for name, step in variants.items()}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(args.warmup + args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        took = {name: timed(variants[name]) for name in order}
        if repeat >= args.warmup:
            for name in names:
                seconds[name].append(took[name])
        progress(f"{dtype_name(dtype)} repeat {repeat + 1}/{args.warmup + args.repeats}", took)
    summary = {}
    for name in names:
        values = seconds[name]
        summary[name] = {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "seconds": values,
            "largest_difference": compared[name],
            "compared_with": "commlib exact" if not name.endswith(cf) else f"commlib padded {cf}",
            "wire": wires[name],
        }
    subject = summary["commlib exact"]["median_s"]
    for name in names:
        summary[name]["commlib_exact_over_this"] = subject / summary[name]["median_s"]
    valid_rows = int(valid)
    for name in names:
        counted = summary[name]["wire"]  # summed over the ranks: a step's exchange is one call on each rank
        counted["row_exchanges_per_step"] = counted["row_exchanges"] // s.world
        per_exchange = counted["rows_sent"] / max(1, counted["row_exchanges_per_step"])
        summary[name]["rows_per_exchange_over_valid"] = per_exchange / valid_rows
    medians = {name: summary[name]["median_s"] for name in names}
    ratios = {  # the goals: <= 1.0 torchtitan-style, <= 0.8 DeepSpeed at cf 1.25, <= 1.3 the floor
        f"commlib exact / {name}": medians["commlib exact"] / medians[name] for name in names if name != "commlib exact"
    }
    if f"deepspeed {cf}" in medians:
        ratios[f"commlib padded {cf} / deepspeed {cf}"] = medians[f"commlib padded {cf}"] / medians[f"deepspeed {cf}"]
    return {
        "ratios": ratios,
        "dtype": dtype_name(dtype),
        "capacity": s.capacity,
        "valid_rows_per_exchange": valid_rows,
        "variants": summary,
    }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="T per rank")
    parser.add_argument("--hidden", type=int, default=1024, help="H")
    parser.add_argument("--experts", type=int, default=16, help="E (a multiple of W)")
    parser.add_argument("--top-k", type=int, default=2, help="K")
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="of the padded variants")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    parser.add_argument("--json", help="also write the result as JSON (rank 0)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)  # torchtitan-style's call
    dist.init_process_group("gloo")
    if deepspeed is not None:
        deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer over the same process group
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    command = "torchrun --standalone --nproc-per-node " + str(world) + " " + shlex.join(sys.argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(args.dtypes) * (args.warmup + args.repeats), file=sys.stderr, desc="moe bench")
        except ImportError:  # pragma: no cover
            bar = None

    def progress(what: str, took: dict[str, float]) -> None:
        if rank != 0:
            return
        line = f"{what}: " + ", ".join(f"{name} {value:.3f} s" for name, value in took.items())
        if bar is not None:
            bar.update(1)
            bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    results = [run_dtype(args, getattr(torch, name), progress) for name in args.dtypes]
    if bar is not None:
        bar.close()
    load_after = os.getloadavg()
    if rank == 0:
        print(
            f"W={world} T={args.tokens} H={args.hidden} E={args.experts} K={args.top_k} cf={args.capacity_factor:g}; "
            f"{args.repeats} timed steps per variant after {args.warmup} warmup; deepspeed "
            f"{deepspeed.__version__ if deepspeed is not None else 'not installed'}; torch {torch.__version__}; "
            f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
        )
        for result in results:
            print(
                f"{result['dtype']} (capacity C = {result['capacity']}, valid rows per exchange "
                f"{result['valid_rows_per_exchange']} over the ranks):"
            )
            print("  ratios of the medians: " + "; ".join(f"{k} {v:.3f}" for k, v in result["ratios"].items()))
            for name, row in result["variants"].items():
                print(
                    f"  {name:22s} median {row['median_s']:.3f} s (min {row['min_s']:.3f}, max {row['max_s']:.3f}); "
                    f"commlib exact / this {row['commlib_exact_over_this']:.3f}; "
                    f"{row['wire']['row_exchanges_per_step']} row exchanges per step, rows per exchange / valid "
                    f"{row['rows_per_exchange_over_valid']:.3f}; vs {row['compared_with']} "
                    f"{row['largest_difference']:.1e}"
                )
        if deepspeed is None:
            print("deepspeed: not installed (its variant did not run)")
        if args.json:
            facts = {
                "command": command,
                "world_size": world,
                "tokens": args.tokens,
                "hidden": args.hidden,
                "experts": args.experts,
                "top_k": args.top_k,
                "capacity_factor": args.capacity_factor,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "threads_per_rank": torch.get_num_threads(),
                "load_before": load_before,
                "load_after": load_after,
                "seconds": time.perf_counter() - started,
                "versions": {
                    "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__ if deepspeed is not None else "not installed",
                    "python": sys.version.split()[0],
                },
            }
            with open(args.json, "w") as file:
                json.dump({"facts": facts, "results": results}, file, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
