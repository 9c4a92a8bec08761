"""What every solver returns: an ordered list of compute and free operations, split into phases.

A schedule is the plan the runtime executes: `ops[:forward_length]` run in the forward pass
(the user's call), the rest in the backward pass (autograd's call). Frees are explicit so the
plan says exactly which tensors cross the phase boundary and when each one dies.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

from rkgraph.graph import RematGraph

OpKind = Literal["compute", "free"]


class Op(NamedTuple):
    """`compute` runs the compute node `name`; `free` releases the data node `name`.

    A named tuple, not a frozen dataclass: the searches build schedules of thousands of ops
    many times over, and a tuple is made several times faster."""

    kind: OpKind
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass
class Schedule:
    ops: list[Op]
    forward_length: int  # ops[:forward_length] run in the forward phase
    solver: str = ""
    budget: int | None = None  # bytes the solver was asked to fit in
    predicted_peak: int = 0  # bytes, as computed by the simulator
    predicted_time: float = 0.0  # sum of the computed nodes' times
    lower_bound: float | None = None  # proven lower bound on the time, when the solver has one
    gap: float | None = None  # (time - lower_bound) / time
    solve_time: float = 0.0  # seconds spent by the solver, model building included
    extra: dict[str, object] = field(default_factory=dict)  # solver-specific diagnostics

    def __post_init__(self) -> None:
        if not 0 <= self.forward_length <= len(self.ops):
            raise ValueError(f"forward_length {self.forward_length} outside 0..{len(self.ops)}")

    @property
    def forward_ops(self) -> list[Op]:
        return self.ops[: self.forward_length]

    @property
    def backward_ops(self) -> list[Op]:
        return self.ops[self.forward_length :]

    def computes(self) -> list[str]:
        """Compute node names in execution order (with repetitions for recomputations)."""
        return [op.name for op in self.ops if op.kind == "compute"]

    @property
    def forward_count(self) -> int:
        """How many of `computes()` run in the forward phase."""
        return sum(op.kind == "compute" for op in self.forward_ops)

    def alive_at_boundary(self, graph: RematGraph) -> list[str]:
        """Non-source data alive at the phase boundary, in order of their (last) computation.

        What the forward leaves for the backward, forward outputs included (the runtime tells
        them apart through `graph.forward_outputs`), before the backward's own frees.
        """
        alive: dict[str, None] = {}  # an ordered set
        for op in self.forward_ops:
            if op.kind == "compute":
                for d in graph.node(op.name).outputs:
                    alive.pop(d, None)
                    alive[d] = None
            else:
                alive.pop(op.name, None)
        return [d for d in alive if not graph.is_source(d)]

    def to_json(self) -> dict:
        obj = asdict(self)
        obj["ops"] = [[op.kind, op.name] for op in self.ops]
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> Schedule:
        ops = [Op(kind, name) for kind, name in obj["ops"]]
        return cls(**{**obj, "ops": ops})

    def export(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        return cls.from_json(json.loads(Path(path).read_text()))


def segment_recompute_order(graph: RematGraph, segments: list[list[str]]) -> list[str]:
    """Compute order of 'checkpoint each segment': the forward once, then before each backward
    node the recomputation of every segment holding a dropped value it reads."""
    segment_of = {name: j for j, seg in enumerate(segments) for name in seg}
    forward_readers: dict[str, set[int]] = {}
    for node in graph.forward_nodes:
        for d in node.inputs:
            forward_readers.setdefault(d, set()).add(segment_of.get(node.name, -1))
    # A value is dropped by its segment unless it leaves the segment (read by another segment
    # or by an unsegmented node, or returned), or comes from a random node.
    dropped: dict[str, int] = {}
    for name, j in segment_of.items():
        node = graph.node(name)
        if node.random:
            continue
        for d in node.outputs:
            if d not in graph.forward_outputs and forward_readers.get(d, set()) <= {j}:
                dropped[d] = j
    computes = [n.name for n in graph.forward_nodes]
    recomputed: set[int] = set()
    for node in graph.backward_nodes:
        for j in sorted({dropped[d] for d in node.inputs if d in dropped} - recomputed):
            computes.extend(name for name in segments[j] if not graph.node(name).random)
            recomputed.add(j)
        computes.append(node.name)
    return computes
