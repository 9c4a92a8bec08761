"""`solve_rotor`: Beaumont et al., "Optimal checkpointing for heterogeneous chains" (rotor).

Rotor's only option per block is "store everything inside the block": each block is either
kept whole for its backward or run again from its input (`solvers.chain` holds the chain and
its dynamic program; Rockmate feeds the same program several options per block).
"""

from __future__ import annotations

import time

from rkgraph.graph import RematGraph
from solvers.chain import build_chain, schedule_chain
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget


def solve_rotor(graph: RematGraph, budget: int, slots: int = 500) -> Schedule:
    """Rotor's optimal checkpointing of the chain of blocks (whole blocks kept or recomputed).
    Raises InfeasibleBudget when no plan of the chain fits."""
    start = time.perf_counter()
    schedule = schedule_chain(graph, build_chain(graph), budget, slots, "rotor")
    if schedule is None:
        raise InfeasibleBudget(f"rotor: no checkpointing of the chain of blocks fits {budget} bytes")
    schedule.solve_time = time.perf_counter() - start
    return schedule
