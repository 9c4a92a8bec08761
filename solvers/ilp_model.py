"""Checkmate's MILP (Jain et al., MLSys 2020) on a RematGraph, built as sparse arrays for HiGHS.

Stages t = 0..n-1 follow the graph order ("frontier advancing"): stage t computes node t,
possibly after recomputing earlier nodes i < t in index order (lower-triangular R).
Variables, in memory units (sizes rounded up, so a feasible model is a feasible schedule):
  R[t,i]   binary   node i runs in stage t; R[t,t] = 1; random nodes only in their own stage
  S[t,d]   binary   data d is alive at the start of stage t (t = n: at the end); tangents and
                    the user's outputs are fixed at 1 from the first backward stage nf on
                    (autograd and the user hold them until the step ends), never freed
  F[t,d,k] in [0,1] d is freed right after step k of stage t (k = d's producer or a reader)
  U[t,k]   >= 0     memory after step k of stage t, frees included
Adaptations to our graph (multi-output nodes, data nodes, workspace):
  - S is per data node, not per compute node, so outputs of one node are kept independently;
  - a step's peak is U[t,k-1] + R[t,k] * (outputs + workspace) <= budget;
  - F only needs upper bounds (F <= R[t,k], F <= 1 - S[t+1,d], F <= 1 - R[t,j] for each later
    reader j): freeing only lowers memory, so the solver sets F as high as allowed, and with
    R, S integral those bounds are 0 or 1. F is continuous, which halves the binaries;
  - recomputing a node while one of its outputs is kept is forbidden (S[t,d] + R[t,p(d)] <= 1):
    it costs time and double-counts memory, so no optimal schedule does it;
  - forward outputs must be alive at the end of stage nf-1 (not freed there) but need not be
    kept into stage nf; the boundary itself (end of forward + tangents) is a peak candidate;
  - backward outputs are S[t,d] = 1 from the stage after their producer's on: once made, a
    gradient stays until the backward returns it (the simulator's rule); a node remade for
    another output may rewrite it, counted twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from rkgraph.graph import RematGraph
from solvers.schedule import Schedule
from solvers.simulate import schedule_from_computes

log = logging.getLogger(__name__)

# Memory is expressed in units of budget / MEMORY_UNITS (at least one byte), so that the
# model's coefficients stay small integers whatever the model size.
MEMORY_UNITS = 10_000
# Beyond this many nodes Checkmate's MILP (about n^2 / 2 binaries for R alone) takes longer to
# build than the other searches take to answer, and gigabytes to hold, and HiGHS finds nothing
# better in a minute: the portfolio builds it neither for a whole graph that has a chain of
# blocks nor for one block of that chain.
MILP_MAX_NODES = 200


def memory_unit(budget: int) -> int:
    return max(1, budget // MEMORY_UNITS)

# Share of HiGHS's MIP effort spent in primal heuristics (default 0.05). The flat model's hard
# part is finding good schedules, not bounds (benchmarks/data/checkmate-graphs/README.md): with
# more effort there HiGHS improves on warm starts that at the default it never leaves.
HEURISTIC_EFFORT = 0.3


@dataclass
class MilpResult:
    status: str  # HiGHS model status, e.g. "Optimal", "Time limit reached", "Infeasible"
    stages: list[list[int]] | None  # node indices computed per stage, None if no incumbent
    objective: float | None  # objective of the incumbent (time, or peak units)
    dual_bound: float | None  # proven lower bound on the objective
    gap: float | None
    binaries: int


class MilpBuilder:
    """Columns and rows accumulated as flat arrays (COO), handed to HiGHS in one passModel."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.coo_row: list[int] = []
        self.coo_col: list[int] = []
        self.coo_val: list[float] = []

    def var(self, lower: float, upper: float, cost: float = 0.0, integer: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.lower) - 1

    def row(self, cols: Sequence[int], vals: Sequence[float], lower: float, upper: float) -> None:
        r = len(self.row_lower)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.coo_row.extend([r] * len(cols))
        self.coo_col.extend(cols)
        self.coo_val.extend(vals)

    def highs(self) -> highspy._Highs:
        """The model in a HiGHS instance that prints nothing.

        HiGHS's core object, not `highspy.Highs`: that wrapper enables callbacks as it is
        constructed, and HiGHS then prints its banner on stdout (once per process) before any
        option can be set. No callback is used here."""
        lp = highspy.HighsLp()
        lp.num_col_ = len(self.lower)
        lp.num_row_ = len(self.row_lower)
        lp.col_cost_ = np.array(self.cost, dtype=np.float64)
        lp.col_lower_ = np.array(self.lower, dtype=np.float64)
        lp.col_upper_ = np.array(self.upper, dtype=np.float64)
        lp.row_lower_ = np.array(self.row_lower, dtype=np.float64)
        lp.row_upper_ = np.array(self.row_upper, dtype=np.float64)
        cols = np.array(self.coo_col, dtype=np.int64)
        order = np.argsort(cols, kind="stable")
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.searchsorted(cols[order], np.arange(lp.num_col_ + 1)).astype(np.int32)
        lp.a_matrix_.index_ = np.array(self.coo_row, dtype=np.int32)[order]
        lp.a_matrix_.value_ = np.array(self.coo_val, dtype=np.float64)[order]
        lp.a_matrix_.num_col_ = lp.num_col_
        lp.a_matrix_.num_row_ = lp.num_row_
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in self.integer]
        h = highspy._Highs()
        h.setOptionValue("output_flag", False)
        h.passModel(lp)
        return h


