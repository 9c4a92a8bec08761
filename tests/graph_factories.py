"""Small RematGraphs shaped like autograd's joint graphs, for solver and runtime tests.

`training_graph` builds a forward DAG (a backbone chain plus optional skip connections) and
mirrors it the way autograd does: one backward node per forward node, in reverse order, that
reads the gradient of the node's output (the tangent for the loss), some of the forward values
(what autograd saves), and produces the gradient contributions for its activation inputs and
the gradient of its parameter.
"""

from __future__ import annotations

import random

from rkgraph.graph import ComputeNode, DataNode, RematGraph


def training_graph(sizes: list[int], times: list[float] | None = None, *,
                   skips: list[tuple[int, int]] = (), saves_output: list[bool] | None = None,
                   workspaces: list[int] | None = None, random_nodes: frozenset[int] = frozenset(),
                   grad_sizes: list[int] | None = None, param_grad_size: int = 1,
                   block_size: int = 0, frozen: int = 0, user_holds_loss: bool = False,
                   weight_nodes: bool = False, name: str = "") -> RematGraph:
    """Forward node i (0-based) reads the previous output (or the input for i = 0) plus the
    outputs of nodes j for each skip (j, i), and its parameter w{i}; writes x{i} of sizes[i].
    Backward node b{i} reads the gradient of x{i}, x{i}'s inputs and, if saves_output[i], x{i};
    writes one gradient per activation input (size grad_sizes[i], default the input's size)
    and gw{i}. The first `frozen` nodes have no trainable parameter: like autograd, no gradient
    flows to their outputs and they get no backward node.
    `block_size` > 0 groups consecutive forward nodes into graph.blocks. `user_holds_loss`
    makes the loss a user output, held until the step ends. `weight_nodes`: gw{i} is made, as
    autograd makes a weight's gradient, by a node of its own (bw{i}, right after b{i}) that reads
    the gradient of x{i} and x{i}'s inputs, an ancestor of no other node."""
    n = len(sizes)
    if not 0 <= frozen < n:
        raise ValueError(f"frozen must be in 0..{n - 1}")
    times = times or [1.0] * n
    saves_output = saves_output or [False] * n
    workspaces = workspaces or [0] * n
    data: dict[str, DataNode] = {"input": DataNode("input", 8, "input")}
    inputs_of: list[list[str]] = [["input" if i == 0 else f"x{i - 1}"] for i in range(n)]
    for j, i in skips:
        if not 0 <= j < i - 1 < n - 1:
            raise ValueError(f"skip ({j}, {i}) must jump over at least one node")
        inputs_of[i].append(f"x{j}")
    nodes: list[ComputeNode] = []
    for i in range(n):
        data[f"w{i}"] = DataNode(f"w{i}", 4, "param")
        data[f"x{i}"] = DataNode(f"x{i}", sizes[i], producer=f"f{i}")
        nodes.append(ComputeNode(f"f{i}", (*inputs_of[i], f"w{i}"), (f"x{i}",), time=times[i],
                                 workspace=workspaces[i], random=i in random_nodes,
                                 module=f"layer{i // block_size if block_size else i}"))
    data["tangent"] = DataNode("tangent", sizes[-1], "tangent")
    # grads[x] lists the gradient contributions to x, one per reader of x.
    grads: dict[str, list[str]] = {f"x{n - 1}": ["tangent"]}
    backward_outputs: list[str] = []
    for i in reversed(range(frozen, n)):
        reads = [*grads[f"x{i}"], *(d for d in inputs_of[i] if d != "input")]
        if saves_output[i]:
            reads.append(f"x{i}")
        outs = []
        for d in inputs_of[i]:
            if d == "input" or int(d[1:]) < frozen:
                continue
            g = f"g{i}.{d}"
            size = grad_sizes[i] if grad_sizes else data[d].size
            data[g] = DataNode(g, size, producer=f"b{i}")
            grads.setdefault(d, []).append(g)
            outs.append(g)
        data[f"gw{i}"] = DataNode(f"gw{i}", param_grad_size, producer=f"bw{i}" if weight_nodes else f"b{i}")
        backward_outputs.append(f"gw{i}")
        if not weight_nodes:
            outs.append(f"gw{i}")
        nodes.append(ComputeNode(f"b{i}", tuple(dict.fromkeys(reads)), tuple(outs), backward=True,
                                 time=2 * times[i]))
        if weight_nodes:
            weight_reads = (*grads[f"x{i}"], *(d for d in inputs_of[i] if d != "input"))
            nodes.append(ComputeNode(f"bw{i}", tuple(dict.fromkeys(weight_reads)), (f"gw{i}",), backward=True,
                                     time=times[i]))
    blocks = ([[f"f{i}" for i in range(s, min(n, s + block_size))] for s in range(0, n, block_size)]
              if block_size else [])
    graph = RematGraph(nodes, data, (f"x{n - 1}",), tuple(backward_outputs), name=name,
                       blocks=blocks, block_classes=list(range(len(blocks))),
                       user_outputs=(f"x{n - 1}",) if user_holds_loss else ())
    graph.validate()
    return graph


def chain_graph(n: int, size: int = 10, time: float = 1.0) -> RematGraph:
    """A uniform chain: every activation `size` bytes, every forward node `time`."""
    return training_graph([size] * n, [time] * n, name=f"chain{n}")


def random_training_graph(seed: int, max_forward: int = 6, *, skip_probability: float = 0.3,
                          random_probability: float = 0.1, weight_nodes: bool = False) -> RematGraph:
    """A random small training graph: sizes 1..50, times 1..10, occasional skips, saved
    outputs, workspaces, random (dropout-like) nodes, blocks and a loss held by the user."""
    rng = random.Random(seed)
    n = rng.randint(1, max_forward)
    skips = [(j, i) for i in range(2, n) for j in range(i - 1) if rng.random() < skip_probability]
    return training_graph(
        [rng.randint(1, 50) for _ in range(n)],
        [float(rng.randint(1, 10)) for _ in range(n)],
        skips=skips,
        saves_output=[rng.random() < 0.5 for _ in range(n)],
        workspaces=[rng.choice([0, 0, rng.randint(1, 20)]) for _ in range(n)],
        random_nodes=frozenset(i for i in range(n) if rng.random() < random_probability),
        block_size=rng.choice([0, 1, 2, 3]),
        user_holds_loss=rng.random() < 0.3,
        weight_nodes=weight_nodes,
        name=f"random{seed}",
    )
