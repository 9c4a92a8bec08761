"""The data model every stage shares: a joint forward+backward graph for rematerialization.

A `RematGraph` has compute nodes (one or more ATen ops, forward or backward) and data nodes
(one tensor storage each). Compute nodes are listed in a valid topological order: the order
PyTorch's own autograd would run them, except weight gradients moved earlier where that frees
memory (`rkgraph.build.hoist_gradients`); it is the store-everything schedule.

Memory semantics, shared by the simulator and every solver:
- Data with no producer (`DataNode.kind` in SOURCE_KINDS: parameters, buffers, inputs) is
  alive before the step and never counted.
- Tangents (gradients of the forward outputs, handed in by the loss) appear at the start of
  the backward phase and are counted from then on.
- Computing a node allocates all its outputs plus `workspace` bytes for the duration of the op;
  inputs that the schedule frees right after it and that its later ops no longer read are gone
  while those run (`ComputeNode.releases`).
- `forward_outputs` must be alive at the end of the forward phase (they are returned to the
  user); `backward_outputs` (gradients) must be alive at the end of the backward phase.
- A node flagged `random` may be computed once only (recomputing it would draw a new mask,
  issue a collective again that the other ranks do not, or call a user's hook again).
  Nodes flagged `rng` draw random numbers too, but the runtime replays the generator state
  recorded at their first run, so they may be recomputed like any other node. A node computed
  more than once holds its `rng_state` bytes from its first computation to its last, and each
  recomputation needs as much again while it runs (the state it puts back afterwards).
- Nodes that draw random numbers, communicate or call a hook (`random` or `rng`) are first
  computed in graph order, eager's: the generator's state at a draw depends on every draw
  before it, and the ranks must issue their collectives in one order. Built graphs chain them
  with zero-byte `order_only` values, so no schedule can do otherwise; the simulator checks it.
  Such a value is held from its first computation to the step's end, as gradients are: a
  recomputation of a draw reads it without remaking the draws before it.
- A source flagged `mutated` (a buffer the step updates, as BatchNorm's running statistics) is
  copied at the end of the forward when a backward computation reads it, since the backward
  must see its value from before the update; the copy lives until its last backward read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCE_KINDS = frozenset({"param", "buffer", "input"})
DATA_KINDS = SOURCE_KINDS | {"activation", "tangent"}


@dataclass
class DataNode:
    """One storage. Views share their base's DataNode, so memory is counted once."""

    name: str
    size: int  # bytes of the storage
    kind: str = "activation"  # one of DATA_KINDS
    producer: str | None = None  # compute node name; None for sources and tangents
    mutated: bool = False  # a source the step updates in place: a backward reading it reads a copy
    # No tensor: a zero-byte value whose only use is to order its producer before its readers
    # (`rkgraph.build.order_run_once`); held once made, and code generation emits nothing for it.
    order_only: bool = False


@dataclass
class ComputeNode:
    """One schedulable step: an ATen op, possibly grouped with its views and cheap successors."""

    name: str
    inputs: tuple[str, ...]  # data node names read
    outputs: tuple[str, ...]  # data node names produced
    backward: bool = False
    time: float = 0.0  # seconds (or arbitrary cost units for imported graphs)
    workspace: int = 0  # temporary bytes during the op (grouped intermediates, kernel scratch)
    # Draws random numbers that cannot be replayed, communicates, or calls a user's hook: compute at most once.
    random: bool = False
    rng: bool = False  # draws random numbers; a recomputation replays the recorded RNG state
    rng_state: int = 0  # bytes of the generator states a recomputation replays (with `rng`)
    module: str = ""  # module path in the user's model, "" when unknown
    op: str = ""  # main ATen op, e.g. "aten.mm.default"
    fx_nodes: tuple[str, ...] = ()  # names of the fx nodes of the joint graph in this group
    # A group whose ops after the first no longer read some inputs: in order, (the inputs read
    # for the last time so far, the peak of the node's own allocations from there on), from
    # ((), ...) with every input alive; empty when no input is read for the last time before
    # the peak. Inputs a schedule frees right after the node die inside it, under what it
    # allocates later (`solvers.simulate.released_inside`).
    releases: tuple[tuple[tuple[str, ...], int], ...] = ()


