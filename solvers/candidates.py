"""The cheap schedules every planner starts from: DTR's variants, the saved-values MILP, peak
shaving and greedy checkpoints.

Each takes a fraction of a second to a few seconds and wins somewhere: DTR on many flat graphs,
its next-use variant where staleness misleads it (fcn8 at 0.62: 3.1% against 4.5%), DTR
evicting the largest first where both give up (ResNet at 0.35), peak shaving where a few
backward steps are tight (fcn8 at 0.70: 0.89%, the proven floor, against DTR's 3.04%), greedy
checkpoints near the smallest budgets, where the others cannot fit, DTR keeping what random ops
drew where it would otherwise redraw dropout masks (GPT at 0.35: +13.6% against +20.0%), the
saved-values MILP where the backward's first steps are tight (GPT at 0.5: +7.74% against
DTR's +8.8%). The MILPs start from the best of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rkgraph.graph import RematGraph
from solvers.dtr import solve_dtr
from solvers.greedy_checkpoints import solve_greedy_checkpoints
from solvers.peak_shaving import solve_peak_shaving
from solvers.saved_values import saved_values_attempts
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget

DTR_HEURISTICS = ("dtr", "next_use", "size")
SHAVING_SHARE = 0.85  # of the time left after DTR: peak shaving (six starts), then greedy checkpoints
GREEDY_SHARE = 0.1  # of the time limit, for greedy checkpoints when peak shaving wins


def heuristic_candidates(graph: RematGraph, budget: int, time_limit: float,
                         good_enough: float = 0.0, known: Sequence[Schedule] = ()) -> list[Schedule]:
    """The schedules of DTR_HEURISTICS, saved values, peak shaving and greedy checkpoints that fit `budget`,
    found within about `time_limit` seconds. The last two run only while the best so far takes
    longer than `good_enough` (a proven floor plus the caller's gap).

    Peak shaving starts from DTR's and saved values' schedules (those that overshoot too) and
    from `known` checkpointing schedules that fit (the baselines): however slow a start, its
    drops may lead elsewhere. From checkpointing
    every block (+33.3%) it reaches fcn8 at 0.62's floor, +2.91%, where from DTR's it stops at
    +3.04%."""
    deadline = time.perf_counter() + time_limit
    found = []

    def attempt(solve, *args, **options) -> bool:
        try:
            found.append(solve(graph, budget, *args, **options))
            return True
        except InfeasibleBudget:
            return False

    def searching() -> bool:
        return not found or min(s.predicted_time for s in found) > good_enough

    for heuristic in DTR_HEURISTICS:
        attempt(solve_dtr, heuristic=heuristic)
    if any(node.rng for node in graph.nodes):
        attempt(solve_dtr, heuristic="dtr", keep_drawn=True)
    # What the forward saves, chosen by a small MILP: its attempts that overshoot are starts
    # for peak shaving, the one that fits (the last, if any) a candidate.
    overshooting = []
    for schedule in saved_values_attempts(graph, budget, time_limit=0.2 * time_limit):
        if schedule.predicted_peak <= budget:
            schedule.budget = budget
            found.append(schedule)
        else:
            overshooting.append(schedule)
    # Not the minimum-memory schedule (its hundreds of drops take the undo seconds, for
    # nothing): only known schedules that run at most the forward again, the checkpoints.
    once = sum(n.time for n in graph.nodes)
    seeds = [*found, *overshooting, *(s for s in known if s.predicted_peak <= budget and s.predicted_time <= 2 * once)]
    shaved = (searching() and attempt(solve_peak_shaving, good_enough=good_enough, seeds=seeds,
                                      time_limit=SHAVING_SHARE * max(0.0, deadline - time.perf_counter()))
              and min(found, key=lambda s: s.predicted_time).solver == "peak_shaving")
    if searching():
        # Greedy checkpoints win near the smallest budgets, where peak shaving does not fit or
        # DTR beats it; where peak shaving wins, greedy rarely helps (mobilenet at 0.90: 2.4 s
        # for nothing).
        left = max(0.0, deadline - time.perf_counter())
        attempt(solve_greedy_checkpoints, time_limit=min(left, GREEDY_SHARE * time_limit) if shaved else left)
    return found
