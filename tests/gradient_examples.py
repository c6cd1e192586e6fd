"""The worked gradient examples of docs/gradients.md, shared by tests/torch/test_conventions.py and
tests/jax/test_conventions.py (plain Python data: neither framework is imported here).

Each example: rank r's loss is ``sum(cotangents[r] * op(xs[r], **kwargs))`` and the objective is the sum of
the ranks' losses; `gradients[r]` is the gradient of xs[r] the op must give (W = len(xs)). `SCALAR_ALL_REDUCE`:
the scalar all_reduce examples, shared by both frontends' test_examples.py.
"""

C = [[1.0], [10.0]]  # W = 2 cotangents: rank 0's loss is 1 * sum(y_0), rank 1's is 10 * sum(y_1)
ONES = [[1.0]] * 4  # W = 4: every rank's loss is sum(y_r)

# (id, op, kwargs, per-rank inputs, per-rank cotangents, per-rank input gradients): the doc's examples.
EXAMPLES = [
    ("all_reduce x_r=[r+1]", "all_reduce", {}, [[1.0], [2.0]], [[1.0], [1.0]], [[2.0], [2.0]]),
    (
        "all_reduce x_r=[r+1] replicated",
        "all_reduce",
        {"convention": "replicated"},
        [[1.0], [2.0]],
        [[1.0], [1.0]],
        [[1.0], [1.0]],
    ),
    ("all_reduce sum", "all_reduce", {}, [[1.0], [2.0]], C, [[11.0], [11.0]]),
    ("all_reduce sum replicated", "all_reduce", {"convention": "replicated"}, [[1.0], [2.0]], C, [[1.0], [10.0]]),
    ("all_reduce avg", "all_reduce", {"op": "avg"}, [[1.0], [2.0]], C, [[5.5], [5.5]]),
    (
        "all_reduce avg replicated",
        "all_reduce",
        {"op": "avg", "convention": "replicated"},
        [[1.0], [2.0]],
        C,
        [[0.5], [5.0]],
    ),
    ("all_reduce max", "all_reduce", {"op": "max"}, [[1.0], [5.0], [2.0], [3.0]], ONES, [[0.0], [4.0], [0.0], [0.0]]),
    (
        "all_reduce max replicated",
        "all_reduce",
        {"op": "max", "convention": "replicated"},
        [[1.0], [5.0], [2.0], [3.0]],
        ONES,
        [[0.0], [1.0], [0.0], [0.0]],
    ),
    (
        "all_reduce max ties",
        "all_reduce",
        {"op": "max"},
        [[5.0], [5.0], [1.0], [1.0]],
        ONES,
        [[2.0], [2.0], [0.0], [0.0]],
    ),
    ("all_reduce min", "all_reduce", {"op": "min"}, [[1.0], [5.0], [2.0], [3.0]], ONES, [[4.0], [0.0], [0.0], [0.0]]),
    (
        "all_reduce product zero",
        "all_reduce",
        {"op": "product"},
        [[2.0], [0.0], [3.0], [4.0]],
        ONES,
        [[0.0], [96.0], [0.0], [0.0]],
    ),
    ("all_gather", "all_gather", {"dim": 0}, [[1.0], [2.0]], [[1.0, 2.0], [10.0, 20.0]], [[11.0], [22.0]]),
    (
        "all_gather replicated",
        "all_gather",
        {"dim": 0, "convention": "replicated"},
        [[1.0], [2.0]],
        [[1.0, 2.0], [10.0, 20.0]],
        [[1.0], [20.0]],
    ),
    ("reduce_scatter", "reduce_scatter", {"dim": 0}, [[1.0, 2.0], [3.0, 4.0]], C, [[1.0, 10.0], [1.0, 10.0]]),
    (
        "all_to_all",
        "all_to_all",
        {"scatter_dim": 0, "gather_dim": 1},
        [[[1.0], [2.0]], [[3.0], [4.0]]],
        [[[1.0, 2.0]], [[10.0, 20.0]]],
        [[[1.0], [10.0]], [[2.0], [20.0]]],
    ),
    ("broadcast", "broadcast", {"src": 0}, [[1.0], [2.0]], C, [[11.0], [0.0]]),
    ("gather", "gather", {"dst": 0, "dim": 0}, [[1.0], [2.0]], [[1.0, 2.0], [10.0, 20.0]], [[1.0], [2.0]]),
    ("scatter", "scatter", {"src": 0, "dim": 0}, [[1.0, 2.0], [3.0, 4.0]], C, [[1.0, 10.0], [0.0, 0.0]]),
    ("permute", "permute", {"perm": [(0, 1)]}, [[1.0], [2.0]], C, [[10.0], [0.0]]),
    ("sum_grad", "sum_grad", {}, [[1.0], [2.0]], C, [[11.0], [11.0]]),
    (
        "all_to_all one dim",
        "all_to_all",
        {"scatter_dim": 0, "gather_dim": 0},
        [[1.0, 2.0], [3.0, 4.0]],
        [[1.0, 2.0], [10.0, 20.0]],
        [[1.0, 10.0], [2.0, 20.0]],
    ),
    ("shard", "shard", {"dim": 0}, [[1.0, 2.0], [1.0, 2.0]], C, [[1.0, 10.0], [1.0, 10.0]]),
    (
        "shard scale_grad",
        "shard",
        {"dim": 0, "scale_grad": True},
        [[1.0, 2.0], [1.0, 2.0]],
        C,
        [[0.5, 5.0], [0.5, 5.0]],
    ),
    ("reduce", "reduce", {"dst": 0}, [[1.0], [2.0]], C, [[1.0], [1.0]]),
    ("reduce avg", "reduce", {"dst": 1, "op": "avg"}, [[1.0], [2.0]], C, [[5.0], [5.0]]),
]


#: The worked examples of all_reduce on one scalar per rank (W = 4), each rank's loss the sum of its output:
#: (op, one scalar per rank, convention, expected output on every rank, expected input gradients). Shared by
#: tests/torch/test_examples.py and tests/jax/test_examples.py.
SCALAR_ALL_REDUCE = [
    ("max", [1, 5, 2, 3], "sum", 5, [0, 4, 0, 0]),
    ("max", [5, 5, 1, 1], "sum", 5, [2, 2, 0, 0]),
    ("max", [2, 2, 2, 2], "sum", 2, [1, 1, 1, 1]),
    ("max", [1, 5, 2, 3], "replicated", 5, [0, 1, 0, 0]),
    ("max", [5, 5, 1, 1], "replicated", 5, [0.5, 0.5, 0, 0]),
    ("min", [4, 0, 6, 7], "sum", 0, [0, 4, 0, 0]),
    ("min", [1, 1, 5, 5], "sum", 1, [2, 2, 0, 0]),
    ("min", [3, 9, -2, -2], "sum", -2, [0, 0, 2, 2]),
    ("product", [2, 0, 3, 4], "sum", 0, [0, 96, 0, 0]),
    ("product", [2, 0, 3, 0], "sum", 0, [0, 0, 0, 0]),
    ("product", [1, 2, 3, 4], "sum", 24, [96, 48, 32, 24]),
    ("product", [2, 0, 3, 4], "replicated", 0, [0, 24, 0, 0]),
    ("sum", [1, 5, 2, 3], "sum", 11, [4, 4, 4, 4]),
    ("avg", [1, 5, 2, 3], "sum", 2.75, [1, 1, 1, 1]),
]
