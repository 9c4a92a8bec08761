"""The referee: replay a schedule on a graph, check it is valid and measure its memory and time.

Memory semantics are those of `rkgraph.graph` (see its docstring); every solver's output goes
through `simulate` before it is returned, so this file is the single definition of "valid".

`free_at_last_use` is the other half: solvers decide only *which* nodes to compute in which
order, and this helper inserts the frees, as early as the semantics allow. Keeping the free
placement in one place means no solver can get liveness subtly wrong on its own. Likewise
`to_recompute` says once what running a node again needs: the producers of its missing
inputs, and theirs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field

from rkgraph.graph import ComputeNode, RematGraph
from rkgraph.units import format_bytes
from solvers.schedule import Op, Schedule

_op = tuple.__new__  # _op(Op, (kind, name)): an Op in half the time of its NamedTuple constructor


class InvalidSchedule(ValueError):
    """The schedule cannot run on the graph (or does not fit its budget)."""


class InfeasibleBudget(ValueError):
    """No schedule can run the graph within the budget."""


class OverBudget(InvalidSchedule, InfeasibleBudget):
    """The schedule runs but peaks above the budget: for a solver, it did not fit. Solvers'
    own memory models leave out what only the simulator counts (what the generated code holds
    beyond the graph's values), so a schedule they fit may not."""


@dataclass
class SimulationResult:
    peak: int  # bytes, the largest memory at any point, transient allocations included
    curve: list[int]  # memory after each op (tangents counted from the first backward op)
    time: float  # sum of the times of all compute ops
    recompute_counts: dict[str, int] = field(default_factory=dict)  # node -> extra computations
    # Bytes alive as the backward starts, before its tangents appear: what the forward hands
    # over (saved values, outputs, recorded generator states, buffer copies). A graph run
    # before another holds this while the other runs (`rockplan.backend`).
    held_into_backward: int = 0


def to_recompute(graph: RematGraph, data: Iterable[str], available: Container[str]) -> list[str]:
    """The nodes to run so that every value in `data` is at hand: the producer of each value
    that is not in `available` and has one (sources and tangents have none), preceded by what
    that producer needs in turn, recursively (not the producer of an order value: held once
    made). Depth first, inputs in order: each node once, in an order it can run in.
    `available` is only read. Random nodes are not left out: a caller that must not run one
    again checks the result, or counts its outputs as available."""
    order: list[str] = []
    chosen: set[str] = set()

    def wanted(d: str) -> str | None:
        producer = graph.data[d].producer
        # An order value is held once made, and its producer is first made in graph order.
        if d in available or producer is None or producer in chosen or d in graph.order_values:
            return None
        return producer

    for root in data:
        first = wanted(root)
        if first is None:
            continue
        chosen.add(first)
        stack = [(first, iter(graph.node(first).inputs))]  # iterative: chains may be long
        while stack:
            name, inputs = stack[-1]
            for d in inputs:
                producer = wanted(d)
                if producer is not None:
                    chosen.add(producer)
                    stack.append((producer, iter(graph.node(producer).inputs)))
                    break
            else:
                stack.pop()
                order.append(name)
    return order


@dataclass
class HeldByCode:
    """Bytes the generated code holds beyond the graph's data nodes, by op index of a schedule:
    recorded generator states of random nodes computed again, and copies of mutated sources
    that the backward reads (`rkgraph.graph`'s memory semantics)."""

    before: dict[int, int] = field(default_factory=dict)  # allocated as op i starts, kept after it
    during: dict[int, int] = field(default_factory=dict)  # allocated while op i runs only
    after: dict[int, int] = field(default_factory=dict)  # released once op i is done
    copies: int = 0  # allocated at the end of the forward


def held_by_code(graph: RematGraph, schedule: Schedule) -> HeldByCode | None:
    """What `schedule`'s generated code holds beyond the graph's data, by op (None when the
    graph has neither generator states nor mutated sources): `simulate` counts it, and so must
    any search that measures schedules with an accounting of its own (`held_by_computes`)."""
    computes = ((i, op.name) for i, op in enumerate(schedule.ops) if op.kind == "compute")
    return held_by_computes(graph, computes, schedule.forward_length)


def held_by_computes(graph: RematGraph, computes: Iterable[tuple[int, str]], forward_length: int) -> HeldByCode | None:
    """`held_by_code` of a schedule given by its computes, (op index, node) in order."""
    if not graph.rng_states and not graph.mutated_sources:
        return None
    held = HeldByCode()
    runs: dict[str, list[int]] = defaultdict(list)
    last_read: dict[str, int] = {}
    for i, name in computes:
        if name not in graph.index:
            continue
        if name in graph.rng_states:
            runs[name].append(i)
        if i >= forward_length and graph.mutated_sources:
            for d in graph.node(name).inputs:
                if d in graph.mutated_sources:
                    last_read[d] = i
    for name, positions in runs.items():
        if len(positions) > 1:
            size = graph.rng_states[name]
            held.before[positions[0]] = held.before.get(positions[0], 0) + size
            held.after[positions[-1]] = held.after.get(positions[-1], 0) + size
            for i in positions[1:]:
                held.during[i] = held.during.get(i, 0) + size
    for d, i in last_read.items():
        held.copies += graph.data[d].size
        held.after[i] = held.after.get(i, 0) + graph.data[d].size
    return held


def released_inside(graph: RematGraph, node: ComputeNode, freed: Collection[str]) -> int:
    """Bytes by which `node` peaks below its outputs plus workspace when the inputs `freed`
    die inside it: the generated code drops a value at its last use, so an input the node
    reads for the last time before its last op is gone while it allocates the rest (a GELU
    chain recomputed in the backward: its input dies at the first op, under the temporaries
    of the next ones). Kernels' scratch in the workspace is unchanged."""
    if not node.releases or not freed:
        return 0
    peak = max(after for _, after in node.releases)
    return peak - max(after - sum(graph.data[d].size for d in read if d in freed)
                      for read, after in node.releases)


def freed_with(ops: Sequence[Op], at: int, stop: int) -> list[str]:
    """The data freed right after `ops[at]`, before the next compute and before `stop` (the end
    of its phase): for a compute, the inputs it is the last reader of."""
    freed = []
    j = at + 1
    while j < stop and ops[j].kind == "free":
        freed.append(ops[j].name)
        j += 1
    return freed


def simulate(graph: RematGraph, schedule: Schedule, budget: int | None = None) -> SimulationResult:
    """Replay `schedule`; raise InvalidSchedule naming the first bad op and why.

    The peak counts what the generated code holds beyond the data nodes (recorded generator
    states, copies of mutated buffers), so that this replay is the one budget check."""
    alive: set[str] = set()  # non-source data currently allocated
    memory = 0
    peak = 0
    curve: list[int] = []
    time = 0.0
    counts: dict[str, int] = defaultdict(int)
    user_outputs, backward_outputs = frozenset(graph.user_outputs), frozenset(graph.backward_outputs)
    tangents = frozenset(graph.tangents)
    held = held_by_code(graph, schedule)
    held_into_backward = 0
    last_run_once: str | None = None  # the latest random or rng node computed for the first time

    def fail(where: int | str, why: str, error: type[InvalidSchedule] = InvalidSchedule) -> InvalidSchedule:
        """`where`: an op's index, or a place in words ("end of schedule")."""
        place = f"op {where} ({schedule.ops[where]})" if isinstance(where, int) else where
        return error(f"{place}: {why}")

    def note_peak(value: int, where: int | str) -> None:
        nonlocal peak
        peak = max(peak, value)
        if budget is not None and value > budget:
            raise fail(where, f"memory {value} bytes exceeds the budget of {budget} bytes", OverBudget)

    def check_required(required: Iterable[str], where: int | str, what: str) -> None:
        for d in required:
            if d not in graph.data:
                raise fail(where, f"{what} {d} is not a data node of the graph")
            if not graph.is_source(d) and d not in alive:
                raise fail(where, f"{what} {d} is not alive")

    def enter_backward(where: int | str) -> None:
        """Phase boundary: forward outputs must be alive, then the tangents appear (counted)."""
        nonlocal memory, held_into_backward
        check_required(graph.forward_outputs, where, "at the end of the forward phase, forward output")
        held_into_backward = memory
        alive.update(tangents)
        memory += sum(graph.data[d].size for d in tangents)
        note_peak(memory, where)

    # Per node run: its distinct outputs and their bytes (looked up once, not at every run).
    made: dict[str, tuple[frozenset[str], int]] = {}
    size = {d: dn.size for d, dn in graph.data.items()}
    nodes, index, reads, forward_length = graph.nodes, graph.index, graph.reads, schedule.forward_length
    for i, (kind, name) in enumerate(schedule.ops):
        where = i  # formatted only into an error message: searches replay thousands of schedules
        if i == forward_length:
            if held is not None and held.copies:
                memory += held.copies
                note_peak(memory, where)
            enter_backward(where)
        backward_phase = i >= forward_length
        if kind == "compute":
            if name not in index:
                raise fail(where, f"unknown compute node {name}")
            node = nodes[index[name]]
            if node.backward and not backward_phase:
                raise fail(where, "backward node computed in the forward phase")
            if node.random and counts[name] >= 1:
                raise fail(where, "random node computed twice (it would draw a different mask)")
            if (node.random or node.rng) and not counts.get(name):
                if last_run_once is not None and index[name] < index[last_run_once]:
                    raise fail(where, f"{name} is first computed after {last_run_once}, which follows it in "
                                      "the graph: it would draw (or communicate) out of eager's order")
                last_run_once = name
            for d in reads[name]:
                if d not in alive:
                    raise fail(where, f"input {d} is not alive")
            if name not in made:
                outputs = frozenset(node.outputs)
                made[name] = outputs, sum(size[d] for d in outputs)
            outputs, transient = made[name]
            transient += node.workspace
            if node.releases:
                stop = forward_length if i < forward_length else len(schedule.ops)
                transient -= released_inside(graph, node, freed_with(schedule.ops, i, stop))
            if held is not None:
                memory += held.before.get(i, 0)
                transient += held.during.get(i, 0)
            value = memory + transient
            if value > peak:
                note_peak(value, where)
            # An output that is already alive is replaced by the new value, not stored twice.
            for d in outputs:
                if d not in alive:
                    alive.add(d)
                    memory += size[d]
            counts[name] += 1
            time += node.time
            if held is not None:
                memory -= held.after.get(i, 0)
        elif kind == "free":
            if name not in size:
                raise fail(where, f"unknown data node {name}")
            if graph.is_source(name):
                raise fail(where, f"{name} is a source ({graph.data[name].kind}), never freed")
            if name not in alive:
                raise fail(where, f"{name} is not alive")
            if backward_phase and name in user_outputs:
                raise fail(where, f"{name} is returned to the user, who holds it until the step ends")
            if name in backward_outputs:
                raise fail(where, f"{name} is a backward output, returned when the backward ends")
            if name in tangents:
                raise fail(where, f"{name} is a tangent: autograd holds it until the backward returns")
            alive.remove(name)
            memory -= size[name]
        else:
            raise fail(where, f"unknown op kind {kind!r}")
        curve.append(memory)

    end = "end of schedule"
    if schedule.forward_length == len(schedule.ops):  # empty backward phase: boundary is the end
        if held is not None and held.copies:
            memory += held.copies
            note_peak(memory, end)
        enter_backward(end)
    check_required(graph.backward_outputs, end, "backward output")
    check_required(graph.user_outputs, end, "output held by the user")
    recomputes = {name: c - 1 for name, c in counts.items() if c > 1}
    return SimulationResult(peak, curve, time, recomputes, held_into_backward)


# --- liveness -----------------------------------------------------------------------------


@dataclass
class Lifetimes:
    """A compute order with the frees of `free_at_last_use` placed, before it is written out
    as ops: what a search that measures thousands of orders needs (`solvers.peak_shaving`),
    without making an op for each compute and free of each."""

    computes: list[str]  # the computations kept, in order
    forward_count: int  # how many of them run in the forward phase
    frees_after: dict[int, list[str]]  # position in `computes` -> the data freed right after it
    boundary_frees: list[str]  # freed as the backward phase starts, once the tangents appear

    def ops(self) -> tuple[list[Op], int]:
        """(ops, forward_length): the schedule's ops."""
        computes, forward_count, frees_after, boundary_frees = (
            self.computes, self.forward_count, self.frees_after, self.boundary_frees)
        ops: list[Op] = []
        forward_length = 0
        for p, name in enumerate(computes):
            if p == forward_count:
                ops.extend([_op(Op, ("free", d)) for d in boundary_frees])
            ops.append(_op(Op, ("compute", name)))
            freed = frees_after.get(p)
            if freed is not None:
                ops.extend([_op(Op, ("free", d)) for d in freed])
            if p == forward_count - 1:
                forward_length = len(ops)
        if forward_count == len(computes):
            ops.extend([_op(Op, ("free", d)) for d in boundary_frees])
        return ops, forward_length

    def positions(self) -> tuple[list[int], int]:
        """(the index in `ops()` of each compute, forward_length), without making the ops."""
        positions: list[int] = []
        frees_after, forward_count = self.frees_after, self.forward_count
        i = forward_length = 0
        for p in range(len(self.computes)):
            if p == forward_count:
                i += len(self.boundary_frees)
            positions.append(i)
            freed = frees_after.get(p)
            i += 1 if freed is None else 1 + len(freed)
            if p == forward_count - 1:
                forward_length = i
        return positions, forward_length


def free_at_last_use(graph: RematGraph, computes: Sequence[str], forward_count: int,
                     keep: Iterable[str] = ()) -> tuple[list[Op], int]:
    """Turn an ordered list of compute nodes into ops with frees inserted as early as possible.

    `computes[:forward_count]` run in the forward phase. Each computed value lives until its
    last read before the next computation of the same data (a recomputation starts a new
    lifetime), stretched to the phase boundary for forward outputs and to the end for backward
    outputs and `keep`. Computations whose results are never used are dropped: solvers (the
    ILP especially, when a node costs nothing) may schedule useless work, and removing it can
    only lower time and memory, so it is done here once for all of them.
    Returns (ops, forward_length); `lifetimes` is the same before the ops are written out.
    """
    return lifetimes(graph, computes, forward_count, keep).ops()


def lifetimes(graph: RematGraph, computes: Sequence[str], forward_count: int, keep: Iterable[str] = ()) -> Lifetimes:
    """`free_at_last_use`'s frees, by the compute each follows (see there).

    One backward sweep does both: a compute's readers all come after it, so when it is reached
    they are settled (kept or dropped), and so are the next kept computation of each of its
    outputs and the last kept read before it. Long schedules (a minimum-memory schedule remakes
    the forward for every backward step) cost one pass over their ops.
    """
    # Outputs returned to the user are held by them until the step ends.
    # Tangents are held by autograd's call of the backward until it returns.
    keep_set = (frozenset(keep) | frozenset(graph.backward_outputs) | frozenset(graph.user_outputs)
                | frozenset(graph.tangents))
    # Held values are never freed; recomputing one replaces it in place (counted once). A
    # backward output (a gradient) is returned when the backward ends: once made, it stays.
    # Order values are held once made (zero bytes): a recomputed draw reads its predecessor's.
    held = (frozenset(graph.user_outputs) | frozenset(graph.tangents) | frozenset(graph.backward_outputs)
            | graph.order_values)
    fwd_out = frozenset(graph.forward_outputs)
    computes = list(computes)
    m = len(computes)
    nodes, index, reads = graph.nodes, graph.index, graph.reads
    last_read: dict[str, int] = {}  # data -> its last read by a kept compute before its next kept computation
    next_def: dict[str, int] = {}  # data -> position of its next kept computation
    kept = [False] * m
    # (position, data, its last read or None, required at the boundary), last position first.
    spans: list[tuple[int, str, int | None, bool]] = []
    # (The searches call this thousands of times per plan: its loops are written out, not
    # generators, and its ops made without NamedTuple's constructor.)
    for p in range(m - 1, -1, -1):
        name = computes[p]
        outputs = nodes[index[name]].outputs
        # Kept when an output is read before it is made again, is kept to the end and made for
        # the last time, or is a forward output made for the last time in the forward.
        for d in outputs:
            if (d in last_read or (d in keep_set and d not in next_def)
                    or (d in fwd_out and p < forward_count <= next_def.get(d, m))):
                break
        else:
            continue
        kept[p] = True
        for d in reversed(outputs):
            if d in held:
                continue
            nxt = next_def.get(d, m)
            if not (d in keep_set and nxt == m):
                spans.append((p, d, last_read.get(d), d in fwd_out and p < forward_count <= nxt))
        for d in outputs:
            last_read.pop(d, None)
            next_def[d] = p
        for d in reads[name]:
            if d not in last_read:
                last_read[d] = p
    # Positions in the schedule without the dropped computations.
    rank = [0] * (m + 1)
    count = 0
    for p in range(m):
        rank[p] = count
        count += kept[p]
    rank[m] = count
    kept_computes = [name for name, k in zip(computes, kept) if k]
    forward_count = rank[forward_count]
    frees_after: dict[int, list[str]] = {}
    boundary_frees: list[str] = []  # freed as the backward phase starts, once tangents appear
    for p, d, last, required_at_boundary in reversed(spans):
        # After its last read, at the boundary if it is required there and unread after it,
        # right after its op if nobody reads it.
        if required_at_boundary and (last is None or rank[last] < forward_count):
            boundary_frees.append(d)
        else:
            q = rank[p if last is None else last]
            if q in frees_after:
                frees_after[q].append(d)
            else:
                frees_after[q] = [d]

    return Lifetimes(kept_computes, forward_count, frees_after, boundary_frees)


def schedule_from_computes(graph: RematGraph, computes: Sequence[str], forward_count: int, *,
                           solver: str, budget: int | None = None, keep: Iterable[str] = (),
                           **metadata: object) -> Schedule:
    """Insert frees, replay in the simulator (budget included) and fill the predictions."""
    ops, forward_length = free_at_last_use(graph, computes, forward_count, keep)
    schedule = Schedule(ops, forward_length, solver=solver, budget=budget, **metadata)
    result = simulate(graph, schedule)
    schedule.predicted_peak = result.peak
    schedule.predicted_time = result.time
    if budget is not None and result.peak > budget:
        raise OverBudget(f"{solver}'s schedule peaks at {result.peak} bytes ({format_bytes(result.peak)}), "
                               f"above the budget of {budget} bytes ({format_bytes(budget)})")
    return schedule


def fixed_schedule(graph: RematGraph, computes: Sequence[str], forward_count: int, *, solver: str,
                   budget: int | None) -> Schedule:
    """A baseline's one schedule, whatever the budget: InfeasibleBudget (the method cannot fit,
    its peak in the message) when it peaks above `budget`."""
    schedule = schedule_from_computes(graph, computes, forward_count, solver=solver)
    if budget is not None and schedule.predicted_peak > budget:
        raise InfeasibleBudget(f"{solver} peaks at {schedule.predicted_peak} bytes "
                               f"({format_bytes(schedule.predicted_peak)}), above the budget of {budget} bytes "
                               f"({format_bytes(budget)})")
    schedule.budget = budget
    return schedule
