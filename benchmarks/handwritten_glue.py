"""The model-level glue of examples/transformers_llama.py written by hand, as a user writes it without
`commlib_torch.sequence`: this rank's tokens, GLOBAL positions and globally shifted labels for the three layouts
the example runs (Ulysses: contiguous; ring: zigzag; USP: zigzag ring blocks cut into Ulysses pieces) at any
length, the loss as this rank's share of the global mean, and the gradients summed over the group. It is the
"before" of docs/sequence-parallel.md's line count and is tested against the helpers
(tests/torch/test_sequence_parity.py: `test_handwritten_glue_is_the_helpers`).

    python benchmarks/handwritten_glue.py   # prints the line counts (code lines: no blanks, comments, docstrings)
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# --- the glue (what a user writes) ---------------------------------------------------------------------------


def balanced(n, parts):
    return [n // parts + (i < n % parts) for i in range(parts)]


def my_positions(seq_len, ring_size, ulysses_size, zigzag, rank):
    chunks = 2 * ring_size if zigzag else ring_size
    bounds = [0]
    for size in balanced(seq_len, chunks):
        bounds.append(bounds[-1] + size)
    ring, piece = divmod(rank, ulysses_size)
    block = list(range(bounds[ring], bounds[ring + 1]))
    if zigzag:
        block += list(range(bounds[chunks - 1 - ring], bounds[chunks - ring]))
    sizes = balanced(len(block), ulysses_size)
    start = sum(sizes[:piece])
    return torch.tensor(block[start : start + sizes[piece]], dtype=torch.long)


def my_shard_tokens(input_ids, positions, ignore_index=-100):
    ignored = torch.full_like(input_ids[:, :1], ignore_index)
    labels = torch.cat([input_ids[:, 1:], ignored], dim=1)
    position_ids = positions.expand(input_ids.shape[0], -1)
    return input_ids[:, positions], position_ids, labels[:, positions]


def my_loss(logits, labels, group=None, ignore_index=-100):
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum()
    dist.all_reduce(count, group=group)
    share = total / count  # this rank's share: backward gives its part of the gradient
    loss = share.detach().clone()
    dist.all_reduce(loss, group=group)  # the global mean, for logging
    return share, loss


def my_sync_gradients(parameters, group=None):
    for parameter in parameters:
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=group)


GLUE = (balanced, my_positions, my_shard_tokens, my_loss, my_sync_gradients)

# --- the count -------------------------------------------------------------------------------------------------

#: The example's glue with the helpers: the lines that call them (the layout is built in both versions).
HELPER_CALLS = (
    "shard_tokens(input_ids, layout)",
    "loss = cross_entropy(logits, labels)",
    "sync_gradients(sharded.parameters())",
    "from commlib_torch.sequence import",
)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers_llama.py"


def code_lines(source: str) -> int:
    """Lines holding code: no blank line, comment line or docstring."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def counts() -> tuple[int, int]:
    """(the hand-written glue's code lines plus its call lines in the example, the helpers' call lines)."""
    written = sum(code_lines(inspect.getsource(function)) for function in GLUE)
    calls = 4  # positions = my_positions(...), my_shard_tokens(...), my_loss(...), my_sync_gradients(...)
    helpers = [line for line in EXAMPLE.read_text().splitlines() if any(call in line for call in HELPER_CALLS)]
    return written + calls, len(helpers)


if __name__ == "__main__":
    written, helpers = counts()
    print(
        f"hand-written glue: {written} code lines (5 functions + 4 call lines); with commlib_torch.sequence: "
        f"{helpers} lines (an import and 3 calls) in {EXAMPLE.name}"
    )
    sys.exit(0)
