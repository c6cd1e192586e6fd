"""Train a Flax nnx decoder (GQA: 8 query heads, 2 kv heads; RoPE, SwiGLU, RMSNorm) sequence-parallel over 4 CPU
devices with commlib's attention swapped in for ``jax.nn.dot_product_attention``, and check it against the same model
trained unsharded in this process (float64, optax adamw, ``jax.jit`` of the whole step). Exit status 1 if the first
step's loss, logits or any parameter's gradient differs by more than 1e-10 relative, or any adamw step's loss by more
than 1e-12.

    python examples/flax_llama.py --attention ulysses --seq-len 30
    python examples/flax_llama.py --attention ring --seq-len 30    # zigzag
    python examples/flax_llama.py --attention usp --seq-len 32     # a 2 x 2 mesh ("ring", "ulysses")
    python examples/flax_llama.py --attention ring --seq-len 32 --packed

``--packed``: each row packs documents of random lengths (some shorter than a shard, some crossing shard
boundaries) and ends in padding. `shard_tokens(..., segment_ids=)` gives the positions that restart at each document,
the labels that stop at each document's end and the shard's segment ids, which the model hands its attention
(``dot_product_attention(..., segment_ids=)``); the reference is the unsharded model with the same segment ids and
document positions. The positions are then document positions, not global ones, so the attention is not handed
``positions=`` (which checks global positions).

The recipe (what a user writes): the model calls `commlib_jax.sequence.dot_product_attention` where it would call
``jax.nn.dot_product_attention``; inside ``jax.shard_map`` each device takes its shard of the full tokens with their
GLOBAL positions (RoPE) and globally shifted labels (`shard_tokens`, padded to ``layout.max_size`` rows), the loss is
`cross_entropy` (the mean over every device's tokens) and `commlib_jax.training.value_and_grad` takes the gradient:
the global mean as the loss, the unsharded gradients, typed replicated so they leave the shard_map with ``P()``
and feed optax outside it, in the same jitted step. Inside the context the helpers' layout and axes must be the
context's (they may be left out), and the attention is handed the positions RoPE used (``positions=``), which it
checks against the layout's on every rank: local positions, or tokens sharded another way, raise instead of
training silently wrong.

The context and jit: `dot_product_attention` reads the innermost ``commlib_jax.sequence.parallel`` context when it is
traced (the context is part of jit's cache key: a step traced in another context is traced again). So the step is
built and called (so traced) inside ``with parallel(...)``: the whole training loop runs in the context, and the one
jitted step is traced once there.
The unsharded model passes its own attention function (the model takes it as an argument), so it never reads the
context: `unsharded_attention`, ``jax.nn.dot_product_attention``'s math through `commlib_jax.attention.attention`,
because ``jax.nn.dot_product_attention`` itself takes the softmax in float32 whatever the dtype (jax 0.10), which
caps a float64 model at ~1e-7 relative; commlib's layers keep float64 (their default local attention is that one).
"""

from __future__ import annotations

import argparse
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)  # before JAX's first use
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import commlib  # noqa: E402
from commlib.sequence_helpers import document_labels, document_positions  # noqa: E402
from commlib_jax import sequence  # noqa: E402
from commlib_jax.attention import attention as local_attention  # noqa: E402
from commlib_jax.training import value_and_grad  # noqa: E402

TOLERANCE = 1e-10  # the first step: loss, logits, every parameter's gradient (relative, float64)
LOSS_TOLERANCE = 1e-12  # every adamw step's loss
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, INTERMEDIATE = 64, 2, 8, 2, 256, 128
HEAD_DIM = HIDDEN // HEADS
WORLD = 4


def rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary embedding of ``x [B, T, N, D]`` at ``positions [B, T]`` (Llama's rotate-half form)."""
    inverse = 1.0 / theta ** (jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float64) / HEAD_DIM)
    angles = positions[..., None].astype(jnp.float64) * inverse  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    half = HEAD_DIM // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def linear(inputs: int, outputs: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(inputs, outputs, use_bias=False, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)


def unsharded_attention(query, key, value, *, is_causal: bool = False, positions=None, segment_ids=None) -> jax.Array:
    """``jax.nn.dot_product_attention(query, key, value, is_causal=...)`` on the whole sequence with the softmax in
    the inputs' float64 (jax.nn's own takes it in float32), masked by `segment_ids` where given; `positions`
    (0..S-1 here) is not needed."""
    return local_attention(query, key, value, causal=is_causal, segment_ids=segment_ids)


