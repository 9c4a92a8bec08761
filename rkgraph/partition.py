"""Cut the forward into a chain of blocks and group identical blocks into classes.

A cut after forward node i is a point where exactly one activation produced at or before i is
read by a forward node after it: every path of the forward passes through that tensor, as
between two transformer layers or two ResNet stages. Backward uses do not break the chain,
and neither do tensors that do not depend on the model's inputs (an attention mask built from
shapes, a position embedding): every block may read those, as it reads parameters.
"""

from __future__ import annotations

import hashlib

from rkgraph.graph import RematGraph


def cut_points(graph: RematGraph) -> list[int]:
    """Positions i (in graph.forward_nodes) after which exactly one activation crosses."""
    forward = graph.forward_nodes
    position = {n.name: i for i, n in enumerate(forward)}
    last_forward_use: dict[str, int] = {}
    for i, node in enumerate(forward):
        for d in node.inputs:
            if graph.data[d].producer in position:
                last_forward_use[d] = i
    constant = input_independent(graph)
    crossing: set[str] = set()
    cuts = []
    for i, node in enumerate(forward[:-1]):
        crossing.update(d for d in node.outputs if last_forward_use.get(d, -1) > i and d not in constant)
        crossing = {d for d in crossing if last_forward_use[d] > i}
        if len(crossing) == 1:
            cuts.append(i)
    return cuts


def input_independent(graph: RematGraph) -> set[str]:
    """Activations computed from parameters, buffers and constants only."""
    constant: set[str] = set()
    for node in graph.forward_nodes:
        if all(graph.data[d].kind in ("param", "buffer") or d in constant for d in node.inputs):
            constant.update(node.outputs)
    return constant


def _signature(graph: RematGraph, block: list[str]) -> str:
    """Structure of a block: ops, sizes and internal wiring, independent of node names."""
    local = {}
    parts = []
    for name in block:
        node = graph.node(name)
        ins = []
        for d in node.inputs:
            data = graph.data[d]
            inside = data.producer in local
            ins.append(f"{local[data.producer]}" if inside else f"ext:{data.kind}:{data.size}")
        local[name] = len(local)
        outs = [graph.data[d].size for d in node.outputs]
        parts.append(f"{node.op}|{ins}|{outs}|{node.workspace}|{node.random}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def partition(graph: RematGraph) -> None:
    """Fill graph.blocks and graph.block_classes."""
    forward = [n.name for n in graph.forward_nodes]
    blocks, start = [], 0
    for cut in cut_points(graph):
        blocks.append(forward[start : cut + 1])
        start = cut + 1
    if start < len(forward):
        blocks.append(forward[start:])
    classes: dict[str, int] = {}
    graph.blocks = blocks
    graph.block_classes = [classes.setdefault(_signature(graph, b), len(classes)) for b in blocks]
