"""The smallest budget at which a schedule exists: a proven lower bound and a schedule near it.

Lower bound (sound: no schedule of any solver can peak below it):
- every node that a required output depends on runs at least once, and while it runs its
  non-source inputs, all its outputs and its workspace are allocated at the same time (less
  what inputs read for the last time early may free inside it, `ComputeNode.releases`), and so
  are the backward outputs its ancestors made: they were made before it and are never freed
  (the parameter gradients of a whole model, at its last backward nodes);
- at the phase boundary the forward outputs are alive and the tangents appear;
- at the end every backward output is alive.

Upper bound: `min_memory_schedule`, which keeps across stages only what cannot be recomputed
(tangents, random outputs, backward values) and recomputes every forward activation from
those and the sources each time it is read; plus the baselines. When the best of them peaks
exactly at the lower bound (the common case: the largest single step sets the floor), the
minimum is known exactly.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from rkgraph.graph import ComputeNode, RematGraph
from rkgraph.units import format_bytes
from solvers.chain import chain_blocks
from solvers.checkpoint_blocks import solve_checkpoint_blocks
from solvers.ilp_model import MilpBuilder
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, released_inside, schedule_from_computes, to_recompute
from solvers.sqrt_segments import solve_sqrt_segments
from solvers.store_all import solve_store_all


def needed_nodes(graph: RematGraph) -> set[str]:
    """Nodes a required output depends on: only these must run in every schedule."""
    needed: set[str] = set()
    stack = [d for d in (*graph.forward_outputs, *graph.backward_outputs) if d in graph.data]
    seen: set[str] = set()
    while stack:
        d = stack.pop()
        if d in seen:
            continue
        seen.add(d)
        producer = graph.data[d].producer
        if producer is not None and producer not in needed:
            needed.add(producer)
            stack.extend(graph.node(producer).inputs)
    return needed


def _size(graph: RematGraph, names: Iterable[str]) -> int:
    return sum(graph.data[d].size for d in dict.fromkeys(names) if not graph.is_source(d))


def _gradients(graph: RematGraph) -> list[tuple[int, str]]:
    """(index of its producer, data) of each backward output that a node makes."""
    return [(graph.index[producer], d) for d in dict.fromkeys(graph.backward_outputs)
            if (producer := graph.data[d].producer) is not None]


def _gradients_by_producer(graph: RematGraph) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """(per node: bytes and number of the gradients it makes; each gradient's producer index)."""
    count = len(graph.nodes)
    made_bytes = np.zeros(count, dtype=np.int64)
    made_count = np.zeros(count, dtype=np.int64)
    made_by = {}
    for i, d in _gradients(graph):
        made_bytes[i] += graph.data[d].size
        made_count[i] += 1
        made_by[d] = i
    return made_bytes, made_count, made_by


def _members(bits: int, count: int) -> np.ndarray:
    """The bit set `bits` over `count` nodes as a boolean mask (bit i: node i)."""
    return np.unpackbits(np.frombuffer(bits.to_bytes((count + 7) // 8, "little"), dtype=np.uint8),
                         bitorder="little", count=count).astype(bool)


def _held_at(graph: RematGraph, node: ComputeNode) -> list[str]:
    """What stays alive through a backward node beyond its own values: the tangents and the user's outputs."""
    return [*graph.tangents, *graph.user_outputs] if node.backward else []


def _alive_at(graph: RematGraph, node: ComputeNode, ancestors: list[int]) -> list[str]:
    """The data alive while `node` runs in any schedule (`_step_floors`): its inputs and outputs,
    what a backward node holds, and the gradients its ancestors made."""
    k = graph.index[node.name]
    before = [d for i, d in _gradients(graph) if ancestors[k] >> i & 1]
    return list(dict.fromkeys([*node.inputs, *node.outputs, *_held_at(graph, node), *before]))


def _step_floors(graph: RematGraph, ancestors: list[int]) -> dict[str, tuple[int, str]]:
    """Per needed node: (bytes alive while it runs in any schedule, why); the data they are is
    `_alive_at`. Its inputs, outputs and workspace; for a backward node also the tangents and
    the user's outputs (held through the backward) and the gradients its ancestors made (made
    before it, never freed: the parameter gradients of a whole model, at its last backward
    nodes). The gradients are summed as bit sets (those made by a node's ancestors), not
    listed per node: a deep model has hundreds, and as many nodes after them."""
    count = len(graph.nodes)
    made_bytes, made_count, made_by = _gradients_by_producer(graph)
    grad_mask = sum(1 << i for i in set(made_by.values()))  # the nodes that make gradients
    floors = {}
    for name in needed_nodes(graph):
        node = graph.node(name)
        held = _held_at(graph, node)
        own = dict.fromkeys([*node.inputs, *node.outputs, *held])
        made_before = ancestors[graph.index[name]] & grad_mask
        before_bytes = before_count = 0
        if made_before:
            members = _members(made_before, count)
            before_bytes, before_count = int(made_bytes[members].sum()), int(made_count[members].sum())
        # Gradients made before it that it reads or holds anyway are counted once.
        counted = [d for d in own if d in made_by and made_before >> made_by[d] & 1]
        alive_bytes = _size(graph, own) + before_bytes - sum(graph.data[d].size for d in counted)
        reason = f"node {name} needs its inputs, outputs and workspace at once"
        if set(held) - {*node.inputs, *node.outputs} or before_count > len(counted):
            reason += ", while the tangents, the user's outputs and the gradients made before it are held"
        # Inputs it reads for the last time before its last op may die inside it, if freed
        # (the gradients made before it are backward outputs).
        freeable = set(node.inputs) - {*held, *graph.tangents, *graph.backward_outputs}
        floors[name] = (alive_bytes + node.workspace - released_inside(graph, node, freeable), reason)
    return floors


def memory_lower_bound(graph: RematGraph) -> tuple[int, str]:
    """(bytes, reason): no schedule can peak below this; the reason names what forces it."""
    return max([*_phase_floors(graph), *_step_floors(graph, _ancestors(graph)).values()])


def backward_step_floor(graph: RematGraph) -> int:
    """Bytes alive at some backward step in any schedule: the highest `_step_floors` of a
    needed backward node (0 without one). Every schedule runs those nodes in its backward."""
    floors = _step_floors(graph, _ancestors(graph))
    return max((floors[n.name][0] for n in graph.backward_nodes if n.name in floors), default=0)


def _phase_floors(graph: RematGraph) -> list[tuple[int, str]]:
    """(bytes, reason) alive in any schedule at the phase boundary and at the end."""
    return [(_size(graph, graph.forward_outputs) + _size(graph, graph.tangents),
             "forward outputs and tangents alive together at the phase boundary"),
            (_size(graph, [*graph.backward_outputs, *graph.user_outputs]),
             "backward outputs and the user's forward outputs alive at the end")]


def in_order_floor(graph: RematGraph, order: Sequence[str] | None = None,
                   order_name: str = "autograd's order") -> tuple[int, str]:
    """(bytes, reason): no schedule that first computes each node in `order` (by default graph
    order, autograd's) peaks below this. Graph order is the family of every heuristic in the
    portfolio (DTR's program, saved values, peak shaving, the minimum-memory family) and of
    Checkmate's MILP (stage t first computes node t); only Rockmate's and rotor's chain plans
    (`solvers.chain`) run in another: block after block (`chain_order_floor`).

    `memory_lower_bound` holds, at each node, only the gradients its ancestors made: a
    gradient of another branch could be made later, from its inputs remade then. In a fixed
    order every gradient made by an earlier node is already made, and gradients are never
    freed: at each needed node, its own floor (`_step_floors` without the ancestors) plus
    every gradient made before it. On a language model whose weight gradients autograd makes
    as it goes, this is far above the proven floor: it is why the portfolio's searches all
    stop at the same budget."""
    floors = _step_floors(graph, [0] * len(graph.nodes))
    backward_outputs = set(graph.backward_outputs)
    made_before = 0  # bytes of the gradients made by the nodes before, in `order`
    gradients: set[str] = set()
    best, why = max(_phase_floors(graph))
    for node in graph.nodes if order is None else map(graph.node, order):
        if node.name in floors:
            own = {*node.inputs, *node.outputs, *_held_at(graph, node)}
            alive = floors[node.name][0] + made_before - _size(graph, own & gradients)
            if alive > best:
                best, why = alive, (f"node {_named(graph, node.name)} needs its inputs, outputs and workspace "
                                    f"while every gradient made before it in {order_name} is held")
        made = [d for d in node.outputs if d in backward_outputs and d not in gradients]
        gradients.update(made)
        made_before += _size(graph, made)
    return best, why


def chain_order_floor(graph: RematGraph) -> tuple[int, str]:
    """(bytes, reason): no plan of the chain of blocks (Rockmate's, rotor's: `solvers.chain`)
    peaks below this.

    A chain plan runs each block's backward whole, from the last block to the first, and a
    block's backward nodes run only there (its options hold its own nodes alone). So while a
    node of block j's backward runs, every gradient the later blocks' backward made is held
    (gradients are never freed), beside its own floor and the gradients its ancestors made
    (`_step_floors`). Not the order within a block: a block's option may run a node later than
    graph order, where the step that made it first is dropped as unused (`free_at_last_use`)."""
    _, backward = chain_blocks(graph)
    ancestors = _ancestors(graph)
    floors = _step_floors(graph, ancestors)
    best, why = max(_phase_floors(graph))
    # The gradients held at a node: those the nodes of the blocks run before made, less those
    # its floor counts (made by its ancestors, or among its own values). By producer, as bit
    # sets: a deep model has hundreds of gradients and thousands of nodes after them.
    made_bytes, _, made_by = _gradients_by_producer(graph)
    later = 0  # the producers of the gradients made by the blocks whose backward ran before
    for block in reversed(backward):
        for name in block:
            if name not in floors:
                continue
            node = graph.node(name)
            held = later & ~ancestors[graph.index[name]]
            if not held:
                alive = floors[name][0]
            else:
                members = _members(held, len(graph.nodes))
                own = dict.fromkeys([*node.inputs, *node.outputs, *_held_at(graph, node)])
                alive = floors[name][0] + int(made_bytes[members].sum()) - sum(
                    graph.data[d].size for d in own if d in made_by and held >> made_by[d] & 1)
            if alive > best:
                best, why = alive, (f"node {_named(graph, name)} needs its inputs, outputs and workspace while "
                                    "every gradient made by the blocks whose backward runs before its block's "
                                    "in a chain plan is held")
        for name in block:
            if made_bytes[graph.index[name]]:
                later |= 1 << graph.index[name]
    return best, why


def reachable_floor(graph: RematGraph) -> tuple[int, str]:
    """(bytes, reason): the least peak any solver of the portfolio can reach, the lower of the
    in-order floor and the chain's; `BudgetBounds.reachable` without building the baselines.
    Below it the portfolio refuses without searching; it is not proven for every schedule
    (`memory_lower_bound` is)."""
    return min(in_order_floor(graph), chain_order_floor(graph))


def time_lower_bound(graph: RematGraph, budget: int, steps: int | None = None, closure: bool = True,
                     intervals: bool = True, time_limit: float | None = None) -> tuple[float, str]:
    """(seconds, reason): no schedule within `budget` bytes runs faster than this.

    Every needed node runs once. Beyond that, take a node k: a value its descendants read,
    made by one of its ancestors (so first made before k runs), is either alive while k runs,
    within the budget less k's own floor (`_step_floors`), or made again after k, which costs
    its producer's time; a producer is spared only if all such outputs of it are kept. The
    cheapest choice is bounded below by knapsacks (`_most_value_kept`) at every needed node
    (or the `steps` with the highest floors, forward and backward): the node that binds need
    not have a high floor of its own (in Swin-T's and ResNet-50's backward, a later layer's,
    with more of the forward read after it), and a knapsack that a greedy packing shows cannot
    beat the best so far is not solved. At the CLOSURE_STEPS moments the knapsacks
    rate tightest, a small MILP (`_remaking_time`) adds what the knapsack leaves out: a value
    made again needs its producer's inputs after k, alive at k or made again too. The bound
    is the largest over the moments (on a language model, its loss's). Then one more MILP
    (`_interval_remaking_time`) takes a chain of those moments together: a value dropped at
    one and read after the next is made again once per interval, which single moments cannot
    see (a convolutional network's backward reads its forward at several steps that each need
    most of the budget). Without `closure`, the knapsacks' bound alone: weaker, and found in a
    fraction of the time. Without `intervals`, no interval MILP: a planner asks for it only once
    its search ends above the floor without it (`solvers.portfolio`), since it costs up to
    INTERVAL_TIME and a plan that meets the cheaper floor needs no tighter one.
    `time_limit`: seconds for the MILP stages (closure's and intervals'), within their own
    limits: a caller's time limit holds them too (on a graph of thousands of nodes, building the
    interval MILP alone takes seconds). A stage cut short by it proves what it proved in that
    time, none where none is left, and is proven again by a later call; the knapsacks, the
    floor every plan is judged by, always run in full."""
    # Each stage is proven once per graph, budget and costs: a planner asks for the knapsacks'
    # floor, then the closure's, and the portfolio for the intervals' where its search ends
    # above, and on a graph of thousands of nodes the knapsacks alone take seconds.
    settings = (CLOSURE_STEPS, CLOSURE_TIME, INTERVAL_MOMENTS, INTERVAL_TIME)
    proof = _proofs(graph).setdefault((budget, steps, settings, _costs(graph)), {})
    if "knapsacks" not in proof:
        proof["knapsacks"] = _knapsack_floor(graph, budget, steps)
    context = proof["knapsacks"]
    best, why = context.best, context.why
    if context.settled:
        return context.base + best, why
    deadline = math.inf if time_limit is None else time.perf_counter() + time_limit
    if closure:
        proven = proof.get("closure") or _closure_floor(graph, context, deadline)
        if proven.complete:
            proof["closure"] = proven
        best, why = max((best, why), (proven.extra, proven.why), key=lambda stage: stage[0])
    if closure and intervals and best > 0:
        proven = proof.get("intervals") or _interval_floor(graph, budget, context, deadline)
        if proven.complete:
            proof["intervals"] = proven
        if proven.extra > best:
            best, why = proven.extra, proven.why
    return context.base + best, why


@dataclass(frozen=True)
class _StageFloor:
    """What one of `time_lower_bound`'s MILP stages proves beyond the knapsacks' base."""

    extra: float  # seconds beyond every needed node once
    why: str
    complete: bool  # False: cut short by a caller's time limit (proven again by a later call)


@dataclass
class _KnapsackFloor:
    """`time_lower_bound`'s first stage, and what its later stages reuse."""

    base: float  # every needed node once
    best: float  # the extra time the knapsacks prove
    why: str
    settled: bool  # storing everything fits: no stage can prove more
    needed: list[str] = field(default_factory=list)
    ancestors: list[int] = field(default_factory=list)
    descendants: list[int] = field(default_factory=list)
    floors: dict = field(default_factory=dict)
    held: set[str] = field(default_factory=set)
    readers: dict[str, int] = field(default_factory=dict)
    rated: list[tuple[float, str, int, bool]] = field(default_factory=list)


def _proofs(graph: RematGraph) -> dict:
    """The floors proven for `graph` (`time_lower_bound`), held as long as the graph is."""
    held = _PROOFS.get(id(graph))
    if held is None or held[0]() is not graph:
        key = id(graph)
        held = _PROOFS[key] = (weakref.ref(graph, lambda _: _PROOFS.pop(key, None)), {})
    return held[1]


_PROOFS: dict[int, tuple[weakref.ref, dict]] = {}


def _costs(graph: RematGraph) -> tuple:
    """What a profile sets on a graph, and its floors depend on: nodes' times and workspaces,
    values' bytes."""
    return (tuple(node.time for node in graph.nodes), tuple(node.workspace for node in graph.nodes),
            tuple(data.size for data in graph.data.values()))


def _knapsack_floor(graph: RematGraph, budget: int, steps: int | None) -> _KnapsackFloor:
    """The knapsacks' stage of `time_lower_bound` (see there)."""
    needed = needed_nodes(graph)
    base = sum(graph.node(name).time for name in needed)
    if solve_store_all(graph).predicted_peak <= budget:  # nothing need be made again: the knapsacks agree
        return _KnapsackFloor(base, 0.0, "every needed node runs once", settled=True)
    ancestors = _ancestors(graph)
    descendants = _descendants(graph)
    floors = _step_floors(graph, ancestors)
    held = {*graph.backward_outputs, *graph.user_outputs}
    readers = {d: sum(1 << graph.index[u] for u in users) for d, users in graph.users.items()}
    moments = sorted(needed, key=lambda n: -floors[n][0])[:steps]
    live_across = _LiveAcross(graph, ancestors, held)
    rated: list[tuple[float, str, int, bool]] = []  # (knapsack's extra time, node, bytes left for values, exact)
    most = 0.0  # the most extra time a knapsack has proven so far
    for name in moments:
        k = graph.index[name]
        floor, _ = floors[name]
        # Per producer: its time and the bytes it leaves for k's descendants. Of what is alive
        # at k anyway (its floor counts it), only k's own inputs and outputs can be among them:
        # the rest of `_alive_at`'s (tangents, user outputs, gradients) is held, never weighed.
        producers, weights = live_across.producers(k, [*graph.nodes[k].inputs, *graph.nodes[k].outputs])
        random = live_across.random[producers]  # runs once: its outputs must stay
        slack = budget - floor - int(weights[random].sum())
        if slack < 0:
            return _KnapsackFloor(base, math.inf, f"node {name}: the outputs of random nodes its descendants read "
                                  "do not fit", settled=True)
        times, weights = live_across.time[producers[~random]], weights[~random]
        total = sum(times.tolist())
        # What a greedy packing keeps is kept by the best packing too: where even its extra is
        # no more than a knapsack's proven one, this moment's knapsack cannot prove more, and
        # its solve (most of a moment's time) is spared; its rating only ranks it below.
        at_most = total - _value_kept_greedily(times, weights, slack)
        if at_most <= most:
            rated.append((at_most, name, budget - floor, False))
            continue
        extra = total - _most_value_kept(list(zip(times.tolist(), weights.tolist())), slack)
        most = max(most, extra)
        rated.append((extra, name, budget - floor, True))
    best, why = 0.0, "every needed node runs once"
    for extra, name, room, exact in rated:
        if exact and extra > best:
            best = extra
            why = (f"at node {_named(graph, name)} only {format_bytes(max(0, room))} are left for the "
                   "values its descendants read: the rest must be recomputed")
    return _KnapsackFloor(base, best, why, False, needed, ancestors, descendants, floors, held, readers, rated)


def _closure_floor(graph: RematGraph, proven: _KnapsackFloor, deadline: float) -> _StageFloor:
    """The closure MILPs' stage of `time_lower_bound`, at the moments the knapsacks rate tightest,
    within CLOSURE_TIME and by `deadline` (a caller's)."""
    best, why = 0.0, ""
    ancestors, held = proven.ancestors, proven.held
    caller = deadline
    deadline = min(time.perf_counter() + CLOSURE_TIME, caller)
    for extra, name, room, _ in sorted(proven.rated, reverse=True)[:CLOSURE_STEPS]:
        left = deadline - time.perf_counter()
        if extra <= 0 or left <= 0:  # where every value fits, so do the inputs of none remade
            break
        alive = set(_alive_at(graph, graph.node(name), ancestors)) | held
        remade = _remaking_time(graph, name, room, alive, ancestors, proven.descendants, proven.readers,
                                left)
        if remade > best:
            best = remade
            why = (f"at node {_named(graph, name)} only {format_bytes(max(0, room))} are left for the "
                   "values its descendants read and the inputs of those made again: the rest must be "
                   "recomputed")
    # Cut short only where the caller's time ran out first: the stage's own limit is part of the proof.
    return _StageFloor(best, why, complete=deadline < caller or time.perf_counter() < caller)


def _interval_floor(graph: RematGraph, budget: int, proven: _KnapsackFloor, deadline: float) -> _StageFloor:
    """The interval MILP's stage of `time_lower_bound`, over a chain of moments, within
    INTERVAL_TIME of HiGHS's and by `deadline` (a caller's), its model's building included."""
    if time.perf_counter() >= deadline:
        return _StageFloor(0.0, "", False)
    moments = _moment_chain(graph, proven.floors, proven.ancestors, budget)
    if not moments:
        return _StageFloor(0.0, "", True)
    remade, cut = _interval_remaking_time(graph, budget, moments, proven.floors, proven.ancestors, proven.needed,
                                          deadline)
    why = (f"at the {len(moments)} nodes {_named(graph, moments[0])} to {_named(graph, moments[-1])}, "
           "run in turn, the values kept from one to the next must fit beside each: the rest must "
           "be recomputed")
    return _StageFloor(remade, why if remade > 0 else "", complete=not cut)


def _named(graph: RematGraph, name: str) -> str:
    """A node's name, with its phase and the module it belongs to where known."""
    node = graph.node(name)
    where = ", ".join(x for x in ("backward" if node.backward else "forward", node.module) if x)
    return f"{name} ({where})"


# The closure MILPs: at most this many moments, in about this many seconds in all. Each has a
# few hundred binaries, so several fit in the time; several are needed, since the knapsacks
# rank the moments only roughly (on a language model, the tightest, the loss's forward, need
# not rank first).
CLOSURE_STEPS = 8
CLOSURE_TIME = 1.0


def _remaking_time(graph: RematGraph, name: str, room: int, alive: set[str], ancestors: list[int],
                   descendants: list[int], readers: dict[str, int], time_limit: float) -> float:
    """A lower bound on the time spent after node `name` making again what its ancestors made
    and is read later, when at most `room` bytes of values can be alive while it runs beside
    `alive` (counted already). One binary per value (alive while `name` runs) and per producer
    (runs again after it):

      minimise  sum_p time(p) * again[p]
      kept[d] + again[p(d)] >= 1          d is read by a descendant of `name`
      kept[x] + again[p(x)] >= again[v]   making v again reads x
      sum_d size(d) * kept[d] <= room     again[p] = 0 for random p

    HiGHS's dual bound is what is returned, so a solve cut short is still sound."""
    k = graph.index[name]
    builder = MilpBuilder()
    kept: dict[str, int] = {}
    again: dict[int, int] = {}

    def counted(d: str) -> bool:
        return not graph.is_source(d) and d not in alive and graph.data[d].kind != "tangent"

    def again_col(p: int) -> int:
        if p not in again:
            node = graph.nodes[p]
            again[p] = builder.var(0, 0 if node.random else 1, node.time, integer=True)
        return again[p]

    def kept_col(d: str) -> int:
        if d not in kept:
            kept[d] = builder.var(0, 1, integer=True)
        return kept[d]

    for p, producer in enumerate(graph.nodes):
        if ancestors[k] >> p & 1:
            for d in producer.outputs:
                if counted(d) and readers[d] & descendants[k]:
                    builder.row([kept_col(d), again_col(p)], [1, 1], 1, math.inf)
    done: set[int] = set()
    todo = list(again)
    while todo:
        p = todo.pop()
        if p in done:
            continue
        done.add(p)
        for x in dict.fromkeys(graph.nodes[p].inputs):
            if counted(x):
                q = graph.index[graph.data[x].producer]
                builder.row([kept_col(x), again_col(q), again[p]], [1, 1, -1], 0, math.inf)
                todo.append(q)
    if not again:
        return 0.0
    builder.row([kept[d] for d in kept], [float(graph.data[d].size) for d in kept], -math.inf, float(room))
    return _proven_bound(builder, time_limit)


def _proven_bound(builder: MilpBuilder, time_limit: float, deadline: float = math.inf, **options: float) -> float:
    """HiGHS's dual bound on the minimum of `builder`'s MILP after at most `time_limit` seconds,
    and no later than `deadline` once its model is handed over (sound when cut short, only
    weaker), less its feasibility tolerances (relative, about 1e-7) so that it stays a proof;
    0 where it has none above 0. `options`: more of HiGHS's."""
    highs = builder.highs()
    highs.setOptionValue("time_limit", max(0.01, min(time_limit, deadline - time.perf_counter())))
    highs.setOptionValue("mip_rel_gap", 1e-4)
    for name, value in options.items():
        highs.setOptionValue(name, value)
    highs.run()
    bound = highs.getInfo().mip_dual_bound
    return bound * (1 - 1e-6) if math.isfinite(bound) and bound > 0 else 0.0


# The interval MILP (`_interval_remaking_time`): at most this many moments, in about this many
# seconds beyond the closure MILPs' (its dual bound is sound when cut short, only weaker).
INTERVAL_MOMENTS = 16
INTERVAL_TIME = 1.0
DEADLINE_EVERY = 256  # nodes between looks at the clock while the interval MILP is built


def _moment_chain(graph: RematGraph, floors: dict[str, tuple[int, str]], ancestors: list[int],
                  budget: int) -> list[str]:
    """Up to INTERVAL_MOMENTS needed nodes, highest floors first, each an ancestor or a
    descendant of every other (so every schedule first runs them in one order, graph order),
    in graph order."""
    chosen: list[str] = []
    for name in sorted(floors, key=lambda n: -floors[n][0]):
        if len(chosen) >= INTERVAL_MOMENTS:
            break
        k = graph.index[name]
        if floors[name][0] <= budget and all(
                ancestors[k] >> graph.index[c] & 1 or ancestors[graph.index[c]] >> k & 1 for c in chosen):
            chosen.append(name)
    return sorted(chosen, key=lambda n: graph.index[n])


def _interval_remaking_time(graph: RematGraph, budget: int, moments: list[str],
                            floors: dict[str, tuple[int, str]], ancestors: list[int], needed: set[str],
                            deadline: float) -> tuple[float, bool]:
    """(a lower bound on the time spent beyond running each needed node once, whether `deadline`
    cut it short), from the first
    runs of `moments` (a chain: each an ancestor of the next, so every schedule first runs them
    in this order). They cut any schedule into intervals 0..J; one binary per (needed node,
    interval), run[p, i]: p runs in interval i, and per (moment, value), alive[j, d]: d is
    alive while moment j first runs (fixed to 1 for what its floor counts, `_alive_at`):

      minimise  sum_{p, i} time(p) * run[p, i]
      sum_i run[p, i] >= 1                     p needed, not a moment (<= 1 for random p)
      run[p, i] <= run[q, i] + alive[i, x]     p reads x, made by q (alive[0, x] = 0)
      alive[j, x] <= run[q, j-1] + alive[j-1, x]    x not made by moment j: made before it
      alive[j, g] >= run[p, i], i < j          g a gradient p makes: never freed
      sum_{d not counted} size(d) * alive[j, d] <= budget - floor(moment j)

    The single-moment bounds (`_remaking_time`) see one moment; here what a moment drops and
    a later one needs is paid once per interval it is remade in, as a network whose backward
    reads the same forward values at several of its largest steps (convolutions' backward
    with their workspaces) pays. Memory between moments is not constrained, so it stays a
    relaxation. The answer is HiGHS's dual bound less one run of each needed node but the
    moments, so a solve cut short is still sound. HiGHS gets INTERVAL_TIME, or what is left
    before `deadline`; a model whose building reaches it proves nothing (0)."""
    intervals = len(moments) + 1
    scale = sum(node.time for node in graph.nodes) or 1.0  # times near 1: HiGHS's absolute gap stays negligible
    builder = MilpBuilder()

    def counted(d: str) -> bool:
        return not graph.is_source(d) and graph.data[d].kind != "tangent" and graph.data[d].producer is not None

    def producer(d: str) -> int:
        return graph.index[graph.data[d].producer]

    moment_set = set(moments)
    nodes = [graph.index[name] for name in needed]
    run: dict[tuple[int, int], int] = {}
    for p in nodes:
        node = graph.nodes[p]
        still = node.random and node.name in moment_set  # a random node runs once: at its moment
        for i in range(intervals):
            run[p, i] = builder.var(0, 0 if still else 1, node.time / scale, integer=True)
        if node.name not in moment_set:
            builder.row([run[p, i] for i in range(intervals)], [1.0] * intervals, 1, 1 if node.random else math.inf)
    held = [set(filter(counted, _alive_at(graph, graph.node(m), ancestors))) for m in moments]
    always = builder.var(1, 1)
    alive: dict[tuple[int, str], int] = {}

    def alive_col(j: int, d: str) -> int | None:
        """Column of d alive at moment j (1..J); None before the first."""
        if j == 0:
            return None
        if d in held[j - 1]:
            return always
        if (j, d) not in alive:
            alive[j, d] = builder.var(0, 1, integer=True)
        return alive[j, d]

    def made_before(j: int, d: str, column: int | None) -> None:
        """d alive at moment j (column, or always if None) was made in interval j-1 or alive at moment j-1."""
        cols, vals = [run[producer(d), j - 1]], [1.0]
        if (before := alive_col(j - 1, d)) is not None:
            cols.append(before)
            vals.append(1.0)
        if column is None:
            builder.row(cols, vals, 1, math.inf)
        else:
            builder.row([*cols, column], [*vals, -1.0], 0, math.inf)

    for count, p in enumerate(nodes):
        if count % DEADLINE_EVERY == 0 and time.perf_counter() > deadline:
            return 0.0, True
        for x in dict.fromkeys(graph.nodes[p].inputs):
            if counted(x):
                for i in range(intervals):
                    cols, vals = [run[p, i], run[producer(x), i]], [1.0, -1.0]
                    if (column := alive_col(i, x)) is not None:
                        cols.append(column)
                        vals.append(-1.0)
                    builder.row(cols, vals, -math.inf, 0)
    for j, moment in enumerate(moments, start=1):
        for x in held[j - 1] - set(graph.node(moment).outputs):
            made_before(j, x, None)
    for d in dict.fromkeys(graph.backward_outputs):
        if counted(d) and graph.data[d].producer in needed:
            for j in range(1, intervals):
                if d not in held[j - 1]:
                    for i in range(j):
                        builder.row([alive_col(j, d), run[producer(d), i]], [1.0, -1.0], 0, math.inf)
    done: set[tuple[int, str]] = set()
    while len(done) < len(alive):  # each value alive at a moment was made before it
        for j, d in [key for key in alive if key not in done]:
            done.add((j, d))
            made_before(j, d, alive[j, d])
    kept: dict[int, tuple[list[int], list[float]]] = {j: ([], []) for j in range(1, intervals)}
    for (j, d), column in alive.items():
        kept[j][0].append(column)
        kept[j][1].append(float(graph.data[d].size))
    for j, moment in enumerate(moments, start=1):
        builder.row(*kept[j], -math.inf, float(budget - floors[moment][0]))
    if time.perf_counter() > deadline:
        return 0.0, True
    bound = _proven_bound(builder, INTERVAL_TIME, deadline, mip_abs_gap=0.0)
    cut = time.perf_counter() >= deadline  # (its own limit spent first, it would have ended before)
    if bound == 0.0:
        return 0.0, cut
    once = sum(graph.nodes[p].time for p in nodes if graph.nodes[p].name not in moment_set)
    return max(0.0, bound * scale - once), cut


class _LiveAcross:
    """Which values a moment k's knapsack counts (`time_lower_bound`): those an ancestor of k
    makes and a descendant of k reads, less what is alive at k anyway, summed by producer.
    Vectorised over the values (numpy over bit sets), since every needed node is a moment: a
    loop over each moment's ancestors took seconds on a graph of two thousand nodes."""

    def __init__(self, graph: RematGraph, ancestors: list[int], held: set[str]) -> None:
        self.count = len(graph.nodes)
        self.width = (self.count + 7) // 8
        self.ancestors = ancestors
        values = [(p, d) for p, producer in enumerate(graph.nodes) for d in producer.outputs
                  if d not in held and graph.data[d].kind != "tangent"]
        self.position = {d: j for j, (_, d) in enumerate(values)}
        self.producer = np.array([p for p, _ in values], dtype=np.int64)
        self.size = np.array([graph.data[d].size for _, d in values], dtype=np.float64)
        self.time = np.array([node.time for node in graph.nodes], dtype=np.float64)
        self.random = np.array([node.random for node in graph.nodes], dtype=bool)
        # Per value, the nodes some reader of it descends from: bit k set iff a descendant of
        # k reads it (a reader descends from k).
        readers_above = []
        for _, d in values:
            mask = 0
            for user in graph.users.get(d, ()):
                mask |= ancestors[graph.index[user]]
            readers_above.append(mask.to_bytes(self.width, "little"))
        self.readers_above = np.frombuffer(b"".join(readers_above), dtype=np.uint8).reshape(len(values), self.width)

    def producers(self, k: int, alive: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
        """(producers, bytes) of what moment k counts, by producer in graph order, bytes > 0."""
        above = _members(self.ancestors[k], self.count)
        live = ((self.readers_above[:, k >> 3] >> (k & 7)) & 1).astype(bool) & above[self.producer]
        live[[self.position[d] for d in alive if d in self.position]] = False
        weights = np.bincount(self.producer[live], weights=self.size[live], minlength=self.count)
        producers = np.flatnonzero(weights)
        return producers, weights[producers].astype(np.int64)


def _value_kept_greedily(values: np.ndarray, weights: np.ndarray, capacity: int) -> float:
    """The value of the items (values, weights > 0) that a greedy packing keeps within
    `capacity`, best value per weight first, each that still fits: a lower bound on the most
    value that fits (`_most_value_kept`)."""
    order = np.argsort(-(values / weights), kind="stable")
    kept, room = 0.0, capacity
    for value, weight in zip(values[order].tolist(), weights[order].tolist()):
        if weight <= room:
            kept += value
            room -= weight
    return kept


def _most_value_kept(items: list[tuple[float, int]], capacity: int, slots: int = 2000) -> float:
    """An upper bound on the value of (value, weight) items fitting in `capacity`: the better
    of the fractional knapsack and the 0/1 knapsack with weights rounded down to `slots` units
    of the capacity (rounding down keeps every truly fitting set fitting)."""
    items = [(v, w) for v, w in items if w <= capacity]  # the others can never be kept whole
    fractional, room = 0.0, capacity
    for value, weight in sorted(items, key=lambda item: item[0] / item[1], reverse=True):
        taken = min(weight, room)
        room -= taken
        fractional += value * taken / weight
    unit = max(1, capacity // slots)
    best = np.zeros(capacity // unit + 1)
    for value, weight in items:
        w = weight // unit
        if w == 0:
            best += value
        else:
            best[w:] = np.maximum(best[w:], best[:-w] + value)  # right side read before the write
    return min(fractional, float(best[-1]))


def _ancestors(graph: RematGraph) -> list[int]:
    """Per node (graph order is topological), the set of nodes it depends on, as a bitmask."""
    result: list[int] = []
    for node in graph.nodes:
        mask = 0
        for d in node.inputs:
            producer = graph.data[d].producer
            if producer is not None:
                p = graph.index[producer]
                mask |= result[p] | (1 << p)
        result.append(mask)
    return result


def _descendants(graph: RematGraph) -> list[int]:
    """Per node, the set of nodes that depend on it, as a bitmask."""
    result = [0] * len(graph.nodes)
    for i in reversed(range(len(graph.nodes))):
        for d in graph.nodes[i].outputs:
            for user in graph.users.get(d, ()):
                j = graph.index[user]
                result[i] |= result[j] | (1 << j)
    return result


class _Remade:
    """What the minimum-memory family remakes, per phase: values kept across stages (`persistent`:
    what cannot be recomputed, and the checkpoints) and, per node, the nodes that running it
    needs to run again first (`to_recompute` of its inputs), as bit sets. Each is the union of
    those of the producers of the node's missing inputs, so each is computed once, in graph
    order, not walked anew at every stage (a deep model's stages remake most of its forward)."""

    def __init__(self, graph: RematGraph, checkpoints: Iterable[str] = ()) -> None:
        persistent = set(graph.tangents) | set(checkpoints)
        for node in graph.nodes:
            if node.backward or node.random:
                persistent.update(node.outputs)
        # Tangents are at hand in the backward phase only.
        self.available = {False: frozenset(d for d in persistent if graph.data[d].kind != "tangent"),
                          True: frozenset(persistent)}
        self.producer = {d: graph.index[dn.producer] for d, dn in graph.data.items() if dn.producer is not None}
        self.count = len(graph.nodes)
        self.remade: dict[bool, list[int]] = {}
        for phase in (False, True):
            remade: list[int] = []  # per node: itself and what running it again needs
            for i, node in enumerate(graph.nodes):
                remade.append(1 << i | self._missing(node, phase, remade))
            self.remade[phase] = remade

    def _missing(self, node: ComputeNode, phase: bool, remade: list[int]) -> int:
        """A producer not before the node is in the set alone: the graph is not in topological
        order, which `_read_before_produced` reports."""
        bits = 0
        available, producer = self.available[phase], self.producer
        for d in node.inputs:
            if d not in available and d in producer:
                p = producer[d]
                bits |= remade[p] if p < len(remade) else 1 << p
        return bits

    def missing(self, node: ComputeNode) -> int:
        """The nodes to run again right before `node`, in its phase, as a bit set."""
        return self._missing(node, node.backward, self.remade[node.backward])

    def members(self, bits: int) -> np.ndarray:
        """The bit set as a boolean mask over the graph's nodes."""
        return _members(bits, self.count)


def _min_memory_stages(graph: RematGraph, remade: _Remade, forward_once: bool) -> Iterator[tuple[ComputeNode, int]]:
    """Each node of the minimum-memory schedule in graph order, with the nodes its stage runs
    again first (a bit set; none in the forward phase with `forward_once`)."""
    for t, node in enumerate(graph.nodes):
        if forward_once and not node.backward:
            yield node, 0
            continue
        missing = remade.missing(node)
        if missing >> t:
            _read_before_produced(graph, node)
        yield node, missing


def min_memory_schedule(graph: RematGraph, checkpoints: Iterable[str] = (), solver: str = "min_memory",
                        forward_once: bool = False) -> Schedule:
    """Stage by stage in graph order, keep only values that cannot be recomputed (and the
    `checkpoints`) and recompute each missing forward activation (and its missing ancestors)
    right before it is read. With `forward_once`, the forward phase runs each node once (values
    live until their last forward use) and only backward stages recompute. The schedule is
    quadratic in the graph's depth (a backward stage remakes the forward up to what it reads)."""
    remade = _Remade(graph, checkpoints)
    names = np.array([node.name for node in graph.nodes], dtype=object)
    computes: list[str] = []
    forward_count = 0
    forward_nodes = len(graph.forward_nodes)
    for t, (node, missing) in enumerate(_min_memory_stages(graph, remade, forward_once)):
        if t == forward_nodes:
            forward_count = len(computes)
        if missing:
            computes.extend(names[remade.members(missing)].tolist())  # in graph order
        computes.append(node.name)
    if forward_nodes == len(graph.nodes):
        forward_count = len(computes)
    return schedule_from_computes(graph, computes, forward_count, solver=solver)


def min_memory_length(graph: RematGraph, checkpoints: Iterable[str] = (), forward_once: bool = False) -> int:
    """How many computations `min_memory_schedule` lists (before the replay drops those whose
    values nothing reads), without building it: its replay is quadratic in depth."""
    remade = _Remade(graph, checkpoints)
    return sum(1 + missing.bit_count() for _, missing in _min_memory_stages(graph, remade, forward_once))


def min_memory_time_floor(graph: RematGraph) -> float:
    """A lower bound on `min_memory_schedule(graph)`'s predicted time, without building it (its
    replay is quadratic in depth). Each backward node a required output depends on runs once,
    and everything its stage remakes is read on the way to it, so none of that is dropped as
    dead work; every other node needed runs at least once. Summed in another order than the
    schedule's, so compare it with a margin (`MIN_MEMORY_MARGIN`)."""
    remade = _Remade(graph)
    times = np.array([node.time for node in graph.nodes])
    needed = needed_nodes(graph)
    in_stages = 0  # the nodes some backward stage remakes
    total = 0.0
    for node in graph.backward_nodes:
        if node.name in needed:
            missing = remade.missing(node)
            in_stages |= missing
            total += node.time + float(times[remade.members(missing)].sum())
    once = [n for n in graph.forward_nodes if n.name in needed and not in_stages >> graph.index[n.name] & 1]
    return total + sum(n.time for n in once)


# Relative margin for comparing `min_memory_time_floor` with a schedule's time: far above the
# rounding of sums of a few million terms, far below any difference a plan choice turns on.
MIN_MEMORY_MARGIN = 1e-9


def _read_before_produced(graph: RematGraph, node: ComputeNode) -> None:
    """ValueError naming a value that running `node` (again) needs, made by a node not before it."""
    t = graph.index[node.name]
    missing = to_recompute(graph, node.inputs, ())
    d = next(d for n in (node.name, *missing) for d in graph.node(n).inputs
             if (p := graph.data[d].producer) is not None and graph.index[p] >= t)
    raise ValueError(f"node {node.name} reads {d} before it is produced")


@dataclass
class BudgetBounds:
    """The proven memory floor and the constructive schedules near it. The minimum-memory
    schedule, quadratic in the graph's depth, is built only when first asked for (`candidates`,
    `schedule`, `upper`): a caller whose budget fits storing everything may need none of it
    (`min_memory_slower_than_store_all`)."""

    lower: int  # proven: no schedule peaks below
    lower_reason: str
    baselines: list[Schedule]  # store-all, checkpointing every block, sqrt segments: linear in the graph
    graph: RematGraph = field(repr=False)
    _min_memory: Schedule | None = field(default=None, repr=False)
    _in_order: tuple[int, str] | None = field(default=None, repr=False)
    _chain: tuple[int, str] | None = field(default=None, repr=False)

    @property
    def min_memory(self) -> Schedule:
        if self._min_memory is None:
            self._min_memory = min_memory_schedule(self.graph)
        return self._min_memory

    @property
    def in_order(self) -> tuple[int, str]:
        """`in_order_floor`: below it only the chain's plans may fit."""
        if self._in_order is None:
            self._in_order = in_order_floor(self.graph)
        return self._in_order

    @property
    def chain(self) -> tuple[int, str]:
        """`chain_order_floor`: no plan of the chain of blocks peaks below it."""
        if self._chain is None:
            self._chain = chain_order_floor(self.graph)
        return self._chain

    @property
    def reachable(self) -> tuple[int, str]:
        """`reachable_floor`, from the floors held here."""
        return min(self.in_order, self.chain)

    @property
    def candidates(self) -> list[Schedule]:
        """Every constructive schedule tried (the baselines, then the minimum-memory schedule)."""
        return [*self.baselines, self.min_memory]

    @property
    def schedule(self) -> Schedule:
        """The candidate with the least peak: the smallest budget known to fit. The minimum-memory
        schedule runs the nodes in autograd's order, so it cannot peak below the in-order floor:
        where a baseline peaks at that floor and is faster than it can be
        (`min_memory_time_floor`), it is not built (seconds on a deep model)."""
        def rank(schedule: Schedule) -> tuple[int, float]:
            return schedule.predicted_peak, schedule.predicted_time

        if self._min_memory is None:
            best = min(self.baselines, key=rank)
            if (best.predicted_peak <= self.in_order[0]
                    and best.predicted_time * (1 + MIN_MEMORY_MARGIN) < min_memory_time_floor(self.graph)):
                return best
        return min(self.candidates, key=rank)

    @property
    def upper(self) -> int:  # achieved by `schedule`
        return self.schedule.predicted_peak

    @property
    def exact(self) -> bool:
        return self.lower == self.upper

    def describe(self) -> str:
        """The smallest feasible budget, in words, for error messages."""
        if self.exact:
            return (f"the smallest feasible budget is {self.lower} bytes ({format_bytes(self.lower)}): "
                    f"{self.lower_reason}")
        return (f"the smallest feasible budget lies between {self.lower} bytes ({format_bytes(self.lower)}; "
                f"{self.lower_reason}) and {self.upper} bytes ({format_bytes(self.upper)}, where a schedule "
                f"is known){self.describe_in_order()}")

    def describe_in_order(self) -> str:
        """The in-order and chain floors in words, for messages, where they say more than the proven floor."""
        floor, reason = self.in_order
        if floor <= self.lower:
            return ""
        said = (f"; no schedule that runs the nodes in autograd's order (every solver's but the chain's) peaks "
                f"below {floor} bytes ({format_bytes(floor)}; {reason})")
        chain, why = self.chain
        if chain > self.lower:
            said += (f", and no plan of the chain of blocks below {chain} bytes ({format_bytes(chain)}; {why})")
        return said


def budget_bounds(graph: RematGraph) -> BudgetBounds:
    lower, reason = memory_lower_bound(graph)
    return BudgetBounds(lower, reason, [solve_store_all(graph), solve_checkpoint_blocks(graph),
                                        solve_sqrt_segments(graph)], graph)


def min_memory_slower_than_store_all(graph: RematGraph) -> bool:
    """True when the minimum-memory schedule is surely slower than storing everything, seen
    without building it: a forward node that takes time is read (through its outputs) by two
    backward nodes that required outputs depend on. Each of those runs once and is kept, and
    its stage remakes that node, so the node runs twice where storing everything runs it once,
    and every other node needed runs at least once in both. False when that is not seen (it
    may still hold): then build it to compare."""
    needed = needed_nodes(graph)
    total = sum(graph.node(name).time for name in needed)
    for node in graph.forward_nodes:
        if node.random or node.name not in needed or node.time <= 1e-9 * total:
            continue  # (a margin far above the rounding of either schedule's summed time)
        readers = {user for d in node.outputs for user in graph.users[d]
                   if graph.node(user).backward and user in needed}
        if len(readers) >= 2:
            return True
    return False


def check_budget(graph: RematGraph, budget: int) -> BudgetBounds:
    """The graph's budget bounds; InfeasibleBudget, stating the smallest feasible budget, when
    `budget` is below the proven memory floor (no solver can fit it: say so before searching)."""
    bounds = budget_bounds(graph)
    if budget < bounds.lower:
        raise InfeasibleBudget(f"budget {budget} bytes ({format_bytes(budget)}) is too small: {bounds.describe()}")
    return bounds


def min_feasible_budget(graph: RematGraph) -> int:
    """Smallest budget (bytes) at which a schedule is known to exist. Exact whenever the
    best constructive schedule meets the lower bound (`budget_bounds(graph).exact`);
    otherwise the true minimum lies in [budget_bounds(graph).lower, this value]."""
    return budget_bounds(graph).upper
