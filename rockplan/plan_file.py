"""Plan files: a schedule saved with the graph it was planned for, to read, diff and reload.

The format is documented in docs/plan-format.md (`"format": "rockplan-plan"`, `"version": 1`).
A plan file holds the whole graph, not only the schedule, for two reasons: a person (or
`rockplan explain`) can read what was decided without the model at hand, and reloading can
check that the file matches the freshly captured graph node by node. A schedule replayed on
another graph would run different ops on different tensors; the mismatch error names the first
node that differs so the cause (another model, shape or dtype, another torch) can be found.

Its `graph` object is the one JSON form of a RematGraph (`plan_document` writes it, `read_plan`
reads it back); Checkmate's node-link files are an import format only
(`solvers.checkmate_graphs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

import torch

from rkgraph.blocks import backward_blocks
from rkgraph.graph import ComputeNode, DataNode, RematGraph
from rockplan.decisions import decide
from solvers.schedule import Op, Schedule
from solvers.simulate import simulate
from solvers.store_all import solve_store_all

log = logging.getLogger(__name__)

FORMAT = "rockplan-plan"
VERSION = 2


class PlanMismatch(ValueError):
    """The plan file was made for another graph than the one captured now."""


class Planned(Protocol):
    """What `export_plan` needs from a `Rockmate` (not imported: the runtime imports us)."""

    graph: RematGraph
    schedule: Schedule
    store_all_peak: int  # autograd's graph storing everything: the reference of ratios
    store_all_time: float
    considered: dict[str, float | str]  # the other graph planned and not run


@dataclass
class PlanFile:
    """A plan file read back: the graph it describes and its schedule."""

    graph: RematGraph
    schedule: Schedule
    fingerprint: str
    store_all: tuple[int, float]  # (peak, time) of the reference: autograd's graph storing everything
    considered: dict[str, float | str] = field(default_factory=dict)  # the other graph planned, not run


# --- the graph's identity ---------------------------------------------------------------------


def _node_structure(node: ComputeNode) -> list[Any]:
    # Everything code generation and the simulator depend on; not times (measured, they vary
    # from run to run) nor module paths (renaming a submodule changes no computation).
    return [node.name, node.op, node.backward, list(node.inputs), list(node.outputs), node.workspace,
            node.random, node.rng, node.rng_state, list(node.fx_nodes)]


def _data_structure(data: DataNode) -> list[Any]:
    return [data.name, data.size, data.kind, data.producer, data.mutated]


def fingerprint(graph: RematGraph) -> str:
    """A hash of the graph's structure: ops, wiring, sizes, phases and outputs."""
    structure = {
        "nodes": [_node_structure(n) for n in graph.nodes],
        "data": [_data_structure(d) for d in graph.data.values()],
        "outputs": [list(graph.forward_outputs), list(graph.backward_outputs), list(graph.user_outputs)],
    }
    return "sha256:" + hashlib.sha256(json.dumps(structure, sort_keys=True).encode()).hexdigest()


def first_difference(planned: RematGraph, captured: RematGraph) -> str | None:
    """The first difference between the graph of a file and a captured graph, in graph order,
    said so a person can find it; None when they match on everything `fingerprint` covers."""
    fields = ("name", "op", "phase (backward)", "inputs", "outputs", "workspace", "random", "rng",
              "generator state bytes", "fx nodes")
    for i, (a, b) in enumerate(zip(planned.nodes, captured.nodes)):
        if a.name != b.name:
            return f"node {i}: the file has {a.name} ({a.op}), the captured graph {b.name} ({b.op})"
        for what, x, y in zip(fields, _node_structure(a), _node_structure(b)):
            if x != y:
                return f"node {i} ({a.name}): {what} is {x} in the file, {y} in the captured graph"
        # Output sizes are compared with their producer, so a changed shape names the op making it.
        for d in a.outputs:
            if planned.data[d].size != captured.data[d].size:
                return (f"node {i} ({a.name}, {a.op}): output {d} has {planned.data[d].size} bytes in the file, "
                        f"{captured.data[d].size} in the captured graph")
    if len(planned.nodes) != len(captured.nodes):
        return f"the file has {len(planned.nodes)} compute nodes, the captured graph {len(captured.nodes)}"
    for name, b in captured.data.items():
        a = planned.data.get(name)
        if a is None:
            return f"data node {name} ({b.kind}) of the captured graph is not in the file"
        if _data_structure(a) != _data_structure(b):
            return (f"data node {name}: {a.kind}, {a.size} bytes, made by {a.producer} in the file; "
                    f"{b.kind}, {b.size} bytes, made by {b.producer} in the captured graph")
    if len(planned.data) != len(captured.data):
        extra = next(name for name in planned.data if name not in captured.data)
        return f"data node {extra} of the file is not in the captured graph"
    for what in ("forward_outputs", "backward_outputs", "user_outputs"):
        if getattr(planned, what) != getattr(captured, what):
            return f"{what.replace('_', ' ')}: {getattr(planned, what)} in the file, {getattr(captured, what)} captured"
    return None


