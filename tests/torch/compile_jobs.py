"""Pool jobs for test_compile.py: each op eager and under torch.compile(fullgraph=True).

The rooted ops (broadcast, gather, scatter, reduce) are left out: c10d's rooted collectives are not traceable by
Dynamo, and rank-dependent rewrites of them hang under AOTAutograd (see docs/plans.md).
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
}


def _value_and_grad(fn, x, cotangent):
    x = x.clone().requires_grad_()
    out = fn(x)
    (out * cotangent).sum().backward()
    return out.detach(), x.grad


def eager_vs_compiled(context, name: str, backend: str):
    """(max |eager - compiled| of the output, of the input gradient) for one op on this rank."""
    torch.manual_seed(context.rank)
    x = torch.randn(2, 4, 4 * context.world_size, 3)
    fn = OPS[name]
    cotangent = torch.randn_like(fn(x.detach()))
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    (out, grad), (out_c, grad_c) = _value_and_grad(fn, x, cotangent), _value_and_grad(compiled, x, cotangent)
    torch._dynamo.reset()
    return float((out - out_c).abs().max()), float((grad - grad_c).abs().max())
