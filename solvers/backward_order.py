"""`delayed_branches`: the graph with its backward run in another topological order, for the
in-order searches to plan on.

Every search but the chain's runs the nodes first in graph order, autograd's. Where the
backward joins two branches (a residual block's shortcut and main path, added where they
meet), autograd runs the branch made first whole, then the other, and the first branch's
gradient is held through every step of the second: at a tight budget, beside each of their
convolutions' backward with its workspace. Running the first branch's last node right before
the second's, or right after it, holds one gradient through one step only; which is better
depends on the two steps' sizes, so both orders are offered and the searches judge.
"""

from __future__ import annotations

from dataclasses import replace

from rkgraph.graph import RematGraph


def delayed_branches(graph: RematGraph, after: bool) -> RematGraph | None:
    """`graph` with each backward node that only a join reads (a node reading two or more
    values, made by it and by a node after it) moved right before that later node, or right
    after it with `after`; None where no node moves. The node moved is read by the join alone,
    which comes after, so the order stays topological; nodes keep their names, so a schedule planned on
    the result is one of `graph` (`solvers.simulate.schedule_from_computes` replays it there)."""
    order = [node.name for node in graph.nodes]
    moved = False
    for join in graph.backward_nodes:
        producers = sorted({graph.index[p] for d in join.inputs if (p := graph.data[d].producer) is not None
                            and graph.node(p).backward}, key=lambda i: order.index(graph.nodes[i].name))
        if len(producers) < 2:
            continue
        first, last = graph.nodes[producers[0]].name, graph.nodes[producers[-1]].name
        readers = {u for d in graph.node(first).outputs for u in graph.users[d]}
        start, stop = order.index(first), order.index(last)
        if readers != {join.name} or graph.node(first).random:
            continue
        order.pop(start)
        order.insert(stop if after else stop - 1, first)
        moved = True
    if not moved:
        return None
    return replace(graph, nodes=[graph.node(name) for name in order])
