"""Train a Flux-style MMDiT block (diffusers' ``FluxTransformerBlock``, the double-stream block of
examples/diffusers_dit.py's tiny Flux, ported to Flax nnx) sequence-parallel over 4 CPU devices with commlib's joint
attention, and check it against the same block trained unsharded in this process (float64, optax adamw, ``jax.jit``
of the whole step). Exit status 1 if any step's output or any parameter's gradient differs by more than 1e-10
relative, or any step's loss by more than 1e-12.

    python examples/dit_jax.py --attention ulysses                        # 16 image tokens, 4 a device
    python examples/dit_jax.py --attention ulysses --height 3 --width 5   # 15: shards of 4, 4, 4, 3 rows
    python examples/dit_jax.py --attention ring                           # zigzag
    python examples/dit_jax.py --attention usp                            # a 2 x 2 mesh ("ring", "ulysses")

The block: adaLN-zero modulation of both streams from the time embedding ``temb``, one attention over
``[text | image]`` (q, k RMSNorm per head, Flux's RoPE on the image tokens' (0, row, col) ids; the text's ids are
0, where the rotation is the identity), a gated GELU MLP per stream. The 5 text tokens are the same on every device;
the image tokens of a ``height x width`` grid are sharded by a `commlib.SequenceLayout`, and the attention is
commlib_jax's `ulysses_attention`, `ring_attention` or `usp_attention` with ``joint_q``, ``joint_k``, ``joint_v``
(the text's q, k, v) and ``joint_position="front"``, which returns this device's image rows and the whole text
output. Ring and USP take joint tensors only over even shards (16 tokens: 4 a device); Ulysses over any.

The recipe (what a user writes): inside ``jax.shard_map`` each device takes its image rows and RoPE rows with
`commlib_jax.sequence.shard_sequence`, runs the block, and returns its share of the loss: the squared error of its
image rows over the whole image's element count plus the text output's mean squared error over the world size
(the text output is the same on every device; each device's 1/W share sums to it).
`commlib_jax.training.value_and_grad` sums the shares and the gradients of each device's own parameter copy, as
torch's ``backward()`` and ``sync_gradients`` do: the unsharded loss and gradients, typed replicated, so they leave
the shard_map with ``P()`` and feed optax in the same jitted step. The unsharded block attends with
`commlib_jax.attention.attention` over the concatenation (float64 softmax; ``jax.nn.dot_product_attention`` takes it
in float32 whatever the dtype, jax 0.10).

`FLUX_TO_FLAX` is the port's parameter map (diffusers' names, ``Linear [out, in]`` -> ``Dense [in, out]``):
tests/jax/test_dit_parity.py runs diffusers' own block with this block's weights and compares the loss and every
gradient (float64, 1e-10).
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
from commlib.testing import LINEAR, ParameterMap  # noqa: E402
from commlib_jax import sequence  # noqa: E402
from commlib_jax.attention import attention as local_attention  # noqa: E402
from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention  # noqa: E402
from commlib_jax.training import value_and_grad  # noqa: E402

TOLERANCE = 1e-10  # every step: the image output, every parameter's gradient (relative, float64)
LOSS_TOLERANCE = 1e-12  # every adamw step's loss
HEADS, HEAD_DIM, TEXT = 4, 8, 5  # examples/diffusers_dit.py's Flux: 4 heads of 8, 5 text tokens
DIM = HEADS * HEAD_DIM
AXES_DIMS, THETA = (2, 2, 4), 10000  # Flux's RoPE: (0, row, col) ids, 2 + 2 + 4 = HEAD_DIM
WORLD = 4

#: diffusers' ``FluxTransformerBlock`` linear layers -> this block's (``.weight [out, in]`` -> ``.kernel [in, out]``).
_LINEARS = {
    "norm1.linear": "norm1.linear",
    "norm1_context.linear": "norm1_context.linear",
    **{f"attn.{name}": f"attn.{name}" for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")},
    "attn.to_out.0": "attn.to_out",
    "attn.to_add_out": "attn.to_add_out",
    "ff.net.0.proj": "ff.hidden",
    "ff.net.2": "ff.out",
    "ff_context.net.0.proj": "ff_context.hidden",
    "ff_context.net.2": "ff_context.out",
}
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")  # RMSNorm's .weight -> .scale
FLUX_TO_FLAX = ParameterMap(
    [
        *[(f"{torch}.weight", f"{flax}.kernel", LINEAR) for torch, flax in _LINEARS.items()],
        *[(f"{torch}.bias", f"{flax}.bias") for torch, flax in _LINEARS.items()],
        *[(f"attn.{norm}.weight", f"attn.{norm}.scale") for norm in _NORMS],
    ]
)


def rope_table(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Flux's RoPE (diffusers' ``FluxPosEmbed(10000, (2, 2, 4))``) of the image ids ``(0, row, col)`` of a
    ``height x width`` grid in row-major order: cos and sin ``[height * width, HEAD_DIM]``, float64, each
    frequency repeated for its (real, imaginary) pair."""
    rows, cols = np.divmod(np.arange(height * width), width)
    cos, sin = [], []
    for positions, dim in zip((np.zeros_like(rows), rows, cols), AXES_DIMS, strict=True):
        angles = positions[:, None] * (1.0 / THETA ** (np.arange(0, dim, 2) / dim))[None]
        cos.append(np.repeat(np.cos(angles), 2, axis=1))
        sin.append(np.repeat(np.sin(angles), 2, axis=1))
    return np.concatenate(cos, axis=1), np.concatenate(sin, axis=1)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """diffusers' ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` (pairs interleaved): x ``[B, S, H, D]``,
    cos and sin ``[S, D]``."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return x * cos[None, :, None] + rotated * sin[None, :, None]


def layer_norm(x: jax.Array) -> jax.Array:
    """``nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)``."""
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)


def dense(inputs: int, outputs: int, rngs: nnx.Rngs) -> nnx.Linear:
    bias = nnx.initializers.normal(0.02)  # nonzero biases, so the port's bias mapping is exercised
    return nnx.Linear(inputs, outputs, bias_init=bias, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)


def rms_norm(rngs: nnx.Rngs) -> nnx.RMSNorm:
    scale = nnx.initializers.uniform(1.0)  # not all ones: the scale's mapping and gradient count
    return nnx.RMSNorm(HEAD_DIM, epsilon=1e-6, scale_init=scale, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)


class AdaNorm(nnx.Module):
    """diffusers' ``AdaLayerNormZero``: ``linear(silu(temb))`` cut in 6; x normalised and modulated by the first 2."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = dense(DIM, 6 * DIM, rngs)

    def __call__(self, x: jax.Array, temb: jax.Array) -> tuple[jax.Array, ...]:
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = jnp.split(self.linear(jax.nn.silu(temb)), 6, axis=-1)
        return layer_norm(x) * (1 + scale[:, None]) + shift[:, None], gate, shift_mlp, scale_mlp, gate_mlp


