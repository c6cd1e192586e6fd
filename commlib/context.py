"""Context-parallel attention: ring attention and USP (Ulysses inside a group, ring across groups).

Everything both frontends walk, and the float64 numpy reference:

- Layouts (`shard_positions`, `shard_sequence`, `unshard_sequence`): which global positions of the sequence
  each shard holds. ``"contiguous"``: ring block r is positions ``[r*S/W, (r+1)*S/W)``; ``"zigzag"``: the
  sequence is cut into 2W chunks and ring block r is chunk r followed by chunk 2W-1-r (every rank then has the
  same causal work). With USP (``ulysses_size`` U > 1) ring block r is cut into U equal contiguous pieces and
  piece u is shard ``r * U + u``: the Ulysses all-to-all over the U ranks of ring index r gathers exactly
  ring block r.
- The schedule (`ring_plan` -> `RingPlan`): the `permute` pairs of one ring step (rank r sends its current k/v
  block to r+1, so at step t rank r holds ring block ``(r - t) % W``), and for each step and rank the *case*
  of the (q block, kv block) pair: an index into a small table of static cases, each a tuple of `Piece`\\ s
  (q rows, kv rows, mask), the pieces the causal mask hides entirely left out. The backward passes dk/dv with
  k/v the same way and one final hop brings them home.
- The step rules (`attend`, `merge`, `attend_vjp`) over an `ArrayMath` (numpy, torch, jax.numpy): one piece's
  output and log-sum-exp, the online-softmax merge of two (out, lse) pairs, and the blockwise backward that
  recomputes the probabilities from the saved LSE (FlashAttention-2, Dao 2023, Algorithm 2):
  ``dS = P * (dP - rowsum(dO * O))``.
- The reference: `reference` (unsharded float64 GQA attention, forward and VJP, cut back into shards) and
  `simulate_ring` (the plan walked on W simulated numpy ranks), so the schedule is tested without a framework.

>>> shard_positions(16, 4, "zigzag")[0]  # rank 0 of the handed case: chunks 0 and 7 of 8
array([ 0,  1, 14, 15])
>>> plan = ring_plan((2, 4, 4, 3), (2, 4, 2, 3), (2, 4, 2, 3), 4, causal=True, layout="zigzag")
>>> [plan.case_names[case] for case in plan.case_table[1]]  # step 1: rank r holds ring block r - 1
['second-half', 'first-half', 'first-half', 'first-half']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from commlib.attention import _check_int, _check_options, _check_shapes, _shown, attention, attention_vjp
from commlib.errors import comm_error, kind_error

__all__ = [
    "RING_OP",
    "USP_OP",
    "SEQUENCE_LAYOUTS",
    "MASKS",
    "Piece",
    "RingPlan",
    "ArrayMath",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
    "ring_plan",
    "attend",
    "merge",
    "attend_vjp",
    "delta",
    "NUMPY",
    "reference",
    "simulate_ring",
    "second_order",
]

RING_OP = "ring_attention"
USP_OP = "usp_attention"
SEQUENCE_LAYOUTS = ("contiguous", "zigzag")
#: A piece's mask: "full" (every q row sees every kv row) or "causal-diagonal" (q row i sees kv rows <= i: the
#: q and kv rows hold the same increasing positions).
MASKS = ("full", "causal-diagonal")


# ---------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------

def _check_layout(op_name: str, seq: int, ring_size: int, layout: object, ulysses_size: int,
                  received: dict) -> None:
    """`layout` known, W and U >= 1, and `seq` (the global length) cut evenly into the layout's chunks."""
    if layout not in SEQUENCE_LAYOUTS:
        raise comm_error(op_name, f"layout ({layout!r}) must be one of {', '.join(SEQUENCE_LAYOUTS)}", **received)
    for name, value in (("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        if value < 1:
            raise comm_error(op_name, f"{name} ({value}) must be >= 1", **received)
    if seq < 1:  # an empty shard: nothing to attend to, and the CPU flash kernels divide by it
        raise comm_error(op_name, f"seq ({seq}) must be >= 1", **received)
    if layout == "zigzag" and seq % (2 * ring_size * ulysses_size):
        raise comm_error(op_name, f"seq ({seq}) must be divisible by 2 * ring_size * ulysses_size "
                         f"({2 * ring_size * ulysses_size}) for layout 'zigzag'", **received)
    if seq % (ring_size * ulysses_size):
        raise comm_error(op_name, f"seq ({seq}) must be divisible by ring_size * ulysses_size "
                         f"({ring_size * ulysses_size})", **received)


def second_order(op_name: str) -> TypeError:
    """The error of differentiating ring / USP attention twice (torch: its backward is hand-written).

    >>> print(second_order("ring_attention"))  # doctest: +ELLIPSIS
    ring_attention: a second derivative is not supported: the backward is hand-written (first order); ...
    """
    message = ("a second derivative is not supported: the backward is hand-written (first order); take one "
               "gradient, or use ulysses_attention, whose backward is autograd's own")
    return kind_error(op_name, message, order=2)


def _positions(seq: int, ring_size: int, layout: str, ulysses_size: int) -> np.ndarray:
    W, U = ring_size, ulysses_size
    if layout == "contiguous":
        blocks = np.arange(seq).reshape(W, seq // W)
    else:
        chunks = np.arange(seq).reshape(2 * W, seq // (2 * W))
        blocks = np.concatenate([chunks[:W], chunks[::-1][:W]], axis=1)
    return blocks.reshape(W * U, seq // (W * U))


def shard_positions(seq: int, ring_size: int, layout: str = "contiguous", ulysses_size: int = 1) -> np.ndarray:
    """int64 ``[W * U, S / (W * U)]``: row ``r * U + u`` holds the global positions of shard ``r * U + u``
    (ring index r, Ulysses index u; ``U = ulysses_size``), in the order the shard holds them.

    >>> shard_positions(8, 2, "zigzag", ulysses_size=2)  # ring block 0 = chunks 0, 3; block 1 = chunks 1, 2
    array([[0, 1],
           [6, 7],
           [2, 3],
           [4, 5]])

    Raises:
        CommError: an unknown layout, W or U < 1, S not divisible by W * U (2 * W * U for zigzag).
        TypeError: S, W or U not ints.
    """
    received = dict(seq=seq, ring_size=ring_size, layout=layout, ulysses_size=ulysses_size)
    seq, ring_size, ulysses_size = (_check_int(name, value, received, "shard_positions") for name, value in
                                    (("seq", seq), ("ring_size", ring_size), ("ulysses_size", ulysses_size)))
    _check_layout("shard_positions", seq, ring_size, layout, ulysses_size, received)
    return _positions(seq, ring_size, layout, ulysses_size)


def shard_sequence(x, dim: int, ring_size: int, layout: str = "contiguous", ulysses_size: int = 1) -> list[np.ndarray]:
    """numpy: the W * U shards of a whole sequence `x` along `dim`, shard i holding the rows
    ``shard_positions(S, W, layout, U)[i]`` (``[.., S, ..] -> W * U x [.., S / (W * U), ..]``)."""
    x = np.asarray(x)
    positions = shard_positions(x.shape[dim], ring_size, layout, ulysses_size)
    return [np.take(x, row, axis=dim) for row in positions]


def unshard_sequence(shards: Sequence, dim: int, ring_size: int, layout: str = "contiguous",
                     ulysses_size: int = 1) -> np.ndarray:
    """numpy: the inverse of `shard_sequence`, the whole sequence back in position order."""
    shards = [np.asarray(shard) for shard in shards]
    whole = np.concatenate(shards, axis=dim)
    positions = shard_positions(whole.shape[dim], ring_size, layout, ulysses_size).reshape(-1)
    return np.take(whole, np.argsort(positions), axis=dim)


# ---------------------------------------------------------------------------------------------------------
# The schedule
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of one (q block, kv block) step: q rows ``q[0]:q[1]`` attend to kv rows ``kv[0]:kv[1]`` (local rows of
    the blocks) under `mask` (one of `MASKS`)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    mask: str


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """A validated `ring_attention` (or the ring of a `usp_attention`) call, the same on every rank.

    Walk (forward): rank r keeps q (its ring block, `rows` rows); for step t in ``range(ring_size)`` it computes
    the pieces of case ``case_table[t, r]`` against the k/v block it holds (ring block ``kv_block(t, r)``),
    merging each piece's (out, lse) into its rows (`merge`), and unless t is the last step sends k/v with
    `permute` over `perm`. Backward: the same walk with dk/dv (zeros at step 0, accumulated in the compute dtype)
    travelling with k/v; after the last step one more `permute` over `perm` brings dk/dv home.
    """

    op_name: str
    ring_size: int  # W, ranks of the ring
    layout: str  # one of SEQUENCE_LAYOUTS
    causal: bool
    scale: float
    batch: int
    rows: int  # rows of q, k, v the ring walks on each rank (USP: the gathered ring block, S / W)
    heads: int  # q heads on each rank (USP: H / U)
    kv_heads: int  # k/v heads on each rank (USP: H_kv / U); they travel unrepeated
    head_dim: int
    value_dim: int
    dtype: str
    ulysses_size: int  # U (1: plain ring attention)
    cases: tuple[tuple[Piece, ...], ...]  # the static cases; () where the mask hides the whole pair
    case_names: tuple[str, ...]
    case_index: tuple[tuple[int, ...], ...]  # [step][rank] -> index into `cases`

    @property
    def perm(self) -> tuple[tuple[int, int], ...]:
        """The `permute` pairs of one ring step: rank r sends to rank r + 1."""
        return tuple((rank, (rank + 1) % self.ring_size) for rank in range(self.ring_size))

    @property
    def case_table(self) -> np.ndarray:
        """int32 ``[W, W]``: ``case_table[t, r]`` is the case of rank r at step t (JAX indexes it with the traced
        axis index and switches over `cases`)."""
        return np.asarray(self.case_index, dtype=np.int32).reshape(self.ring_size, self.ring_size)

    @property
    def compute_dtype(self) -> str:
        """Scores, the softmax and its LSE, the accumulated output and dk/dv: float64 for float64, else float32."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def group(self) -> int:
        """q heads per kv head."""
        return self.heads // self.kv_heads

    def kv_block(self, step: int, rank: int) -> int:
        """The ring block whose k/v rank `rank` holds at step `step`."""
        return (rank - step) % self.ring_size

    def positions(self, block: int) -> np.ndarray:
        """Global positions of ring block `block`'s rows, in the order its rows hold them."""
        seq = self.rows * self.ring_size
        return _positions(seq, self.ring_size, self.layout, 1)[block]

    def wire_elements(self) -> int:
        """Elements of k and v one rank sends per forward step: ``B * rows * H_kv * (D + D_v)`` (GQA: unrepeated)."""
        return self.batch * self.rows * self.kv_heads * (self.head_dim + self.value_dim)


def _cases(rows: int, causal: bool, layout: str) -> tuple[tuple[str, tuple[Piece, ...]], ...]:
    """(name, pieces) of every static case of the layout; the index of each is what `case_table` holds."""
    every, half = (0, rows), rows // 2
    full = ("full", (Piece(every, every, "full"),))
    if not causal:
        return (full,)
    diagonal = ("diagonal", (Piece(every, every, "causal-diagonal"),))
    if layout == "contiguous":
        return diagonal, full, ("skip", ())
    # zigzag: q chunks (r, 2W-1-r) against kv chunks (s, 2W-1-s)
    return (diagonal,
            ("first-half", (Piece(every, (0, half), "full"),)),  # s < r: every q row sees kv chunk s only
            ("second-half", (Piece((half, rows), every, "full"),)))  # s > r: q chunk 2W-1-r sees both kv chunks


def _case_of(causal: bool, rank: int, block: int) -> int:
    """Index into `_cases`: 0 for the own block (and every non-causal pair), 1 for an earlier block, 2 later."""
    if not causal or block == rank:
        return 0
    return 1 if block < rank else 2


def ring_plan(q_shape, k_shape, v_shape, ring_size, *, causal=False, scale=None, layout="contiguous",
              dtypes=("float32",) * 3, ulysses_size=1, op_name: str = RING_OP) -> RingPlan:
    """The `RingPlan` of ``ring_attention(q, k, v, causal, scale, layout)`` over `ring_size` ranks, or of
    ``usp_attention`` (``op_name=USP_OP``, `ulysses_size` U) -- or `CommError` / `TypeError`.

    Shapes are one rank's inputs as the user holds them: q ``[B, S_r, H, D]``, k ``[B, S_r, H_kv, D]``, v
    ``[B, S_r, H_kv, D_v]``, ``S = S_r * W * U``. The ring walks ``rows = S_r * U`` rows with ``H / U`` q and
    ``H_kv / U`` kv heads (USP: after the Ulysses all-to-all).

    >>> ring_plan((1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4), 2, layout="zigzag")
    Traceback (most recent call last):
    ...
    commlib.errors.CommError: ring_attention: seq (6) must be divisible by 2 * ring_size * ulysses_size (4) for layout 'zigzag'. Received: q_shape=(1, 3, 2, 4), k_shape=(1, 3, 2, 4), v_shape=(1, 3, 2, 4), ring_size=2, layout='zigzag', ulysses_size=1
    """
    shapes = dict(q=q_shape, k=k_shape, v=v_shape)
    received: dict[str, object] = {f"{name}_shape": _shown(shape) for name, shape in shapes.items()}
    received.update(ring_size=ring_size, layout=layout, ulysses_size=ulysses_size)
    ring_size = _check_int("ring_size", ring_size, received, op_name)
    ulysses_size = _check_int("ulysses_size", ulysses_size, received, op_name)
    if layout not in SEQUENCE_LAYOUTS:
        raise comm_error(op_name, f"layout ({layout!r}) must be one of {', '.join(SEQUENCE_LAYOUTS)}", **received)
    checked = _check_shapes(shapes, received, op_name)
    q, k, v = checked["q"], checked["k"], checked["v"]
    if ulysses_size > q[2]:
        raise comm_error(op_name, f"ulysses_size ({ulysses_size}) must be <= heads ({q[2]})", **received)
    for name, heads in (("heads", q[2]), ("kv heads", k[2])):
        if heads % ulysses_size:
            raise comm_error(op_name, f"{name} ({heads}) must be divisible by ulysses_size ({ulysses_size})",
                             **received)
    _check_layout(op_name, q[1] * ring_size * ulysses_size, ring_size, layout, ulysses_size, received)
    scale = _check_options(tuple(dtypes), causal, scale, q[3], received, op_name)
    rows = q[1] * ulysses_size
    named = _cases(rows, causal, layout)
    index = tuple(tuple(_case_of(causal, rank, (rank - step) % ring_size) for rank in range(ring_size))
                  for step in range(ring_size))
    return RingPlan(op_name, ring_size, layout, causal, scale, q[0], rows, q[2] // ulysses_size,
                    k[2] // ulysses_size, q[3], v[3], str(dtypes[0]), ulysses_size,
                    tuple(pieces for _, pieces in named), tuple(name for name, _ in named), index)


# ---------------------------------------------------------------------------------------------------------
# The step rules, over an array namespace
# ---------------------------------------------------------------------------------------------------------

class ArrayMath:
    """The array operations the step rules use, over an array module `xp` (numpy, jax.numpy, torch). A frontend
    whose arrays live on devices overrides `causal_mask` to build it where `like` lives."""

    def __init__(self, xp) -> None:
        self.xp = xp

    def einsum(self, subscripts: str, *operands):
        return self.xp.einsum(subscripts, *operands)

    def exp(self, x):
        return self.xp.exp(x)

    def log(self, x):
        return self.xp.log(x)

    def logaddexp(self, x, y):
        return self.xp.logaddexp(x, y)

    def where(self, condition, x, y):
        return self.xp.where(condition, x, y)

    def max_last(self, x):
        return self.xp.amax(x, -1)

    def sum_last(self, x):
        return self.xp.sum(x, -1)

    def causal_mask(self, rows: int, like):
        """bool ``[rows, rows]``: True where column <= row."""
        return self.xp.arange(rows)[:, None] >= self.xp.arange(rows)[None, :]


def _grouped(x, kv_heads: int):
    """``[B, S, H, D] -> [B, S, H_kv, G, D]``: q head ``n * G + g`` uses kv head n."""
    batch, seq, heads, dim = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads, dim)


def _grouped_rows(x, kv_heads: int):
    """``[B, S, H] -> [B, S, H_kv, G]``."""
    batch, seq, heads = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads)


def _probabilities(math_: ArrayMath, q5, k, scale: float, mask: str, lse=None):
    """Scores ``[B, H_kv, G, Sq, Sk]`` masked by `mask`; with `lse` (``[B, Sq, H_kv, G]``) the probabilities."""
    scores = math_.einsum("bqngd,bknd->bngqk", q5, k) * scale
    if mask == "causal-diagonal":
        scores = math_.where(math_.causal_mask(scores.shape[-1], scores), scores, -math.inf)
    if lse is None:
        return scores
    return math_.exp(scores - math_.einsum("bqng->bngq", lse)[..., None])


def attend(math_: ArrayMath, q, k, v, scale: float, mask: str):
    """One piece: q ``[B, Sq, H, D]`` against k ``[B, Sk, H_kv, D]``, v ``[B, Sk, H_kv, D_v]`` (q head i using kv
    head ``i // (H // H_kv)``) -> ``(out [B, Sq, H, D_v], lse [B, Sq, H])``, softmax-normalised within the piece,
    in the dtype of the arrays given (the frontend casts to `RingPlan.compute_dtype` first). Every q row must
    see at least one kv row (the plan's pieces do)."""
    batch, rows, heads, _ = q.shape
    scores = _probabilities(math_, _grouped(q, k.shape[2]), k, scale, mask)
    top = math_.max_last(scores)
    lse = top + math_.log(math_.sum_last(math_.exp(scores - top[..., None])))
    weights = math_.exp(scores - lse[..., None])
    out = math_.einsum("bngqk,bknd->bqngd", weights, v)
    return out.reshape(batch, rows, heads, v.shape[-1]), math_.einsum("bngq->bqng", lse).reshape(batch, rows, heads)


def merge(math_: ArrayMath, out, lse, piece_out, piece_lse):
    """The online-softmax merge of two partial results over disjoint keys: ``(out [B, S, H, D_v], lse [B, S, H])``
    with ``lse = logaddexp(lse, piece_lse)`` and each output weighted by ``exp(its lse - lse)``. The LSEs must
    be finite (step 0's own block gives every row a finite one)."""
    total = math_.logaddexp(lse, piece_lse)
    merged = out * math_.exp(lse - total)[..., None] + piece_out * math_.exp(piece_lse - total)[..., None]
    return merged, total


def attend_vjp(math_: ArrayMath, q, k, v, d_out, lse, delta, scale: float, mask: str):
    """One piece's share of the gradients, FlashAttention-2's backward: the probabilities recomputed from the
    final `lse` (``[B, Sq, H]``), ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` (``[B, Sq, H]``, see
    `delta`). Returns ``(dq [B, Sq, H, D], dk [B, Sk, H_kv, D], dv [B, Sk, H_kv, D_v])``; dk/dv sum over the q
    heads that share a kv head."""
    kv_heads = k.shape[2]
    q5, d_out5 = _grouped(q, kv_heads), _grouped(d_out, kv_heads)
    weights = _probabilities(math_, q5, k, scale, mask, _grouped_rows(lse, kv_heads))
    dv = math_.einsum("bngqk,bqngd->bknd", weights, d_out5)
    d_weights = math_.einsum("bqngd,bknd->bngqk", d_out5, v)
    d_scores = weights * (d_weights - math_.einsum("bqng->bngq", _grouped_rows(delta, kv_heads))[..., None])
    dq = math_.einsum("bngqk,bknd->bqngd", d_scores, k) * scale
    dk = math_.einsum("bngqk,bqngd->bknd", d_scores, q5) * scale
    return dq.reshape(q.shape), dk, dv


def delta(math_: ArrayMath, out, d_out):
    """``rowsum(dO * O)``: ``[B, S, H, D_v] x 2 -> [B, S, H]``."""
    return math_.sum_last(out * d_out)


# ---------------------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------------------

def reference(qs, ks, vs, cotangents, ring_size: int, *, causal=False, scale=None, layout="contiguous",
              ulysses_size: int = 1):
    """float64: every shard's output and ``(dq, dk, dv)`` of attention on the whole sequence (shards in the
    layout: shard ``r * U + u`` at index ``r * U + u``): ``(outs, dqs, dks, dvs)``, lists of W * U arrays."""
    whole = [unshard_sequence(xs, 1, ring_size, layout, ulysses_size).astype(np.float64)
             for xs in (qs, ks, vs, cotangents)]
    out = attention(*whole[:3], causal=causal, scale=scale)
    grads = attention_vjp(*whole, causal=causal, scale=scale)
    return tuple(shard_sequence(x, 1, ring_size, layout, ulysses_size) for x in (out, *grads))


NUMPY = ArrayMath(np)


def _pieces(plan: RingPlan, step: int, rank: int) -> tuple[Piece, ...]:
    return plan.cases[plan.case_index[step][rank]]


def _send(plan: RingPlan, held: list) -> list:
    """`permute` over `plan.perm` on simulated ranks: rank dst gets rank src's value."""
    moved = list(held)
    for src, dst in plan.perm:
        moved[dst] = held[src]
    return moved


def simulate_ring(plan: RingPlan, qs, ks, vs, cotangents=None):
    """The ring walked on W simulated numpy ranks (float64), as the frontends walk it: ``outs`` (and, with
    `cotangents`, ``(outs, dqs, dks, dvs)``), lists of W arrays in the ring layout."""
    W = plan.ring_size
    qs, ks, vs = ([np.asarray(x, dtype=np.float64) for x in xs] for xs in (qs, ks, vs))
    outs: list = [None] * W
    lses: list = [None] * W
    held = list(zip(ks, vs, strict=True))
    for step in range(W):
        for rank in range(W):
            k, v = held[rank]
            for piece in _pieces(plan, step, rank):
                rows = slice(*piece.q)
                part = attend(NUMPY, qs[rank][:, rows], k[:, slice(*piece.kv)], v[:, slice(*piece.kv)],
                              plan.scale, piece.mask)
                if outs[rank] is None:  # step 0: the own block covers every row
                    outs[rank], lses[rank] = part
                else:
                    outs[rank][:, rows], lses[rank][:, rows] = merge(NUMPY, outs[rank][:, rows],
                                                                     lses[rank][:, rows], *part)
        if step < W - 1:
            held = _send(plan, held)
    if cotangents is None:
        return outs
    return outs, *_simulate_vjp(plan, qs, ks, vs, outs, lses, cotangents)


def _simulate_vjp(plan: RingPlan, qs, ks, vs, outs, lses, cotangents):
    W = plan.ring_size
    d_outs = [np.asarray(x, dtype=np.float64) for x in cotangents]
    deltas = [delta(NUMPY, out, d_out) for out, d_out in zip(outs, d_outs, strict=True)]
    dqs = [np.zeros_like(q) for q in qs]
    held = [(k, v, np.zeros_like(k), np.zeros_like(v)) for k, v in zip(ks, vs, strict=True)]
    for step in range(W):
        for rank in range(W):
            k, v, dk, dv = held[rank]
            for piece in _pieces(plan, step, rank):
                rows, keys = slice(*piece.q), slice(*piece.kv)
                dq_part, dk_part, dv_part = attend_vjp(NUMPY, qs[rank][:, rows], k[:, keys], v[:, keys],
                                                       d_outs[rank][:, rows], lses[rank][:, rows],
                                                       deltas[rank][:, rows], plan.scale, piece.mask)
                dqs[rank][:, rows] += dq_part
                dk[:, keys] += dk_part
                dv[:, keys] += dv_part
        held = _send(plan, held)  # W - 1 hops with k/v, the last one brings dk/dv home
    return dqs, [dk for _, _, dk, _ in held], [dv for _, _, _, dv in held]
