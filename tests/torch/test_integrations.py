"""`commlib_torch.sequence.parallel` and `commlib_torch.integrations.transformers` on real gloo process groups:
the registered attention, called as transformers calls it, against the float64 reference (`commlib.attention`:
unsharded GQA attention at global positions) on every rank, values and dq/dk/dv, for Ulysses (odd lengths, a rank
with fewer rows), ring (zigzag) and USP 2 x 2; every refusal with its message on every rank; nested contexts; a
transformers Llama sharded against the unsharded model, outside a context and with a padding mask. The whole
training loop is examples/transformers_llama.py (tests/test_training_examples.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import commlib
from commlib import attention as A
from commlib_torch.integrations import transformers as integration
from commlib_torch.sequence import parallel
from commlib_torch.tools.parity_jobs import usp_groups

# --- per-rank jobs: the pool's workers run them (module level: pickled by reference) ------------------------


def context(ctx, layout: commlib.SequenceLayout, attention: str):
    """``parallel(layout, ...)`` for `attention` over WORLD (USP: ring of Ulysses groups of layout.ulysses_size)."""
    if attention == "usp":
        ulysses_group, ring_group = usp_groups(ctx.world_size, layout.ulysses_size)
        return parallel(layout, attention="usp", ulysses_group=ulysses_group, ring_group=ring_group)
    return parallel(layout, attention=attention)


def attention_call(ctx, layout: commlib.SequenceLayout, attention: str, whole: list[np.ndarray], causal: bool):
    """This rank's output and (dq, dk, dv) of the registered attention on its shard of the whole float64
    ``[B, S, H, D]`` q, k, v (and the cotangent), called as transformers calls it: ``[B, H, S_r, D]``."""
    shard = [torch.tensor(part[ctx.rank]) for part in (layout.shard(x) for x in whole)]
    leaves = [x.requires_grad_() for x in shard[:3]]  # [B, S_r, H, D]: transformers hands over [B, H, S_r, D] views
    module = torch.nn.Module()
    module.is_causal = causal
    position_ids = torch.as_tensor(layout.positions(ctx.rank))[None]
    with context(ctx, layout, attention):
        out, weights = integration.attention_forward(
            module, *(x.transpose(1, 2) for x in leaves), None, scaling=0.3, position_ids=position_ids
        )
    assert weights is None
    (out * shard[3]).sum().backward()
    return out.detach().numpy(), [leaf.grad.numpy() for leaf in leaves]


def _error(call) -> str:
    try:
        call()
    except (commlib.CommError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def refusals(ctx) -> dict[str, str]:
    """The error text of every call the integration and the context refuse, on this rank (W ranks, S = 7)."""
    layout = commlib.SequenceLayout(7, ulysses_size=ctx.world_size)
    rows = layout.sizes[ctx.rank]
    q, k = torch.ones(1, 4, rows, 8, dtype=torch.float64), torch.ones(1, 2, rows, 8, dtype=torch.float64)
    positions = torch.as_tensor(layout.positions(ctx.rank))[None]

    def call(**kwargs):
        arguments = dict(attention_mask=None, position_ids=positions) | kwargs
        mask = arguments.pop("attention_mask")
        with parallel(layout):
            integration.attention_forward(None, arguments.pop("query", q), k, k, mask, **arguments)

    def enter(*args, **kwargs):
        with parallel(*args, **kwargs):
            pass

    return {
        "outside": _error(lambda: integration.attention_forward(None, q, k, k, None)),
        "mask": _error(lambda: call(attention_mask=torch.ones(1, 1, rows, 7, dtype=torch.bool))),
        "padding shape": _error(lambda: call(attention_mask=torch.ones(1, rows + 1, dtype=torch.bool))),
        "dropout": _error(lambda: call(dropout=0.1)),
        "sliding_window": _error(lambda: call(sliding_window=0)),
        "softcap": _error(lambda: call(softcap=30.0)),
        "sinks": _error(lambda: call(s_aux=torch.zeros(4))),
        "local positions": _error(lambda: call(position_ids=torch.arange(rows)[None] + 1)),
        "rows": _error(lambda: call(query=torch.ones(1, 4, rows + 1, 8, dtype=torch.float64))),
        "layout world size": _error(lambda: enter(commlib.SequenceLayout(7, ulysses_size=ctx.world_size + 1))),
        "ring layout for ulysses": _error(lambda: enter(commlib.SequenceLayout(8, ring_size=ctx.world_size))),
        "unknown attention": _error(lambda: enter(layout, attention="flash")),
        "usp without groups": _error(lambda: enter(layout, attention="usp")),
        "not a layout": _error(lambda: enter(7)),
    }


def nesting(ctx) -> list[str]:
    """The attention of the innermost context, before, inside and after a nested one."""
    from commlib_torch import _parallel

    seen = []
    outer = commlib.SequenceLayout(8, ulysses_size=ctx.world_size)
    inner = commlib.SequenceLayout(8, ring_size=ctx.world_size)
    with parallel(outer):
        seen.append(_parallel.current("test").plan.attention)
        with parallel(inner, attention="ring"):
            seen.append(_parallel.current("test").plan.attention)
        seen.append(_parallel.current("test").plan.attention)
    seen.append(str(_parallel.CONTEXTS.innermost()))
    return seen


def llama(ctx, seq_len: int, padding: bool):
    """A tiny transformers Llama (GQA) built with ``attn_implementation="commlib"``: its sharded logits on this
    rank against the unsharded SDPA model's (relative error), or, with `padding`, the error (if any) of a call
    with a padding mask."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    integration.register()
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64)
    sharded = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="commlib", dtype=torch.float64)
    sharded.load_state_dict(reference.state_dict())
    layout = commlib.SequenceLayout(seq_len, ulysses_size=ctx.world_size)
    ids = torch.randint(0, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    positions = torch.as_tensor(layout.positions(ctx.rank))
    mine = dict(input_ids=ids[:, positions], position_ids=positions[None].expand(2, -1), use_cache=False)
    if padding:
        mask = torch.ones(2, len(positions), dtype=torch.long)
        mask[0, 0] = 0
        with parallel(layout):
            return _error(lambda: sharded(**mine, attention_mask=mask))
    outside = _error(lambda: sharded(**mine))
    with parallel(layout):
        logits = sharded(**mine).logits
    want = reference(input_ids=ids, use_cache=False).logits[:, positions]
    return outside, float((logits - want).abs().max() / want.abs().max())


def llama_masked(ctx, seq_len: int, attention: str, what: str) -> float:
    """The tiny Llama with ``attn_implementation="commlib"`` on this rank's shard with packed documents (`what`
    "packed": position_ids restarting at each document, as DataCollatorWithFlattening makes, no mask) or a
    padding ``attention_mask`` ("padding": row 0 padded at its end, row 1 at its start), against the unsharded
    SDPA model given the same positions or mask: the largest relative error of the logits of this rank's
    non-padding tokens."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from commlib import sequence_helpers
    from tests.sequence_cases import documents

    integration.register()
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64)
    sharded = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="commlib", dtype=torch.float64)
    sharded.load_state_dict(reference.state_dict())
    layout = (
        commlib.SequenceLayout(seq_len, ring_size=ctx.world_size, layout="zigzag")
        if attention == "ring"
        else commlib.SequenceLayout(seq_len, ulysses_size=ctx.world_size)
    )
    ids = torch.randint(0, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    mine = torch.as_tensor(layout.positions(ctx.rank))
    if what == "packed":  # documents of random lengths crossing shards, no padding
        segments = documents(layout)[:1].repeat(2, 0)
        segments[segments < 0] = segments.max() + 1
        positions = torch.as_tensor(sequence_helpers.document_positions(segments))
        kept = torch.ones(2, seq_len, dtype=torch.bool)
        want = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
        with parallel(layout, attention=attention, packed=True):
            got = sharded(input_ids=ids[:, mine], position_ids=positions[:, mine], use_cache=False).logits
    else:
        mask = torch.ones(2, seq_len, dtype=torch.long)
        mask[0, seq_len - 3 :], mask[1, :2] = 0, 0
        kept = mask.bool()
        global_positions = torch.arange(seq_len)[None].expand(2, -1)
        want = reference(input_ids=ids, attention_mask=mask, position_ids=global_positions, use_cache=False).logits
        with parallel(layout, attention=attention):
            got = sharded(
                input_ids=ids[:, mine],
                attention_mask=mask[:, mine],
                position_ids=global_positions[:, mine],
                use_cache=False,
            ).logits
    rows = kept[:, mine]
    return float((got - want[:, mine])[rows].abs().max() / want[:, mine][rows].abs().max())


def not_a_packing(ctx) -> list[str]:
    """position_ids that no packing of documents gives, on this rank (W = 2, S = 8, contiguous Ulysses): a step
    of +2 inside the shard, a position past the token's global one, and local 0..n-1 (on rank 1; rank 0's local
    positions are its global ones, so it gets a negative position instead)."""
    layout = commlib.SequenceLayout(8, ulysses_size=ctx.world_size)
    q, k = torch.ones(1, 4, 4, 8, dtype=torch.float64), torch.ones(1, 2, 4, 8, dtype=torch.float64)
    start = 4 * ctx.rank
    calls = [
        torch.tensor([[0, 1, 3, 4]]),
        torch.tensor([[start + 1] * 4]) + torch.arange(4),
        torch.arange(4)[None] if ctx.rank else torch.tensor([[0, 1, 2, -1]]),
    ]
    texts = []
    for positions in calls:
        with parallel(layout, packed=True):
            texts.append(_error(lambda: integration.attention_forward(None, q, k, k, None, position_ids=positions)))  # noqa: B023
    return texts


def refusal_on_some_ranks(ctx, what: str) -> str:
    """In checked mode, a call refused on some ranks only (`what`: "positions" -- local positions, which rank 0's
    global ones equal under contiguous Ulysses; "mask" -- a padding mask on the last rank only): the error on
    this rank, which must raise too instead of entering the all-to-all alone."""
    from commlib_torch import checked

    layout = commlib.SequenceLayout(8, ulysses_size=ctx.world_size)
    rows = layout.sizes[ctx.rank]
    q, k = torch.ones(1, 4, rows, 8, dtype=torch.float64), torch.ones(1, 2, rows, 8, dtype=torch.float64)
    positions = torch.arange(rows)[None]  # local: rank 0's are its global ones
    mask = torch.ones(1, 1, rows, 8, dtype=torch.bool) if what == "mask" and ctx.rank == ctx.world_size - 1 else None
    if what == "mask":
        positions = torch.as_tensor(layout.positions(ctx.rank))[None]
    with checked(), parallel(layout):
        return _error(lambda: integration.attention_forward(None, q, k, k, mask, position_ids=positions))


def llama_default_positions(ctx) -> str:
    """A Llama called inside the context without `position_ids` (transformers then makes local ones, 0..n-1) in
    checked mode: the error on this rank (rank 0's local positions are its global ones: it raises too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from commlib_torch import checked

    integration.register()
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="commlib", dtype=torch.float64)
    layout = commlib.SequenceLayout(9, ulysses_size=ctx.world_size)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with checked(), parallel(layout):
        return _error(lambda: model(input_ids=ids[:, layout.positions(ctx.rank)], use_cache=False))


