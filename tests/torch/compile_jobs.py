"""Pool jobs for test_compile.py: each op eager and under torch.compile(fullgraph=True).

The rooted ops (broadcast, gather, scatter, reduce, and reduce in broadcast's backward) run, under compile, as
calls Dynamo traces (`commlib_torch._walk`): the functional broadcast and one all_to_all_single; eagerly as
c10d's own.
"""

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import commlib_torch as cl

OPS = {
    "all_to_all_4d": lambda x: cl.all_to_all_4d(x, 2, 1),
    "all_to_all": lambda x: cl.all_to_all(x, 2, 0),
    "all_reduce": lambda x: cl.all_reduce(x, "avg"),
    "all_reduce_max": lambda x: cl.all_reduce(x, "max"),
    "all_gather": lambda x: cl.all_gather(x, 1, convention="replicated"),
    "reduce_scatter": lambda x: cl.reduce_scatter(x, 2),
    "sum_grad": lambda x: cl.sum_grad(x),
    "permute": lambda x: cl.permute(x, [(0, 1), (1, 0)]),
    "permute_partial": lambda x: cl.permute(x, [(0, 1)]),
    "all_reduce_product": lambda x: cl.all_reduce(x, "product"),
    "all_to_all_single": lambda x: cl.all_to_all(x, 2, 2),
    "shard": lambda x: cl.shard(x, 2, scale_grad=True),
    # uneven sizes (exact layout): heads 8 -> 5 and 3; all_gather's all_to_all_single form (eager: pairwise)
    "uneven": lambda x: cl.reduce_scatter(
        cl.all_gather(cl.all_to_all_4d(x, 2, 1, scatter_sizes=(5, 3)), 2, sizes=(5, 3)), 1, sizes=(3, 5)
    ),
    "broadcast": lambda x: cl.broadcast(x, 1),
    "gather": lambda x: cl.gather(x, 0, 2),
    "scatter": lambda x: cl.scatter(x, 1, 2),
    "reduce": lambda x: cl.reduce(x, 1, "avg"),
    # uneven rooted ops: rank 0 (dst) gathers 3 + 5 rows; rank 1 (src) scatters 3 and 5 rows of its 8
    "gather_uneven": lambda x: cl.gather(x[:, :, : 3 + 2 * dist.get_rank()], 0, 2, sizes=(3, 5)),
    "scatter_uneven": lambda x: cl.scatter(x, 1, 2, sizes=(3, 5)),
}


def _value_and_grad(fn, x, cotangent):
    x = x.clone().requires_grad_()
    out = fn(x)
    (out * cotangent).sum().backward()
    return out.detach(), x.grad


def eager_vs_compiled(context, name: str, backend: str):
    """(max |eager - compiled| of the output, of the input gradient) for one op on this rank. The compiled call
    runs first, and the only eager call before it on other values: a compiled graph that skipped a collective
    cannot pass by reading the eager result from freed memory."""
    return _eager_vs_compiled(context, OPS[name], backend)


def _eager_vs_compiled(context, fn, backend: str):
    torch.manual_seed(context.rank)
    x = torch.randn(2, 4, 4 * context.world_size, 3)
    cotangent = torch.randn_like(fn(x.detach() + 1.0))
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    out_c, grad_c = _value_and_grad(compiled, x, cotangent)
    out, grad = _value_and_grad(fn, x, cotangent)
    torch._dynamo.reset()
    return float((out - out_c).abs().max()), float((grad - grad_c).abs().max())


#: Ops whose output one may modify in place: all but sum_grad (its output is x itself, as Megatron's f returns
#: it: autograd refuses an in-place change of an input a Function returns) and max (its backward reads its
#: output: autograd refuses the backward after the change), eagerly and under torch.compile.
IN_PLACE = tuple(name for name in OPS if name not in ("sum_grad", "all_reduce_max"))


def in_place_eagerly(context, name: str):
    """(max |out' - 2 out|, max |grad' - 2 grad|) where out' is the op's output doubled in place and grad' the
    input gradient through it, out and grad the op's own: the change is allowed and the gradient follows it."""
    torch.manual_seed(context.rank)
    x = torch.randn(2, 4, 4 * context.world_size, 3)
    cotangent = torch.randn_like(OPS[name](x + 1.0))
    out, grad = _value_and_grad(OPS[name], x, cotangent)
    changed, grad_changed = _value_and_grad(lambda x: OPS[name](x).mul_(2.0), x, cotangent)
    return float((changed - 2 * out).abs().max()), float((grad_changed - 2 * grad).abs().max())


