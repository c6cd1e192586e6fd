"""Pool jobs for test_compile.py: each op eager and under torch.compile(fullgraph=True).

The rooted ops (broadcast, gather, scatter, reduce, and reduce in broadcast's backward) run, under compile, as
calls Dynamo traces (`commlib_torch._walk`): the functional broadcast and one all_to_all_single; eagerly as
c10d's own.
"""

import torch

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
    "uneven": lambda x: cl.reduce_scatter(cl.all_gather(cl.all_to_all_4d(x, 2, 1, scatter_sizes=(5, 3)), 2,
                                                        sizes=(5, 3)), 1, sizes=(3, 5)),
    "broadcast": lambda x: cl.broadcast(x, 0),
    "broadcast_src_1": lambda x: cl.broadcast(x, 1),
    "gather": lambda x: cl.gather(x, 0, 2),
    "gather_dst_1": lambda x: cl.gather(x, 1, 1),
    "scatter": lambda x: cl.scatter(x, 0, 2),
    "scatter_src_1": lambda x: cl.scatter(x, 1, 0),
    "reduce": lambda x: cl.reduce(x, 1, "avg"),
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
    torch.manual_seed(context.rank)
    x = torch.randn(2, 4, 4 * context.world_size, 3)
    fn = OPS[name]
    cotangent = torch.randn_like(fn(x.detach() + 1.0))
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    out_c, grad_c = _value_and_grad(compiled, x, cotangent)
    out, grad = _value_and_grad(fn, x, cotangent)
    torch._dynamo.reset()
    return float((out - out_c).abs().max()), float((grad - grad_c).abs().max())


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
    breaks = torch._dynamo.explain(rooted_chain)(x).graph_break_count
    torch._dynamo.reset()
    compiled = torch.compile(rooted_chain, fullgraph=True, backend=backend)
    out_c, grad_c = _value_and_grad(compiled, x, cotangent)
    out, grad = _value_and_grad(rooted_chain, x, cotangent)
    torch._dynamo.reset()
    return breaks, float((out - out_c).abs().max()), float((grad - grad_c).abs().max())
