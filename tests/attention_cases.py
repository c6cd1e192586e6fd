"""Ulysses attention cases beyond the parity table (`commlib.tools.cases.case_table` holds the handed case, MQA
and bfloat16), shared by tests/torch/test_attention.py and tests/jax/test_attention.py."""

from __future__ import annotations

from commlib.tools.cases import Case, attention_case

__all__ = ["extra_cases", "handed_case"]


def handed_case(causal: bool = False) -> Case:
    """Issue 9's case: W=4, B=1, S=10, H=6, H_kv=2, D=4, float64, seq_sizes (3, 3, 2, 2)."""
    return attention_case(4, (1, 10, 6, 4), kv_heads=2, seq_sizes=(3, 3, 2, 2), causal=causal)


def extra_cases(world_size: int) -> list[Case]:
    """Shapes the table leaves out, at `world_size`: fewer heads than ranks and a rank with no rows; q heads that
    do not group evenly over a rank's kv heads (W=3: heads 3, 4, 5 use kv heads 0, 1, 1); even sizes (the even
    collectives); v's own head dim with causal; float32."""
    W = world_size
    rows = (2, 0, 1, 3)[:W]
    return [
        attention_case(W, (1, sum(rows), 2, 2), "few-heads", kv_heads=1, seq_sizes=rows, causal=True),
        attention_case(W, (1, 5, 8, 2), "grouping", kv_heads=2, seq_sizes="split", causal=True),
        attention_case(W, (2, 2 * W, 8, 2), "even", kv_heads=8, causal=True),
        attention_case(W, (2, 6, 4, 3), "value-dim", kv_heads=2, value_dim=5, seq_sizes="split", causal=True),
        attention_case(W, (1, 10, 6, 4), "float32", kv_heads=2, dtype="float32", seq_sizes="split"),
    ]
