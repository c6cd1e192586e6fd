"""The training examples launched the way users launch them, as CI runs them, each once per configuration that
proves something distinct, every claim of a launch checked on its output:

- ``torchrun --standalone --nproc-per-node 4 examples/train_torch.py`` and two ``python examples/train_jax.py
  --num-processes 2 --process-id i --coordinator 127.0.0.1:PORT`` (jax.distributed, 2 CPU devices each): the block
  over SP 2 x TP 2 for 20 steps, every step equal to the unsharded model's;
- ``torchrun --standalone --nproc-per-node 4 examples/transformers_llama.py`` and ``python examples/flax_llama.py``
  (4 CPU devices in one process): one launch per layer (ulysses, ring, usp), USP's with ``--packed`` (documents of
  random lengths and padding), 5 AdamW steps equal to the unsharded model's;
- ``torchrun --standalone --nproc-per-node 4 examples/diffusers_dit.py``: a tiny diffusers Wan over each layer
  (ulysses, ring, usp) and a tiny Flux over Ulysses (joint attention), 3 AdamW steps equal to the unsharded model's;
- ``python examples/dit_jax.py`` (4 CPU devices in one process): a Flux-style MMDiT block's joint attention over
  Ulysses (15 image tokens: uneven shards) and the ring (16, zigzag), 3 adamw steps equal to the unsharded block's;
- the MoE block's ``torchrun --standalone --nproc-per-node 4 examples/moe_torch.py`` and ``python
  examples/moe_jax.py``.

`_launch` starts them all. The JAX launches compile at XLA -O0 (as tests/jax/conftest.py and
tests/test_port_check.py): the same tolerances hold, the compiles cost less.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 240  # seconds per launch
STEP = r"^step +(\d+) +loss ([0-9.]+) +unsharded ([0-9.]+)"


def _environment(jax: bool) -> dict[str, str]:
    """The test's environment without the JAX tests' device settings (the example chooses its devices); a JAX
    launch compiles at -O0."""
    environment = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    if jax:
        environment["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    return environment


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun(script: str, *arguments: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node 4 script arguments`` with this interpreter's environment's
    torchrun (its console script, else the module it runs)."""
    found = Path(sys.executable).with_name("torchrun")
    launcher = [str(found)] if found.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc-per-node", "4", script, *arguments]


def _python(script: str, *arguments: str) -> list[str]:
    return [sys.executable, script, *arguments]


