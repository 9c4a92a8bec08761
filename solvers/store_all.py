"""Baseline: what plain autograd does. Run the graph in order, keep every activation until its
last use, recompute nothing. The fastest schedule, and the reference for memory savings."""

from __future__ import annotations

import time

from rkgraph.graph import RematGraph
from solvers.schedule import Schedule
from solvers.simulate import fixed_schedule


def solve_store_all(graph: RematGraph, budget: int | None = None) -> Schedule:
    """Every node once, in graph order, each value freed after its last use: the fastest
    schedule and the largest peak, the reference of every budget ratio."""
    start = time.perf_counter()
    computes = [n.name for n in graph.nodes]
    schedule = fixed_schedule(graph, computes, len(graph.forward_nodes),
                                      solver="store_all", budget=budget)
    schedule.solve_time = time.perf_counter() - start
    return schedule
