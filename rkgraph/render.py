"""Draw a RematGraph with graphviz: blocks, forward and backward ops, tensor sizes, decisions.

Two views. The full view draws every compute node: forward ops as blue boxes grouped into one
cluster per block (graph.blocks), backward ops as yellow ellipses grouped by the block whose
backward they compute (graph.backward_blocks: the blocks the planners use; module paths only
label a block), and data as edges labelled with their size when large. Parameters and inputs
are not drawn (they are alive throughout and cost the step nothing); tangents are small notes
where the backward begins. The collapsed view, for graphs too large to read op by op, draws one node
per block and one per block's backward, side by side, so a 12-layer transformer is two
columns of a few dozen boxes.

`decisions` (from a plan or the runtime) colour compute nodes, and the edges of data nodes,
by what happens to them: "kept", "recomputed" or "freed early".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import graphviz

from rkgraph.blocks import block_module, block_of
from rkgraph.graph import ComputeNode, RematGraph
from rkgraph.units import format_bytes

__all__ = ["COLLAPSE_ABOVE", "DECISION_COLORS", "graph_dot", "render"]

# Beyond this many compute nodes the full view is a wall of boxes; the collapsed view is drawn.
COLLAPSE_ABOVE = 150
# An edge is labelled when its data is at least this fraction of the largest activation:
# labelling every small tensor (means, masks, scalars) would hide the ones that matter.
LARGE_FRACTION = 0.05

DECISION_COLORS = {"kept": "#a6dba0", "recomputed": "#f4a261", "freed early": "#c2a5cf"}
FORWARD_COLOR = "#dbe9f6"
BACKWARD_COLOR = "#fff2c6"
# Pale backgrounds for block clusters, one per class: identical blocks look alike.
CLASS_COLORS = ("#f7f7f7", "#eef6ee", "#f6eef6", "#eef3f8", "#f8f3e8", "#eef8f8", "#f8eeee", "#f2f2e6")
FORMATS = frozenset({"pdf", "png", "svg"})
LABEL_DIGITS = 1  # sizes in labels: compact


def format_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _short_op(op: str) -> str:
    """"aten.addmm.default" -> "addmm": the overload and namespace say nothing to a reader."""
    parts = op.split(".")
    if len(parts) >= 2 and parts[0] == "aten":
        return parts[1]
    return op or "?"


def _check_decisions(graph: RematGraph, decisions: Mapping[str, str]) -> None:
    for name, what in decisions.items():
        if what not in DECISION_COLORS:
            raise ValueError(f"decision {what!r} for {name}: expected one of {', '.join(DECISION_COLORS)}")
        if name not in graph.index and name not in graph.data:
            raise ValueError(f"decision for {name}: no compute or data node of that name")


def _new_digraph(graph: RematGraph, title: str) -> graphviz.Digraph:
    dot = graphviz.Digraph(graph.name or "graph")
    dot.attr("graph", rankdir="TB", label=title, labelloc="t", fontsize="20", fontname="Helvetica",
             newrank="true", nodesep="0.25", ranksep="0.3", compound="true")
    dot.attr("node", fontname="Helvetica", fontsize="10", style="filled", penwidth="0.8")
    dot.attr("edge", fontname="Helvetica", fontsize="8", color="#555555", arrowsize="0.6")
    return dot


def _legend(dot: graphviz.Digraph, decisions: Mapping[str, str], collapsed: bool) -> None:
    entries = [
        ("forward block" if collapsed else "forward op", {"shape": "box", "fillcolor": FORWARD_COLOR}),
        ("backward of a block" if collapsed else "backward op", {"shape": "ellipse", "fillcolor": BACKWARD_COLOR}),
    ]
    if not collapsed:
        entries.append(("tangent (from the loss)", {"shape": "note", "fillcolor": "white"}))
    entries += [(what, {"shape": "box", "fillcolor": color}) for what, color in DECISION_COLORS.items()
                if what in decisions.values()]
    with dot.subgraph(name="cluster_legend") as legend:
        legend.attr(label="legend", style="rounded", color="#999999", fontsize="12")
        names = [f"legend_{i}" for i in range(len(entries))]
        for name, (text, attrs) in zip(names, entries):
            legend.node(name, text, **attrs)
        for a, b in zip(names, names[1:]):
            legend.edge(a, b, style="invis")


def graph_dot(graph: RematGraph, decisions: Mapping[str, str] | None = None,
              collapse: bool | None = None) -> graphviz.Digraph:
    """The graphviz description of `graph` (collapsed when None and the graph is large)."""
    decisions = dict(decisions or {})
    _check_decisions(graph, decisions)
    if collapse is None:
        collapse = len(graph.nodes) > COLLAPSE_ABOVE
    return _collapsed_dot(graph, decisions) if collapse else _full_dot(graph, decisions)


def render(graph: RematGraph, path: str | Path, decisions: Mapping[str, str] | None = None,
           collapse: bool | None = None) -> Path:
    """Draw `graph` to `path`, in the format its suffix names (.pdf, .png or .svg)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise ValueError(f"cannot tell the format of {path}: use a .pdf, .png or .svg suffix")
    dot = graph_dot(graph, decisions, collapse)
    if fmt == "png":
        dot.attr("graph", dpi="110")
    path.parent.mkdir(parents=True, exist_ok=True)
    # `outfile` names the result exactly; the DOT source file graphviz writes first is removed.
    dot.render(outfile=path, format=fmt, cleanup=True)
    return path


