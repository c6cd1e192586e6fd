"""The sequence helpers of a whole sequence-parallel model over `torch.distributed`: this rank's tokens, global
positions and globally shifted labels (`shard_tokens`, `position_ids`), the differentiable take and gather of a
sequence (`shard_sequence`, `gather_sequence`), the loss over every rank's tokens (`cross_entropy`) and the
gradient sync of replicated parameters (`sync_gradients`).

Each takes a `commlib.SequenceLayout` whose world size is the group's; rank r holds shard r exactly
(``layout.sizes[r]`` rows, possibly none). Inside a `parallel` context `layout` may be left out (None: the
context's; another one is refused with a `CommError` naming both) and `group` None is the context's (Ulysses' or
ring's group; USP's whole group, WORLD where none was given). The spec (`commlib.sequence_helpers`) validates
every call before any communication and owns the index tables; the float64 references there are what the tests
compare with.

And the `parallel` context that names the
attention layer (Ulysses, ring, USP), its groups and the `commlib.SequenceLayout` for the code inside it
(an integration, e.g. `commlib_torch.integrations.transformers`, runs that layer for the model's attention).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from commlib import SequenceLayout
from commlib import parallel as parallel_spec
from commlib import sequence_helpers as spec
from commlib.layer_check import layer_call, sequence_call
from commlib.parallel import ParallelPlan
from commlib_torch import _parallel
from commlib_torch._checked import exchange_layer, is_checked
from commlib_torch._dtypes import dtype_name
from commlib_torch._groups import GroupArgument, ResolvedGroup, check_tensor, resolve_group, world_size
from commlib_torch.functional import ReduceOpArgument, all_gather, all_reduce, shard

__all__ = [
    "shard_tokens",
    "shard_sequence",
    "gather_sequence",
    "position_ids",
    "cross_entropy",
    "sync_gradients",
    "parallel",
]


def _context_group(group: GroupArgument) -> GroupArgument:
    """`group`, or inside a `parallel` context where it is None the context's group (None: WORLD)."""
    state = _parallel.CONTEXTS.innermost()
    return state.group if group is None and state is not None else group


def _rank_layout(op_name: str, layout: object, group: GroupArgument) -> tuple[SequenceLayout, ResolvedGroup, int]:
    """The layout checked against the group, the resolved group and this rank in it. Inside a `parallel` context
    a layout None is the context's (another one is refused by the spec) and a group None the context's
    (Ulysses' or ring's group; USP's whole group, WORLD where none was given)."""
    state = _parallel.CONTEXTS.innermost()
    layout = parallel_spec.helper_layout(op_name, None if state is None else state.plan, layout)
    resolved = resolve_group(op_name, _context_group(group))
    layout = spec.check_layout(op_name, layout, world_size(op_name, resolved))
    return layout, resolved, dist.get_rank(resolved)


@functools.lru_cache(maxsize=256)
def _table(kind: str, layout: SequenceLayout, rank: int, device: torch.device) -> torch.Tensor:
    """An index tensor of the spec's tables, built once per layout, rank and device (read-only after)."""
    table: np.ndarray | None
    if kind == "positions":
        table = layout.positions(rank)
    elif kind == "labels":  # where each row's label comes from; -1: ignore_index
        table = spec.label_table(layout)[rank, : layout.sizes[rank]]
    elif kind == "shard":  # the shard order, a padding row taken from the zero row at index S
        order = spec.shard_order(layout, padded=not layout.is_even)
        assert order is not None  # only asked for where the spec says there is an order
        table = np.where(order < 0, layout.seq_len, order)
    else:  # "gather": natural order from the gathered shards
        table = spec.gather_order(layout)
    assert table is not None
    return torch.tensor(table, dtype=torch.int64, device=device)


def position_ids(layout: SequenceLayout | None = None, group: GroupArgument = None) -> torch.Tensor:
    """This rank's global positions: int64 ``[layout.sizes[rank]]`` (``layout.positions(rank)``) on the CPU
    (``.to(device)`` them), for RoPE and position embeddings (feeding local positions 0..n-1 instead is the
    silent mistake this replaces); `shard_tokens` returns them ``[B, n]`` on input_ids' device.

    Raises:
        CommError: ``layout.world_size`` is not the group's size; a layout other than the `parallel`
            context's, or none outside one. TypeError: `layout` not a `SequenceLayout`.

    Example:
        >>> from commlib import SequenceLayout
        >>> position_ids(SequenceLayout(5))  # W = 1: every position
        tensor([0, 1, 2, 3, 4])
    """
    layout, _, rank = _rank_layout("position_ids", layout, group)
    return _table("positions", layout, rank, torch.device("cpu")).clone()