def helpers_in_context(ctx) -> dict:
    """Inside a ring context over a contiguous layout: shard_tokens / position_ids with layout (and group) None
    against the explicit call, and the errors of a zigzag layout given to each helper."""
    from commlib_torch import sequence

    contiguous = commlib.SequenceLayout(13, ring_size=ctx.world_size)
    zigzag = commlib.SequenceLayout(13, ring_size=ctx.world_size, layout="zigzag")
    ids = torch.arange(13)[None]
    x = torch.zeros(1, 13, 2)
    with parallel(contiguous, attention="ring"):
        defaults = [t.tolist() for t in (*sequence.shard_tokens(ids), sequence.position_ids())]
        explicit = [t.tolist() for t in (*sequence.shard_tokens(ids, contiguous), sequence.position_ids(contiguous))]
        errors = [
            _error(lambda: sequence.shard_tokens(ids, zigzag)),
            _error(lambda: sequence.position_ids(zigzag)),
            _error(lambda: sequence.shard_sequence(x, zigzag)),
            _error(lambda: sequence.gather_sequence(x[:, : zigzag.sizes[ctx.rank]], zigzag)),
        ]
    outside = _error(lambda: sequence.position_ids())
    return {"defaults": defaults, "explicit": explicit, "errors": errors, "outside": outside}


