"""Check a port: the transformers Llama of examples/transformers_llama.py against its Flax port (the decoder of
examples/flax_llama.py: RMSNorm eps 1e-6, RoPE theta 10000 in the rotate-half layout, SwiGLU, GQA 8 query / 2 kv
heads, untied embeddings, as the config), the same weights, both sequence-parallel under Ulysses over W = 4 (4 gloo
ranks, 4 JAX CPU devices), float64. Exit status 0 when the logits, the loss and every parameter's gradient agree
within 1e-10 relative and the two traces of commlib calls agree call for call; else 1, printing the first
diverging call.

    python examples/port_check.py                          # exit 0: the port agrees
    python examples/port_check.py --bug local-positions    # exit 1: the JAX side's RoPE fed local positions
    python examples/port_check.py --bug none --bug local-positions   # both ports against one torch run (CI)

How: the torch side runs as ``torchrun --nproc-per-node 4 examples/port_check.py --side torch`` (a subprocess: torch
and JAX never share a process), each rank recording its commlib calls during the forward
(`commlib_torch.testing.record`), then ``python examples/port_check.py --side jax`` on 4 CPU devices with the
torch weights mapped into the Flax model (`torch_to_flax`: Linear ``[out, in]`` -> Dense ``[in, out]``), recording
its forward under ``jax.jit`` (`commlib_jax.testing.record`). This process compares the results and the
traces (`commlib.testing.first_divergence`): a wrong port is reported at the first commlib call whose
inputs differ, with both call sites (``model.layers.0.self_attn`` and ``layers.0.attention``), not at the loss.

transformers (5.24) takes RMSNorm's variance and RoPE's angles in float32 whatever the model's dtype, which caps a
float64 comparison with any other implementation near float32's precision (with the stock modules: logits 1.0e-7,
gradients 2.8e-7 relative, and the traces part at layer 0's attention, q, k and v on every rank, ~1e-7): the torch
side runs those two modules in
float64 (`Float64RMSNorm`, `Float64RotaryEmbedding`: the same math in the input's dtype), as the Flax port does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from commlib.testing import LINEAR, ParameterMap, Trace, first_divergence

TOLERANCE = 1e-10  # relative: logits, loss, every parameter's gradient (float64)
WORLD, SEED, DATA_SEED, VOCAB = 4, 0, 1, 256
HERE = Path(__file__).resolve().parent


# The port's weight mapping: transformers' names <-> the Flax decoder's paths (Linear [out, in] is Dense [in, out]).
LLAMA_TO_FLAX = ParameterMap(
    [
        ("model.embed_tokens.weight", "embed.embedding"),
        ("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.attention_norm.scale"),
        ("model.layers.{layer}.self_attn.q_proj.weight", "layers.{layer}.attention.query.kernel", LINEAR),
        ("model.layers.{layer}.self_attn.k_proj.weight", "layers.{layer}.attention.key.kernel", LINEAR),
        ("model.layers.{layer}.self_attn.v_proj.weight", "layers.{layer}.attention.value.kernel", LINEAR),
        ("model.layers.{layer}.self_attn.o_proj.weight", "layers.{layer}.attention.output.kernel", LINEAR),
        ("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.mlp_norm.scale"),
        ("model.layers.{layer}.mlp.gate_proj.weight", "layers.{layer}.gate.kernel", LINEAR),
        ("model.layers.{layer}.mlp.up_proj.weight", "layers.{layer}.up.kernel", LINEAR),
        ("model.layers.{layer}.mlp.down_proj.weight", "layers.{layer}.down.kernel", LINEAR),
        ("model.norm.weight", "norm.scale"),
        ("lm_head.weight", "head.kernel", LINEAR),
    ]
)


def tokens(batch: int, seq_len: int) -> np.ndarray:
    """The seeded token ids ``[B, S]`` both sides feed."""
    return np.random.default_rng(DATA_SEED).integers(0, VOCAB, (batch, seq_len))


def torch_side(out: Path, batch: int, seq_len: int) -> None:
    """One gloo rank: the float64 transformers Llama with commlib's attention under Ulysses, its forward recorded;
    writes this rank's trace and logits, and (rank 0) the loss, the weights and the synced gradients."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    import commlib
    from commlib_torch.integrations.transformers import register
    from commlib_torch.sequence import cross_entropy, parallel, shard_tokens, sync_gradients
    from commlib_torch.testing import record

    class Float64RMSNorm(modeling_llama.LlamaRMSNorm):
        """LlamaRMSNorm with the variance in the input's dtype (transformers takes it in float32)."""

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    class Float64RotaryEmbedding(modeling_llama.LlamaRotaryEmbedding):
        """Llama's default RoPE (rotate-half cos / sin) with the angles in float64 (transformers: float32)."""

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
            dim = self.config.hidden_size // self.config.num_attention_heads
            inverse = 1.0 / self.config.rope_parameters["rope_theta"] ** (
                torch.arange(0, dim, 2, dtype=torch.float64) / dim
            )
            angles = position_ids[..., None].to(torch.float64) * inverse
            angles = torch.cat((angles, angles), dim=-1)
            return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    register()
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        attention_dropout=0.0,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM._from_config(config, attn_implementation="commlib", dtype=torch.float64)
    for module in model.modules():
        if type(module) is modeling_llama.LlamaRMSNorm:
            module.__class__ = Float64RMSNorm
    model.model.rotary_emb.__class__ = Float64RotaryEmbedding
    layout = commlib.SequenceLayout(seq_len, ulysses_size=dist.get_world_size())
    ids, position_ids, labels = shard_tokens(torch.as_tensor(tokens(batch, seq_len)), layout)
    with parallel(layout, attention="ulysses"):
        with record() as trace:
            logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        loss = cross_entropy(logits, labels)
        loss.backward()
    sync_gradients(model.parameters())
    trace.save(out / f"torch_trace_{rank}.npz")
    np.save(out / f"torch_logits_{rank}.npy", logits.detach().numpy())
    if rank == 0:
        named = dict(model.named_parameters())
        np.savez(out / "torch_weights.npz", **{name: p.detach().numpy() for name, p in named.items()})
        np.savez(out / "torch_grads.npz", loss=loss.detach().numpy(), **{n: p.grad.numpy() for n, p in named.items()})
    dist.destroy_process_group()


