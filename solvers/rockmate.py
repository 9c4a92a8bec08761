"""Rockmate's plan of a chain of blocks (Zhao et al., ICML 2023).

A flat MILP over a whole model is quadratic in its size; a chain of identical blocks is not.
So each distinct block (its forward nodes and the backward nodes that differentiate them, see
`solvers.chain.block_subgraph`) is solved with Checkmate's MILP for a small grid of budgets on
its peak and on what its forward keeps for its backward. Each solution is an option: a forward
sequence, a backward sequence (with its recomputations) and the memory and time of both.
Rotor's dynamic program then picks one option per block and the checkpointing between blocks.
The default planner (`solvers.portfolio.solve_rockmate`) runs this beside the heuristics and
the flat MILP and keeps the fastest schedule.
"""

from __future__ import annotations

import math
import time

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.bounds import backward_step_floor, memory_lower_bound, needed_nodes
from solvers.chain import (
    BlockOption,
    build_chain,
    chain_fits_model,
    measure,
    schedule_chain,
    store_all_option,
    undominated,
)
from solvers.greedy_checkpoints import Measured, solve_greedy_checkpoints
from solvers.ilp_model import MILP_MAX_NODES, CheckmateMilp, memory_unit
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget

# Grid of block budgets, as fractions of the range between the block's least and most memory:
# the peak over the whole block, and what its forward keeps for its backward.
PEAK_FRACTIONS = (0.1, 0.5, 1.0)
KEPT_FRACTIONS = (0.1, 0.5)
BLOCK_GAP = 0.02  # relative MIP gap of a block solve: options need not be exactly optimal


def _option_of(sub: RematGraph, schedule: Schedule, source: str) -> BlockOption:
    return measure(sub, schedule.computes(), schedule.forward_count, source)


def block_options(sub: RematGraph, time_limit: float) -> tuple[list[BlockOption], int]:
    """(options, MILP solves) for one block graph: store-all, checkpoint (forward again in the
    backward) and the MILP's and greedy checkpoints' schedules over the budget grid, dominated
    options removed. A block of more than MILP_MAX_NODES nodes (a whole decoder that the chain
    could not cut) gets the first two only: its MILP would take gigabytes and longer than its
    time to build, and greedy checkpoints' minimum-memory schedules are quadratic in its depth
    (seconds each); the heuristics' schedules, cut per block, are its other options."""
    forward = [n.name for n in sub.forward_nodes]
    store_all = store_all_option(sub)
    recompute = measure(sub, [*forward, *forward, *(n.name for n in sub.backward_nodes)], len(forward),
                        "checkpoint")
    options = [store_all, recompute]
    if len(sub.nodes) > MILP_MAX_NODES:
        return undominated(options), 0
    # HiGHS finds bounds fast but good schedules slowly: each solve starts from the fastest
    # known option that fits its budgets, so a short time limit still yields a good option.
    lowest = memory_lower_bound(sub)[0]
    highest = max(store_all.forward_peak, store_all.backward_peak)
    nf = len(forward)
    solves = 0
    deadline = time.perf_counter() + time_limit
    measured: Measured = {}  # greedy checkpoints' budget-free builds, shared by the grid
    for peak_fraction in PEAK_FRACTIONS:
        peak = int(lowest + peak_fraction * (highest - lowest))
        unit = memory_unit(peak)
        try:
            options.append(_option_of(sub, solve_greedy_checkpoints(sub, peak, time_limit=time_limit / 10,
                                                                   measured=measured),
                                      f"greedy peak {format_bytes(peak)}"))
        except InfeasibleBudget:
            pass
        for kept_fraction in KEPT_FRACTIONS:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            kept = int(recompute.kept + kept_fraction * (store_all.kept - recompute.kept))
            # The model rounds each size up a unit: allow one unit per value, or the options
            # that fit in bytes (the warm starts) do not fit the model. Options are measured.
            slack = len(sub.data)
            model = CheckmateMilp(sub, unit, peak // unit + slack)
            # Memory after the last forward step, frees included, is what the forward keeps.
            model.highs.addRow(-math.inf, float(kept // unit + slack), 1, [model.U[nf - 1, nf - 1]], [1.0])
            fitting = [o for o in options if o.kept <= kept and max(o.forward_peak, o.backward_peak) <= peak]
            if fitting:
                start = min(fitting, key=lambda o: o.forward_time + o.backward_time)
                model.warm_start([*start.forward, *start.backward])
            result = model.solve(min(remaining, time_limit / len(PEAK_FRACTIONS) / len(KEPT_FRACTIONS)),
                                 BLOCK_GAP)
            solves += 1
            if result.stages is None:
                continue
            computes = [sub.nodes[i].name for stage in result.stages for i in stage]
            options.append(measure(sub, computes, sum(map(len, result.stages[:nf])),
                                   f"ilp peak {format_bytes(peak)} kept {format_bytes(kept)}"))
    return undominated(options), solves


def least_memory_option(sub: RematGraph) -> list[BlockOption]:
    """One option of a block graph that needs no more memory than any schedule of it: nothing
    kept, no forward peak, the backward peak its steps force in every schedule
    (`solvers.bounds.backward_step_floor`), and as its backward only the backward nodes every
    schedule runs there (the chain reads the block's input for it only if one of them does).
    It exists only to say where no real option can fit (`chain_schedules`): no schedule runs it."""
    needed = needed_nodes(sub)
    backward = [n.name for n in sub.backward_nodes if n.name in needed]
    return [BlockOption([], backward, 0.0, 0.0, 0, 0, backward_step_floor(sub), "least memory")]


def chain_schedules(graph: RematGraph, budget: int, known: list[Schedule], time_limit: float,
                    block_time_limit: float = 1.0, slots: int = 500) -> tuple[list[Schedule], dict[str, object]]:
    """Rockmate's plan of the chain of blocks and rotor's, those that fit `budget`, found in
    about `time_limit` seconds (late blocks get less, at worst no MILP solve), with what the
    search did. `known` schedules (the heuristics') are cut per block into more options: they
    treat identical layers differently, and the program can mix their treatments."""
    start = time.perf_counter()
    solves = 0
    # Each block's MILPs take seconds: first ask whether any plan of the chain can fit, with
    # every block at the least memory its schedules need (a fraction of a second). Where the
    # program finds none, neither Rockmate's options nor rotor's can fit.
    least = build_chain(graph, least_memory_option)
    if not chain_fits_model(least, budget, slots):
        return [], {"blocks": len(least.blocks), "distinct_blocks": least.distinct, "ilp_solves": 0,
                    "chain_fits": False}

    def options(sub: RematGraph) -> list[BlockOption]:
        nonlocal solves
        left = time_limit - (time.perf_counter() - start)
        found, count = block_options(sub, min(block_time_limit, max(0.0, left / 4)))
        solves += count
        return found

    chain = build_chain(graph, options, schedules=known)
    chained = schedule_chain(graph, chain, budget, slots, "rockmate")
    rotor = schedule_chain(graph, build_chain(graph), budget, slots, "rotor")
    return [s for s in (chained, rotor) if s is not None], {
        "blocks": len(chain.blocks), "distinct_blocks": chain.distinct, "ilp_solves": solves,
        "options_per_block": [len(b.options) for b in chain.blocks]}
