"""`solve_saved_values`: choose what the forward saves for the backward, by a small MILP.

The family is that of PyTorch's partitioner (torch.compile's `activation_memory_budget`): the
forward runs once, in graph order; the backward is handed a set of saved forward values and
recomputes any other forward value it reads right before its first read (with the unsaved
ancestors that needs), after which the value lives to its last read. With one binary per
forward value the backward reads (saved[d]) and one per forward node (again[v]: recomputed):

  minimise   sum_v time(v) * again[v]
  saved[d] + again[p(d)] >= 1                 the backward reads d (p(d): its producer)
  saved[x] + again[p(x)] >= again[v]          recomputing v reads x, which the backward reads
  again[p(x)] >= again[v]                     ... x, which only the forward reads (freed there)
  sum of size(d) over the d unsaved at t >= store_all(t) - M          at every step t

d is unsaved at step t when it is not saved and t lies strictly between its last forward read
and its first backward read: memory at step t is the store-everything schedule's less those
values. A value is held before its first backward read where a node reading it is remade
earlier, and a chain of remade nodes (a convolution, its normalization and its activation, remade
for the activation's gradient) brings that far forward; the model follows the nodes that a
replayed choice remade, with a continuous recomputed[v, i] per node and backward run
(`_Family._early_presence`). It leaves out the recomputations' own transient memory (an
ancestor freed in the forward remade only to remake d, a recomputed op's workspace), so the
schedule is built and replayed by the simulator, and M is lowered by the overshoot until it fits.

PyTorch bounds the saved values' total by a ratio of its own estimate, which a caller bisects;
this bounds the memory at every step, in bytes, and the model is small enough (a binary per
value the backward reads and per forward node) that HiGHS solves it fast on whole models.
Peak shaving, whose family holds this one, starts from it (solvers/portfolio.py).
"""

from __future__ import annotations

import math
import time

import numpy as np

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.ilp_model import MilpBuilder
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, schedule_from_computes, simulate, to_recompute
from solvers.store_all import solve_store_all

NAME = "saved_values"
MIP_GAP = 1e-3  # within the family: its optimum is what is wanted, and it comes in milliseconds
# The most columns the model may gain to follow remade nodes (`_Family._early_presence`): one per
# node and backward run, so they grow with the square of depth. The Hugging Face and zoo models
# of a few hundred nodes stay well under it, and HiGHS solves them within the search's share;
# GPT-2 with 48 layers or a bidirectional GRU would need ten to a hundred times more, where one
# attempt outlasts that share. Beyond it the attempts lower the limits instead.
CHAIN_COLUMNS = 30_000
# An overshoot (relative to the budget) that lowering the limits mends at once, in an attempt or
# two: a transient the model leaves out. Above it the next attempt follows the remade nodes: on
# the zoo's and Hugging Face's graphs the first choices over by more were held by chains of
# remade nodes, and those over by less fitted as well with lowered limits, several times sooner.
CHAIN_OVERSHOOT = 0.01


