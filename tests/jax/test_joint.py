"""Joint attention (``joint_q``, ``joint_k``, ``joint_v``) in `commlib_jax.attention.ulysses_attention` under
``jax.shard_map`` on simulated CPU devices (W = 1-4, check_vma True and False): every case of tests/joint_cases.py
against the float64 reference of the concatenation on every rank -- out, joint_out, dq, dk, dv and d joint_q,
d joint_k, d joint_v (``convention="sum"``, per-rank copies of the joint tensors; given once, ``in_specs=P()``, JAX
sums the ranks' shares: the full gradient) -- joint_out bit for bit the same on every rank, the padded layout's
rows past a rank's size 0 with gradient 0, bfloat16 within its tolerance, and bad calls refused; and the same in
`ring_attention` and `usp_attention` (tests/joint_cases.py's `ring_cases`, one jitted program per case: each
rank's d joint_* its part; given once, the full gradient).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from commlib import CommError
from commlib_jax.attention import ring_attention, ulysses_attention, usp_attention
from tests import joint_cases

JOINT = ("joint_q", "joint_k", "joint_v")


def _padded(shards: list, rows: int) -> np.ndarray:
    return np.stack([np.pad(x, [(0, 0), (0, rows - x.shape[1]), (0, 0), (0, 0)]) for x in shards])


def _run(case, arrays, check_vma=True, dtype=jnp.float64, once=False):
    """Every rank's out (padded rows included), joint_out, and the gradients {name: per rank} (`once`: the joint
    tensors given once, ``in_specs=P()``: their gradient is one array)."""
    world_size = case.world_size
    mesh = Mesh(np.array(jax.devices()[:world_size]), ("x",))
    rows = max(case.seq_sizes)
    main = [jnp.asarray(_padded(arrays[name], rows), dtype) for name in "qkv"]
    copies = [np.asarray(arrays[name]) if once else np.stack([arrays[name]] * world_size) for name in JOINT]
    tensors = [jnp.asarray(x, dtype) for x in copies]
    cots = [_padded(arrays["cotangent"], rows), np.stack(arrays["joint_cotangent"])]

    def body(cot, joint_cot, q, k, v, jq, jk, jv):
        if not once:
            jq, jk, jv = jq[0], jk[0], jv[0]
        out, joint_out = ulysses_attention(q[0], k[0], v[0], "x", joint_q=jq, joint_k=jk, joint_v=jv, **case.kwargs())
        loss = (out * cot[0]).astype(jnp.float64).sum() + (joint_out * joint_cot[0]).astype(jnp.float64).sum()
        return out[None], joint_out[None], loss[None]

    joint_spec = P() if once else P("x")
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("x"),) * 5 + (joint_spec,) * 3,
        out_specs=(P("x"),) * 3,
        check_vma=check_vma,
    )

    def total(*xs):
        out, joint_out, losses = mapped(*map(jnp.asarray, cots), *xs)
        return losses.sum(), (out, joint_out)

    step = jax.jit(jax.value_and_grad(total, argnums=tuple(range(6)), has_aux=True))  # one program, not op by op
    (_, (out, joint_out)), grads = step(*main, *tensors)
    as_numpy = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    named = dict(zip(("q", "k", "v", *JOINT), map(as_numpy, grads), strict=True))
    return as_numpy(out), as_numpy(joint_out), named


def _errors(case, arrays, out, joint_out, grads, rank, once=False) -> dict:
    size = case.seq_sizes[rank]
    errors = {
        "out": np.abs(out[rank][:, :size] - arrays["out"][rank]).max(initial=0.0),
        "joint_out": np.abs(joint_out[rank] - arrays["joint_out"]).max(),
        "padding": max(np.abs(x[rank][:, size:]).max(initial=0.0) for x in (out, grads["q"], grads["k"], grads["v"])),
    }
    for name in "qkv":
        want = arrays[f"d{name}"][rank]
        scale = max(1.0, np.abs(want).max(initial=0.0))
        errors[f"d{name}"] = np.abs(grads[name][rank][:, :size] - want).max(initial=0.0) / scale
    for name in JOINT:
        want = sum(arrays[f"d{name}"]) if once else arrays[f"d{name}"][rank]
        got = grads[name] if once else grads[name][rank]
        errors[f"d{name}"] = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    return errors


#: (world size, check_vma, the cases run): each compile is seconds of CPU, so the cases are spread over the
#: world sizes (every case at least once; W = 4's uneven heads with front, rear and both causal) -- the torch
#: twin and tests/spec/test_joint.py run every case at every W.
SPREAD = [
    (1, True, ("front", "mha-v-dim")),
    (2, True, ("rear-causal", "chunks-2")),
    (3, True, ("front-causal", "mqa-one-token")),
    (4, True, ("rear", "front-causal", "mqa-one-token")),
    (4, False, ("front",)),
]


@pytest.mark.parametrize(("world_size", "check_vma", "names"), SPREAD)
def test_cases_against_the_reference_on_every_rank(world_size, check_vma, names):
    failed = []
    for case in (case for case in joint_cases.cases(world_size) if case.name in names):
        arrays = joint_cases.arrays(case)
        out, joint_out, grads = _run(case, arrays, check_vma)
        for rank in range(world_size):
            errors = _errors(case, arrays, out, joint_out, grads, rank)
            if max(errors.values()) > 1e-12:
                failed.append(f"{case.name} rank {rank}: {errors}")
            if not np.array_equal(joint_out[rank], joint_out[0]):
                failed.append(f"{case.name} rank {rank}: joint_out is not rank 0's bit for bit")
    assert not failed, "\n".join(failed)


def test_joint_tensors_given_once_get_the_full_gradient():
    failed = []
    for case in joint_cases.cases(4)[1:2]:
        arrays = joint_cases.arrays(case)
        out, joint_out, grads = _run(case, arrays, once=True)
        errors = _errors(case, arrays, out, joint_out, grads, 0, once=True)
        if max(errors.values()) > 1e-12:
            failed.append(f"{case.name}: {errors}")
    assert not failed, "\n".join(failed)


def test_bfloat16_within_its_tolerance():
    failed = []
    for case in joint_cases.cases(4)[2:3]:
        arrays = joint_cases.arrays(case)
        out, joint_out, grads = _run(case, arrays, dtype=jnp.bfloat16)
        for rank in range(4):
            errors = _errors(case, arrays, out, joint_out, grads, rank)
            if max(errors.values()) > 0.05:
                failed.append(f"{case.name} rank {rank}: {errors}")
            if not np.array_equal(joint_out[rank], joint_out[0]):
                failed.append(f"{case.name} rank {rank}: joint_out is not rank 0's bit for bit")
    assert not failed, "\n".join(failed)


def _call(joint_shapes, **options):
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    tensors = [None if shape is None else jnp.zeros(shape) for shape in joint_shapes]

    def body(q, k):
        out, _ = ulysses_attention(q, k, k, "x", joint_q=tensors[0], joint_k=tensors[1], joint_v=tensors[2], **options)
        return out

    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"),) * 2, out_specs=P(None, "x"))(
        jnp.zeros((1, 8, 6, 8)), jnp.zeros((1, 8, 2, 8))
    )


TEXT = ((1, 3, 6, 8), (1, 3, 2, 8), (1, 3, 2, 8))


def test_bad_calls_name_the_layer_and_both_numbers():
    with pytest.raises(CommError, match=r"ulysses_attention: joint_q, joint_k and joint_v must be given together"):
        _call((TEXT[0], None, TEXT[2]))
    with pytest.raises(CommError, match=r"ulysses_attention: joint_k seq \(2\) must equal joint_q seq \(3\)"):
        _call((TEXT[0], (1, 2, 2, 8), TEXT[2]))
    with pytest.raises(CommError, match=r"ulysses_attention: joint_q heads \(4\) must equal q heads \(6\)"):
        _call(((1, 3, 4, 8), *TEXT[1:]))
    with pytest.raises(CommError, match=r"ulysses_attention: joint_position \('middle'\) must be one of"):
        _call(TEXT, joint_position="middle")


def _ring_run(case, arrays, check_vma=True, dtype=jnp.float64, once=False):
    """Every rank's out, joint_out and gradients {name: per rank} of a ring / USP case (tests/joint_cases.py's
    `ring_cases`), one jitted program: rank ``r * U + u`` is the mesh's row-major (ring, ulysses) device."""
    devices = np.array(jax.devices()[: case.world_size])
    if case.op == "usp_attention":
        mesh, axes = Mesh(devices.reshape(case.ring_size, case.ulysses_size), ("ring", "ulysses")), ("ring", "ulysses")
        layer = lambda q, k, v, **kw: usp_attention(q, k, v, "ulysses", "ring", **kw)  # noqa: E731
    else:
        mesh, axes = Mesh(devices, ("x",)), ("x",)
        layer = lambda q, k, v, **kw: ring_attention(q, k, v, "x", **kw)  # noqa: E731
    main = [jnp.asarray(np.stack(arrays[name]), dtype) for name in "qkv"]
    copies = [np.asarray(arrays[name]) if once else np.stack([arrays[name]] * case.world_size) for name in JOINT]
    tensors = [jnp.asarray(x, dtype) for x in copies]
    cots = [jnp.asarray(np.stack(arrays[name])) for name in ("cotangent", "joint_cotangent")]

    def body(cot, joint_cot, q, k, v, jq, jk, jv):
        if not once:
            jq, jk, jv = jq[0], jk[0], jv[0]
        out, joint_out = layer(q[0], k[0], v[0], joint_q=jq, joint_k=jk, joint_v=jv, **case.kwargs())
        loss = (out * cot[0]).astype(jnp.float64).sum() + (joint_out * joint_cot[0]).astype(jnp.float64).sum()
        return out[None], joint_out[None], loss[None]

    spec = P(axes)
    joint_spec = P() if once else spec
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * 5 + (joint_spec,) * 3, out_specs=(spec,) * 3, check_vma=check_vma
    )

    def total(*xs):
        out, joint_out, losses = mapped(*cots, *xs)
        return losses.sum(), (out, joint_out)

    program = jax.jit(jax.value_and_grad(total, argnums=tuple(range(6)), has_aux=True))
    (_, (out, joint_out)), grads = program(*main, *tensors)
    as_numpy = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    named = dict(zip(("q", "k", "v", *JOINT), map(as_numpy, grads), strict=True))
    return as_numpy(out), as_numpy(joint_out), named


