"""Cut the forward into a chain of blocks and group identical blocks into classes.

A cut after forward node i is a point where exactly one activation produced at or before i is
read by a forward node after it: every path of the forward passes through that tensor, as
between two transformer layers or two ResNet stages. Backward uses do not break the chain,
and neither do the values every block may read as it reads parameters (`chain_constants`:
an attention mask built from shapes or from the padding mask, positions, a position embedding).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from rkgraph.graph import RematGraph


def cut_points(graph: RematGraph) -> list[int]:
    """Positions i (in graph.forward_nodes) after which exactly one activation crosses: the
    single-tensor cuts, where blocks end and where checkpointing a segment keeps one tensor."""
    forward = graph.forward_nodes
    position = {n.name: i for i, n in enumerate(forward)}
    last_forward_use: dict[str, int] = {}
    for i, node in enumerate(forward):
        for d in node.inputs:
            if graph.data[d].producer in position:
                last_forward_use[d] = i
    constant = chain_constants(graph)
    crossing: set[str] = set()
    cuts = []
    for i, node in enumerate(forward[:-1]):
        crossing.update(d for d in node.outputs if last_forward_use.get(d, -1) > i and d not in constant)
        crossing = {d for d in crossing if last_forward_use[d] > i}
        if len(crossing) == 1:
            cuts.append(i)
    return cuts


def cut_pieces(graph: RematGraph) -> list[list[str]]:
    """The forward node names in graph order, cut after every one of `cut_points`: the finest
    chain of blocks (graphs without blocks are grouped from these). A graph whose forward has
    no nodes (a graph Dynamo captured of views only, its backward joining their gradients) is
    one empty block, which its backward nodes belong to."""
    forward = [n.name for n in graph.forward_nodes]
    if not forward:
        return [[]]
    pieces, start = [], 0
    for cut in cut_points(graph):
        pieces.append(forward[start : cut + 1])
        start = cut + 1
    if start < len(forward):
        pieces.append(forward[start:])
    return pieces


def chain_constants(graph: RematGraph) -> set[str]:
    """Values that do not cut the chain of blocks, and that every block may read as it reads
    parameters: forward activations computed from parameters, buffers and constants only (a
    position embedding), or from the inputs, buffers and constants with no parameter read on
    the way (what a model derives from its inputs once and hands to every layer: a language
    model's attention mask from the padding mask, its positions, their rotary tables), and the
    zero-byte values that order random draws (`DataNode.order_only`, held once made). Made
    before the first layer and read by all, they would otherwise leave a model one block: no
    single tensor crosses between its layers. The second kind only in a graph that reads
    parameters: it is what a model computes beside the layers, which read parameters; in a
    graph without any (Checkmate's graphs, which model none) every activation is computed
    from the inputs alone, and all of them taken for constants left it one block, its
    checkpoint-per-block baseline storing everything."""
    reads_parameters = any(data.kind == "param" for data in graph.data.values())
    derived = _computed_from(graph, ("input", "buffer")) if reads_parameters else set()
    return _computed_from(graph, ("param", "buffer")) | derived | graph.order_values


def _computed_from(graph: RematGraph, kinds: tuple[str, ...]) -> set[str]:
    """Forward activations whose every input is a source of `kinds` or such an activation."""
    found: set[str] = set()
    for node in graph.forward_nodes:
        if all(graph.data[d].kind in kinds or d in found for d in node.inputs):
            found.update(node.outputs)
    return found


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


def backward_blocks(graph: RematGraph, blocks: list[list[str]] | None = None) -> list[list[str]]:
    """Assign each backward node to the block whose forward it differentiates (`blocks`, by
    default graph.blocks: a chain of blocks covering the forward nodes in graph order).

    A backward node belongs where the forward values it reads were made: the block of the
    activations internal to one block it reads (the latest such block), else the block that
    consumes the cut tensor it reads (a weight gradient reads its layer's input, the previous
    block's output; the earliest such block when it reads several, as the gradient nodes of
    Checkmate's graphs read a value and its consumer's output), else the last block (it reads
    only tangents). Then data flow settles the
    rest: backward blocks run from the last to the first, so a node can be no later a block
    than the nodes whose gradients it reads (a gradient sum joins the block of its earliest
    contribution). Nodes keep graph order within each block, so every block's list is a valid
    order and running the lists from the last block to the first is a valid backward.
    """
    blocks = graph.blocks if blocks is None else blocks
    block_of = {name: j for j, block in enumerate(blocks) for name in block}
    constant = chain_constants(graph)
    made_in = {d: block_of[dn.producer] for d, dn in graph.data.items()
               if dn.producer in block_of and d not in constant}
    # Activations read by the forward of other blocks cross a cut: owned by their last reader.
    read_by: dict[str, int] = {}
    for node in graph.forward_nodes:
        for d in node.inputs:
            if d in made_in and block_of[node.name] != made_in[d]:
                read_by[d] = max(read_by.get(d, 0), block_of[node.name])
    last = len(blocks) - 1
    assigned: dict[str, int] = {}
    for node in graph.backward_nodes:
        internal = [made_in[d] for d in node.inputs if d in made_in and d not in read_by]
        crossing = [read_by[d] for d in node.inputs if d in read_by]
        anchor = max(internal) if internal else min(crossing) if crossing else last
        upstream = [assigned[p] for d in node.inputs if (p := graph.data[d].producer) in assigned]
        assigned[node.name] = min([anchor, *upstream])
    result: list[list[str]] = [[] for _ in blocks]
    for node in graph.backward_nodes:
        result[assigned[node.name]].append(node.name)
    return result


def block_of(graph: RematGraph) -> dict[str, int]:
    """The block of each node in the graph's chain: forward nodes by graph.blocks, backward
    nodes by graph.backward_blocks (the blocks the planners use); nodes outside it (a graph
    not split yet) are absent."""
    owner = {name: j for j, block in enumerate(graph.blocks) for name in block}
    owner.update({name: j for j, block in enumerate(graph.backward_blocks) for name in block})
    return owner


def common_module(modules: Iterable[str]) -> str:
    """Longest dotted prefix shared by the non-empty module paths (glue ops have none)."""
    paths = [m.split(".") for m in modules if m]
    if not paths:
        return ""
    prefix = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(prefix), len(path)) and prefix[n] == path[n]:
            n += 1
        prefix = prefix[:n]
    return ".".join(prefix)


def block_module(graph: RematGraph, block: Iterable[str]) -> str:
    """A name for a block a person recognises: the module path its nodes share, or
    "(top level)". Only a label: which nodes a block holds is decided by data flow."""
    return common_module(graph.node(n).module for n in block) or "(top level)"


def split_into_blocks(graph: RematGraph) -> None:
    """Cut the forward into a chain of blocks at `cut_points`: fill graph.blocks,
    graph.block_classes and graph.backward_blocks."""
    classes: dict[str, int] = {}
    graph.blocks = cut_pieces(graph)
    graph.block_classes = [classes.setdefault(_signature(graph, b), len(classes)) for b in graph.blocks]
    graph.backward_blocks = backward_blocks(graph)


def _prefix(graph: RematGraph, name: str) -> str:
    """Grouping key: the top-level module, or for imported graphs the name's first word
    (Keras names layers block1_conv1, block1_pool, ...)."""
    module = graph.node(name).module
    return module.split(".")[0] if module else name.split("_")[0]


def derived_blocks(graph: RematGraph) -> list[list[str]]:
    """Blocks for graphs that come without: the pieces between single-tensor cuts
    (`rkgraph.blocks.cut_pieces`), merged while consecutive pieces belong to the same
    top-level module (or name prefix)."""
    blocks: list[list[str]] = []
    for piece in cut_pieces(graph):
        if blocks and _prefix(graph, blocks[-1][0]) == _prefix(graph, piece[0]):
            blocks[-1].extend(piece)
        else:
            blocks.append(list(piece))
    return blocks