class _Family:
    """What the model needs of one graph, whatever the budget."""

    def __init__(self, graph: RematGraph) -> None:
        self.graph = graph
        self.nf = len(graph.forward_nodes)
        required = {*graph.forward_outputs, *graph.user_outputs}
        # d -> (last forward read, first backward read): the steps strictly between are those
        # where d is absent unless saved. Values read by the backward that cannot be dropped
        # (random draws, required outputs) or that are read again at once are always saved.
        self.gaps: dict[str, tuple[int, int]] = {}
        self.forward_only: set[str] = set()  # freed in the forward: remade if a recomputation reads them
        for d, dn in graph.data.items():
            # Order values are held once made (`RematGraph.order_values`): never absent.
            if dn.producer is None or dn.order_only or graph.node(dn.producer).backward:
                continue
            made = graph.index[dn.producer]
            reads = [graph.index[u] for u in graph.users[d]]
            backward_reads = [i for i in reads if i >= self.nf]
            if not backward_reads:
                if d not in required:
                    self.forward_only.add(d)
                continue
            last_forward = max((i for i in reads if i < self.nf), default=made)
            if d not in required and not graph.node(dn.producer).random and min(backward_reads) > last_forward + 1:
                self.gaps[d] = (last_forward, min(backward_reads))
        # The steps cut into runs over which the same values are absent (a run starts where a
        # gap opens or closes): the model needs one memory row per run, not per step, and on a
        # deep graph the values absent at each step, listed step by step, run to millions.
        cuts = sorted({0, len(graph.nodes), *(c for last, first in self.gaps.values() for c in (last + 1, first))})
        self.runs = [(start, end) for start, end in zip(cuts, cuts[1:]) if start < end]
        self.run_of = [i for i, (start, end) in enumerate(self.runs) for _ in range(start, end)]
        self.opening: list[list[str]] = [[] for _ in self.runs]  # the values first absent in each run
        self.closing: list[list[str]] = [[] for _ in self.runs]  # ... and last absent in it
        for d, (last, first) in self.gaps.items():
            self.opening[self.run_of[last + 1]].append(d)
            self.closing[self.run_of[first - 1]].append(d)
        # The values absent in each run when nothing is saved, and their bytes, as running sums.
        self.absent_count: list[int] = []
        self.absent_bytes: list[int] = []
        count = absent = 0
        for i in range(len(self.runs)):
            closed = self.closing[i - 1] if i else []
            count += len(self.opening[i]) - len(closed)
            absent += sum(graph.data[d].size for d in self.opening[i]) - sum(graph.data[d].size for d in closed)
            self.absent_count.append(count)
            self.absent_bytes.append(absent)
        self.backward_run = self.run_of[self.nf] if self.nf < len(graph.nodes) else len(self.runs)
        # Forward node v -> the last run at which recomputing v reads a value in its gap (its own
        # input, or, through values freed in the forward, an ancestor's): after it, v's
        # recomputation needs nothing absent. -1 where it never does.
        self.needs_until: dict[str, int] = {}
        for v in graph.forward_nodes:
            until = -1
            for x in graph.reads[v.name]:
                if x in self.gaps:
                    until = max(until, self.run_of[self.gaps[x][1] - 1])
                elif x in self.forward_only:
                    until = max(until, self.needs_until.get(graph.data[x].producer, -1))
            self.needs_until[v.name] = until
        # The forward nodes whose recomputation time the model follows (`solve`): those a replayed
        # choice recomputed, added attempt by attempt (`saved_values_attempts`).
        self.chained: set[str] = set()
        self.absent_modelled: list[float] = []  # per run, the bytes the latest answer leaves absent
        self.store_all_steps = self._store_all_steps()

    def _store_all_steps(self) -> list[int]:
        """Memory during each node's step in the store-everything schedule (0 for a node whose
        outputs nobody reads: the schedule does not run it)."""
        steps = _step_memory(self.graph, solve_store_all(self.graph))
        return [steps.get(t, 0) for t in range(len(self.graph.nodes))]

    def solve(self, memory: list[int], time_limit: float) -> set[str] | None:
        """The values saved by the fastest choice whose modelled memory stays within
        `memory[t]` bytes at each step t; None when there is none (or HiGHS found none in time).
        Sets `absent_modelled` for the answer."""
        graph = self.graph
        unit = max(1.0, max(memory) / 10_000)  # small coefficients, whatever the model's size
        b = MilpBuilder()
        saved = {d: b.var(0, 1, 0.0, True) for d in self.gaps}
        # Among equally fast choices, the one recomputing fewest nodes (views cost ~0 here,
        # not in Python at run time).
        tie = 1e-6 * max((v.time for v in graph.nodes), default=0.0)
        again = {v.name: b.var(0, 0 if v.random else 1, v.time + tie, True) for v in graph.forward_nodes}
        for d, col in saved.items():
            b.row([col, again[graph.data[d].producer]], [1, 1], 1, math.inf)
        for v in graph.forward_nodes:
            for x in graph.reads[v.name]:
                producer = graph.data[x].producer
                if x in saved:
                    b.row([saved[x], again[producer], again[v.name]], [1, 1, -1], 0, math.inf)
                elif x in self.forward_only:
                    b.row([again[producer], again[v.name]], [1, -1], 0, math.inf)
        early = self._early_presence(b, saved)
        # Per run, kept[i]: the bytes (in units) of the values absent there but saved, as a
        # running sum: the values whose gap opens in run i added, those whose gap closed in the
        # run before taken off. One row per run with each value in two of them, not each run's
        # whole list: on a deep model the lists sum to about the square of its values, and
        # HiGHS's presolve alone then took longer than the saved-values search's share.
        kept_before: int | None = None  # column of kept[i - 1]; None where nothing was absent
        kept_cols: list[int | None] = []
        for i, (start, end) in enumerate(self.runs):
            absent_bytes = self.absent_bytes[i]
            # The run's most binding step: its limit implies the others' (the same values).
            over = max(self.store_all_steps[t] - memory[t] for t in range(start, end))
            if over > absent_bytes:
                return None  # even with nothing saved, a step of the run is above its limit
            if not self.absent_count[i]:
                kept_before = None
                kept_cols.append(None)
                continue
            # sum size * (1 - saved) - early presence >= over, i.e.
            # kept + early presence <= sum size - over
            limit = (absent_bytes - over) / unit if over > 0 else math.inf
            kept = b.var(0.0, math.inf if early[i] else limit)
            if early[i] and over > 0:
                b.row([kept, *(col for col, _ in early[i])], [1.0, *(size / unit for _, size in early[i])],
                      -math.inf, limit)
            cols = [kept, *(saved[d] for d in self.opening[i])]
            vals = [1.0, *(-graph.data[d].size / unit for d in self.opening[i])]
            if kept_before is not None:
                cols += [kept_before, *(saved[d] for d in self.closing[i - 1])]
                vals += [-1.0, *(graph.data[d].size / unit for d in self.closing[i - 1])]
            b.row(cols, vals, 0.0, 0.0)
            kept_before = kept
            kept_cols.append(kept)
        h = b.highs()
        h.setOptionValue("time_limit", float(max(0.01, time_limit)))
        h.setOptionValue("mip_rel_gap", MIP_GAP)
        h.setOptionValue("random_seed", 0)
        h.run()
        if h.getInfo().primal_solution_status != 2:  # 2 = feasible
            return None
        x = np.asarray(h.getSolution().col_value)
        self.absent_modelled = [
            0.0 if kept is None else
            self.absent_bytes[i] - unit * x[kept] - sum(size * x[col] for col, size in early[i])
            for i, kept in enumerate(kept_cols)]
        return {d for d, col in saved.items() if x[col] > 0.5}

    def _early_presence(self, b: MilpBuilder, saved: dict[str, int]) -> list[list[tuple[int, int]]]:
        """Columns of `b` for the values present before their gap ends, per run: (column, bytes).

        The backward remakes a forward node v (again[v]) where a value it reads is absent, at
        the first backward read of an unsaved output of v, or earlier, where a node remade
        earlier reads an output of v that is unsaved (or freed in the forward); its inputs are
        then made or at hand, and each lives to its last read. So a value absent until its first
        backward read is present from where a node reading it is remade: held longer than its
        gap says, by the whole span of a chain of remade nodes. For the nodes in `chained`:
        recomputed[v, i] (continuous, 1 at the optimum where v is remade by run i, the runs from
        the backward's first to the last where v needs a value in its gap, `needs_until`), and
        early[x, i] >= recomputed[v, i] - saved[x] for each value x such a node reads, in each
        run of its gap from the backward's first. A remade node's other outputs (a pooling's
        indices, a normalization's statistics), made early too, are left out: following them as
        well found no faster choice on the zoo's and Hugging Face's graphs, and on some took
        longer. The replay sees them, as it sees the transients."""
        graph = self.graph
        recomputed = {(v, i): b.var(0.0, 1.0) for v in self.chained for i in self._remade_runs(v)}
        for v in self.chained:
            for d in graph.node(v).outputs:  # remade for its own output's first backward read
                if d in self.gaps:
                    for i in range(self.run_of[self.gaps[d][1]], self.needs_until[v] + 1):
                        b.row([recomputed[v, i], saved[d]], [1, 1], 1, math.inf)
            for y in graph.reads[v]:  # remade for a node remade earlier
                producer = graph.data[y].producer
                if producer not in self.chained or (y not in self.gaps and y not in self.forward_only):
                    continue
                for i in range(self.backward_run, min(self.needs_until[v], self.needs_until[producer]) + 1):
                    if y in self.gaps:
                        b.row([recomputed[producer, i], recomputed[v, i], saved[y]], [1, -1, 1], 0, math.inf)
                    else:
                        b.row([recomputed[producer, i], recomputed[v, i]], [1, -1], 0, math.inf)
        early: list[list[tuple[int, int]]] = [[] for _ in self.runs]
        for x in self.gaps:
            readers = [v for v in graph.users[x] if v in self.chained]
            if not readers:
                continue
            for i in self._early_runs(x):
                col = b.var(0.0, 1.0)
                for v in readers:
                    b.row([col, recomputed[v, i], saved[x]], [1, -1, 1], 0, math.inf)
                early[i].append((col, graph.data[x].size))
        return early

    def _remade_runs(self, v: str) -> range:
        """The runs of v's recomputed[v, i]: from the backward's first to `needs_until[v]`."""
        return range(self.backward_run, self.needs_until[v] + 1)

    def _early_runs(self, x: str) -> range:
        """The runs of x's early[x, i]: those of its gap from the backward's first."""
        last, first = self.gaps[x]
        return range(max(self.run_of[last + 1], self.backward_run), self.run_of[first - 1] + 1)

    def chain_columns(self, nodes: set[str]) -> int:
        """The columns `_early_presence` adds to the model for following `nodes`."""
        return (sum(len(self._remade_runs(v)) for v in nodes)
                + sum(len(self._early_runs(x)) for x in self.gaps if any(v in nodes for v in self.graph.users[x])))

    def modelled(self, t: int) -> float:
        """The model's memory at step t in its latest answer (`solve`)."""
        return self.store_all_steps[t] - self.absent_modelled[self.run_of[t]]

    def schedule(self, saved: set[str]) -> Schedule:
        """Forward once; at the boundary the unsaved values go; the backward remakes what it
        reads (and what that needs) right before the read."""
        graph = self.graph
        gone = (self.gaps.keys() - saved) | self.forward_only
        computes: list[str] = []
        available: set[str] = set()
        forward_count = 0
        for i, node in enumerate(graph.nodes):
            if i == self.nf:
                forward_count = len(computes)
                available.difference_update(gone)
                available.update(graph.tangents)
            for name in (*to_recompute(graph, node.inputs, available), node.name):
                computes.append(name)
                available.update(graph.node(name).outputs)
        if self.nf == len(graph.nodes):
            forward_count = len(computes)
        return schedule_from_computes(graph, computes, forward_count, solver=NAME, budget=None,
                                      extra={"saved": len(saved), "dropped": len(self.gaps) - len(saved)})