def llama_all_ones(ctx, attention: str) -> dict:
    """The tiny Llama (2 layers) with ``attn_implementation="commlib"`` on this rank's shard, two forwards and
    backwards with an all-ones ``attention_mask`` (a tokenizer's, long) against the same without a mask: the
    largest differences of the logits and of every parameter's gradient, and the all_reduces made per forward
    (the ranks' decision whether every mask keeps every token)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    integration.register()
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="commlib", dtype=torch.float64)
    masked = copy.deepcopy(plain)
    layout = (
        commlib.SequenceLayout(12, ring_size=ctx.world_size, layout="zigzag")
        if attention == "ring"
        else commlib.SequenceLayout(12, ulysses_size=ctx.world_size)
    )
    positions = torch.as_tensor(layout.positions(ctx.rank))[None].expand(2, -1)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))[:, positions[0]]
    reduce, reduces = torch.distributed.all_reduce, []

    def counted(*args, **kwargs):
        reduces.append(1)
        return reduce(*args, **kwargs)

    found: dict = {"reduces": []}
    for model, mask in ((plain, None), (masked, torch.ones_like(ids))):
        for _ in range(2):
            torch.distributed.all_reduce = counted
            try:
                with parallel(layout, attention=attention):
                    logits = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
            finally:
                torch.distributed.all_reduce = reduce
            logits.sum().backward()
            found["reduces"] += [len(reduces)] if mask is not None else []
            reduces.clear()
        found["masked" if mask is not None else "plain"] = logits.detach()
    found["logits"] = float((found.pop("masked") - found.pop("plain")).abs().max())
    found["gradients"] = max(
        float((p.grad - q.grad).abs().max()) for p, q in zip(plain.parameters(), masked.parameters(), strict=True)
    )
    return found


def llama_with_a_hole(ctx, attention: str) -> dict:
    """The tiny Llama (2 layers, float64) trained one step the way docs/integrations.md says for a tokenizer's
    padding mask: ``segment_ids = where(mask, 0, -1)``, ``shard_tokens(..., segment_ids=)``, ``parallel(...,
    packed=True)``, the mask of this rank's tokens, `cross_entropy` and `sync_gradients`; the mask has holes (zeros
    between ones: row 0 at 4, 5, where rank 0's Ulysses shard ends; row 1 at 3 and 7, right padding). The
    reference is the unsharded SDPA model given the same 2-D mask (transformers attends across a hole, its
    positions arange), its loss over the same labels (`document_labels`: none on padding or before a hole). Returns
    the largest absolute differences of the logits of this rank's kept tokens, of the loss and of every parameter's
    gradient. (Left padding is left out: the helpers' positions start at the text, transformers' arange at 0, and
    transformers' float32 RoPE then differs in the gradients by ~1e-8 relative, hole or none.)"""
    import copy

    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from commlib.sequence_helpers import document_labels
    from commlib_torch.sequence import cross_entropy, shard_tokens, sync_gradients

    integration.register()
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64)
    sharded = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="commlib", dtype=torch.float64)
    sharded.load_state_dict(reference.state_dict())
    seq_len = 11
    layout = (
        commlib.SequenceLayout(seq_len, ring_size=ctx.world_size, layout="zigzag")
        if attention == "ring"
        else commlib.SequenceLayout(seq_len, ulysses_size=ctx.world_size)
    )
    ids = torch.randint(0, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0]])
    segments = torch.where(mask.bool(), 0, -1)  # docs/integrations.md: a tokenizer's mask, one document a row
    with parallel(layout, attention=attention, packed=True):
        mine_ids, positions, labels, mine = shard_tokens(ids, layout, segment_ids=segments)
        logits = sharded(
            input_ids=mine_ids, position_ids=positions, attention_mask=(mine >= 0).long(), use_cache=False
        ).logits
        loss = cross_entropy(logits, labels)
        loss.backward()
        sync_gradients(sharded.parameters())
    want_logits = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    whole_labels = torch.as_tensor(document_labels(ids, segments))
    want = F.cross_entropy(want_logits.flatten(0, 1), whole_labels.flatten(), ignore_index=-100)
    want.backward()
    rows, kept = layout.positions(ctx.rank), mine >= 0
    return {
        "logits": float((logits.detach() - want_logits.detach()[:, rows])[kept].abs().max()),
        "loss": float((loss - want).detach().abs()),
        "gradients": max(
            float((p.grad - q.grad).abs().max())
            for p, q in zip(sharded.parameters(), reference.parameters(), strict=True)
        ),
    }


