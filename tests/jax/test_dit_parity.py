"""Torch against JAX on one DiT block: diffusers' ``FluxTransformerBlock`` (the double-stream block of
examples/diffusers_dit.py's tiny Flux: 4 heads of 8, 5 text tokens) and its Flax nnx port in examples/dit_jax.py,
the same weights (`FLUX_TO_FLAX`), the same inputs and RoPE table (checked against diffusers' ``FluxPosEmbed``),
unsharded, float64: the loss and every parameter's gradient agree to commlib parity's float64 tolerance (1e-10,
`assert_parity`). diffusers applies RoPE in ``.float()`` whatever the dtype (without the fix below 30 of the 33
arrays differ), so the torch side runs with examples/diffusers_dit.py's ``float64_kept`` (float64 stays float64 in
``.float()``), as that example does. The sharded block against the unsharded one:
tests/test_training_examples.py::test_dit_jax_with_python."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # both frameworks in one process, as tests/jax/test_testing_llama.py

from commlib.testing import assert_parity
from commlib_jax.testing import named_arrays
from commlib_torch.testing import named_arrays as torch_named_arrays

pytest.importorskip("diffusers", reason="the [diffusers] extra (CI installs it)")
pytest.importorskip("flax", reason="the [flax] extra (CI installs it)")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flux_block_port_gives_diffusers_loss_and_gradients():
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxTransformerBlock
    from flax import nnx

    dit = _example("dit_jax")
    float64_kept = _example("diffusers_dit").float64_kept
    height, width = 3, 5
    graphdef, params = nnx.split(dit.Block(nnx.Rngs(0)), nnx.Param)
    block = FluxTransformerBlock(dit.DIM, dit.HEADS, dit.HEAD_DIM).to(torch.float64)
    weights = dit.FLUX_TO_FLAX.to_torch(named_arrays(params), like=torch_named_arrays(block))
    block.load_state_dict({name: torch.from_numpy(np.array(value)) for name, value in weights.items()})
    cos, sin = dit.rope_table(height, width)
    ids = torch.zeros(dit.TEXT + height * width, 3, dtype=torch.float64)
    ids[dit.TEXT :, 1], ids[dit.TEXT :, 2] = torch.arange(15) // width, torch.arange(15) % width
    diffusers_cos, diffusers_sin = FluxPosEmbed(dit.THETA, list(dit.AXES_DIMS))(ids)
    np.testing.assert_allclose(diffusers_cos[dit.TEXT :].double().numpy(), cos, atol=1e-7)  # float32 ids there
    np.testing.assert_allclose(diffusers_sin[dit.TEXT :].double().numpy(), sin, atol=1e-7)
    x, text, temb, target, text_target = dit.batch(2, height * width)
    rope = tuple(
        torch.from_numpy(np.concatenate([fill(dit.TEXT), table]))
        for fill, table in ((lambda n: np.ones((n, dit.HEAD_DIM)), cos), (lambda n: np.zeros((n, dit.HEAD_DIM)), sin))
    )
    with float64_kept():
        text_out, out = block(*(torch.from_numpy(a) for a in (x, text, temb)), image_rotary_emb=rope)
        loss = torch.mean((out - torch.from_numpy(target)) ** 2) + torch.mean(
            (text_out - torch.from_numpy(text_target)) ** 2
        )
        loss.backward()
    torch_run = {"loss": loss.detach().numpy(), "gradients": {n: p.grad.numpy() for n, p in block.named_parameters()}}
    loss_fn = dit.unsharded_loss(graphdef, (cos, sin))
    (value, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *(jnp.asarray(a) for a in dit.batch(2, 15)))
    jax_run = {
        "loss": np.asarray(value),
        "gradients": dit.FLUX_TO_FLAX.to_torch(named_arrays(grads), like=torch_run["gradients"]),
    }
    assert len(torch_run["gradients"]) == 32
    assert_parity(torch_run, jax_run, names=("torch", "jax"))