class FeedForward(nnx.Module):
    """diffusers' ``FeedForward(DIM, activation_fn="gelu-approximate")``: 4x wide, tanh GELU."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = dense(DIM, 4 * DIM, rngs)
        self.out = dense(4 * DIM, DIM, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.hidden(x), approximate=True))


class JointAttention(nnx.Module):
    """diffusers' ``FluxAttention`` with ``FluxAttnProcessor``: the image and text projections, RMSNorm on q and k
    per head, RoPE on the image q and k, `attend` over ``[text | image]``, the two output projections."""

    def __init__(self, rngs: nnx.Rngs):
        self.to_q, self.to_k, self.to_v = (dense(DIM, DIM, rngs) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (dense(DIM, DIM, rngs) for _ in range(3))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (rms_norm(rngs) for _ in range(4))
        self.to_out = dense(DIM, DIM, rngs)
        self.to_add_out = dense(DIM, DIM, rngs)

    def __call__(self, x: jax.Array, text: jax.Array, cos: jax.Array, sin: jax.Array, attend) -> tuple[jax.Array, ...]:
        def heads(y: jax.Array) -> jax.Array:
            return y.reshape(*y.shape[:2], HEADS, HEAD_DIM)

        q = rotate(self.norm_q(heads(self.to_q(x))), cos, sin)
        k = rotate(self.norm_k(heads(self.to_k(x))), cos, sin)
        v = heads(self.to_v(x))
        text_q = self.norm_added_q(heads(self.add_q_proj(text)))  # ids 0: RoPE is the identity there
        text_k = self.norm_added_k(heads(self.add_k_proj(text)))
        text_v = heads(self.add_v_proj(text))
        out, text_out = attend(q, k, v, text_q, text_k, text_v)
        return self.to_out(out.reshape(*x.shape[:2], DIM)), self.to_add_out(text_out.reshape(*text.shape[:2], DIM))


class Block(nnx.Module):
    """diffusers' ``FluxTransformerBlock(DIM, HEADS, HEAD_DIM)``: image rows ``[B, S_r, DIM]``, the text ``[B, TEXT,
    DIM]``, ``temb [B, DIM]``, the image rows' RoPE ``[S_r, HEAD_DIM]`` -> ``(text, image)`` outputs (float64)."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = AdaNorm(rngs)
        self.norm1_context = AdaNorm(rngs)
        self.attn = JointAttention(rngs)
        self.ff = FeedForward(rngs)
        self.ff_context = FeedForward(rngs)

    def __call__(self, x, text, temb, cos, sin, attend) -> tuple[jax.Array, jax.Array]:
        norm_x, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)
        norm_text, text_gate, text_shift_mlp, text_scale_mlp, text_gate_mlp = self.norm1_context(text, temb)
        out, text_out = self.attn(norm_x, norm_text, cos, sin, attend)
        x = x + gate[:, None] * out
        x = x + gate_mlp[:, None] * self.ff(layer_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None])
        text = text + text_gate[:, None] * text_out
        modulated = layer_norm(text) * (1 + text_scale_mlp[:, None]) + text_shift_mlp[:, None]
        return text + text_gate_mlp[:, None] * self.ff_context(modulated), x