def shard_tokens(
    input_ids: torch.Tensor,
    layout: SequenceLayout | None = None,
    group: GroupArgument = None,
    *,
    ignore_index: int = -100,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """This rank's part of the full tokens ``[B, S]`` every rank holds: ``(ids, position_ids, labels)``, each
    int64-indexed ``[B, sizes[rank]]`` (ids and labels in input_ids' dtype, positions int64).

    ids: the tokens at this rank's positions; position_ids: those global positions; labels: the next token of
    each position over the whole sequence (the label of position p is token p + 1; position S - 1 gets
    `ignore_index`), not shifted per shard. No communication; no gradient (integers).

    `segment_ids` (integers ``[B, S]`` like input_ids, e.g. rows of `commlib.segment_ids`: packed documents, a
    negative id padding): returns ``(ids, position_ids, labels, segment_ids)``; the positions restart at each
    document (a run of equal ids; padding 0; padding between two tokens of one id is a hole in that document,
    counted by the positions after it, as transformers counts a padding mask's zero in the middle:
    `commlib.sequence_helpers.document_tables`), a document's last token, the token before a hole and padding get
    `ignore_index` as label,
    and the fourth output is this rank's segment ids (in their dtype), for the attention layers' ``segment_ids=``.

    Raises:
        CommError: input_ids not 2-D, ``S != layout.seq_len``, ``layout.world_size`` not the group's; a
            layout other than the `parallel` context's, or none outside one; segment_ids not input_ids' shape.
        TypeError: input_ids or segment_ids not an integer tensor, `layout` not a `SequenceLayout`,
            `ignore_index` not an int.

    Example:
        >>> from commlib import SequenceLayout
        >>> ids, positions, labels = shard_tokens(torch.tensor([[5, 6, 7, 8]]), SequenceLayout(4))
        >>> ids, positions, labels  # W = 1: the labels are the tokens shifted by one
        (tensor([[5, 6, 7, 8]]), tensor([[0, 1, 2, 3]]), tensor([[   6,    7,    8, -100]]))
        >>> segments = torch.tensor([[0, 0, 1, -1]])  # a document of 2 tokens, one of 1, padding
        >>> shard_tokens(torch.tensor([[5, 6, 7, 8]]), SequenceLayout(4), segment_ids=segments)
        (tensor([[5, 6, 7, 8]]), tensor([[0, 1, 0, 0]]), tensor([[   6, -100, -100, -100]]), tensor([[ 0,  0,  1, -1]]))
    """
    input_ids = check_tensor("shard_tokens", input_ids, "input_ids")
    layout, _, rank = _rank_layout("shard_tokens", layout, group)
    ignore = spec.check_tokens(
        "shard_tokens", tuple(input_ids.shape), dtype_name(input_ids.dtype), layout, ignore_index
    )
    rows, labels_from = (_table(kind, layout, rank, input_ids.device) for kind in ("positions", "labels"))
    if segment_ids is not None:
        return _shard_documents(input_ids, check_tensor("shard_tokens", segment_ids, "segment_ids"), rows, ignore)
    ids = input_ids.index_select(1, rows)
    labels = input_ids.index_select(1, labels_from.clamp(min=0)).masked_fill(labels_from < 0, ignore)
    return ids, rows.repeat(input_ids.shape[0], 1), labels


class _TorchDocuments(spec.DocumentMath):
    """`commlib.sequence_helpers.DocumentMath` on torch tensors ``[B, S]`` (along dim 1)."""

    def __init__(self) -> None:
        super().__init__(torch)

    def cummax(self, x: torch.Tensor) -> torch.Tensor:
        return x.cummax(dim=1).values

    def take(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.gather(1, index)

    def shift(self, x: torch.Tensor, fill: int, step: int) -> torch.Tensor:
        edge = torch.full_like(x[:, :1], fill)
        return torch.cat([edge, x[:, :-1]] if step > 0 else [x[:, 1:], edge], dim=1)

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(x.shape[1], device=x.device).expand(x.shape)


_TORCH_DOCUMENTS = _TorchDocuments()


def _shard_documents(
    input_ids: torch.Tensor, segment_ids: torch.Tensor, rows: torch.Tensor, ignore: int
) -> tuple[torch.Tensor, ...]:
    """`shard_tokens` of packed documents (`spec.document_tables`: a run of one id, padding inside it a hole) at
    `rows`."""
    spec.check_token_segments(
        "shard_tokens", tuple(segment_ids.shape), dtype_name(segment_ids.dtype), tuple(input_ids.shape)
    )
    segments = segment_ids.to(input_ids.device)
    positions, continues = spec.document_tables(segments, _TORCH_DOCUMENTS)
    labels = torch.where(continues, input_ids.roll(-1, 1), ignore).to(input_ids.dtype)
    return tuple(whole.index_select(1, rows) for whole in (input_ids, positions, labels, segments))


def shard_sequence(
    x: torch.Tensor, layout: SequenceLayout | None = None, group: GroupArgument = None, *, dim: int = 1
) -> torch.Tensor:
    """Differentiable take of this rank's positions of a replicated `x`: ``[.., S, ..] -> [.., sizes[rank], ..]``
    along `dim` (``S == layout.seq_len``), x's dtype; no communication forward.

    Gradient: every rank's cotangent all-gathered into place (as `commlib_torch.shard`): each rank gets the
    gradient of the one replicated x. Built on `shard` (uneven layouts: each shard padded to
    ``layout.max_size`` rows in the shard order, the padding's cotangent dropped).

    Raises:
        CommError: `dim` out of range, ``x.shape[dim] != layout.seq_len``, ``layout.world_size`` not the group's;
            a layout other than the `parallel` context's, or none outside one.
        TypeError: x not a tensor, `layout` not a `SequenceLayout`.

    Example:
        >>> from commlib import SequenceLayout
        >>> shard_sequence(torch.arange(6.0).reshape(1, 3, 2), SequenceLayout(3)).shape  # W = 1: all of it
        torch.Size([1, 3, 2])
    """
    return _shard_sequence("shard_sequence", x, layout, group, dim)


def _shard_sequence(
    op_name: str, x: torch.Tensor, layout: SequenceLayout | None, group: GroupArgument, dim: int
) -> torch.Tensor:
    """`shard_sequence` as helper `op_name` (its errors name it)."""
    x = check_tensor(op_name, x)
    layout, resolved, rank = _rank_layout(op_name, layout, group)
    dim = spec.check_sequence(op_name, tuple(x.shape), dim, layout.seq_len, "layout.seq_len")
    if spec.shard_order(layout, padded=not layout.is_even) is not None:
        if not layout.is_even:  # a zero row at index S stands for every padding row
            x = torch.cat([x, x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1 :]))], dim)
        x = x.index_select(dim, _table("shard", layout, rank, x.device))
    out = shard(x, dim, resolved)
    return out if layout.is_even else out.narrow(dim, 0, layout.sizes[rank])