# --- full view --------------------------------------------------------------------------------


def _node_label(node: ComputeNode, graph: RematGraph) -> str:
    op = _short_op(node.op)
    lines = [node.name if node.name.startswith(op) else f"{node.name}\n{op}"]
    if len(node.fx_nodes) > 1:
        lines.append(f"+{len(node.fx_nodes) - 1} grouped ops")
    out = sum(graph.data[d].size for d in node.outputs)
    lines.append(f"{format_bytes(out, LABEL_DIGITS)} · {format_time(node.time)}")
    return "\n".join(lines)


def _tooltip(node: ComputeNode, graph: RematGraph) -> str:
    outs = ", ".join(f"{d} ({format_bytes(graph.data[d].size, LABEL_DIGITS)})" for d in node.outputs)
    return (f"{node.name}: {node.op}\nmodule: {node.module or '-'}\noutputs: {outs}\n"
            f"workspace: {format_bytes(node.workspace, LABEL_DIGITS)}\ntime: {format_time(node.time)}"
            + ("\nrandom: computed once" if node.random else ""))


def _full_dot(graph: RematGraph, decisions: dict[str, str]) -> graphviz.Digraph:
    dot = _new_digraph(graph, f"{graph.name or 'graph'}: {len(graph.forward_nodes)} forward, "
                              f"{len(graph.backward_nodes)} backward nodes")
    largest = max((d.size for d in graph.data.values() if not graph.is_source(d.name)), default=0)

    def add_node(target: graphviz.Digraph, node: ComputeNode) -> None:
        fill = DECISION_COLORS.get(decisions.get(node.name, ""), BACKWARD_COLOR if node.backward else FORWARD_COLOR)
        target.node(node.name, _node_label(node, graph), shape="ellipse" if node.backward else "box",
                    fillcolor=fill, tooltip=_tooltip(node, graph),
                    penwidth="2" if node.random else "0.8")  # a thick frame marks random ops

    owner = block_of(graph)
    for i, block in enumerate(graph.blocks):
        cls = graph.block_classes[i] if i < len(graph.block_classes) else 0
        module = block_module(graph, block)
        with dot.subgraph(name=f"cluster_block_{i}") as cluster:
            cluster.attr(label=f"block {i} · class {cls}\n{module}", style="filled,rounded",
                         fillcolor=CLASS_COLORS[cls % len(CLASS_COLORS)], color="#888888", fontsize="11")
            for name in block:
                add_node(cluster, graph.node(name))
    for node in graph.forward_nodes:  # graphs not split yet have no blocks
        if node.name not in owner:
            add_node(dot, node)

    by_block: dict[int | None, list[ComputeNode]] = defaultdict(list)
    for node in graph.backward_nodes:
        by_block[owner.get(node.name)].append(node)
    with dot.subgraph(name="cluster_backward") as backward:
        backward.attr(label="backward (runs bottom to top)", labelloc="b", style="rounded", color="#b08000",
                      fontsize="14")
        for d in graph.tangents:
            backward.node(d, f"{d}\n{format_bytes(graph.data[d].size, LABEL_DIGITS)}", shape="note", fillcolor="white",
                          fontsize="9")
        for i, nodes in by_block.items():
            label = "backward (unassigned)" if i is None else f"backward of block {i}"
            with backward.subgraph(name=f"cluster_backward_{i}") as cluster:
                cluster.attr(label=label, style="dashed,rounded", color="#b08000", fontsize="10")
                for node in nodes:
                    add_node(cluster, node)
    # The backward column climbs beside the forward one (the classic U): the tangents sit level
    # with the end of the forward, and the last backward op of each block level with the block's
    # first forward op, so the tensors a block saves for its backward cross horizontally.
    if graph.forward_nodes and graph.tangents:
        with dot.subgraph() as row:
            row.attr(rank="same")
            row.node(graph.forward_nodes[-1].name)
            row.node(graph.tangents[0])
    for i, nodes in by_block.items():
        if i is not None and i < len(graph.blocks) and graph.blocks[i]:
            with dot.subgraph() as row:
                row.attr(rank="same")
                row.node(graph.blocks[i][0])
                row.node(nodes[-1].name)

    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for node in graph.nodes:
        for d in dict.fromkeys(node.inputs):
            source = graph.data[d].producer or (d if graph.data[d].kind == "tangent" else None)
            if source is not None:
                edges[(source, node.name)].append(d)
    for (a, b), data in edges.items():
        size = sum(graph.data[d].size for d in data)
        attrs: dict[str, str] = {}
        if largest and size >= LARGE_FRACTION * largest:
            attrs["label"] = format_bytes(size, LABEL_DIGITS)
        decided = [decisions[d] for d in data if d in decisions]
        if decided:
            attrs.update(color=DECISION_COLORS[decided[0]], penwidth="2.5")
        a_backward = a not in graph.index or graph.node(a).backward  # tangents belong to the backward
        if not a_backward and graph.node(b).backward:
            # Saved for backward: drawn light, and left out of the layout's ranking.
            attrs.setdefault("color", "#aaaaaa")
            attrs.update(style="dashed", constraint="false", fontcolor="#888888")
            dot.edge(a, b, tooltip=", ".join(data), **attrs)
        elif a_backward:
            # Backward dataflow points up: declared consumer-to-producer, drawn with the arrow
            # reversed, so dot ranks the backward upward.
            dot.edge(b, a, dir="back", tooltip=", ".join(data), **attrs)
        else:
            dot.edge(a, b, tooltip=", ".join(data), **attrs)
    _legend(dot, decisions, collapsed=False)
    return dot


