"""Read the Checkmate paper's training graphs (networkx node-link JSON, shipped in
benchmarks/data/checkmate-graphs/ with a README giving their source and format) as
RematGraphs, so our solvers meet the literature's yardstick, and reproduce that README's
"peak without rematerialization" accounting."""

from __future__ import annotations

import json
from pathlib import Path

from rkgraph.graph import ComputeNode, DataNode, RematGraph

# The one place that says where the graphs are: in the source checkout, beside the benchmarks.
CHECKMATE_GRAPHS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "checkmate-graphs"


def load_checkmate_graph(path: str | Path) -> RematGraph:
    """One compute node per graph node, with one output of `cost_ram` bytes and time
    `cost_cpu`. No parameters are modelled. The node ids are a topological order, forward
    nodes first. Forward outputs: the last forward node's output (the loss node itself is
    flagged backward in these files); backward outputs: backward values nobody reads."""
    obj = json.loads(Path(path).read_text())
    raw = sorted(obj["nodes"], key=lambda n: n["id"])
    by_id = {n["id"]: n for n in raw}
    # Names are unique in the published files; the id suffix guards against future duplicates.
    names = {n["id"]: n["name"] if sum(m["name"] == n["name"] for m in raw) == 1 else f"{n['name']}#{n['id']}"
             for n in raw}
    preds: dict[int, list[int]] = {n["id"]: [] for n in raw}
    consumers: dict[int, int] = {n["id"]: 0 for n in raw}
    for link in obj["links"]:
        preds[link["target"]].append(link["source"])
        consumers[link["source"]] += 1
    data = {f"{names[i]}:out": DataNode(f"{names[i]}:out", int(by_id[i]["cost_ram"]), "activation", names[i])
            for i in by_id}
    # The files leave the model's input implicit; forward nodes without a predecessor read it.
    # Without it every forward value would look input-independent (a constant of the step).
    data["input"] = DataNode("input", 0, "input")
    nodes = [ComputeNode(names[n["id"]], tuple(f"{names[p]}:out" for p in sorted(preds[n["id"]]))
                         or (() if n["backward"] else ("input",)),
                         (f"{names[n['id']]}:out",), backward=bool(n["backward"]),
                         time=float(n["cost_cpu"])) for n in raw]
    last_forward = [n for n in nodes if not n.backward][-1]
    backward_outputs = tuple(f"{names[n['id']]}:out" for n in raw
                             if n["backward"] and consumers[n["id"]] == 0)
    graph_name = obj.get("graph", {}).get("name") or Path(path).stem
    graph = RematGraph(nodes, data, last_forward.outputs, backward_outputs, name=graph_name)
    graph.validate()
    return graph


def checkmate_reference_peak(graph: RematGraph) -> int:
    """The README's "peak without rematerialization": max over steps t, in graph order, of the
    outputs made before t that still have a reader at or after t, plus what step t allocates
    (its outputs; and its workspace, zero in Checkmate's graphs). Sources are not counted."""
    last_read: dict[str, int] = {}
    for t, node in enumerate(graph.nodes):
        for d in node.inputs:
            last_read[d] = t
    peak = 0
    alive: set[str] = set()
    for t, node in enumerate(graph.nodes):
        alive = {d for d in alive if last_read.get(d, -1) >= t}
        step = sum(graph.data[d].size for d in alive) + node.workspace
        step += sum(graph.data[d].size for d in node.outputs if not graph.is_source(d))
        peak = max(peak, step)
        alive |= {d for d in node.outputs if not graph.is_source(d)}
    return peak