def unsharded_attend(q, k, v, text_q, text_k, text_v):
    """One softmax over ``[text | image]`` (float64), cut back into the image and text rows."""
    out = local_attention(*(jnp.concatenate(pair, axis=1) for pair in ((text_q, q), (text_k, k), (text_v, v))))
    return out[:, TEXT:], out[:, :TEXT]


def setup(attention: str, tokens: int, ulysses_size: int):
    """The layout, the mesh, the axes the image tokens are sharded over (device i of the mesh's row-major order
    holds shard i) and the joint attention of `attention` on this device's rows."""
    joint = {"joint_position": "front"}
    if attention == "usp":
        layout = commlib.SequenceLayout(
            tokens, ring_size=WORLD // ulysses_size, ulysses_size=ulysses_size, layout="zigzag"
        )
        mesh = Mesh(np.array(jax.devices()[:WORLD]).reshape(WORLD // ulysses_size, ulysses_size), ("ring", "ulysses"))

        def attend(q, k, v, text_q, text_k, text_v):
            return usp_attention(
                q, k, v, "ulysses", "ring", layout=layout, joint_q=text_q, joint_k=text_k, joint_v=text_v, **joint
            )

        return layout, mesh, ("ring", "ulysses"), attend  # shard index r * U + u
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("sp",))
    if attention == "ring":
        layout = commlib.SequenceLayout(tokens, ring_size=WORLD, layout="zigzag")
        layer = ring_attention
    else:
        layout = commlib.SequenceLayout(tokens, ulysses_size=WORLD)
        layer = ulysses_attention

    def attend(q, k, v, text_q, text_k, text_v):
        return layer(q, k, v, "sp", layout=layout, joint_q=text_q, joint_k=text_k, joint_v=text_v, **joint)

    return layout, mesh, "sp", attend


def sharded_step(graphdef, optimizer, layout, mesh, axes, attend, rope):
    """The jitted sharded step: ``(params, opt_state, x, text, temb, target, text_target) -> (params, opt_state,
    loss, grads, out)``; out ``[B, W * max_size, DIM]``, every device's padded image shard in shard order."""
    cos, sin = (jnp.asarray(table) for table in rope)

    def loss(params, x, text, temb, target, text_target):
        rows = [sequence.shard_sequence(a, layout, axes) for a in (x, target)]  # padding rows: 0
        cos_rows, sin_rows = (sequence.shard_sequence(table, layout, axes, dim=0) for table in (cos, sin))
        valid = sequence.shard_sequence(jnp.ones(layout.seq_len), layout, axes, dim=0)[None, :, None]
        text_out, out = nnx.merge(graphdef, params)(rows[0], text, temb, cos_rows, sin_rows, attend)
        image = jnp.sum(valid * (out - rows[1]) ** 2) / target.size  # this device's share of the image's mean
        return image + jnp.mean((text_out - text_target) ** 2) / layout.world_size, out

    body = value_and_grad(loss, axes, has_aux=True)
    gradients = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 6, out_specs=((P(), P(None, axes)), P()))

    @jax.jit
    def step(params, opt_state, *batch):
        (value, out), grads = gradients(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads, out

    return step


def unsharded_loss(graphdef, rope):
    """The block's loss on the whole image: ``(params, x, text, temb, target, text_target) -> (loss, out)``."""
    cos, sin = (jnp.asarray(table) for table in rope)

    def loss(params, x, text, temb, target, text_target):
        text_out, out = nnx.merge(graphdef, params)(x, text, temb, cos, sin, unsharded_attend)
        return jnp.mean((out - target) ** 2) + jnp.mean((text_out - text_target) ** 2), out

    return loss


def unsharded_step(graphdef, optimizer, rope):
    """The jitted reference step (`unsharded_loss`)."""
    differentiate = jax.value_and_grad(unsharded_loss(graphdef, rope), has_aux=True)

    @jax.jit
    def step(params, opt_state, *batch):
        (value, out), grads = differentiate(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads, out

    return step


def batch(size: int, tokens: int, seed: int = 1) -> tuple[np.ndarray, ...]:
    """Seeded float64 inputs and targets: image ``[B, tokens, DIM]``, text ``[B, TEXT, DIM]``, temb ``[B, DIM]``,
    the image's target, the text's target."""
    rng = np.random.default_rng(seed)
    shapes = ((size, tokens, DIM), (size, TEXT, DIM), (size, DIM), (size, tokens, DIM), (size, TEXT, DIM))
    return tuple(rng.standard_normal(shape) for shape in shapes)


def relative(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-300))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=("ulysses", "ring", "usp"), default="ulysses")
    parser.add_argument("--height", type=int, default=4, help="the image grid's rows")
    parser.add_argument("--width", type=int, default=4, help="the image grid's columns")
    parser.add_argument("--ulysses-size", type=int, default=2, help="USP's Ulysses axis size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    tokens = args.height * args.width
    layout, mesh, axes, attend = setup(args.attention, tokens, args.ulysses_size)
    rope = rope_table(args.height, args.width)
    graphdef, params = nnx.split(Block(nnx.Rngs(0)), nnx.Param)
    optimizer = optax.adamw(1e-3)
    inputs = tuple(jnp.asarray(a) for a in batch(args.batch, tokens))
    states = {"sharded": (params, optimizer.init(params)), "unsharded": (params, optimizer.init(params))}
    step = sharded_step(graphdef, optimizer, layout, mesh, axes, attend, rope)
    reference = unsharded_step(graphdef, optimizer, rope)
    errors = {"loss": 0.0, "output": 0.0, "gradients": 0.0}
    for number in range(1, args.steps + 1):
        *states["sharded"], loss, grads, out = step(*states["sharded"], *inputs)
        *states["unsharded"], want, want_grads, want_out = reference(*states["unsharded"], *inputs)
        whole = layout.unshard(np.split(np.asarray(out), layout.world_size, axis=1), dim=1, padded=True)
        errors["loss"] = max(errors["loss"], relative(loss, want))
        errors["output"] = max(errors["output"], relative(whole, want_out))
        errors["gradients"] = max(errors["gradients"], *jax.tree.leaves(jax.tree.map(relative, grads, want_grads)))
        print(f"step {number:3d}  loss {float(loss):.12f}  unsharded {float(want):.12f}", flush=True)
    passed = errors["loss"] <= LOSS_TOLERANCE and errors["output"] <= TOLERANCE and errors["gradients"] <= TOLERANCE
    shown = ", ".join(f"{name} {value:.1e}" for name, value in errors.items())
    print(
        f"{'PASS' if passed else 'FAIL'}: {args.attention} W={layout.world_size} tokens={tokens} text={TEXT} "
        f"sizes={layout.sizes}, {args.steps} adamw steps; relative errors {shown}",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