def _step_memory(graph: RematGraph, schedule: Schedule) -> dict[int, int]:
    """Step t -> the most memory during the ops run for it (its recomputations, then node t
    itself): what is alive after each op (the simulator's curve) plus the op's workspace."""
    curve = simulate(graph, schedule).curve
    steps: dict[int, int] = {}
    pending: list[int] = []  # memory during the recomputations made for the next step
    step = 0
    for j, op in enumerate(schedule.ops):
        if op.kind != "compute":
            continue
        pending.append(curve[j] + graph.node(op.name).workspace)
        if graph.index[op.name] >= step:  # the step's own node (unread nodes are not run)
            step = graph.index[op.name]
            steps[step] = max(pending)
            pending, step = [], step + 1
    return steps


def saved_values_attempts(graph: RematGraph, budget: int, time_limit: float = 5.0,
                          attempts: int = 8) -> list[Schedule]:
    """The schedule of each attempt, in order; only the last may fit `budget`. Each attempt
    solves the model with a memory limit per step (the budget at first) and replays its
    schedule. Where it overshoots and remade forward nodes whose recomputation time the model
    did not follow, the next attempt follows them (`_Family.chained`): a chain of remade nodes
    holds values from the start of the chain's recomputation, and on a CNN (a convolution,
    its normalization and activation remade together) that held the first choice far over the
    budget, where lowering the limits alone made the next attempt infeasible. Otherwise, at
    each step that overshoots, the limit is lowered by as much (the model misses the
    recomputations' transient memory there). The attempts that overshoot are good starts
    for peak shaving: the first can meet the proven floor on time while only a little over
    the budget, where the later attempt that fits is slower, and peak shaving repairs the first
    to fit at almost no cost in time."""
    deadline = time.perf_counter() + time_limit
    family = _Family(graph)
    limits = [budget] * len(graph.nodes)
    found: list[Schedule] = []
    for _ in range(attempts):
        saved = family.solve(limits, deadline - time.perf_counter())
        if saved is None:
            break
        found.append(family.schedule(saved))
        over = {t: memory - budget for t, memory in _step_memory(graph, found[-1]).items() if memory > budget}
        if not over or time.perf_counter() > deadline:
            break
        remade = {op.name for op in found[-1].backward_ops if op.kind == "compute" and not graph.node(op.name).backward}
        if (max(over.values()) > CHAIN_OVERSHOOT * budget and not remade <= family.chained
                and family.chain_columns(family.chained | remade) <= CHAIN_COLUMNS):
            family.chained |= remade
            continue
        # Below what the model counted at t, not below the limit: where the model was under its
        # limit, a limit lowered by the excess alone may not bind, and the same choice comes back,
        # attempt after attempt, a little over.
        for t, excess in over.items():
            limits[t] = min(limits[t], family.modelled(t)) - excess
    return found


def solve_saved_values(graph: RematGraph, budget: int, time_limit: float = 5.0, attempts: int = 8) -> Schedule:
    """The fastest schedule of the family found within `budget` bytes (`saved_values_attempts`).
    Raises InfeasibleBudget when no attempt fits."""
    start = time.perf_counter()
    found = saved_values_attempts(graph, budget, time_limit, attempts)
    if not found or found[-1].predicted_peak > budget:
        raise InfeasibleBudget(f"no choice of saved values fits {budget} bytes ({format_bytes(budget)}) "
                               f"in {len(found)} attempt(s)")
    best = found[-1]
    best.budget = budget
    best.extra["attempts"] = len(found)
    best.solve_time = time.perf_counter() - start
    return best
