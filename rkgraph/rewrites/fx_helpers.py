"""What the graph rewrites of this package share:
building a node with its fake value, walking single-user chains, erasing what a rewrite left
unread. Plain functions over torch.fx's `Graph` and `Node`."""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

# Ops that only give their input another shape.
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def call(graph: fx.Graph, target: object, args: tuple, kwargs: dict, meta: dict) -> fx.Node:
    """A new node of `graph` with `meta` and its value computed on the inputs' fake values."""
    node = graph.call_function(target, args, kwargs)
    vals = fx.node.map_arg(args, lambda a: a.meta["val"])  # nodes in lists too (stack's tensors)
    with meta["val"].fake_mode if isinstance(meta["val"], torch.Tensor) else meta["val"][0].fake_mode:
        node.meta = {**meta, "val": target(*vals, **kwargs)}
    return node


def only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def detach_chains(node: fx.Node) -> list[fx.Node]:
    """The detach chains hanging off `node` (AOTAutograd's, for values the backward saves)."""
    detached = [u for u in node.users if u.target is aten.detach.default]
    return [*detached, *(w for v in detached for w in detach_chains(v))]


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def erase_unused(graph: fx.Graph, nodes: list) -> None:
    """Erase those of `nodes` nobody reads any more, or only others of them that are erased."""
    # Rounds until none is left unread, rather than one pass latest first: that order would
    # number the whole graph again for each pattern a rewrite takes.
    candidates = {n for n in nodes if isinstance(n, fx.Node) and n.op == "call_function"}
    while unread := [n for n in candidates if not n.users]:
        for node in unread:
            graph.erase_node(node)
            candidates.discard(node)