def empty_shard(ctx, attention: str) -> str:
    """``parallel`` at S = 3 over this pool's 4 ranks (ring zigzag or contiguous Ulysses, USP 2 x 2): the error
    entering it raises on this rank (before, rank 3's empty shard entered and then crashed inside transformers),
    or "entered"."""
    layout = (
        commlib.SequenceLayout(3, 2, 2)
        if attention == "usp"
        else commlib.SequenceLayout(3, ring_size=4, layout="zigzag")
        if attention == "ring"
        else commlib.SequenceLayout(3, ulysses_size=4)
    )
    try:
        with context(ctx, layout, attention):
            return "entered"
    except commlib.CommError as error:
        return str(error)


def skip_the_mask_decision(ctx, checked: bool) -> str:
    """Rank 0 calls the registered attention with an all-ones padding mask (its first layer all_reduces the
    decision; in checked mode the refusal exchange all_reduces first); rank 1 never does. What rank 0 raises
    after the pool's 5 s process-group timeout (type: message), rank 1 "skipped"."""
    from commlib_torch._checked import checked as checked_mode

    if ctx.rank == 1:
        return "skipped"
    layout = commlib.SequenceLayout(8, ulysses_size=ctx.world_size)
    q = torch.ones(1, 4, 4, 8, dtype=torch.float64)
    try:
        with parallel(layout), checked_mode(checked):
            integration.attention_forward(
                None, q, q, q, torch.ones(1, 4, dtype=torch.long), position_ids=torch.arange(4)[None]
            )
    except Exception as error:  # what reaches the user: the type is the test's point
        return f"{type(error).__name__}: {error}"
    return "returned"


