"""`commlib.testing.ParameterMap` on the handed case of the port check: the transformers Llama of
examples/transformers_llama.py (its config) against the Flax nnx decoder of examples/flax_llama.py. The two
architectures match (pre-norm RMSNorm with eps 1e-6, GQA 8/2 heads with rotate-half RoPE at theta 1e4, SwiGLU, no
biases, untied head) but for precision: transformers computes RMSNorm and RoPE's cos and sin in float32 whatever the
model's dtype (``LlamaRMSNorm.forward``, ``LlamaRotaryEmbedding.forward``, transformers 5), which caps a float64
comparison near float32's precision (one run: logits 7.5e-08, gradients 2.1e-07 off, relative to each array's
largest value). With those two computed in float64 on the torch side
(`_float64_llama`) and the weights mapped, the logits, the loss and every parameter's gradient agree to commlib
parity's float64 tolerance (1e-10), both ways.
Unsharded, one process: the mapping is what is tested here."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # both frameworks in one process, as the torch tests' parent and the JAX tests share one

from commlib.testing import ParameterMap, ParameterMapError, assert_parity
from commlib_jax.testing import load_named_arrays, named_arrays
from commlib_torch.testing import named_arrays as torch_named_arrays

transformers = pytest.importorskip("transformers", reason="the [transformers] extra (CI installs it)")
pytest.importorskip("flax", reason="the [flax] extra (CI installs it)")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: transformers' LlamaForCausalLM names -> examples/flax_llama.py's Decoder paths: the port check's own map.
LLAMA_TO_FLAX = _example("port_check").LLAMA_TO_FLAX


def _flax_example():
    return _example("flax_llama")  # sets the 4 CPU devices and x64 this folder's conftest already set


def _llama():
    """examples/transformers_llama.py's model (its config, float64), seeded."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=256,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64)


def _float64_llama(model) -> None:
    """transformers' RMSNorm and RoPE tables computed in the model's float64, as the Flax port computes them."""
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = _float64_norm(module)
    rotary, config = model.model.rotary_emb, model.config
    head_dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def forward(x, position_ids):
        angles = position_ids[..., None].to(torch.float64) * inverse
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    rotary.forward = forward


def _float64_norm(norm):
    def forward(hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return norm.weight * (hidden_states * torch.rsqrt(variance + norm.variance_epsilon))

    return forward


def _torch_step(model, input_ids):
    logits = model(input_ids=torch.from_numpy(input_ids), use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), torch.from_numpy(input_ids[:, 1:]).flatten())
    loss.backward()
    gradients = {name: parameter.grad.numpy() for name, parameter in model.named_parameters()}
    return logits.detach().numpy(), loss.item(), gradients


def _flax_step(example, graphdef, state, input_ids):
    def loss(params):
        ids = jnp.asarray(input_ids)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        logits = example.nnx.merge(graphdef, params)(ids, positions)
        log_probabilities = jax.nn.log_softmax(logits[:, :-1])
        picked = jnp.take_along_axis(log_probabilities, ids[:, 1:, None], axis=-1)
        return -picked.mean(), logits

    (value, logits), gradients = jax.value_and_grad(loss, has_aux=True)(state)
    return np.asarray(logits), float(value), gradients


def test_transformers_llama_to_the_flax_port_and_back():
    example, model = _flax_example(), _llama()
    _float64_llama(model)
    graphdef, state = example.nnx.split(example.Decoder(example.nnx.Rngs(0)), example.nnx.Param)
    flat = LLAMA_TO_FLAX.to_jax(torch_named_arrays(model), like=named_arrays(state))
    state = load_named_arrays(state, flat)
    input_ids = np.random.default_rng(1).integers(0, 256, (2, 13))
    torch_logits, torch_loss, torch_gradients = _torch_step(model, input_ids)
    flax_logits, flax_loss, flax_gradients = _flax_step(example, graphdef, state, input_ids)
    names = ("transformers", "flax")
    assert_parity({"logits": torch_logits, "loss": torch_loss}, {"logits": flax_logits, "loss": flax_loss}, names=names)
    mapped_back = LLAMA_TO_FLAX.to_torch(named_arrays(flax_gradients), like=torch_gradients)
    assert list(mapped_back) == list(torch_gradients) and len(mapped_back) == 2 * 9 + 3
    assert_parity(torch_gradients, mapped_back, names=names)
    with pytest.raises(AssertionError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight'"):  # it can fail
        assert_parity(
            torch_gradients,
            {
                **mapped_back,
                "model.layers.1.mlp.down_proj.weight": mapped_back["model.layers.1.mlp.down_proj.weight"] * (1 + 1e-8),
            },
        )


def test_a_rule_left_out_or_a_missing_transpose_is_named():
    example, model = _flax_example(), _llama()
    _, state = example.nnx.split(example.Decoder(example.nnx.Rngs(0)), example.nnx.Param)
    incomplete = ParameterMap([rule for rule in LLAMA_TO_FLAX.rules if "up_proj" not in rule.torch])
    untransposed = ParameterMap(
        [(rule.torch, rule.jax) if rule.torch == "lm_head.weight" else rule for rule in LLAMA_TO_FLAX.rules]
    )
    with pytest.raises(ParameterMapError) as info:
        incomplete.to_jax(torch_named_arrays(model), like=named_arrays(state))
    assert str(info.value).splitlines()[1:] == [
        "  no rule matches torch name 'model.layers.0.mlp.up_proj.weight'",
        "  no rule matches torch name 'model.layers.1.mlp.up_proj.weight'",
        "  nothing maps to 'layers.0.up.kernel'",
        "  nothing maps to 'layers.1.up.kernel'",
    ]
    with pytest.raises(
        ParameterMapError,
        match=r"shape differs: 'head\.kernel' is \(256, 64\) from 'lm_head\.weight', "
        r"like has \(64, 256\) \(its transpose: check the rule's axes\)",
    ):
        untransposed.to_jax(torch_named_arrays(model), like=named_arrays(state))