class Attention(nnx.Module):
    """Causal GQA self-attention with RoPE; `attention` is ``jax.nn.dot_product_attention`` or its commlib drop-in."""

    def __init__(self, rngs: nnx.Rngs):
        self.query = linear(HIDDEN, HEADS * HEAD_DIM, rngs)
        self.key = linear(HIDDEN, KV_HEADS * HEAD_DIM, rngs)
        self.value = linear(HIDDEN, KV_HEADS * HEAD_DIM, rngs)
        self.output = linear(HEADS * HEAD_DIM, HIDDEN, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attention, segment_ids=None) -> jax.Array:
        batch, rows, _ = x.shape
        q = rope(self.query(x).reshape(batch, rows, HEADS, HEAD_DIM), positions)
        k = rope(self.key(x).reshape(batch, rows, KV_HEADS, HEAD_DIM), positions)
        v = self.value(x).reshape(batch, rows, KV_HEADS, HEAD_DIM)
        if segment_ids is None:
            out = attention(q, k, v, is_causal=True, positions=positions)  # commlib checks RoPE's positions
        else:  # packed documents: positions restart at each one (not the global ones positions= checks)
            out = attention(q, k, v, is_causal=True, segment_ids=segment_ids)
        return self.output(out.reshape(batch, rows, HEADS * HEAD_DIM))


class Layer(nnx.Module):
    """A pre-norm decoder layer: RMSNorm, attention, RMSNorm, SwiGLU MLP, each with its residual."""

    def __init__(self, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(HIDDEN, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)
        self.attention = Attention(rngs)
        self.mlp_norm = nnx.RMSNorm(HIDDEN, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)
        self.gate = linear(HIDDEN, INTERMEDIATE, rngs)
        self.up = linear(HIDDEN, INTERMEDIATE, rngs)
        self.down = linear(INTERMEDIATE, HIDDEN, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attention, segment_ids=None) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), positions, attention, segment_ids)
        y = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(y)) * self.up(y))


class Decoder(nnx.Module):
    """Token embedding, `LAYERS` decoder layers, a final RMSNorm and the vocabulary projection: ids ``[B, T]`` and
    their global positions ``[B, T]`` -> logits ``[B, T, VOCAB]`` (float64)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, HIDDEN, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(HIDDEN, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)
        self.head = linear(HIDDEN, VOCAB, rngs)

    def __call__(
        self, ids: jax.Array, positions: jax.Array, attention=unsharded_attention, segment_ids=None
    ) -> jax.Array:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, positions, attention, segment_ids)
        return self.head(self.norm(x))


def setup(attention: str, seq_len: int, ulysses_size: int):
    """The layout, the mesh, the axes the sequence is sharded over (device i of the mesh's row-major order holds
    shard i) and the `parallel` context of `attention`."""
    if attention == "usp":
        layout = commlib.SequenceLayout(
            seq_len, ring_size=WORLD // ulysses_size, ulysses_size=ulysses_size, layout="zigzag"
        )
        mesh = Mesh(np.array(jax.devices()[:WORLD]).reshape(WORLD // ulysses_size, ulysses_size), ("ring", "ulysses"))
        axes = ("ring", "ulysses")  # shard index r * U + u
        return layout, mesh, axes, sequence.parallel(layout, attention="usp", ulysses_axis="ulysses", ring_axis="ring")
    if attention == "ring":
        layout = commlib.SequenceLayout(seq_len, ring_size=WORLD, layout="zigzag")
    else:
        layout = commlib.SequenceLayout(seq_len, ulysses_size=WORLD)
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("sp",))
    return layout, mesh, "sp", sequence.parallel(layout, "sp", attention=attention)


def sharded_step(graphdef, optimizer, layout, mesh, axes):
    """The jitted sharded step: ``(params, opt_state, input_ids) -> (params, opt_state, loss, grads, logits)``;
    logits ``[B, W * max_size, V]``, every device's padded shard in shard order."""

    def loss(params, input_ids, segments):
        if segments is None:
            ids, positions, labels = sequence.shard_tokens(input_ids, layout, axes)
            mine = None
        else:  # packed documents: positions and labels per document, this shard's segment ids
            ids, positions, labels, mine = sequence.shard_tokens(input_ids, layout, axes, segment_ids=segments)
        logits = nnx.merge(graphdef, params)(ids, positions, sequence.dot_product_attention, mine)
        return sequence.cross_entropy(logits, labels, axes), logits

    body = value_and_grad(loss, axes, has_aux=True)
    gradients = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=((P(), P(None, axes)), P()))

    @jax.jit
    def step(params, opt_state, input_ids, segments=None):
        (value, logits), grads = gradients(params, input_ids, segments)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads, logits

    return step