def sliding_window_model(ctx, arch: str, attention: str, seq_len: int, window: int) -> list[float]:
    """A tiny transformers model whose layers have a sliding window (``"mistral"``: every layer; ``"qwen2"``: a
    full layer then a sliding one), float64, seeded, built with ``attn_implementation="commlib"`` and run
    sharded in a `parallel` context (`attention`: "ulysses" or "ring", zigzag): the largest |difference| of
    this rank's logits from the unsharded SDPA model's (whose mask is transformers' own sliding-window mask),
    and of every parameter's gradient of ``sum(logits * cotangent)`` (summed over the ranks) from the
    unsharded model's."""
    import copy

    import torch.distributed as dist
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    integration.register()
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sizes.update(num_key_value_heads=2, vocab_size=64, sliding_window=window)
    if arch == "mistral":
        config, model = MistralConfig(**sizes, head_dim=8), MistralForCausalLM
    else:
        config, model = Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=1), Qwen2ForCausalLM
    torch.manual_seed(0)
    reference = model._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64)
    sharded = model._from_config(copy.deepcopy(config), attn_implementation="commlib", dtype=torch.float64)
    sharded.load_state_dict(reference.state_dict())
    if attention == "ring":
        layout = commlib.SequenceLayout(seq_len, ring_size=ctx.world_size, layout="zigzag")
    else:
        layout = commlib.SequenceLayout(seq_len, ulysses_size=ctx.world_size)
    ids = torch.randint(0, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    cotangent = torch.randn(2, seq_len, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    positions = torch.as_tensor(layout.positions(ctx.rank))
    with parallel(layout, attention=attention):
        logits = sharded(
            input_ids=ids[:, positions], position_ids=positions[None].expand(2, -1), use_cache=False
        ).logits
    (logits * cotangent[:, positions]).sum().backward()
    want = reference(input_ids=ids, use_cache=False).logits
    (want * cotangent).sum().backward()
    errors = [float((logits - want[:, positions]).abs().max())]
    for mine, theirs in zip(sharded.parameters(), reference.parameters(), strict=True):
        grad = mine.grad.clone()
        dist.all_reduce(grad)
        errors.append(float((grad - theirs.grad).abs().max()))
    return errors


# --- the tests ----------------------------------------------------------------------------------------------


WORLD_SIZES = (1, 2, 3, 4)
TOLERANCE = 1e-10


def _whole(seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """float64 q ``[2, S, 8, 4]``, k and v ``[2, S, 2, 4]`` (GQA) and the output cotangent."""
    rng = np.random.default_rng(seed)
    shapes = [(2, seq_len, 8, 4), (2, seq_len, 2, 4), (2, seq_len, 2, 4), (2, seq_len, 8, 4)]
    return [rng.standard_normal(shape) for shape in shapes]


def _check(pool, layout: commlib.SequenceLayout, attention: str, causal: bool) -> None:
    whole = _whole(layout.seq_len)
    replies = pool(layout.world_size).run(attention_call, layout, attention, whole, causal)
    want = A.attention(*whole[:3], causal=causal, scale=0.3)
    want_grads = A.attention_vjp(*whole, causal=causal, scale=0.3)
    for rank, (out, grads) in enumerate(replies):
        rows = layout.positions(rank)
        np.testing.assert_allclose(out, want[:, rows], rtol=0, atol=TOLERANCE, err_msg=f"rank {rank} output")
        for name, grad, wanted in zip("qkv", grads, want_grads, strict=True):
            np.testing.assert_allclose(grad, wanted[:, rows], rtol=0, atol=TOLERANCE, err_msg=f"rank {rank} d{name}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("seq_len", [7, 37])
def test_ulysses_any_length(pool, world_size, seq_len):
    """S = 7 at W = 4: three ranks hold 2 rows, one holds 1."""
    _check(pool, commlib.SequenceLayout(seq_len, ulysses_size=world_size), "ulysses", causal=True)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_zigzag(pool, world_size):
    _check(pool, commlib.SequenceLayout(24, ring_size=world_size, layout="zigzag"), "ring", causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_usp_two_by_two(pool, causal):
    _check(pool, commlib.SequenceLayout(16, ring_size=2, ulysses_size=2, layout="zigzag"), "usp", causal=causal)


def test_ring_contiguous_not_causal(pool):
    _check(pool, commlib.SequenceLayout(12, ring_size=3), "ring", causal=False)


def test_refusals(pool):
    """Every refused call raises the spec's message, the same on every rank, before communicating."""
    replies = pool(4).run(refusals)
    for reply in replies[1:]:
        assert set(reply) == set(replies[0])
    first = replies[0]
    assert first["outside"].startswith(
        "CommError: commlib attention: called outside a commlib_torch.sequence.parallel(...) context"
    )
    assert "a dense attention mask is not supported" in first["mask"]
    assert "a padding attention_mask (1, 3) must be [batch, this rank's rows] (1, 2)" in first["padding shape"]
    assert "dropout (0.1) must be 0" in first["dropout"]
    assert "sliding_window (0) must be an int >= 1" in first["sliding_window"]
    assert "softcap (30.0) is not supported" in first["softcap"]
    assert "an attention bias is not supported" in first["sinks"]
    assert (
        "position_ids must be the global positions of shard 0 of the layout (layout.positions(0); "
        "sequence.shard_tokens and sequence.position_ids give them): from row 0 of batch row 0, expected [0, 1], "
        "received [1, 2]" in first["local positions"]
    )
    assert "query rows (3) must be layout.sizes[0] (2)" in first["rows"]
    assert (
        "parallel: layout.ulysses_size (5) must be 4 (the group's size for attention='ulysses')"
        in first["layout world size"]
    )
    assert "parallel: layout.ulysses_size (1) must be 4" in first["ring layout for ulysses"]
    assert "parallel: attention ('flash') must be one of ulysses, ring, usp" in first["unknown attention"]
    assert "attention='usp' needs both ulysses_group and ring_group" in first["usp without groups"]
    assert first["not a layout"].startswith("TypeError: parallel: layout must be a commlib.SequenceLayout, not int")
    for rank, reply in enumerate(replies):
        assert f"shard {rank}" in reply["local positions"]
        assert all(text != "no error" for text in reply.values()), (rank, reply)


@pytest.mark.parametrize("what", ["positions", "mask"])
def test_checked_mode_refusal_reaches_every_rank(pool, what):
    """In checked mode a refusal decided on some ranks only (local positions: rank 0's equal its global ones; a
    padding mask on the last rank only) makes every rank raise, the refusing ranks their own error and the others
    "another rank ... refused", instead of the passing ranks waiting in the all-to-all for the timeout."""
    replies = pool(4).run(refusal_on_some_ranks, what)
    refusing = range(1, 4) if what == "positions" else [3]
    for rank, text in enumerate(replies):
        if rank in refusing:
            wanted = (
                f"position_ids must be the global positions of shard {rank}"
                if what == "positions"
                else "a dense attention mask is not supported"
            )
            assert wanted in text, (rank, text)
        else:
            assert text.startswith("CommError: commlib attention: another rank of the layer refused this call"), (
                rank,
                text,
            )


def test_llama_without_position_ids_is_refused_on_every_rank(pool):
    """transformers' default positions are local (0..n-1 on each rank): the integration sees them and refuses,
    and in checked mode rank 0, whose local positions are its global ones, raises too."""
    replies = pool(3).run(llama_default_positions)
    assert replies[0].startswith("CommError: commlib attention: another rank of the layer refused this call")
    for rank in (1, 2):
        assert f"position_ids must be the global positions of shard {rank} of the layout" in replies[rank]
        assert "expected [3, 4, 5], received [0, 1, 2]" in replies[1]


def test_helpers_take_and_must_match_the_context_layout(pool):
    """Inside a context the helpers' layout None (and group None) are the context's; a zigzag layout under a
    contiguous context is refused by every helper, naming both layouts; outside, a layout is required."""
    contiguous = commlib.SequenceLayout(13, ring_size=3)
    zigzag = commlib.SequenceLayout(13, ring_size=3, layout="zigzag")
    for rank, reply in enumerate(pool(3).run(helpers_in_context)):
        assert reply["defaults"] == reply["explicit"]
        assert reply["defaults"][1] == [contiguous.positions(rank).tolist()]
        for name, text in zip(
            ("shard_tokens", "position_ids", "shard_sequence", "gather_sequence"), reply["errors"], strict=True
        ):
            assert text.startswith(
                f"CommError: {name}: layout ({zigzag!r}) must be the parallel context's layout ({contiguous!r})"
            ), text
        assert reply["outside"].startswith(
            "CommError: position_ids: layout is required outside a parallel(...) context"
        )


def test_nesting(pool):
    """The innermost context wins; the outer one is back on exit; nothing is left after."""
    for reply in pool(2).run(nesting):
        assert reply == ["ulysses", "ring", "ulysses", "None"]


def test_llama_through_the_registry(pool):
    """A transformers Llama with attn_implementation="commlib" at S = 7 over 3 ranks: logits within 1e-10 of the
    unsharded SDPA model's on every rank; outside a context, a clear CommError."""
    for outside, error in pool(3).run(llama, 7, False):
        assert "called outside a commlib_torch.sequence.parallel(...) context" in outside
        assert error <= TOLERANCE


@pytest.mark.parametrize(
    ("world_size", "seq_len", "attention", "what"),
    [(2, 9, "ulysses", "padding"), (3, 13, "ring", "padding"), (2, 9, "ulysses", "packed"), (3, 37, "ring", "packed")],
)
def test_llama_with_masks_is_the_unsharded_model(pool, world_size, seq_len, attention, what):
    """A padding attention_mask (padding at the end of one row, the start of the other) and packed documents
    (position_ids that restart, documents crossing shards) become segment ids: the logits of every rank's
    non-padding tokens equal the unsharded SDPA model's with the same mask or positions."""
    for rank, error in enumerate(pool(world_size).run(llama_masked, seq_len, attention, what)):
        assert error <= TOLERANCE, (rank, error)


@pytest.mark.parametrize(("world_size", "attention"), [(2, "ulysses"), (4, "ring")])
def test_a_padding_mask_with_holes_is_one_document(pool, world_size, attention):
    """A tokenizer's padding mask with zeros between ones, made segment ids as docs/integrations.md says and run
    with ``packed=True``: one document across each hole, as transformers attends; logits of the kept tokens, the
    loss and every gradient within 1e-10 of the unsharded model with the same 2-D mask (issue 34 item 8: the
    helpers restarted the positions after a hole, so the route split the row in two: logits 0.49, gradients 0.73
    off)."""
    for rank, found in enumerate(pool(world_size).run(llama_with_a_hole, attention)):
        assert max(found.values()) <= TOLERANCE, (rank, found)


@pytest.mark.parametrize(("world_size", "attention"), [(2, "ulysses"), (3, "ring")])
def test_an_all_ones_mask_is_dropped_once_per_forward(pool, world_size, attention):
    """A tokenizer's all-ones attention_mask costs one all_reduce per forward (the first layer decides for the
    model's two; a second forward decides again) and then runs exactly as without a mask: logits and gradients
    bit for bit. A mask that keeps every token on some ranks only stays segment ids on every rank
    (`test_llama_with_masks_is_the_unsharded_model`: at W = 3 ring, rank 2's shard holds no padding)."""
    for rank, found in enumerate(pool(world_size).run(llama_all_ones, attention)):
        assert found == {"reduces": [1, 1], "logits": 0.0, "gradients": 0.0}, (rank, found)


@pytest.mark.parametrize("attention", ["ulysses", "ring", "usp"])
def test_an_empty_shard_is_refused_on_every_rank(pool, attention):
    """S = 3 over 4 ranks: every rank's `parallel` raises the spec's CommError on entry, before any communication
    (issue 34 item 10: rank 3's empty shard crashed inside transformers 5.x and another rank got gloo's raw
    RuntimeError from the integration's all_reduce)."""
    for rank, text in enumerate(pool(4).run(empty_shard, attention)):
        assert text.startswith(
            f"parallel: seq_len (3) must be at least the world size (4) for attention={attention!r}: a rank with no "
            "tokens cannot run the model"
        ), (rank, text)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
def test_a_rank_missing_from_the_integrations_all_reduce_is_a_comm_timeout(checked):
    """The integration's own all_reduces (the all-ones mask decision; checked mode's refusal exchange) go through
    the failure translation: the rank left waiting raises CommTimeout naming "commlib attention" and its group,
    not gloo's raw RuntimeError (issue 34 item 10)."""
    from commlib_torch.tools.pool import WorkerPool

    with WorkerPool(2, timeout=60.0, pg_timeout=5.0) as pool:
        waiting, skipped = pool.run(skip_the_mask_decision, checked)
    assert skipped == "skipped"
    assert waiting.startswith(
        "CommTimeout: commlib attention: timed out on group rank 0 of the group with global ranks [0, 1] waiting for "
        "the other ranks"
    ), waiting


def test_packing_that_cannot_be_is_refused(pool):
    """In a packed context, position_ids that are no packing (a step of +2 inside the shard, a position past the
    token's global one, a negative one) or transformers' local 0..n-1 stay the spec's positions error; a custom
    4-D mask stays refused (`test_refusals`)."""
    for rank, texts in enumerate(pool(2).run(not_a_packing)):
        for text in texts:
            assert f"position_ids must be the global positions of shard {rank}" in text, (rank, text)


@pytest.mark.parametrize(
    ("arch", "attention", "world_size", "seq_len"),
    [("mistral", "ring", 4, 37), ("qwen2", "ring", 3, 24), ("mistral", "ulysses", 3, 13), ("qwen2", "ulysses", 2, 9)],
)
def test_sliding_window_models_are_the_unsharded_model(pool, arch, attention, world_size, seq_len):
    """transformers models with ``sliding_window = 5`` (Mistral: every layer; Qwen2: a full layer then a sliding
    one), float64, through ``attn_implementation="commlib"`` (each sliding layer's ``mask=SlidingWindow(5)``):
    every rank's logits and every parameter's gradient (summed over the ranks) within 1e-10 of the unsharded
    SDPA model's, whose mask is transformers' own. Refused before the rule existed."""
    for errors in pool(world_size).run(sliding_window_model, arch, attention, seq_len, 5):
        assert max(errors) <= TOLERANCE, errors
