"""The Ulysses walk on W simulated numpy ranks (float64): `simulate_ulysses` runs a `commlib.attention.UlyssesPlan`
the way the frontends do -- per head group, one send buffer per exchange, the all-to-all, the kv indexing, the
reference `commlib.attention.attention` on each rank, the return all-to-all -- so the plan is tested without a
framework (as `commlib.ring_reference` does for the ring).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from commlib.attention import Exchange, HeadSplit, UlyssesPlan, _offsets, attention

__all__ = ["simulate_ulysses"]


def _heads_first(x: np.ndarray) -> np.ndarray:
    return np.moveaxis(np.asarray(x, dtype=np.float64), 2, 0)


def _exchange_ranks(exchange: Exchange, plans: Sequence[UlyssesPlan], inputs: dict) -> list[np.ndarray]:
    """One `Exchange` on every simulated rank: pack by `send_index`, all-to-all, gather the sequence."""
    W = len(plans)
    stacked = [np.concatenate([_heads_first(inputs[name][r]) for name in exchange.inputs]) for r in range(W)]
    zero = [np.zeros((1, *stack.shape[1:])) for stack in stacked]
    sends = [np.concatenate([stack, pad])[list(exchange.send_index)] for stack, pad in zip(stacked, zero, strict=True)]
    sizes = exchange.scatter_sizes or (len(exchange.send_index) // W,) * W
    bounds = (*_offsets(sizes), sum(sizes))
    valid = plans[0].seq_sizes
    return [
        np.concatenate([sends[source][bounds[r] : bounds[r + 1], :, : valid[source]] for source in range(W)], axis=2)
        for r in range(W)
    ]


def simulate_ulysses(plans: Sequence[UlyssesPlan], qs, ks, vs) -> list[np.ndarray]:
    """Every rank's output of the walk the frontends make, on W simulated numpy ranks (float64): for each head
    group, its exchanges, kv indexing and the reference `attention` per rank, then its return all-to-all; the
    groups' outputs cut by `UlyssesPlan.out_runs`. ``plans[r]`` is rank r's plan (the padded layout: the same
    plan W times; inputs then hold ``max(seq_sizes)`` rows and rows past a rank's size are never read).
    Outputs: exact ``[B, seq_sizes[r], H, D_v]``."""
    outputs = [_simulate_group(plans, index, {"q": qs, "k": ks, "v": vs}) for index in range(plans[0].chunks)]
    runs = plans[0].out_runs
    if runs is None:
        return outputs[0]
    return [
        np.concatenate([outputs[index][rank][:, :, start:stop] for index, start, stop in runs], axis=2)
        for rank in range(len(plans))
    ]


def _simulate_group(plans: Sequence[UlyssesPlan], index: int, inputs: dict) -> list[np.ndarray]:
    """Head group `index` on every simulated rank: ``[B, S_r, h_c, D_v]`` (every rank's heads of the group)."""
    W, plan = len(plans), plans[0]
    received: list[dict[str, np.ndarray]] = [{} for _ in range(W)]
    for number, exchange in enumerate(plan.groups[index].exchanges):
        recvs = _exchange_ranks(exchange, plans, {name: inputs[name] for name in exchange.inputs})
        for rank, recv in enumerate(recvs):
            for name, start, stop in plans[rank].groups[index].exchanges[number].receive:
                received[rank][name] = np.moveaxis(recv[start:stop], 0, 2)
    outputs = []
    for rank in range(W):
        local, group = received[rank], plans[rank].groups[index]
        k, v = local["k"], local["v"]
        if group.kv_index is not None:
            kv_index = list(group.kv_index[0 if plan.layout == "exact" else rank])
            k, v = k[:, :, kv_index], v[:, :, kv_index]
        outputs.append(attention(local["q"], k, v, causal=plan.causal, scale=plan.scale))
    return _return_ranks(plans[0].groups[index].heads, plan.seq_sizes, outputs)


def _return_ranks(split: HeadSplit, sizes: tuple[int, ...], outputs: list[np.ndarray]) -> list[np.ndarray]:
    """The output all-to-all: rank r's rows of every rank's heads, heads concatenated in rank order."""
    bounds = (*_offsets(sizes), sum(sizes))
    result = []
    for rank in range(len(outputs)):
        rows = slice(bounds[rank], bounds[rank + 1])
        result.append(
            np.concatenate(
                [outputs[source][:, rows, : split.q_sizes[source]] for source in range(len(outputs))], axis=2
            )
        )
    return result
