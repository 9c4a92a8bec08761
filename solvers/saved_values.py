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
values. The model leaves out the recomputations' own transient memory (an ancestor remade only
to remake d, a recomputed op's workspace), so the schedule is built and replayed by the
simulator, and M is lowered by the overshoot until it fits.

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
        self.absent_in: list[list[str]] = [[] for _ in self.runs]
        self.opening: list[list[str]] = [[] for _ in self.runs]  # the values first absent in each run
        self.closing: list[list[str]] = [[] for _ in self.runs]  # ... and last absent in it
        for d, (last, first) in self.gaps.items():
            opens, closes = self.run_of[last + 1], self.run_of[first - 1]
            self.opening[opens].append(d)
            self.closing[closes].append(d)
            for i in range(opens, closes + 1):
                self.absent_in[i].append(d)
        self.store_all_steps = self._store_all_steps()

    def _store_all_steps(self) -> list[int]:
        """Memory during each node's step in the store-everything schedule (0 for a node whose
        outputs nobody reads: the schedule does not run it)."""
        steps = _step_memory(self.graph, solve_store_all(self.graph))
        return [steps.get(t, 0) for t in range(len(self.graph.nodes))]

    def solve(self, memory: list[int], time_limit: float) -> set[str] | None:
        """The values saved by the fastest choice whose modelled memory stays within
        `memory[t]` bytes at each step t; None when there is none (or HiGHS found none in time)."""
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
        # Per run, kept[i]: the bytes (in units) of the values absent there but saved, as a
        # running sum: the values whose gap opens in run i added, those whose gap closed in the
        # run before taken off. One row per run with each value in two of them, not each run's
        # whole list: on a deep model the lists sum to about the square of its values, and
        # HiGHS's presolve alone then took longer than the saved-values search's share.
        kept_before: int | None = None  # column of kept[i - 1]; None where nothing was absent
        absent_bytes = 0
        for i, (start, end) in enumerate(self.runs):
            absent_bytes += sum(graph.data[d].size for d in self.opening[i])
            absent_bytes -= sum(graph.data[d].size for d in self.closing[i - 1]) if i else 0
            # The run's most binding step: its limit implies the others' (the same values).
            over = max(self.store_all_steps[t] - memory[t] for t in range(start, end))
            if over > absent_bytes:
                return None  # even with nothing saved, a step of the run is above its limit
            if not self.absent_in[i]:
                kept_before = None
                continue
            # sum size * (1 - saved) >= over, i.e. sum size * saved <= sum size - over
            kept = b.var(0.0, (absent_bytes - over) / unit if over > 0 else math.inf)
            cols = [kept, *(saved[d] for d in self.opening[i])]
            vals = [1.0, *(-graph.data[d].size / unit for d in self.opening[i])]
            if kept_before is not None:
                cols += [kept_before, *(saved[d] for d in self.closing[i - 1])]
                vals += [-1.0, *(graph.data[d].size / unit for d in self.closing[i - 1])]
            b.row(cols, vals, 0.0, 0.0)
            kept_before = kept
        h = b.highs()
        h.setOptionValue("time_limit", float(max(0.01, time_limit)))
        h.setOptionValue("mip_rel_gap", MIP_GAP)
        h.setOptionValue("random_seed", 0)
        h.run()
        if h.getInfo().primal_solution_status != 2:  # 2 = feasible
            return None
        x = np.asarray(h.getSolution().col_value)
        return {d for d, col in saved.items() if x[col] > 0.5}

    def modelled(self, t: int, saved: set[str]) -> int:
        """The model's memory at step t for the values `saved`."""
        absent = self.absent_in[self.run_of[t]]
        return self.store_all_steps[t] - sum(self.graph.data[d].size for d in absent if d not in saved)

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
    schedule; at each step that overshoots, the limit is lowered by as much (the model misses
    the recomputations' transient memory there). The attempts that overshoot are good starts
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
        # Below what the model counted at t, not below the limit: where the model was under its
        # limit, a limit lowered by the excess alone may not bind, and the same choice comes back,
        # attempt after attempt, a little over.
        for t, excess in over.items():
            limits[t] = min(limits[t], family.modelled(t, saved)) - excess
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
