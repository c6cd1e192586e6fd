"""The training block both frontends train (`commlib_torch.tools.train_block`, `commlib_jax.tools.train_block`):
its sizes, parameters and meshes, and its float64 numpy reference -- tooling for the examples, the tests and
`commlib parity --workload train`, not the library (the JAX helper's rules are `commlib.training`).

The block (pre-norm; x ``[B, S, D]``; over an SP x TP mesh every rank holds the sequence block ``[B, S/SP, D]``)::

    y = x + attention(rms_norm(x, norm1))      # q, k, v = h @ wq, h @ wk, h @ wv; Ulysses over SP; out @ wo
    z = y + mlp(rms_norm(y, norm2))            # silu(f(u) @ w_in) @ w_out, then g: w_in split by columns,
                                               # w_out by rows over TP (Megatron)
    loss = 0.5 * sum((z - target) ** 2) / (B * S)

Each rank's loss covers its own tokens, so the unsharded loss is the sum of the SP ranks' losses; the TP
ranks of one SP block compute the same loss (g is ``all_reduce(convention="replicated")``). Every
parameter is replicated over SP; ``w_in``/``w_out`` are sharded over TP (`TP_DIM`), the others replicated.
The recipe (torch and JAX alike): f = ``sum_grad``, g = ``all_reduce(..., convention="replicated")``, each
rank's backward, then every gradient all_reduced (sum) over SP.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from commlib import attention
from commlib.errors import comm_error

__all__ = [
    "TP_DIM",
    "BlockConfig",
    "init",
    "loss_and_grads",
    "mesh_shape",
    "meshes",
    "shard_parameter",
    "sequence_block",
    "sgd",
]

#: Parameter name -> the dim split over TP (None: replicated), in the order every side lists them.
TP_DIM: dict[str, int | None] = {
    "norm1": None,
    "wq": None,
    "wk": None,
    "wv": None,
    "wo": None,
    "norm2": None,
    "w_in": 1,
    "w_out": 0,
}


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Sizes and settings of the block and its training run."""

    batch: int = 2
    seq: int = 8  # S, split over SP
    dim: int = 8  # model width D
    heads: int = 4  # split over SP by the Ulysses all-to-all
    head_dim: int = 2
    hidden: int = 16  # MLP width, split over TP
    causal: bool = True  # causal attention over global positions (the examples and `commlib parity` train this)
    eps: float = 1e-6  # RMSNorm
    lr: float = 0.1  # SGD step size
    steps: int = 20

    @classmethod
    def for_world_size(cls, world_size: int, **overrides: Any) -> BlockConfig:
        """A block every SP x TP mesh of `world_size` ranks can shard: S = 2W, H = W, hidden = 4W."""
        return cls(seq=2 * world_size, heads=world_size, hidden=4 * world_size, **overrides)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shape of every parameter."""
        D, HD, F = self.dim, self.heads * self.head_dim, self.hidden
        return {
            "norm1": (D,),
            "wq": (D, HD),
            "wk": (D, HD),
            "wv": (D, HD),
            "wo": (HD, D),
            "norm2": (D,),
            "w_in": (D, F),
            "w_out": (F, D),
        }

    @property
    def tokens(self) -> int:
        """B * S: the loss is a mean over every token of the unsharded batch."""
        return self.batch * self.seq


def mesh_shape(world_size: int, sp: int | None = None, tp: int | None = None) -> tuple[int, int]:
    """(SP, TP) for `world_size` ranks: as given, the other one filled in, or TP = 2 when W is even (else 1).

    >>> mesh_shape(4), mesh_shape(4, sp=4), mesh_shape(3)
    ((2, 2), (4, 1), (3, 1))
    """
    received = dict(sp=sp, tp=tp)
    for name, size in received.items():
        if size is not None and (size < 1 or world_size % size):
            raise comm_error("training", f"{name} ({size}) must divide the world size ({world_size})", **received)
    if sp is None:
        tp = tp or (2 if world_size % 2 == 0 else 1)
        sp = world_size // tp
    tp = world_size // sp if tp is None else tp
    if sp * tp != world_size:
        raise comm_error("training", f"sp * tp ({sp * tp}) must equal the world size ({world_size})", **received)
    return sp, tp


def meshes(world_size: int) -> list[tuple[int, int]]:
    """Every (SP, TP) with SP * TP = `world_size`, SP first descending: 4 -> [(4, 1), (2, 2), (1, 4)]."""
    return [(world_size // tp, tp) for tp in range(1, world_size + 1) if world_size % tp == 0]


def init(config: BlockConfig, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Float64 (parameters, x, target) from `seed`: norms near 1, weights N(0, 1 / fan_in), x and target N(0, 1)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in config.shapes().items():
        if len(shape) == 1:
            params[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            params[name] = rng.standard_normal(shape) / math.sqrt(shape[0])
    shape = (config.batch, config.seq, config.dim)
    return params, rng.standard_normal(shape), rng.standard_normal(shape)


def _check_split(what: str, size: int, parts: int, index: int) -> None:
    if size % parts:
        raise comm_error("training", f"{what} ({size}) must be divisible by the mesh size ({parts})")
    if not 0 <= index < parts:
        raise comm_error("training", f"rank ({index}) must be in [0, {parts})", what=what)


def shard_parameter(name: str, value: np.ndarray, tp: int, tp_rank: int) -> np.ndarray:
    """TP rank `tp_rank`'s block of parameter `name` (the whole array if it is replicated)."""
    dim = TP_DIM[name]
    if dim is None:
        return value
    _check_split(name, value.shape[dim], tp, tp_rank)
    return np.split(value, tp, axis=dim)[tp_rank]