def gather_sequence(
    x: torch.Tensor,
    layout: SequenceLayout | None = None,
    group: GroupArgument = None,
    *,
    dim: int = 1,
    convention: str = "sum",
) -> torch.Tensor:
    """The inverse of `shard_sequence`: every rank's shard ``[.., sizes[r], ..]`` gathered into the whole
    sequence ``[.., S, ..]`` in natural position order along `dim`, on every rank; x's dtype.

    One `all_gather` (``sizes=layout.sizes`` when uneven) and one local permutation (none for a contiguous
    layout). Gradient as all_gather's: "sum" -> this rank's positions of the sum of every rank's cotangent;
    "replicated" -> this rank's positions of its own cotangent.

    Raises:
        CommError: `dim` out of range, ``x.shape[dim] != layout.sizes[rank]``, unknown convention,
            ``layout.world_size`` not the group's; a layout other than the `parallel` context's, or none
            outside one. TypeError: x not a tensor, `layout` not a `SequenceLayout`.

    Example:
        >>> from commlib import SequenceLayout
        >>> gather_sequence(torch.arange(3.0).reshape(1, 3), SequenceLayout(3))  # W = 1: as it is
        tensor([[0., 1., 2.]])
    """
    return _gather_sequence("gather_sequence", x, layout, group, dim, convention)