# --- collapsed view ---------------------------------------------------------------------------


def _decision_summary(names: list[str], graph: RematGraph, decisions: dict[str, str]) -> tuple[str, str | None]:
    """A line counting the decisions on these nodes and their outputs, and the fill colour of
    the most consequential one (recomputed, then freed early, then kept), so a glance down the
    column tells which blocks run again."""
    # An op and its first output usually share a name: counted once.
    named = dict.fromkeys([*names, *(d for n in names for d in graph.node(n).outputs)])
    decided = [decisions[x] for x in named if x in decisions]
    if not decided:
        return "", None
    counts = {what: decided.count(what) for what in DECISION_COLORS if what in decided}
    line = "\n" + " · ".join(f"{what} {count}" for what, count in counts.items())
    strongest = next(what for what in ("recomputed", "freed early", "kept") if what in counts)
    return line, DECISION_COLORS[strongest]


def _collapsed_dot(graph: RematGraph, decisions: dict[str, str]) -> graphviz.Digraph:
    dot = _new_digraph(graph, f"{graph.name or 'graph'}: {len(graph.blocks)} blocks, "
                              f"{len(graph.nodes)} nodes (collapsed)")
    owner = block_of(graph)
    group_of: dict[str, str] = {n.name: f"block_{owner[n.name]}" for n in graph.forward_nodes if n.name in owner}
    backward_members: dict[int | None, list[str]] = defaultdict(list)
    for node in graph.backward_nodes:
        group_of[node.name] = f"backward_{owner.get(node.name)}"
        backward_members[owner.get(node.name)].append(node.name)

    def summary(names: list[str]) -> str:
        nodes = [graph.node(n) for n in names]
        activations = sum(graph.data[d].size for n in nodes for d in n.outputs)
        return (f"{len(nodes)} node{'s' * (len(nodes) != 1)} · {format_bytes(activations, LABEL_DIGITS)}\n"
                f"time {format_time(sum(n.time for n in nodes))}")

    for i, block in enumerate(graph.blocks):
        cls = graph.block_classes[i] if i < len(graph.block_classes) else 0
        module = block_module(graph, block)
        extra, fill = _decision_summary(block, graph, decisions)
        back = backward_members.get(i, [])
        # Each block's backward sits beside it: the forward reads down, the backward up.
        with dot.subgraph() as row:
            row.attr(rank="same")
            row.node(f"block_{i}", f"block {i} · class {cls}\n{module}\n{summary(block)}{extra}",
                     shape="box", fillcolor=fill or FORWARD_COLOR, style="filled,rounded")
            if back:
                extra, fill = _decision_summary(back, graph, decisions)
                row.node(f"backward_{i}", f"backward of block {i}\n{summary(back)}{extra}",
                         shape="ellipse", fillcolor=fill or BACKWARD_COLOR)
    if None in backward_members:
        dot.node("backward_None", f"backward (unassigned)\n{summary(backward_members[None])}",
                 shape="ellipse", fillcolor=BACKWARD_COLOR)
    for name in (n.name for n in graph.forward_nodes if n.name not in owner):
        dot.node(name, name, shape="box", fillcolor=FORWARD_COLOR)
        group_of[name] = name

    # One edge per pair of groups, labelled with the bytes of the distinct tensors it carries.
    carried: dict[tuple[str, str], set[str]] = defaultdict(set)
    for node in graph.nodes:
        for d in node.inputs:
            producer = graph.data[d].producer
            if producer is not None and group_of[producer] != group_of[node.name]:
                carried[(group_of[producer], group_of[node.name])].add(d)
    for (a, b), data in carried.items():
        label = format_bytes(sum(graph.data[d].size for d in data), LABEL_DIGITS)
        if a.startswith("block_") and b.startswith("block_"):
            # Edges that skip blocks (an attention mask read by every layer) would pull the
            # chain into a diagonal; only the chain itself sets the layout.
            skips = int(b.removeprefix("block_")) != int(a.removeprefix("block_")) + 1
            dot.edge(a, b, label=label, **({"constraint": "false", "color": "#999999"} if skips else {}))
        elif a.startswith("block_"):  # saved for backward
            dot.edge(a, b, label=label, style="dashed", color="#aaaaaa", fontcolor="#777777", constraint="false")
        else:  # gradients flow up the backward column
            dot.edge(a, b, label=label, color="#b08000", constraint="false")
    _legend(dot, decisions, collapsed=True)
    return dot
