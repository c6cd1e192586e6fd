"""Both frontends' public functions take the same keyword names: the ops, the attention layers, the sequence
helpers and the communicators' methods. The one difference is the group: torch's ``group`` (``ulysses_group`` /
``ring_group``) is JAX's ``axis_name`` (``ulysses_axis`` / ``ring_axis``), required in JAX and placed after the
arrays, where torch's defaults to None (WORLD) and comes after the op's own arguments; and torch's last keyword
``async_op`` (JAX has none: XLA schedules). Every other parameter has the same name, kind (positional or
keyword-only), default and order. Each frontend is read in a fresh interpreter.
"""

import functools
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: torch's group parameters -> JAX's.
GROUP_TO_AXIS = {"group": "axis_name", "ulysses_group": "ulysses_axis", "ring_group": "ring_axis"}
#: torch's keyword without a JAX twin, on the ops that take it (last, keyword-only, default False).
TORCH_ONLY = ["async_op", "KEYWORD_ONLY", "False"]
#: JAX's keyword without a torch twin yet: `block_size` is the key block of the JAX layers' blockwise attention
#: (issue 32 item 1, `commlib.blockwise.attend_blocks`); torch's layers run their pieces on torch's fused kernels
#: (CPU flash, SDPA), which pick their own blocks, and its einsum path takes none until issue 32 item 2.
JAX_ONLY = ["block_size", "KEYWORD_ONLY", "None"]
JAX_ONLY_LAYERS = {"attention.ulysses_attention", "attention.ring_attention", "attention.usp_attention"}
#: Defaults that differ by design (DESIGN.md "Expert parallelism"): JAX's route is always padded.
DEFAULTS = {("moe.route", "layout"): ("'exact'", "'padded'")}
ASYNC_OPS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_4d", "permute"}

_PROBE = """
import importlib, inspect, json, sys
frontend = sys.argv[1]
package = importlib.import_module(f"commlib_{frontend}")
attention = importlib.import_module(f"commlib_{frontend}.attention")
communicator = package.DeviceCommunicator if frontend == "torch" else package.Communicator

def parameters(function):
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(function).parameters.values()]

found = {}
for name in package.__all__:
    if inspect.isfunction(getattr(package, name)):
        found[name] = parameters(getattr(package, name))
for name in attention.__all__:
    found[f"attention.{name}"] = parameters(getattr(attention, name))
sequence = importlib.import_module(f"commlib_{frontend}.sequence")
for name in ("shard_tokens", "shard_sequence", "gather_sequence", "position_ids", "cross_entropy"):
    found[f"sequence.{name}"] = parameters(getattr(sequence, name))
cfg = importlib.import_module(f"commlib_{frontend}.cfg")
for name in ("cfg_split", "cfg_combine"):
    found[f"cfg.{name}"] = parameters(getattr(cfg, name))
moe = importlib.import_module(f"commlib_{frontend}.moe")
for name in ("route", "dispatch", "combine"):
    found[f"moe.{name}"] = parameters(getattr(moe, name))
for name, value in vars(communicator).items():
    if inspect.isfunction(value) and not name.startswith("_"):
        found[f"communicator.{name}"] = parameters(value)
print(json.dumps(found))
"""