def in_place_eager_vs_compiled(context, name: str, backend: str):
    """`eager_vs_compiled` of the op followed by an in-place change of its output (inside the compiled region)."""
    fn = OPS[name]

    def changed(x):
        out = fn(x)
        out.mul_(2.0)
        return out

    return _eager_vs_compiled(context, changed, backend)


def rooted_chain(x: torch.Tensor) -> torch.Tensor:
    """Every rooted op, roots other than 0, and a rank that receives nothing from permute (W = 3)."""
    y = cl.scatter(cl.broadcast(x, 2), 1, 1)  # [2, 4W, 3] -> [2, 4, 3]
    y = cl.permute(y.sin(), [(0, 1), (1, 2)])
    return cl.gather(y * x[:, :4], 2, 0)


def chain_eager_vs_compiled(context, backend: str):
    """(graph breaks, max |eager - compiled| of the output, of the input gradient) of `rooted_chain` on this
    rank; the compiled call first (see `eager_vs_compiled`)."""
    torch.manual_seed(context.rank)
    x = torch.randn(2, 4 * context.world_size, 3)
    cotangent = torch.randn_like(rooted_chain(x + 1.0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(rooted_chain, fullgraph=True, backend=backend)
    out_c, grad_c = _value_and_grad(compiled, x, cotangent)
    breaks = sum(counters["graph_break"].values())
    out, grad = _value_and_grad(rooted_chain, x, cotangent)
    torch._dynamo.reset()
    return breaks, float((out - out_c).abs().max()), float((grad - grad_c).abs().max())


def block_eager_vs_compiled(context, backend: str, group_kind: str, steps: int = 3):
    """The training block (`commlib_torch.tools.train_block`) on a 2 x 2 SP x TP mesh of 4 ranks, float64, its
    forward under torch.compile(fullgraph=True) and its backward compiled with it (AOTAutograd), against eager
    for `steps` SGD steps on this rank's parameters. `group_kind`: "process groups" (``mesh.get_group``) or
    "mesh dims" (``(mesh, "sp")``: resolved while tracing). Returns (graph breaks, graphs compiled, max relative
    loss difference, max relative gradient difference)."""
    from commlib.tools import train_block
    from commlib_torch.tools.train_block import block_loss
    from tests.torch.mesh_jobs import mesh

    config = train_block.BlockConfig.for_world_size(4)
    grid = mesh()
    s, t = grid.get_local_rank("sp"), grid.get_local_rank("tp")
    groups = ((grid, "sp"), (grid, "tp")) if group_kind == "mesh dims" else (grid.get_group("sp"), grid.get_group("tp"))
    params, x, target = train_block.init(config, seed=0)
    x, target = (torch.from_numpy(train_block.sequence_block(a, 2, s).copy()) for a in (x, target))

    def parameters():
        return {
            name: torch.from_numpy(train_block.shard_parameter(name, value, 2, t).copy()).requires_grad_()
            for name, value in params.items()
        }

    def train(loss_fn, tensors):
        history = []
        for _ in range(steps):
            loss = loss_fn(tensors, x, target, config, groups)
            grads = torch.autograd.grad(loss, list(tensors.values()))
            with torch.no_grad():
                for value, grad in zip(tensors.values(), grads, strict=True):
                    value -= config.lr * grad
            history.append((float(loss), [grad.detach() for grad in grads]))
        return history

    torch._dynamo.reset()
    counters.clear()
    compiled = train(torch.compile(block_loss, fullgraph=True, backend=backend), parameters())
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    eager = train(block_loss, parameters())
    torch._dynamo.reset()
    relative = lambda got, want: float((got - want).abs().max() / want.abs().max())  # noqa: E731
    loss_error = max(abs(a - b) / abs(b) for (a, _), (b, _) in zip(compiled, eager, strict=True))
    grad_error = max(
        relative(got, want)
        for (_, gots), (_, wants) in zip(compiled, eager, strict=True)
        for got, want in zip(gots, wants, strict=True)
    )
    return breaks, graphs, loss_error, grad_error