def unsharded_step(graphdef, optimizer):
    """The jitted reference step on the whole sequence (`unsharded_attention`)."""

    def loss(params, input_ids, segments):
        if segments is None:
            logits = nnx.merge(graphdef, params)(
                input_ids, jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
            )
            token_losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], input_ids[:, 1:])
            return token_losses.mean(), logits
        positions, labels, documents = segments  # packed: document positions, labels ignored at documents' ends
        logits = nnx.merge(graphdef, params)(input_ids, positions, unsharded_attention, documents)
        valid = labels >= 0
        token_losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
        return jnp.sum(jnp.where(valid, token_losses, 0)) / valid.sum(), logits

    @jax.jit
    def step(params, opt_state, input_ids, segments=None):
        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params, input_ids, segments)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads, logits

    return step


def packed_documents(batch: int, seq_len: int, seed: int) -> np.ndarray:
    """Segment ids ``[batch, seq_len]``: per row, documents of random lengths 1..seq_len/3 packed in order, then
    1..seq_len/8 tokens of padding (-1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        padding = int(rng.integers(1, max(2, seq_len // 8 + 1)))
        lengths: list[int] = []
        while sum(lengths) < seq_len - padding:
            lengths.append(min(int(rng.integers(1, max(2, seq_len // 3 + 1))), seq_len - padding - sum(lengths)))
        rows.append(commlib.segment_ids(lengths, seq_len))
    return np.stack(rows)


def relative(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-300))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=("ulysses", "ring", "usp"), default="ulysses")
    parser.add_argument("--seq-len", type=int, default=30)
    parser.add_argument("--ulysses-size", type=int, default=2, help="USP's Ulysses axis size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--packed", action="store_true", help="packed documents of random lengths and padding")
    args = parser.parse_args()
    layout, mesh, axes, sequence_parallel = setup(args.attention, args.seq_len, args.ulysses_size)
    graphdef, params = nnx.split(Decoder(nnx.Rngs(0)), nnx.Param)
    optimizer = optax.adamw(1e-3)
    input_ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq_len), 0, VOCAB)
    sharded_documents = unsharded_documents = None
    if args.packed:  # the same documents for both: segment ids, and the unsharded positions and labels
        segments = packed_documents(args.batch, args.seq_len, seed=2)
        sharded_documents = jnp.asarray(segments)
        unsharded_documents = (
            jnp.asarray(document_positions(segments)),
            jnp.asarray(document_labels(np.asarray(input_ids), segments, -1)),
            sharded_documents,
        )
    states = {"sharded": (params, optimizer.init(params)), "unsharded": (params, optimizer.init(params))}
    reference = unsharded_step(graphdef, optimizer)
    errors = {"loss": 0.0, "logits": 0.0, "gradients": 0.0}
    with sequence_parallel:  # the sharded step is traced (at its first call) inside the context
        step = sharded_step(graphdef, optimizer, layout, mesh, axes)
        for number in range(1, args.steps + 1):
            *states["sharded"], loss, grads, logits = step(*states["sharded"], input_ids, sharded_documents)
            *states["unsharded"], want, want_grads, want_logits = reference(
                *states["unsharded"], input_ids, unsharded_documents
            )
            errors["loss"] = max(errors["loss"], relative(loss, want))
            if number == 1:
                shards = np.split(np.asarray(logits), layout.world_size, axis=1)
                errors["logits"] = relative(layout.unshard(shards, dim=1, padded=True), want_logits)
                errors["gradients"] = max(jax.tree.leaves(jax.tree.map(relative, grads, want_grads)))
            print(f"step {number:3d}  loss {float(loss):.12f}  unsharded {float(want):.12f}", flush=True)
    passed = errors["loss"] <= LOSS_TOLERANCE and errors["logits"] <= TOLERANCE and errors["gradients"] <= TOLERANCE
    shown = ", ".join(f"{name} {value:.1e}" for name, value in errors.items())
    print(
        f"{'PASS' if passed else 'FAIL'}: {args.attention} W={layout.world_size} S={args.seq_len} "
        f"sizes={layout.sizes}{' packed' if args.packed else ''}, {args.steps} adamw steps; relative errors {shown}",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