# --- writing ----------------------------------------------------------------------------------


def rockplan_version() -> str:
    """The installed package's version ("unknown" in a checkout run without installing it)."""
    try:
        return version("rockplan")
    except PackageNotFoundError:  # run from a checkout without installing
        return "unknown"


def plan_document(graph: RematGraph, schedule: Schedule, reference: tuple[int, float] | None = None,
                  considered: dict[str, float | str] | None = None) -> dict[str, Any]:
    """The JSON object of a plan file (see docs/plan-format.md). `reference`: the (peak, time) of
    autograd's graph storing everything, where `graph` is a variant of it (`lean_variant`);
    `considered`: the other graph planned and not run (`Rockmate.considered`)."""
    store_all = solve_store_all(graph)
    reference = reference or (store_all.predicted_peak, store_all.predicted_time)
    decisions = decide(graph, schedule, store_all)
    labels = decisions.labels()
    nodes = []
    for n in graph.nodes:
        nodes.append({
            "name": n.name, "phase": "backward" if n.backward else "forward", "op": n.op, "module": n.module,
            "inputs": list(n.inputs), "outputs": list(n.outputs), "time": n.time, "workspace": n.workspace,
            "random": n.random, "rng": n.rng, "rng_state": n.rng_state, "fx_nodes": list(n.fx_nodes),
            "releases": [[list(read), after] for read, after in n.releases],
            "computed": decisions.computed[n.name], "recomputed": decisions.recomputations(n.name),
        })
    data = [{"name": d.name, "kind": d.kind, "size": d.size, "producer": d.producer, "mutated": d.mutated,
             "order_only": d.order_only, "decision": labels.get(d.name)} for d in graph.data.values()]
    return {
        "format": FORMAT,
        "version": VERSION,
        "created_by": {"rockplan": rockplan_version(), "torch": torch.__version__},
        "graph": {
            "name": graph.name,
            "fingerprint": fingerprint(graph),
            "nodes": nodes,
            "data": data,
            "forward_outputs": list(graph.forward_outputs),
            "backward_outputs": list(graph.backward_outputs),
            "user_outputs": list(graph.user_outputs),
            "blocks": [list(b) for b in graph.blocks],
            "block_classes": list(graph.block_classes),
        },
        "schedule": {
            "solver": schedule.solver,
            "budget": schedule.budget,
            "predicted_peak": schedule.predicted_peak,
            "predicted_time": schedule.predicted_time,
            "lower_bound": schedule.lower_bound,
            "gap": schedule.gap,
            "solve_time": schedule.solve_time,
            "forward_length": schedule.forward_length,
            "ops": [[op.kind, op.name] for op in schedule.ops],
            "extra": schedule.extra,
        },
        "store_all": {"predicted_peak": reference[0], "predicted_time": reference[1]},
        "considered": dict(considered or {}),
        "summary": {
            "recomputed_nodes": sum(1 for c in decisions.computed.values() if c > 1),
            "recomputations": sum(max(c - 1, 0) for c in decisions.computed.values()),
            "kept_bytes": sum(graph.data[d].size for d in decisions.kept),
            "freed_early_bytes": sum(graph.data[d].size for d in decisions.freed_early),
        },
    }


