"""The cheap schedules every planner starts from: DTR's variants and the greedy heuristic.

Each takes a fraction of a second to a few seconds, fits budgets down to near the floor, and
wins somewhere: DTR on most flat graphs, its next-use variant where staleness misleads it
(fcn8 at 0.62: 3.1% against 4.5%), DTR evicting the largest first where both give up
(ResNet at 0.35), greedy checkpoints on some chains. The MILPs start from the best of them.
"""

from __future__ import annotations

from rkgraph.graph import RematGraph
from solvers.dtr import solve_dtr
from solvers.greedy_checkpoints import solve_greedy_checkpoints
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget

DTR_HEURISTICS = ("dtr", "next_use", "size")


def heuristic_candidates(graph: RematGraph, budget: int, greedy_time_limit: float) -> list[Schedule]:
    """The schedules of DTR_HEURISTICS and of the greedy heuristic that fit `budget`."""
    attempts = [lambda h=h: solve_dtr(graph, budget, heuristic=h) for h in DTR_HEURISTICS]
    attempts.append(lambda: solve_greedy_checkpoints(graph, budget, time_limit=greedy_time_limit))
    found = []
    for attempt in attempts:
        try:
            found.append(attempt())
        except InfeasibleBudget:
            pass
    return found