def jax_side(out: Path, batch: int, seq_len: int, bugs: list[str]) -> None:
    """The Flax port on 4 CPU devices with the torch weights, Ulysses under shard_map, once per planted bug
    ("none": the faithful port): its forward recorded under jax.jit, then the loss and gradients
    (`commlib_jax.training.value_and_grad`); writes them with the logits under ``out / bug``."""
    sys.path.insert(0, str(HERE))
    import flax_llama  # configures 4 CPU devices and float64 before JAX's first use
    from flax import nnx

    import commlib
    from commlib_jax.testing import load_named_arrays, named_arrays

    layout = commlib.SequenceLayout(seq_len, ulysses_size=WORLD)
    graphdef, params = nnx.split(flax_llama.Decoder(nnx.Rngs(0)), nnx.Param)
    with np.load(out / "torch_weights.npz") as weights:
        params = load_named_arrays(params, LLAMA_TO_FLAX.to_jax(dict(weights), like=named_arrays(params)))
    for bug in bugs:
        (out / bug).mkdir()
        _jax_run(out / bug, graphdef, params, layout, tokens(batch, seq_len), bug)


def _without_positions(query, key, value, *, is_causal: bool = False, positions=None):
    """`commlib_jax.sequence.dot_product_attention` as a port calls it when it does not opt in to ``positions=``:
    with them, commlib itself refuses local positions on every rank (docs/integrations.md), and nothing is
    left for the trace to find."""
    from commlib_jax import sequence

    return sequence.dot_product_attention(query, key, value, is_causal=is_causal)


