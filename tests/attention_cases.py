"""Ulysses attention cases beyond the parity table (`commlib.tools.cases.case_table` holds the handed case, MQA
and bfloat16), shared by tests/torch/test_attention.py and tests/jax/test_attention.py; and the head-group
(``chunks=``) cases shared by tests/torch/test_chunks.py and tests/jax/test_chunks.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from commlib import SequenceLayout, segment_ids
from commlib import attention as A
from commlib.tools.cases import Case, attention_case

__all__ = [
    "extra_cases",
    "headless_cases",
    "handed_case",
    "chunk_cases",
    "with_chunks",
    "kv_exact",
    "chunked_segments",
    "BAD_CHUNKS",
]


def handed_case(causal: bool = False) -> Case:
    """The handed uneven case: W=4, B=1, S=10, H=6, H_kv=2, D=4, float64, seq_sizes (3, 3, 2, 2)."""
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


def headless_cases(world_size: int) -> list[Case]:
    """Calls where some rank attends with no heads in some head group while v has its own head dim (q, k in one
    exchange, v in another): fewer heads than ranks (H = W - 1; W = 2: H = 1), and more chunks than a rank's
    heads (H = 3, W = 2, chunks = 2: rank 1's second group is empty). Every rank still takes part in every
    exchange, forward and backward (a headless rank's q and k rows go to the ranks that attend with them)."""
    W = world_size
    rows = (
        [
            attention_case(
                W,
                (1, 2 * W + 1, W - 1, 2),
                "headless-value-dim",
                kv_heads=1,
                value_dim=3,
                seq_sizes="split",
                causal=True,
            )
        ]
        if W > 1
        else []
    )
    if W == 2:
        rows += [
            with_chunks(
                attention_case(
                    W, (1, 5, 3, 2), "headless-group-value-dim", kv_heads=1, value_dim=3, seq_sizes="split", causal=True
                ),
                chunks,
            )
            for chunks in (1, 2)
        ]
        rows += [
            with_chunks(
                attention_case(W, (2, 4, 3, 4), "headless-group-float32", kv_heads=3, value_dim=2, dtype="float32"), 2
            )
        ]
    if W == 3:  # GQA, split_sizes(4, 3) = (2, 1, 1): ranks 1 and 2 have no heads in group 1
        rows += [
            with_chunks(
                attention_case(
                    W, (1, 7, 4, 2), "headless-group-gqa-value-dim", kv_heads=2, value_dim=3, seq_sizes="split"
                ),
                2,
            )
        ]
    return rows


def chunk_cases(world_size: int) -> list[tuple[Case, tuple[int, ...]]]:
    """``(case, chunks)`` rows for ``ulysses_attention(..., chunks=c)`` at `world_size`: each `case` (run with
    chunks=1) is compared with every c of `chunks`. MHA with uneven heads and S (the last group empty on some
    ranks), causal; GQA whose groups keep each kv head's q heads together (float32, batch 2, even sizes); GQA
    whose groups cut a kv head's q heads (up to one head a group); MQA; v's own head dim (two exchanges per
    group)."""
    W = world_size
    most = -(-8 // W)  # ceil(8 / W): the most q heads a rank attends with at H = 8
    return [
        (
            attention_case(
                W, (1, 2 * W + 3, 2 * W + 1, 3), "chunks-mha", kv_heads=2 * W + 1, seq_sizes="split", causal=True
            ),
            (2, 3),
        ),
        (
            attention_case(W, (2, 2 * W, 4 * W, 4), "chunks-gqa-aligned", kv_heads=2 * W, dtype="float32", causal=True),
            (2,),
        ),
        (
            attention_case(W, (1, 3 * W + 1, 8, 2), "chunks-gqa", kv_heads=2, seq_sizes="split"),
            tuple(sorted({2, most})),
        ),
        (attention_case(W, (1, 2 * W + 1, 2 * W, 3), "chunks-mqa", kv_heads=1, seq_sizes="split", causal=True), (2,)),
        (attention_case(W, (1, 2 * W, 2 * W, 3), "chunks-value-dim", kv_heads=W, value_dim=5, causal=True), (2,)),
    ]


def with_chunks(case: Case, chunks: int) -> Case:
    """`case` called with ``chunks=chunks`` (the reference is the same: chunks changes no value)."""
    return dataclasses.replace(case, name=f"{case.name}[chunks={chunks}]", kwargs=(*case.kwargs, ("chunks", chunks)))


def kv_exact(case: Case, chunks: int) -> bool:
    """Whether dk and dv of ``chunks`` groups equal chunks=1's bit for bit: every kv head serves q heads of one
    group only (its gradient then sums the same terms in the same order; other groups add exact zeros)."""
    heads, kv_heads = case.shape[2], int(case.params["kv_heads"])  # type: ignore[call-overload]
    groups = A.head_groups(A.head_split(heads, kv_heads, case.world_size), chunks)
    users: dict[int, set[int]] = {}
    for index, group in enumerate(groups):
        for start, stop in group.kv_ranges:
            for head in range(start, stop):
                users.setdefault(head, set()).add(index)
    return all(len(indices) == 1 for indices in users.values())


def chunked_segments(world_size: int) -> tuple[SequenceLayout, list[np.ndarray], np.ndarray, int]:
    """Packed documents and padding at `world_size`: ``(layout, whole [q, k, v, cotangent], ids, chunks)``,
    B = 2, S = 6 W + 1 (uneven), H = 2 W + 2, H_kv = W + 1 (GQA), D = 4, chunks 2 (float64; causal by the
    caller); compared with chunks=1 and with `tests.mask_cases.expected`."""
    seq = 6 * world_size + 1
    layout = SequenceLayout(seq, ulysses_size=world_size)
    rng = np.random.default_rng(seq)
    whole = [
        rng.standard_normal(shape)
        for shape in (
            (2, seq, 2 * world_size + 2, 4),
            (2, seq, world_size + 1, 4),
            (2, seq, world_size + 1, 4),
            (2, seq, 2 * world_size + 2, 4),
        )
    ]
    ids = np.stack([segment_ids([3, seq - 5], seq), segment_ids([seq - 2], seq)])  # row 1: two padding rows
    return layout, whole, ids, 2


#: ``(chunks, error type name, the spec's message start)`` of calls refused before any communication, with
#: q ``[1, S_r, 6, 4]``, k and v ``[1, S_r, 2, 4]`` at W = 4 (split_sizes(6, 4) = (2, 2, 1, 1)).
BAD_CHUNKS = [
    ("2", "TypeError", "ulysses_attention: chunks must be an int, not str"),
    (2.0, "TypeError", "ulysses_attention: chunks must be an int, not float"),
    (0, "CommError", "ulysses_attention: chunks (0) must be >= 1"),
    (
        3,
        "CommError",
        "ulysses_attention: chunks (3) must be <= the most q heads a rank attends with (2: "
        "split_sizes(heads=6, world_size=4) = (2, 2, 1, 1))",
    ),
]