def _gather_sequence(
    op_name: str, x: torch.Tensor, layout: SequenceLayout | None, group: GroupArgument, dim: int, convention: str
) -> torch.Tensor:
    """`gather_sequence` as helper `op_name` (its errors, and checked mode's comparison, name it)."""
    x = check_tensor(op_name, x)
    layout, resolved, rank = _rank_layout(op_name, layout, group)
    if is_checked() and not torch.compiler.is_compiling():  # the ranks compare the options first
        exchange_layer(
            sequence_call(op_name, x.shape, dim, dtype_name(x.dtype), layout=layout, dim=dim, convention=convention),
            (resolved,),
            x.device,
        )
    dim = spec.check_sequence(
        op_name, tuple(x.shape), dim, layout.sizes[rank], f"layout.sizes[{rank}]", convention=convention
    )
    whole = all_gather(x, dim, resolved, convention=convention, sizes=spec.gather_sizes(layout))
    if spec.gather_order(layout) is None:
        return whole
    return whole.index_select(dim, _table("gather", layout, rank, whole.device))


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: GroupArgument = None, *, ignore_index: int = -100
) -> torch.Tensor:
    """The mean cross entropy over EVERY rank's non-ignored tokens, the same value on every rank of `group`:
    logits ``[*s, V]`` (this rank's tokens), labels ``[*s]`` -> a scalar in ``promote(logits.dtype, float32)``.

    This rank's token losses are summed (``F.cross_entropy(..., reduction="sum")``), the sums and the counts of
    non-ignored labels all_reduced, and loss = global sum / global count (a mean per shard, averaged, is wrong
    for uneven shards and padding). Gradient (``all_reduce(..., convention="replicated")``): each rank's logits
    get their tokens' share of the global mean, ``(softmax - one_hot) / global count`` (0 on ignored rows), so
    the replicated parameters' gradients summed over the group (`sync_gradients`) are the unsharded ones. No
    non-ignored token anywhere: NaN, as torch's mean. `group` None inside a `parallel` context: the context's
    group (the sequence group `shard_tokens` shards over), else WORLD.

    Labels outside ``[0, V)`` other than `ignore_index` on any rank: every rank raises the same CommError (their
    count per rank rides the loss's all_reduce; one host read of it per call, skipped under ``torch.compile``,
    where they count as ignored).

    Raises:
        CommError: ``labels.shape != logits.shape[:-1]``, logits 0-d, labels outside ``[0, V)`` other than
            `ignore_index` (on every rank). TypeError: logits not floating, labels not integer, `ignore_index`
            not an int.

    Example:
        >>> logits, labels = torch.zeros(1, 3, 4, requires_grad=True), torch.tensor([[1, 2, -100]])
        >>> loss = cross_entropy(logits, labels)  # W = 1: the mean over the two labelled tokens
        >>> round(loss.item(), 6)  # log(4)
        1.386294
    """
    logits, labels = check_tensor("cross_entropy", logits, "logits"), check_tensor("cross_entropy", labels, "labels")
    resolved = resolve_group("cross_entropy", _context_group(group))
    if is_checked() and not torch.compiler.is_compiling():  # the ranks compare the options first
        world_size("cross_entropy", resolved)  # (a rank outside the group: the spec's error, not an exchange)
        exchange_layer(
            sequence_call(
                "cross_entropy",
                logits.shape[-1:],
                None,
                dtype_name(logits.dtype),
                ignore_index=ignore_index,
                labels_dtype=dtype_name(labels.dtype),
            ),
            (resolved,),
            logits.device,
        )
    ignore = spec.check_cross_entropy(
        tuple(logits.shape), tuple(labels.shape), dtype_name(logits.dtype), dtype_name(labels.dtype), ignore_index
    )
    accumulate = torch.promote_types(logits.dtype, torch.float32)
    vocab, size = logits.shape[-1], world_size("cross_entropy", resolved)
    flat_labels = labels.reshape(-1).long()
    bad = (flat_labels != ignore) & ((flat_labels < 0) | (flat_labels >= vocab))
    flat_labels = torch.where(bad, ignore, flat_labels)  # counted below, never indexed
    flat = logits.reshape(-1, logits.shape[-1]).to(accumulate)
    local = torch.nn.functional.cross_entropy(flat, flat_labels, ignore_index=ignore, reduction="sum")
    count = (flat_labels != ignore).sum().to(accumulate)
    bad_by_rank = (torch.arange(size, device=logits.device) == dist.get_rank(resolved)) * bad.sum().to(accumulate)
    total = all_reduce(torch.cat([torch.stack([local, count]), bad_by_rank]), group=resolved, convention="replicated")
    if not torch.compiler.is_compiling():  # one host read: every rank raises the same error, none waits
        counts = [int(value) for value in total[2:].tolist()]
        if any(counts):
            raise spec.labels_out_of_range_error(counts, vocab, ignore)
    return total[0] / total[1].detach()


