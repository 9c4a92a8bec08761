"""Heuristic: the minimum-memory schedule plus as many checkpoints as the budget allows.

Start from `min_memory_schedule` (every forward activation recomputed from sources and kept
values whenever it is read, in the forward phase too or only in the backward) and greedily
keep forward activations, best time saved per byte first, while the schedule still fits.
It is cheap (two simulations per candidate and family) and fits budgets down to the floor,
which the segment baselines cannot: the ILP uses it as a warm start at tight budgets, where
HiGHS alone struggles to find any good schedule.
"""

from __future__ import annotations

import time

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.bounds import min_memory_length, min_memory_schedule
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, simulate

NAME = "greedy_checkpoints"
# A family whose minimum-memory schedule lists more computations than this is not tried. That
# schedule is quadratic in the graph's depth, each trial of the search rebuilds one about as
# long, and the time limit cannot stop a build: a deep recurrent network's takes longer than the
# whole limit, and a schedule recomputing the forward hundreds of times is never the plan. This
# many take a second or two to build.
MAX_COMPUTES = 200_000


Measured = dict[tuple[bool, str], tuple[int, float]]  # (forward_once, checkpoint) -> (peak, time) of it alone


def _greedy(graph: RematGraph, budget: int | None, forward_once: bool, deadline: float,
            alone: Measured) -> Schedule | None:
    """Greedy checkpoint selection within one schedule family (see `min_memory_schedule`); None
    where its schedules are too long to build (`MAX_COMPUTES`)."""
    if min_memory_length(graph, forward_once=forward_once) > MAX_COMPUTES:
        return None
    def build(checkpoints: list[str]) -> Schedule:
        return min_memory_schedule(graph, checkpoints, solver=NAME, forward_once=forward_once)

    def fits(peak: int) -> bool:
        return budget is None or peak <= budget

    best = build([])
    candidates = [d for node in graph.forward_nodes if not node.random for d in node.outputs
                  if not graph.is_source(d) and graph.data[d].size > 0]
    gains: dict[str, float] = {}
    # (peak, time) of each checkpoint alone, whatever the budget: until one is kept, the trials
    # below are these very schedules, so they are built again only when they fit (at tight
    # budgets, almost none do).
    for d in candidates:
        if (forward_once, d) not in alone:
            if time.perf_counter() > deadline:
                break
            single = build([d])
            alone[forward_once, d] = (single.predicted_peak, single.predicted_time)
        saved = best.predicted_time - alone[forward_once, d][1]
        if saved > 0:
            gains[d] = saved / graph.data[d].size
    kept: list[str] = []
    for d in sorted(gains, key=gains.__getitem__, reverse=True):
        if time.perf_counter() > deadline:
            break
        peak, took = alone[forward_once, d]
        if not kept and not (fits(peak) and took < best.predicted_time):
            continue
        trial = build([*kept, d])
        if fits(trial.predicted_peak) and trial.predicted_time < best.predicted_time:
            kept.append(d)
            best = trial
    best.extra = {"checkpoints": kept, "forward_once": forward_once}
    return best


def solve_greedy_checkpoints(graph: RematGraph, budget: int | None = None, time_limit: float = 10.0,
                             measured: Measured | None = None) -> Schedule:
    """Best of two families: recompute forward activations in the forward phase too (fits the
    tightest budgets) or run the forward once (much faster when it fits). `time_limit` caps the
    search (the best schedule so far is returned). Raises
    InfeasibleBudget if no schedule of either family fits. A caller that solves one graph at
    several budgets passes the same `measured` (empty at first) to each call: the schedules
    keeping one checkpoint do not depend on the budget, and they are most of the work."""
    start = time.perf_counter()
    measured = {} if measured is None else measured
    results, tried = [], False
    for i, forward_once in enumerate((True, False)):
        family = _greedy(graph, budget, forward_once, start + time_limit * (i + 1) / 2, measured)
        tried = tried or family is not None
        if family is not None and (budget is None or family.predicted_peak <= budget):
            results.append(family)
    if not tried:
        raise InfeasibleBudget(f"greedy checkpoints not tried: the minimum-memory schedules of this graph run "
                               f"more than {MAX_COMPUTES} computations (quadratic in its depth)")
    if not results:
        raise InfeasibleBudget(f"budget {budget} bytes ({format_bytes(budget or 0)}) is below the "
                               "peak of the minimum-memory schedule")
    best = min(results, key=lambda s: s.predicted_time)
    simulate(graph, best, budget)
    best.budget = budget
    best.solve_time = time.perf_counter() - start
    return best