@functools.cache
def _signatures(frontend: str) -> dict[str, list]:
    """{public function: [[name, kind, default repr or None], ...]} of one frontend."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, frontend], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _without_groups(parameters: list, names) -> list:
    return [parameter for parameter in parameters if parameter[0] not in names]


def test_both_frontends_have_the_same_public_functions():
    torch_names, jax_names = set(_signatures("torch")), set(_signatures("jax"))
    assert torch_names == jax_names
    assert {"all_reduce", "attention.ulysses_attention", "communicator.all_to_all_4D", "moe.route"} <= torch_names
    assert {"attention.cross_attention", "cfg.cfg_split", "cfg.cfg_combine"} <= torch_names


def _differences(torch_parameters: list, jax_parameters: list) -> list[str]:
    torch_groups = [parameter[0] for parameter in torch_parameters if parameter[0] in GROUP_TO_AXIS]
    jax_axes = [parameter[0] for parameter in jax_parameters if parameter[0] in GROUP_TO_AXIS.values()]
    found = []
    if [GROUP_TO_AXIS[group] for group in torch_groups] != jax_axes:
        found.append(f"groups {torch_groups} vs axes {jax_axes}")
    if _without_groups(torch_parameters, GROUP_TO_AXIS) != _without_groups(jax_parameters, jax_axes):
        found.append(f"torch {torch_parameters} vs jax {jax_parameters}")
    return found


def test_async_op_is_torch_only_and_last():
    torch_signatures, jax_signatures = _signatures("torch"), _signatures("jax")
    assert {name for name, parameters in torch_signatures.items() if TORCH_ONLY in parameters} == ASYNC_OPS
    assert all(torch_signatures[name][-1] == TORCH_ONLY for name in ASYNC_OPS)
    assert not any(TORCH_ONLY[0] in [p[0] for p in parameters] for parameters in jax_signatures.values())


def test_same_keywords_but_the_group():
    torch_signatures = {
        name: [p for p in parameters if p != TORCH_ONLY] for name, parameters in _signatures("torch").items()
    }
    jax_signatures = {name: [list(p) for p in parameters] for name, parameters in _signatures("jax").items()}
    assert {name for name, parameters in jax_signatures.items() if JAX_ONLY in parameters} == JAX_ONLY_LAYERS
    jax_signatures = {name: [p for p in parameters if p != JAX_ONLY] for name, parameters in jax_signatures.items()}
    for (name, keyword), (torch_default, jax_default) in DEFAULTS.items():
        [parameter] = [p for p in jax_signatures[name] if p[0] == keyword]
        assert parameter[2] == jax_default, (name, parameter)
        parameter[2] = torch_default  # the one difference DESIGN.md makes
    differences = {
        name: found
        for name in sorted(torch_signatures.keys() & jax_signatures.keys())
        if (found := _differences(torch_signatures[name], jax_signatures[name]))
    }
    assert differences == {}


def test_a_different_keyword_is_found():
    """The comparison itself: a renamed keyword, a changed default and a group without its axis all show."""
    ops = [["x", "POSITIONAL_OR_KEYWORD", None], ["dim", "POSITIONAL_OR_KEYWORD", "-1"]]
    torch_op, jax_op = [*ops, ["group", "POSITIONAL_OR_KEYWORD", "None"]], [ops[0], ["axis_name", "X", None], ops[1]]
    assert _differences(torch_op, jax_op) == []
    assert _differences(torch_op, [ops[0], ["axis_name", "X", None], ["axis", "POSITIONAL_OR_KEYWORD", "-1"]])
    assert _differences(torch_op, [ops[0], ["axis_name", "X", None], ["dim", "POSITIONAL_OR_KEYWORD", "0"]])
    assert _differences(torch_op, ops)


def test_attention_docstrings_name_only_their_parameters():
    """``ulysses_attention``'s docstring spoke of "x's dtype", and it has no `x`. Every
    "NAME's dtype" / "NAME's shape" in the layers' docstrings names one of their parameters (read from the
    source: no import)."""
    import ast
    import re

    for frontend in ("torch", "jax"):
        tree = ast.parse((ROOT / f"commlib_{frontend}" / "attention.py").read_text())
        for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
            if not function.name.endswith("_attention"):
                continue
            names = {argument.arg for argument in (*function.args.args, *function.args.kwonlyargs)}
            owners = set(re.findall(r"\b([a-z_]+)'s (?:dtype|shape)\b", ast.get_docstring(function) or ""))
            assert owners <= names, (frontend, function.name, owners - names)