def sync_gradients(
    parameters: Iterable[torch.Tensor], group: GroupArgument = None, *, op: ReduceOpArgument = "sum"
) -> None:
    """Sum (``op="sum"``) or average (``"avg"``) the gradients of replicated parameters over `group`, in place:
    one all_reduce per dtype and device (the gradients flattened into one buffer each). With `cross_entropy`
    (each rank's share of the global mean) "sum" gives every rank the unsharded gradients; DDP's average would
    give 1/W of them. `group` None inside a `parallel` context: the context's group (the sequence group; on a
    DP x SP mesh the data-parallel average stays DDP's or yours), else WORLD.

    Every rank must pass the same parameters in the same order (shapes, dtypes, which are frozen; checked mode
    compares them). Parameters that do not require grad (frozen) are left out, as DDP leaves them. A parameter
    without a gradient on a rank takes part as zeros there, as under DDP's ``find_unused_parameters``, so every
    rank sends the same buffers and no gradient lands on another parameter: a parameter with a gradient on some
    rank gets the sum (or the average over all W ranks) on every rank, its gradient made where it had none; one
    with a gradient on no rank keeps None (a flag per parameter rides the all_reduce; read on the host only where
    a local gradient is None).

    An empty iterable is refused (CommError), not a silent no-op: syncing nothing is a mistake in a training
    step (a consumed generator, ``model.parameters()`` iterated before), and a rank that returned at once would
    leave its peers waiting in an all_reduce it never joins. Unchecked, a rank cannot know what its peers
    passed: the empty rank raises before communicating and the others time out (CommTimeout); in checked mode
    (``COMMLIB_CHECK=1``) the ranks compare their parameter lists first, so a rank's empty list, a different
    order or count, or a different `op` makes every rank raise the same CommError naming sync_gradients, the
    argument and what each rank had (two same-shape parameters swapped cannot be told apart).

    Raises:
        CommError: op not sum/avg, `parameters` empty (every rank in checked mode), ranks that disagree on the
            parameters or op (checked mode). TypeError: a parameter that is not a tensor, a sparse gradient.

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> (3 * weight).sum().backward()
        >>> sync_gradients([weight])  # W = 1: the sum over one rank
        >>> weight.grad
        tensor([3., 3.])
    """
    reduce_op = spec.check_sync_op(op)
    resolved = resolve_group("sync_gradients", _context_group(group))
    parameters = [check_tensor("sync_gradients", parameter, "parameter") for parameter in parameters]
    for parameter in parameters:
        if parameter.grad is not None and parameter.grad.is_sparse:
            raise spec.sparse_gradient_error(tuple(parameter.shape))
    if is_checked() and not torch.compiler.is_compiling():  # the ranks compare their parameters first
        world_size("sync_gradients", resolved)
        listed = spec.describe_parameters([(tuple(p.shape), _described_dtype(p)) for p in parameters])
        exchange_layer(
            layer_call("sync_gradients", parameters=listed, op=reduce_op.value), (resolved,), _device(resolved)
        )
    if not parameters:
        raise spec.no_parameters_error()
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for parameter in filter(lambda parameter: parameter.requires_grad, parameters):  # (as DDP: frozen left out)
        buckets.setdefault((parameter.dtype, parameter.device), []).append(parameter)
    with torch.no_grad():
        for members in buckets.values():
            _sync_bucket(members, reduce_op.value, resolved)


