"""The attention layers' fuzz space, shared by tests/torch/test_layer_fuzz.py and tests/jax/test_layer_fuzz.py
(plain data: neither framework is imported here).

`layer_cases()` draws a `commlib.tools.cases.Case` of ``ulysses_attention``, ``ring_attention`` or
``usp_attention``: world sizes 1-4 (USP on 2 x 2), batch 1-2, MHA, GQA and MQA (1-4 kv heads, 1-3 q heads
each), a head dim of 1-4 and v's own head dim or the same, causal or not; Ulysses with any rows per rank (zeros
included, so an empty shard) and 1-3 head groups (``chunks``, more than some rank's heads); the ring and USP
contiguous or zigzag, of an even length or of any length (a `SequenceLayout`). Calls the spec rejects are
drawn too (their text must reach every rank)."""

from __future__ import annotations

from hypothesis import strategies as st

from commlib.tools import cases
from commlib.tools.cases import Case

__all__ = ["layer_cases"]


@st.composite
def layer_cases(
    draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2, 3, 4), dtypes: tuple[str, ...] = ("float64", "float32")
) -> Case:
    """One attention layer call (see the module docstring)."""
    W = draw(st.sampled_from(world_sizes))
    layer = draw(st.sampled_from(("ulysses", "ring", "usp") if W == 4 else ("ulysses", "ring")))
    kv_heads = draw(st.integers(1, 4))
    heads, head_dim = kv_heads * draw(st.integers(1, 3)), draw(st.integers(1, 4))
    value_dim = draw(st.sampled_from((head_dim, draw(st.integers(1, 5)))))
    keywords: dict[str, object] = {"causal": draw(st.booleans()), "dtype": draw(st.sampled_from(dtypes))}
    if value_dim != head_dim:
        keywords["value_dim"] = value_dim
    batch = draw(st.integers(1, 2))
    if layer == "ulysses":
        rows = tuple(draw(st.lists(st.integers(0, 3), min_size=W, max_size=W)))
        return cases.attention_case(
            W,
            (batch, sum(rows), heads, head_dim),
            "~fuzz",
            kv_heads=kv_heads,
            seq_sizes=rows,
            chunks=draw(st.integers(1, 3)),
            **keywords,
        )
    ring_size, ulysses_size = (2, 2) if layer == "usp" else (W, None)
    layout = draw(st.sampled_from(("contiguous", "zigzag")))
    if draw(st.booleans()):
        seq, keywords["any_length"] = draw(st.integers(1, 3 * W + 2)), True
    else:
        seq = draw(st.integers(1, 2)) * W * (2 if layout == "zigzag" else 1)
    return cases.context_case(
        ring_size,
        (batch, seq, heads, head_dim),
        "~fuzz",
        kv_heads=kv_heads,
        ulysses_size=ulysses_size,
        layout=layout,
        **keywords,
    )