@dataclass
class RematGraph:
    nodes: list[ComputeNode]
    data: dict[str, DataNode]
    forward_outputs: tuple[str, ...]
    backward_outputs: tuple[str, ...]
    name: str = ""
    # The forward nodes cut into a chain of blocks (lists of forward node names; see
    # `rkgraph.blocks.split_into_blocks`) and a class id per block: blocks with the same class
    # are structurally identical.
    blocks: list[list[str]] = field(default_factory=list)
    block_classes: list[int] = field(default_factory=list)
    # Forward outputs returned to the user, who holds them until the step ends (the others are
    # new values of mutated buffers, copied into the buffers right after the forward).
    user_outputs: tuple[str, ...] = ()
    # Backward nodes per block (same indexing as `blocks`): those differentiating its forward.
    backward_blocks: list[list[str]] = field(default_factory=list)
    # The captured joint fx graph this was built from (None for imported graphs); not saved.
    joint: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        # The gradients of the forward's outputs, in data order: they appear as the backward
        # starts and are held until it ends (the simulator, every solver and codegen agree).
        self.tangents: tuple[str, ...] = tuple(d for d, dn in self.data.items() if dn.kind == "tangent")
        self.users: dict[str, list[str]] = {d: [] for d in self.data}
        for n in self.nodes:
            for d in n.inputs:
                self.users[d].append(n.name)
        # Per node, its distinct non-source inputs: what schedule replays (run thousands of
        # times by the searches) track.
        self.reads: dict[str, tuple[str, ...]] = {
            n.name: tuple(dict.fromkeys(d for d in n.inputs if self.data[d].kind not in SOURCE_KINDS))
            for n in self.nodes}
        # What the generated code holds beyond the data nodes (see the module's docstring).
        self.mutated_sources = frozenset(d for d, dn in self.data.items() if dn.mutated)
        self.rng_states: dict[str, int] = {n.name: n.rng_state for n in self.nodes if n.rng and n.rng_state}
        # Zero-byte values that only order their producers (`DataNode.order_only`): once made,
        # held to the step's end, so a recomputation that reads one never remakes its producer.
        self.order_values = frozenset(d for d, dn in self.data.items() if dn.order_only)

    def __repr__(self) -> str:
        """One line of counts: the dataclass's own repr would list every node (tens of kilobytes)."""
        return (f"RematGraph({self.name!r}, {len(self.nodes)} compute nodes ({len(self.forward_nodes)} forward), "
                f"{len(self.data)} data nodes, {len(self.blocks)} blocks in {len(set(self.block_classes))} classes)")

    def node(self, name: str) -> ComputeNode:
        return self.nodes[self.index[name]]

    @property
    def forward_nodes(self) -> list[ComputeNode]:
        return [n for n in self.nodes if not n.backward]

    @property
    def backward_nodes(self) -> list[ComputeNode]:
        return [n for n in self.nodes if n.backward]

    def is_source(self, data: str) -> bool:
        return self.data[data].kind in SOURCE_KINDS

    def validate(self) -> None:
        """Check internal consistency; raise ValueError naming the first problem."""
        seen: set[str] = {d for d, dn in self.data.items() if dn.producer is None}
        in_backward = False
        for n in self.nodes:
            if n.backward:
                in_backward = True
            elif in_backward:
                raise ValueError(f"forward node {n.name} after a backward node")
            for d in n.inputs:
                if d not in self.data:
                    raise ValueError(f"node {n.name} reads unknown data {d}")
                if d not in seen:
                    raise ValueError(f"node {n.name} reads {d} before it is produced")
            for d in n.outputs:
                if self.data[d].producer != n.name:
                    raise ValueError(f"data {d} claims producer {self.data[d].producer}, not {n.name}")
                seen.add(d)
        for d in (*self.forward_outputs, *self.backward_outputs):
            if d not in self.data:
                raise ValueError(f"required output {d} is not a data node")
        for d, dn in self.data.items():
            if dn.kind not in DATA_KINDS:
                raise ValueError(f"data {d} has unknown kind {dn.kind}")
            if dn.producer is None and dn.kind == "activation":
                raise ValueError(f"activation {d} has no producer")

    def render(self, path: str | Path, **kw: Any) -> Path:
        from rkgraph.render import render  # graphviz is imported only when drawing

        return render(self, path, **kw)


def matching_nodes(held: RematGraph, graph: RematGraph) -> dict[str, str]:
    """`held`'s node -> `graph`'s node that is the same node of the same step at other input
    shapes. First by what it computes: the same op of the same module, in the same phase, on
    inputs matched in turn (values without a producer by name: parameters, buffers, inputs
    and tangents keep theirs), the k-th of several such nodes to the k-th. The same step traced
    at another input shape gives the same nodes under other names and, in the backward, at
    times in another order (autograd ran a linear layer's two gradient products the other way
    round at another batch size), so neither names nor positions match them. The nodes left
    unmatched (descendants of a node one graph lacks: a `clone` a batch of one does not need)
    are then matched by where they are among the unmatched (`node_keys` of those). Nodes
    without a counterpart are left out."""
    codes: dict[tuple, int] = {}  # one table for both graphs: equal structure, equal code

    def coded(g: RematGraph) -> dict[tuple[int, int], str]:
        value_code: dict[str, int] = {}
        seen: dict[int, int] = {}
        by_code = {}
        for node in g.nodes:
            inputs = tuple(value_code[d] if d in value_code else codes.setdefault(("value", d), len(codes))
                           for d in node.inputs)
            code = codes.setdefault((node.module, node.op, node.backward, inputs), len(codes))
            occurrence = seen.get(code, 0)
            seen[code] = occurrence + 1
            by_code[code, occurrence] = node.name
            for i, d in enumerate(node.outputs):
                value_code[d] = codes.setdefault(("output", code, occurrence, i), len(codes))
        return by_code

    mine, theirs = coded(held), coded(graph)
    matched = {name: theirs[key] for key, name in mine.items() if key in theirs}
    if len(matched) < len(held.nodes):
        taken = set(matched.values())
        places = {key: name for name, key in node_keys(graph, [n for n in graph.nodes if n.name not in taken]).items()}
        for name, key in node_keys(held, [n for n in held.nodes if n.name not in matched]).items():
            if (other := places.get(key)) is not None:
                matched[name] = other
    return matched


def node_keys(graph: RematGraph, nodes: Sequence[ComputeNode] | None = None) -> dict[str, tuple[str, str, bool, int]]:
    """Node name -> where the node is in the step whatever fx numbered it: (module path, op,
    whether in the backward, how many such nodes of that module came before it), among `nodes`
    (graph order; default: all of `graph`'s). fx numbers nodes by op across the whole graph,
    so one op more or less at another batch size (a `clone` that a batch of one does not need)
    renames every later node of that op; the keys of other modules' nodes stay."""
    seen: dict[tuple[str, str, bool], int] = {}
    keys = {}
    for node in graph.nodes if nodes is None else nodes:
        kind = (node.module, node.op, node.backward)
        keys[node.name] = (*kind, seen.get(kind, 0))
        seen[kind] = seen.get(kind, 0) + 1
    return keys