def _sync_bucket(parameters: list[torch.Tensor], op: str, group: ResolvedGroup) -> None:
    """One all_reduce of the parameters' gradients (zeros for None) and a has-a-gradient flag per parameter."""
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
    flags = torch.tensor([p.grad is not None for p in parameters], dtype=parameters[0].dtype, device=grads[0].device)
    flat = all_reduce(torch.cat([*(grad.reshape(-1) for grad in grads), flags]), op, group)
    *parts, _ = flat.split([grad.numel() for grad in grads] + [len(flags)])
    missing = any(parameter.grad is None for parameter in parameters)  # (the flags read on the host only then)
    present = flat[-len(flags) :].tolist() if missing else [True] * len(flags)
    for parameter, grad, part, anywhere in zip(parameters, grads, parts, present, strict=True):
        if parameter.grad is not None:
            grad.copy_(part.view_as(grad))
        elif anywhere != 0:  # a gradient on another rank: made here (the sum, or the average, of the others')
            parameter.grad = torch.empty_like(parameter).copy_(part.view_as(parameter))


def _described_dtype(parameter: torch.Tensor) -> str:
    """A parameter's dtype as checked mode shows it, "frozen" added where it does not require grad."""
    return dtype_name(parameter.dtype) + ("" if parameter.requires_grad else " frozen")


def _device(group: ResolvedGroup) -> torch.device:
    """The device of sync_gradients' checked-mode exchange: the group's, not a parameter's (an empty rank must
    exchange on the same backend as its peers)."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- the parallel context ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def parallel(
    layout: SequenceLayout,
    group: GroupArgument = None,
    *,
    attention: str = "ulysses",
    ulysses_group: GroupArgument = None,
    ring_group: GroupArgument = None,
    packed: bool = False,
) -> Iterator[ParallelPlan]:
    """A context in which an integration's attention call (a transformers model built with
    ``attn_implementation="commlib"``) runs commlib's `attention` layer on this rank's shard of `layout`.

    Args:
        layout: the `commlib.SequenceLayout` every rank's tokens follow (any length: Ulysses at any length;
            ring and USP through the layout itself where the length is uneven).
        group: the layer's group for ``"ulysses"`` and ``"ring"`` (None: WORLD), a 1-D DeviceMesh or
            ``(mesh, dim_name)``; for ``"usp"`` optional, the whole sequence group (its size is checked).
        attention: ``"ulysses"`` (`commlib_torch.attention.ulysses_attention`: ``layout.ulysses_size`` = the
            group's size, ``ring_size`` 1), ``"ring"`` (`ring_attention`: ``ring_size`` = the group's size) or
            ``"usp"`` (`usp_attention` over `ulysses_group` and `ring_group`, both required).
        packed: the model's ``position_ids`` are those of packed documents (restarting at 0 at each document,
            as transformers' ``DataCollatorWithFlattening`` and ``shard_tokens(..., segment_ids=)`` make): the
            integration masks attention by document (`commlib_torch.integrations.transformers.attention_forward`).
            A flag of the context, the same on every rank, since whether a rank's shard restarts is its own:
            the ranks of a layer must all pass segment ids or none. False: global positions, checked.

    Yields the spec's `commlib.parallel.ParallelPlan` (the layer and its layout keywords). Contexts nest (the
    innermost wins, the outer one is back on exit) and are per thread (a contextvar). The rank at Ulysses
    index u and ring index r holds shard ``r * U + u`` of the layout; the model must be fed that shard's
    tokens and its global positions (``layout.positions(shard)``) as ``position_ids``. The layers' gradients
    are exact (see each layer).

    Raises:
        CommError: an unknown `attention`, USP without both groups (or Ulysses / ring given them), a layout whose
            Ulysses or ring size is not its group's, a `group` whose size is not ``layout.world_size``; a
            ``layout.seq_len`` below the world size (a rank with an empty shard cannot run a transformers 5.x
            model: `commlib.parallel.check_every_shard_has_tokens`), on every rank alike, before any communication.
        TypeError: `layout` not a SequenceLayout, `attention` not a str, wrong group kinds.

    Example (one rank: WORLD of size 1):
        >>> import commlib, torch
        >>> from commlib_torch.attention import attention
        >>> from commlib_torch.integrations import transformers
        >>> layout = commlib.SequenceLayout(5)
        >>> with parallel(layout, attention="ulysses") as plan:
        ...     out, _ = transformers.attention_forward(None, *(torch.ones(2, 4, 5, 8) for _ in range(3)), None)
        >>> plan.attention, out.shape  # transformers' [B, H, S, D] in, [B, S, H, D] out
        ('ulysses', torch.Size([2, 5, 4, 8]))
    """
    state = _parallel.enter(layout, group, attention, ulysses_group, ring_group)
    state.packed = bool(packed)
    with _parallel.CONTEXTS.entered(state):
        yield state.plan