def _launch(*commands: list[str], jax: bool = False, environment: dict[str, str] | None = None) -> list[str]:
    """Run `commands` side by side (the processes of one launch) from the repository root; each must exit 0.
    Their outputs (stdout, then stderr), in order."""
    launched = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=_environment(jax) | (environment or {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for command in commands
    ]
    try:
        outputs = [process.communicate(timeout=LIMIT) for process in launched]
    finally:
        for process in launched:
            process.kill()
    for process, (stdout, stderr) in zip(launched, outputs, strict=True):
        assert process.returncode == 0, stdout + stderr
    return [stdout for stdout, _ in outputs]


def _assert_steps(output: str, steps: int) -> list[str]:
    """Steps 1..`steps` printed, each loss equal to the unsharded model's to the 12 digits printed; the losses."""
    found = re.findall(STEP, output, re.MULTILINE)
    assert [int(step) for step, _, _ in found] == list(range(1, steps + 1)), output
    assert all(loss == unsharded for _, loss, unsharded in found), output
    return [loss for _, loss, _ in found]


def _assert_passed(output: str, pattern: str) -> None:
    assert len(re.findall(rf"^PASS: {pattern}", output, re.MULTILINE)) == 1, output


def test_torch_example_with_torchrun_standalone():
    (output,) = _launch(_torchrun("examples/train_torch.py"))
    _assert_steps(output, 20)
    _assert_passed(output, r"sp=2 tp=2, 20 steps")


def test_jax_example_with_two_processes():
    address = f"127.0.0.1:{_free_port()}"
    processes = [
        _python("examples/train_jax.py", "--num-processes", "2", "--process-id", f"{process}", "--coordinator", address)
        for process in (0, 1)
    ]
    first, second = _launch(*processes, jax=True)
    _assert_steps(first, 20)
    _assert_passed(first, r"process 0 of 2, sp=2 tp=2, 20 steps")
    _assert_passed(second, r"process 1 of 2, sp=2 tp=2, 20 steps")


#: One launch per layer; USP's with packed documents (the ring over an uneven SequenceLayout with segment ids).
LLAMA_LAUNCHES = [("ulysses", False), ("ring", False), ("usp", True)]


@pytest.mark.parametrize(("attention", "packed"), LLAMA_LAUNCHES)
def test_transformers_llama_with_torchrun(attention, packed):
    """examples/transformers_llama.py over 4 ranks: a transformers Llama (GQA) with commlib's attention through the
    registry, 5 AdamW steps equal to the unsharded model's, at S = 37 (shards of 10, 9, 9, 9 or 9, 9, 9, 10 rows);
    USP's launch `--packed` (documents of random lengths, some shorter than a shard, some crossing shards, and
    padding, against the unsharded model given the same documents as a mask). Proven in process, where a case
    costs no launch: ring packed Llamas (S = 13, 37: tests/torch/test_integrations.py
    ``test_llama_with_masks_is_the_unsharded_model``), USP through the registry without documents
    (``test_usp_two_by_two``), S = 5 at W = 4 (2, 1, 1, 1 rows), S = 3 (an empty shard) and even lengths for every
    layer (tests/torch/test_ring_any_length.py)."""
    arguments = ["--attention", attention, "--seq-len", "37", *(["--packed"] if packed else [])]
    (output,) = _launch(_torchrun("examples/transformers_llama.py", *arguments))
    _assert_steps(output, 5)
    tag = " packed" if packed else ""
    _assert_passed(output, rf"{attention} W=4 S=37 sizes=\([0-9, ]+\){tag}, 5 AdamW steps")


#: One launch per layer on Wan (27 video tokens: 7, 7, 7, 6 rows) and Flux's joint attention under Ulysses (its 15
#: image tokens over a ring of 4 are uneven shards, which the ring refuses with joint tensors; tests/torch/
#: test_diffusers.py runs Flux on a ring of 3).
DIT_LAUNCHES = [("wan", "ulysses"), ("wan", "ring"), ("wan", "usp"), ("flux", "ulysses")]


@pytest.mark.parametrize(("model", "attention"), DIT_LAUNCHES)
def test_diffusers_dit_with_torchrun(model, attention):
    """examples/diffusers_dit.py over 4 ranks: a tiny diffusers Wan (self- and cross-attention) or Flux (joint
    attention) through commlib's diffusers backend, 3 AdamW steps equal to the unsharded model's (loss 1e-12,
    output and every gradient 1e-10). The in-process cases (W = 1 and 3, the refusals):
    tests/torch/test_diffusers.py."""
    pytest.importorskip("diffusers")
    (output,) = _launch(_torchrun("examples/diffusers_dit.py", "--model", model, "--attention", attention))
    _assert_steps(output, 3)
    _assert_passed(output, rf"{model} {attention} W=4 tokens=[0-9]+ sizes=\([0-9, ]+\), 3 AdamW steps")


def test_transformers_llama_refuses_fewer_tokens_than_ranks():
    """``--seq-len 3`` over 4 ranks: the example refuses before it starts (exit 2 with argparse's message naming
    the length, the world size and the minimum), where it crashed inside transformers on the empty rank and in gloo
    on another (issue 34 item 10). The check runs before the process group, on what torchrun hands every rank
    (``WORLD_SIZE``), so one rank's process, given torchrun's environment, is that launch's every rank."""
    torchrun = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}
    done = subprocess.run(
        _python("examples/transformers_llama.py", "--attention", "ring", "--seq-len", "3"),
        cwd=ROOT,
        env=_environment(jax=False) | torchrun,
        capture_output=True,
        text=True,
        timeout=LIMIT,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: --seq-len (3) must be at least the world size (4): one token a rank" in done.stderr, done.stderr
    assert "site-packages/transformers" not in done.stderr and "gloo" not in done.stderr, done.stderr


FLAX_LAUNCHES = [("ulysses", 30, False), ("ring", 32, False), ("usp", 30, True)]


@pytest.mark.parametrize(("attention", "seq_len", "packed"), FLAX_LAUNCHES)
def test_flax_llama_with_python(attention, seq_len, packed):
    """examples/flax_llama.py on 4 CPU devices: a Flax nnx decoder (GQA, RoPE) with commlib's attention swapped in
    under shard_map, 5 optax adamw steps in one jitted step equal to the unsharded model's. One launch per layer:
    Ulysses S = 30 (shards of 8, 8, 7, 7 rows, held padded to 8), ring zigzag S = 32 (even), and `--packed` USP 2 x
    2 S = 30 (8, 7, 8, 7: the ring over an uneven SequenceLayout, with documents of random lengths, some shorter
    than a shard, some crossing shards, and padding; the JAX shards' padding rows too). USP at uneven lengths
    without segment ids is proven in process (tests/jax/test_ring_any_length.py, ``test_usp_any_length``: S = 37
    and 5, both layouts, causal and not)."""
    arguments = ["--attention", attention, "--seq-len", str(seq_len), *(["--packed"] if packed else [])]
    (output,) = _launch(_python("examples/flax_llama.py", *arguments), jax=True)
    _assert_steps(output, 5)
    tag = " packed" if packed else ""
    _assert_passed(output, rf"{attention} W=4 S={seq_len} sizes=\([0-9, ]+\){tag}, 5 adamw steps")


#: Ulysses over an uneven grid (3 x 5: shards of 4, 4, 4, 3 rows) and the ring over an even one (4 x 4, zigzag:
#: the ring takes joint tensors over even shards only). USP (2 x 2) runs the same path as these two composed and
#: costs a launch as much (~17 s CPU): run by hand (docs/dit.md).
DIT_JAX_LAUNCHES = [("ulysses", 3, 5), ("ring", 4, 4)]


@pytest.mark.parametrize(("attention", "height", "width"), DIT_JAX_LAUNCHES)
def test_dit_jax_with_python(attention, height, width):
    """examples/dit_jax.py on 4 CPU devices: diffusers' Flux double-stream block ported to Flax nnx, its joint
    attention (5 text tokens replicated, the image tokens sharded) through commlib_jax's layer, 3 optax adamw steps
    in one jitted step equal to the unsharded block's (every step's loss 1e-12, image output and every gradient
    1e-10). The port against diffusers' own block: tests/jax/test_dit_parity.py."""
    arguments = ["--attention", attention, "--height", str(height), "--width", str(width)]
    (output,) = _launch(_python("examples/dit_jax.py", *arguments), jax=True)
    _assert_steps(output, 3)
    _assert_passed(output, rf"{attention} W=4 tokens={height * width} text=5 sizes=\([0-9, ]+\), 3 adamw steps")


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(_torchrun("examples/moe_torch.py"), id="torch"),
        pytest.param(_python("examples/moe_jax.py"), id="jax"),
    ],
)
def test_moe_example(command):
    """examples/moe_torch.py (torchrun, 4 gloo ranks) and examples/moe_jax.py (4 CPU devices): a transformer block
    with a softmax top-2 router over 8 experts sharded over the ranks, a shared expert, the load-balancing loss,
    5 AdamW steps equal to the unsharded model's (loss, every gradient, the router's, every parameter within
    1e-10). The two are one model: their losses agree to the 12 digits printed."""
    (output,) = _launch(command, jax=command[1] == "examples/moe_jax.py")
    losses = _assert_steps(output, 5)
    assert losses[::4] == ["2.772222560180", "1.723783208636"], output  # both frameworks
    errors = re.search(r"^PASS: 4 \w+, E=8 K=2, 5 AdamW steps, max relative error: (.*)", output, re.MULTILINE)
    assert errors is not None, output
    assert all(float(value) <= 1e-10 for value in re.findall(r"\d\.\de[+-]\d\d", errors[1])), errors[1]