def _ring_errors(arrays, out, joint_out, grads, rank, once=False) -> dict:
    errors = {"out": np.abs(out[rank] - arrays["out"][rank]).max(initial=0.0)}
    errors["joint_out"] = np.abs(joint_out[rank] - arrays["joint_out"]).max()
    for name in ("q", "k", "v", *JOINT):
        want = sum(arrays[f"d{name}"]) if once and name in JOINT else arrays[f"d{name}"][rank]
        got = grads[name] if once and name in JOINT else grads[name][rank]
        errors[f"d{name}"] = np.abs(got - want).max(initial=0.0) / max(1.0, np.abs(want).max(initial=0.0))
    return errors


#: (world size, check_vma, the ring / USP cases run): one compile each (seconds of CPU), spread over the world
#: sizes -- MQA with one joint token, USP at U = 2, causal zigzag at W = 3, check_vma=False at W = 4, and USP's
#: front causal zigzag on a 2 x 2 mesh in the joint-given-once test below; the torch twin runs every case at
#: every W.
RING_SPREAD = [
    (1, True, ("ring-front-causal-mqa",)),
    (2, True, ("usp-rear",)),
    (3, True, ("ring-rear-causal-zigzag",)),
    (4, False, ("ring-front",)),
]


@pytest.mark.parametrize(("world_size", "check_vma", "names"), RING_SPREAD)
def test_ring_and_usp_cases_against_the_reference_on_every_rank(world_size, check_vma, names):
    failed = []
    for case in (case for case in joint_cases.ring_cases(world_size) if case.name in names):
        arrays = joint_cases.ring_arrays(case)
        out, joint_out, grads = _ring_run(case, arrays, check_vma)
        for rank in range(world_size):
            errors = _ring_errors(arrays, out, joint_out, grads, rank)
            if max(errors.values()) > 1e-12:
                failed.append(f"{case.name} rank {rank}: {errors}")
            if not np.array_equal(joint_out[rank], joint_out[0]):
                failed.append(f"{case.name} rank {rank}: joint_out is not rank 0's bit for bit")
    assert not failed, "\n".join(failed)


def test_ring_joint_tensors_given_once_get_the_full_gradient():
    case = joint_cases.ring_cases(4)[4]  # USP front causal zigzag: the shares of both axes summed by JAX
    arrays = joint_cases.ring_arrays(case)
    out, joint_out, grads = _ring_run(case, arrays, once=True)
    errors = _ring_errors(arrays, out, joint_out, grads, 0, once=True)
    assert max(errors.values()) < 1e-12, errors