class CheckmateMilp:
    """The model for one graph and one memory unit. `budget_units=None` minimises the peak
    instead of the time (used to find the smallest feasible budget)."""

    def __init__(self, graph: RematGraph, unit: int, budget_units: int | None) -> None:
        self.graph = graph
        self.unit = unit
        self.budget_units = budget_units
        n = len(graph.nodes)
        nf = len(graph.forward_nodes)
        self.n, self.nf = n, nf
        b = MilpBuilder()
        size = {d: math.ceil(dn.size / unit) for d, dn in graph.data.items() if not graph.is_source(d)}
        producer = {d: graph.index[dn.producer] for d, dn in graph.data.items()
                    if dn.producer is not None}
        tangents = graph.tangents
        tangent_set = set(tangents)
        readers: dict[str, list[int]] = {d: [] for d in size}
        for k, node in enumerate(graph.nodes):
            for d in dict.fromkeys(node.inputs):
                if d in readers:
                    readers[d].append(k)
        forward_outputs = {d for d in graph.forward_outputs if d in size}
        user_outputs = {d for d in graph.user_outputs if d in size}
        backward_outputs = {d for d in graph.backward_outputs if d in size}
        useful = {d for d in size if readers[d] or d in forward_outputs or d in backward_outputs}

        self.peak_var = None if budget_units is not None else b.var(0, math.inf, 1.0)
        cap = math.inf if budget_units is None else float(budget_units)
        time_cost = 1.0 if budget_units is not None else 0.0

        # R[t, i]
        self.R: dict[tuple[int, int], int] = {}
        for t in range(n):
            for i in range(t + 1):
                node = graph.nodes[i]
                if i == t:
                    self.R[t, i] = b.var(1, 1, time_cost * node.time, True)
                elif not node.random:
                    self.R[t, i] = b.var(0, 1, time_cost * node.time, True)
        # S[t, d], t = 1..n; tangents from nf
        self.S: dict[tuple[int, str], int] = {}
        for t in range(1, n + 1):
            for d in useful:
                held = d in backward_outputs or d in user_outputs
                if d in producer and producer[d] < t and (t < n or held):
                    # The user holds the outputs returned to them until the step ends; a
                    # gradient, once made, stays until the backward returns it (as in the
                    # simulator; dropping one and making it again undercounted memory).
                    fixed = t == n or (t >= nf and d in user_outputs) or d in backward_outputs
                    self.S[t, d] = b.var(1 if fixed else 0, 1, 0.0, True)
        # Tangents are held by autograd's call of our backward until it returns.
        for d in tangents:
            for t in range(nf, n):
                self.S[t, d] = b.var(1, 1, 0.0, True)
        self.binaries = len(self.R) + len(self.S)

        for t in range(n):
            # Dependencies: a node runs only if each input is kept or made earlier in the stage.
            for i in range(t + 1):
                if (t, i) not in self.R:
                    continue
                for d in dict.fromkeys(graph.nodes[i].inputs):
                    if d not in size:
                        continue
                    cols, vals = [self.R[t, i]], [1.0]
                    for c in (self.S.get((t, d)), self.R.get((t, producer.get(d, -1)))):
                        if c is not None:
                            cols.append(c)
                            vals.append(-1.0)
                    b.row(cols, vals, -math.inf, 0.0)
            # Keeping d into stage t+1 needs d alive in stage t; never recompute what is kept.
            for d in size:
                made = self.R.get((t, producer[d])) if d in producer else None
                kept = self.S.get((t, d))
                if (t + 1, d) in self.S and not (d in tangents and t + 1 == nf):
                    cols, vals = [self.S[t + 1, d]], [1.0]
                    for c in (made, kept):
                        if c is not None:
                            cols.append(c)
                            vals.append(-1.0)
                    b.row(cols, vals, -math.inf, 0.0)
                if made is not None and kept is not None and d not in backward_outputs:
                    # (A node remade for another output may rewrite a held gradient: its
                    # output is then counted twice, which only errs on the safe side.)
                    b.row([made, kept], [1.0, 1.0], -math.inf, 1.0)
                if t == nf - 1 and d in forward_outputs:  # alive at the end of the forward phase
                    present = [c for c in (made, kept) if c is not None]
                    b.row(present, [1.0] * len(present), 1.0, math.inf)

        # Frees and memory, stage by stage.
        self.U: dict[tuple[int, int], int] = {}
        for t in range(n):
            frees_at: dict[int, list[tuple[int, int]]] = {}  # step k -> [(F column, size)]
            for d in size:
                if ((t == n - 1 and d in backward_outputs) or (t == nf - 1 and d in forward_outputs)
                        or (t >= nf - 1 and d in user_outputs) or d in tangent_set):
                    continue  # required alive at the end of this stage
                steps = [k for k in readers[d] if k <= t and (t, k) in self.R]
                if d in producer and (t, producer[d]) in self.R:
                    steps.insert(0, producer[d])
                for k in steps:
                    f = b.var(0, 1)
                    frees_at.setdefault(k, []).append((f, size[d]))
                    b.row([f, self.R[t, k]], [1.0, -1.0], -math.inf, 0.0)
                    if (t + 1, d) in self.S:
                        b.row([f, self.S[t + 1, d]], [1.0, 1.0], -math.inf, 1.0)
                    for j in readers[d]:
                        if k < j <= t and (t, j) in self.R:
                            b.row([f, self.R[t, j]], [1.0, 1.0], -math.inf, 1.0)
            start_cols = [self.S[t, d] for d in size if (t, d) in self.S]
            start_vals = [float(size[d]) for d in size if (t, d) in self.S]
            prev: int | None = None
            for k in range(t + 1):
                if (t, k) not in self.R:
                    continue
                node = graph.nodes[k]
                out = float(sum(size[d] for d in node.outputs))
                step = out + math.ceil(node.workspace / unit)
                base_cols, base_vals = ([prev], [1.0]) if prev is not None else (start_cols, start_vals)
                # Peak during step k.
                cols = [*base_cols, self.R[t, k]]
                vals = [*base_vals, step]
                if self.peak_var is not None:
                    b.row([*cols, self.peak_var], [*vals, -1.0], -math.inf, 0.0)
                else:
                    b.row(cols, vals, -math.inf, cap)
                # Memory after step k and its frees.
                u = b.var(0, math.inf)
                frees = frees_at.get(k, [])
                b.row([u, *base_cols, self.R[t, k], *(f for f, _ in frees)],
                      [1.0, *(-v for v in base_vals), -out, *(float(s) for _, s in frees)], 0.0, 0.0)
                self.U[t, k] = u
                prev = u
            if t == nf - 1 and tangents and prev is not None:
                # Phase boundary: what the forward leaves alive plus the tangents.
                extra = float(sum(size[d] for d in tangents))
                if self.peak_var is not None:
                    b.row([prev, self.peak_var], [1.0, -1.0], -math.inf, -extra)
                else:
                    b.row([prev], [1.0], -math.inf, cap - extra)
        self.size = size
        self.highs = b.highs()
        self.col_lower = b.lower

    def add_time_floor(self, floor: float) -> None:
        """Total time >= `floor`, a proven bound (solvers.bounds.time_lower_bound): HiGHS's
        own bound starts there, so the gap closes as soon as a schedule near it is found."""
        cols = np.array(list(self.R.values()), dtype=np.int32)
        costs = np.array([self.graph.nodes[i].time for _, i in self.R], dtype=np.float64)
        self.highs.addRow(floor * (1 - 1e-9), math.inf, len(cols), cols, costs)

    def warm_start(self, computes: Sequence[str]) -> bool:
        """Hand HiGHS a starting point: R and S of a known schedule (HiGHS completes F and U
        with an LP), its compute sequence put in stage form (`stages_of`). Returns whether
        HiGHS accepted it (False when the sequence has no stage form, or that form does not
        fit: putting recomputations in index order can raise the peak)."""
        graph = self.graph
        stages = stages_of(graph, computes)
        if stages is None:
            return False
        staged = schedule_from_computes(graph, [graph.nodes[i].name for stage in stages for i in stage],
                                        sum(map(len, stages[:self.nf])), solver="warm start")
        if self.budget_units is not None and staged.predicted_peak > self.budget_units * self.unit:
            return False
        alive = alive_at_stage_starts(graph, staged, stages)
        index, value = [], []
        chosen = {(t, i) for t, stage in enumerate(stages) for i in stage}
        for key, col in self.R.items():
            index.append(col)
            value.append(1.0 if key in chosen else 0.0)
        for (t, d), col in self.S.items():
            index.append(col)
            value.append(max(self.col_lower[col], 1.0 if d in alive[t] else 0.0))
        status = self.highs.setSolution(len(index), np.array(index, dtype=np.int32),
                                        np.array(value, dtype=np.float64))
        return status == highspy.HighsStatus.kOk

    def solve(self, time_limit: float, mip_rel_gap: float) -> MilpResult:
        h = self.highs
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("mip_heuristic_effort", HEURISTIC_EFFORT)
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        info = h.getInfo()
        if info.primal_solution_status != 2:  # 2 = feasible
            log.debug("MILP: %s without incumbent", status)
            return MilpResult(status, None, None, _finite(info.mip_dual_bound), None, self.binaries)
        x = np.asarray(h.getSolution().col_value)
        stages: list[list[int]] = [[] for _ in range(self.n)]
        for (t, i), col in sorted(self.R.items()):
            if x[col] > 0.5:
                stages[t].append(i)
        return MilpResult(status, stages, info.objective_function_value, _finite(info.mip_dual_bound),
                          info.mip_gap, self.binaries)


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def stages_of(graph: RematGraph, computes: Sequence[str]) -> list[list[int]] | None:
    """Split a compute sequence into frontier-advancing stages: stage t ends with node t's
    first computation, after the recomputations run since node t-1's. Those are put in index
    order (a topological order; the MILP's), once each: DTR recomputes on demand, in the order
    an op asks for its inputs, and its schedules must still warm-start the MILP. None when a
    node is first computed out of graph order or a random node is recomputed."""
    stages: list[list[int]] = []
    current: set[int] = set()
    for name in computes:
        i = graph.index[name]
        if i == len(stages):
            stages.append([*sorted(current), i])
            current = set()
        elif i < len(stages) and not graph.nodes[i].random:
            current.add(i)
        else:
            return None
    return stages if len(stages) == len(graph.nodes) and not current else None


def alive_at_stage_starts(graph: RematGraph, schedule: Schedule, stages: list[list[int]]) -> list[set[str]]:
    """Non-source data alive before the first op of each stage (and at the end), for S."""
    starts = set(np.cumsum([0] + [len(s) for s in stages[:-1]]).tolist())
    alive: set[str] = set()
    result: list[set[str]] = []
    computed = 0
    for i, op in enumerate(schedule.ops):
        if i == schedule.forward_length:
            alive |= set(graph.tangents)
        if op.kind == "compute":
            if computed in starts:
                result.append(set(alive))
            computed += 1
            alive |= {d for d in graph.node(op.name).outputs if not graph.is_source(d)}
        else:
            alive.discard(op.name)
    result.append(alive)
    return result