def export_plan(source: Planned | tuple[RematGraph, Schedule], path: str | Path) -> Path:
    """Write the plan of a `Rockmate` (or of a `(graph, schedule)` pair) to `path` as JSON."""
    if isinstance(source, tuple):
        (graph, schedule), reference, considered = source, None, None
    else:
        graph, schedule = source.graph, source.schedule
        reference, considered = (source.store_all_peak, source.store_all_time), source.considered
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan_json(graph, schedule, reference, considered))
    return path


def plan_json(graph: RematGraph, schedule: Schedule, reference: tuple[int, float] | None = None,
              considered: dict[str, float | str] | None = None) -> str:
    """The text of a plan file: `plan_document` (see there) as JSON."""
    # Solver diagnostics may hold numpy numbers or enums: written as text rather than refused.
    return json.dumps(plan_document(graph, schedule, reference, considered), indent=1, default=str)


# --- reading ----------------------------------------------------------------------------------


def _graph_from_document(obj: dict[str, Any]) -> RematGraph:
    nodes = [ComputeNode(name=n["name"], inputs=tuple(n["inputs"]), outputs=tuple(n["outputs"]),
                         backward=n["phase"] == "backward", time=n["time"], workspace=n["workspace"],
                         random=n["random"], rng=n["rng"], rng_state=n["rng_state"], module=n["module"], op=n["op"],
                         fx_nodes=tuple(n["fx_nodes"]),
                         releases=tuple((tuple(read), after) for read, after in n.get("releases", ())))
             for n in obj["nodes"]]
    data = {d["name"]: DataNode(d["name"], d["size"], d["kind"], d["producer"], d["mutated"],
                                    d.get("order_only", False)) for d in obj["data"]}
    graph = RematGraph(nodes, data, tuple(obj["forward_outputs"]), tuple(obj["backward_outputs"]), obj["name"],
                       [list(b) for b in obj["blocks"]], list(obj["block_classes"]), tuple(obj["user_outputs"]))
    # Not stored: the backward's blocks follow from the forward's by data flow, as when planning.
    graph.backward_blocks = backward_blocks(graph) if graph.blocks else []
    return graph


def _schedule_from_document(obj: dict[str, Any]) -> Schedule:
    return Schedule(ops=[Op(kind, name) for kind, name in obj["ops"]], forward_length=obj["forward_length"],
                    solver=obj["solver"], budget=obj["budget"], predicted_peak=obj["predicted_peak"],
                    predicted_time=obj["predicted_time"], lower_bound=obj["lower_bound"], gap=obj["gap"],
                    solve_time=obj["solve_time"], extra=obj["extra"])


def read_plan(path: str | Path) -> PlanFile:
    """Read a plan file on its own (no model needed): for `rockplan explain` and tools."""
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        bare = isinstance(obj, dict) and "ops" in obj
        hint = " (a bare schedule from Schedule.export: write plans with rk.export)" if bare else ""
        raise ValueError(f"{path} is not a rockplan plan file{hint}")
    if obj.get("version") != VERSION:
        raise ValueError(f"{path} is a plan file of version {obj.get('version')}; this rockplan reads "
                         f"version {VERSION}")
    try:
        return PlanFile(_graph_from_document(obj["graph"]), _schedule_from_document(obj["schedule"]),
                        obj["graph"]["fingerprint"],
                        (obj["store_all"]["predicted_peak"], obj["store_all"]["predicted_time"]),
                        dict(obj.get("considered", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is a damaged plan file: {type(e).__name__}: {e}") from None


def load_plan(path: str | Path, graph: RematGraph) -> Schedule:
    """The schedule of plan file `path`, after checking it was planned for `graph`.

    Raises PlanMismatch naming the first node that differs. A bare schedule written by
    `Schedule.export` carries no graph to compare; it is only replayed by the simulator,
    which names the first op that cannot run.
    """
    obj = json.loads(Path(path).read_text())
    if isinstance(obj, dict) and "format" not in obj and "ops" in obj:
        log.warning("%s is a bare schedule: it is replayed on the graph but cannot be matched to it", path)
        schedule = Schedule.from_json(obj)
        simulate(graph, schedule)
        return schedule
    plan = read_plan(path)
    difference = first_difference(plan.graph, graph)
    if difference is not None:
        raise PlanMismatch(f"{path} was planned for another graph than {graph.name or 'the model'}'s: {difference}")
    return plan.schedule