def _jax_run(out: Path, graphdef, params, layout, input_ids: np.ndarray, bug: str) -> None:
    """One port (`bug`) on the mesh: the trace of its forward, its logits, loss and gradients under `out`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from commlib_jax import sequence
    from commlib_jax.testing import named_arrays, record
    from commlib_jax.training import value_and_grad

    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("sp",))

    def forward(params, input_ids):
        ids, positions, labels = sequence.shard_tokens(input_ids, layout, "sp")
        attention = sequence.dot_product_attention
        if bug == "local-positions":  # the port's bug: RoPE fed this shard's own row numbers ...
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
            attention = _without_positions  # ... in a port that does not hand them to commlib (which would refuse)
        return nnx.merge(graphdef, params)(ids, positions, attention), labels

    def loss(params, input_ids):
        logits, labels = forward(params, input_ids)
        return sequence.cross_entropy(logits, labels, "sp"), logits

    logits_of = jax.jit(
        jax.shard_map(lambda p, i: forward(p, i)[0], mesh=mesh, in_specs=(P(), P()), out_specs=P(None, "sp"))
    )
    step = jax.jit(
        jax.shard_map(
            value_and_grad(loss, "sp", has_aux=True),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=((P(), P(None, "sp")), P()),
        )
    )
    input_ids = jnp.asarray(input_ids)
    with sequence.parallel(layout, "sp", attention="ulysses"):
        with record() as trace:
            logits_of(params, input_ids)
        (value, logits), grads = step(params, input_ids)
    trace.save(out / "jax_trace.npz")
    np.save(out / "jax_logits.npy", np.asarray(logits))
    flat = LLAMA_TO_FLAX.to_torch(named_arrays(grads))
    np.savez(out / "jax_grads.npz", loss=np.asarray(value), **flat)


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-300))


def compare(out: Path, bug: str) -> int:
    """Print the agreement figures of the port `bug` and, where the traces part, the first diverging call; the
    exit status."""
    torch_logits = [np.load(out / f"torch_logits_{rank}.npy") for rank in range(WORLD)]
    jax_logits = np.split(np.load(out / bug / "jax_logits.npy"), WORLD, axis=1)
    errors = {"logits": max(relative(j, t) for j, t in zip(jax_logits, torch_logits, strict=True))}
    with np.load(out / "torch_grads.npz") as torch_grads, np.load(out / bug / "jax_grads.npz") as jax_grads:
        errors["loss"] = relative(jax_grads["loss"], torch_grads["loss"])
        gradients = {name: relative(jax_grads[name], torch_grads[name]) for name in torch_grads.files if name != "loss"}
    errors["gradients"] = max(gradients.values())
    trace_torch = Trace.merge([Trace.load(out / f"torch_trace_{rank}.npz") for rank in range(WORLD)])
    trace_jax = Trace.load(out / bug / "jax_trace.npz")
    divergence = first_divergence(trace_torch, trace_jax, names=("torch", "jax"))
    agree = max(errors.values()) <= TOLERANCE and divergence is None
    shown = ", ".join(f"{name} {value:.1e}" for name, value in errors.items())
    worst = max(gradients, key=gradients.__getitem__)
    print(
        f"port with bug {bug}: relative errors (jax vs torch, float64): {shown} (worst gradient: {worst}); "
        f"{len(gradients)} parameters; traces: {len(trace_torch)} torch calls, {len(trace_jax)} jax calls"
    )
    if divergence is not None:
        print(divergence.report())
    print(
        f"{'PASS' if agree else 'FAIL'}: transformers Llama vs Flax port, Ulysses W={WORLD}, float64, "
        f"tolerance {TOLERANCE:.0e}"
    )
    return 0 if agree else 1


def _run(command: list[str], environment: dict[str, str]) -> None:
    done = subprocess.run(command, env=environment, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise SystemExit(f"port_check: {' '.join(command)} exited {done.returncode}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bug",
        choices=("none", "local-positions"),
        action="append",
        help="plant a porting bug in the JAX side (repeat: one JAX run per bug; default none)",
    )
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--side", choices=("torch", "jax"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "torch":
        torch_side(args.out, args.batch, args.seq_len)
        return 0
    bugs = args.bug or ["none"]
    if args.side == "jax":
        jax_side(args.out, args.batch, args.seq_len, bugs)
        return 0
    environment = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    sizes = ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    with tempfile.TemporaryDirectory(prefix="port_check_") as directory:
        me = [str(Path(__file__).resolve()), *sizes, "--out", directory]
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={WORLD}",
                *me,
                "--side",
                "torch",
            ],
            environment,
        )
        _run([sys.executable, *me, "--side", "jax", *(word for bug in bugs for word in ("--bug", bug))], environment)
        return max(compare(Path(directory), bug) for bug in bugs)


if __name__ == "__main__":
    sys.exit(main())