def sequence_block(x: np.ndarray, sp: int, sp_rank: int) -> np.ndarray:
    """SP rank `sp_rank`'s block of the sequence dim (1) of ``[B, S, ...]``."""
    _check_split("seq", x.shape[1], sp, sp_rank)
    return np.split(x, sp, axis=1)[sp_rank]


def sgd(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> dict[str, np.ndarray]:
    return {name: params[name] - lr * grads[name] for name in params}


# --- the numpy reference: forward and hand-written backward, float64 -------------------------------------------


def _rms_norm(x, weight, eps):
    inverse = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inverse * weight, inverse


def _rms_norm_vjp(x, weight, inverse, cotangent):
    """(dx, dweight) of ``x * inverse * weight`` with inverse = (mean(x^2) + eps)^-1/2."""
    dweight = np.sum(cotangent * x * inverse, axis=tuple(range(x.ndim - 1)))
    scaled = cotangent * weight
    dx = inverse * scaled - x * inverse**3 * np.mean(x * scaled, axis=-1, keepdims=True)
    return dx, dweight


def _sigmoid(u):
    return 1.0 / (1.0 + np.exp(-u))


def _attention(config, q, k, v):
    return attention.attention(q, k, v, causal=config.causal)


def _attention_vjp(config, q, k, v, cotangent):
    return attention.attention_vjp(q, k, v, cotangent, causal=config.causal)


def loss_and_grads(
    config: BlockConfig, params: dict[str, np.ndarray], x: np.ndarray, target: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """The unsharded block's loss and the gradient of every parameter (float64)."""
    p = params
    B, S, _ = x.shape
    heads = (B, S, config.heads, config.head_dim)
    h1, inverse1 = _rms_norm(x, p["norm1"], config.eps)
    q, k, v = ((h1 @ p[name]).reshape(heads) for name in ("wq", "wk", "wv"))
    attended = _attention(config, q, k, v).reshape(B, S, -1)
    y = x + attended @ p["wo"]
    h2, inverse2 = _rms_norm(y, p["norm2"], config.eps)
    u = h2 @ p["w_in"]
    s = u * _sigmoid(u)
    z = y + s @ p["w_out"]
    loss = 0.5 * float(np.sum((z - target) ** 2)) / config.tokens

    dz = (z - target) / config.tokens
    grads = {"w_out": np.einsum("bsf,bsd->fd", s, dz)}
    sig = _sigmoid(u)
    du = (dz @ p["w_out"].T) * sig * (1.0 + u * (1.0 - sig))
    grads["w_in"] = np.einsum("bsd,bsf->df", h2, du)
    dy_norm, grads["norm2"] = _rms_norm_vjp(y, p["norm2"], inverse2, du @ p["w_in"].T)
    dy = dz + dy_norm
    grads["wo"] = np.einsum("bsk,bsd->kd", attended, dy)
    dq, dk, dv = _attention_vjp(config, q, k, v, (dy @ p["wo"].T).reshape(heads))
    dh1 = np.zeros_like(h1)
    for name, d in (("wq", dq), ("wk", dk), ("wv", dv)):
        d = d.reshape(B, S, -1)
        grads[name] = np.einsum("bsd,bsk->dk", h1, d)
        dh1 += d @ p[name].T
    _, grads["norm1"] = _rms_norm_vjp(x, p["norm1"], inverse1, dh1)
    return loss, {name: grads[name] for name in TP_DIM}
