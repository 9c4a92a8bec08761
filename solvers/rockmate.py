"""`solve_rockmate`, the default solver: Rockmate (Zhao et al., ICML 2023).

A flat MILP over a whole model is quadratic in its size; a chain of identical blocks is not.
So each distinct block (its forward nodes and the backward nodes that differentiate them, see
`solvers.rotor.block_subgraph`) is solved with Checkmate's MILP for a small grid of budgets on
its peak and on what its forward keeps for its backward. Each solution is an option: a forward
sequence, a backward sequence (with its recomputations) and the memory and time of both.
Rotor's dynamic program then picks one option per block and the checkpointing between blocks. The
heuristics' schedules that fit (DTR's, ...) are cut per block into more options: they treat
identical layers differently, and the program can mix their treatments.

The result is replayed by the simulator like every schedule. When the graph has no chain (one
block), or is small enough for the flat MILP to help (FLAT_ILP_MAX_NODES), and nothing found is
within `gap` of the proven floor yet, the flat ILP runs, warm-started from the best schedule. Whatever
happens, the fastest schedule that fits among rockmate's, the flat ILP's and the baselines'
(DTR's included) is returned, so the default is never worse than a baseline.
"""

from __future__ import annotations

import logging
import math
import time

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.bounds import budget_bounds, memory_lower_bound, time_lower_bound
from solvers.candidates import heuristic_candidates
from solvers.greedy_checkpoints import solve_greedy_checkpoints
from solvers.ilp import memory_unit, solve_ilp
from solvers.ilp_model import CheckmateMilp
from solvers.rotor import (
    BlockOption,
    build_chain,
    chain_blocks,
    measure,
    schedule_chain,
    store_all_option,
    undominated,
)
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget

log = logging.getLogger(__name__)

# Grid of block budgets, as fractions of the range between the block's least and most memory:
# the peak over the whole block, and what its forward keeps for its backward.
PEAK_FRACTIONS = (0.1, 0.5, 1.0)
KEPT_FRACTIONS = (0.1, 0.5)
BLOCK_GAP = 0.02  # relative MIP gap of a block solve: options need not be exactly optimal
# Beyond this many nodes the flat MILP (about n^2 / 2 binaries for R alone) is not tried on a
# graph that has a chain of blocks: on GPT-2 small (683 nodes) building it took 20 s and HiGHS
# found nothing in 60 s, while the chain and the heuristics answered in 5 s.
FLAT_ILP_MAX_NODES = 200
FLAT_ILP_MIN_LOOK = 3.0  # seconds
CHAIN_MIN_TIME = 0.5  # seconds


def _option_of(sub: RematGraph, schedule: Schedule, source: str) -> BlockOption:
    return measure(sub, schedule.computes(), schedule.forward_count, source)


def block_options(sub: RematGraph, time_limit: float) -> tuple[list[BlockOption], int]:
    """(options, MILP solves) for one block graph: store-all, checkpoint (forward again in the
    backward) and the MILP's schedules over the budget grid, dominated options removed."""
    forward = [n.name for n in sub.forward_nodes]
    store_all = store_all_option(sub)
    recompute = measure(sub, [*forward, *forward, *(n.name for n in sub.backward_nodes)], len(forward),
                        "checkpoint")
    options = [store_all, recompute]
    # HiGHS finds bounds fast but good schedules slowly: each solve starts from the fastest
    # known option that fits its budgets, so a short time limit still yields a good option.
    lowest = memory_lower_bound(sub)[0]
    highest = max(store_all.forward_peak, store_all.backward_peak)
    nf = len(forward)
    solves = 0
    deadline = time.perf_counter() + time_limit
    for peak_fraction in PEAK_FRACTIONS:
        peak = int(lowest + peak_fraction * (highest - lowest))
        unit = memory_unit(peak)
        try:
            options.append(_option_of(sub, solve_greedy_checkpoints(sub, peak, time_limit=time_limit / 10),
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


def solve_rockmate(graph: RematGraph, budget: int, time_limit: float = 60.0, slots: int = 500,
                   block_time_limit: float = 1.0, gap: float = 0.01, **_: object) -> Schedule:
    """Fastest schedule found within `budget` bytes, in about `time_limit` seconds (more only
    when nothing fits yet); `block_time_limit` bounds the MILP solves of one distinct block.
    The search stops as soon as a schedule is within `gap` (relative) of the proven lower
    bound on time. Raises InfeasibleBudget, with the smallest feasible budget in the message,
    when nothing fits."""
    start = time.perf_counter()
    bounds = budget_bounds(graph)
    if budget < bounds.lower:
        raise InfeasibleBudget(f"budget {budget} bytes ({format_bytes(budget)}) is too small: {bounds.describe()}")
    floor = time_lower_bound(graph, budget)[0]
    candidates = [s for s in bounds.candidates if s.predicted_peak <= budget]
    extra: dict[str, object] = {}

    def searching() -> bool:
        return not candidates or min(s.predicted_time for s in candidates) > floor * (1 + gap)

    store_all = next(s for s in bounds.candidates if s.solver == "store_all")
    if store_all.predicted_peak > budget:
        # The heuristics first: they take a fraction of a second and often meet the bound
        # (GPT-2 small at 0.95 down to the minimum: DTR is rockmate's answer at every budget),
        # and they beat the chain plan where the chain model is coarse.
        candidates += heuristic_candidates(graph, budget, time_limit=min(3.0, 0.8 * time_limit),
                                           good_enough=floor * (1 + gap), known=candidates)
        forward_blocks, _ = chain_blocks(graph)
        # The chain stage takes a while even when its MILPs get no time (segnet, 32 distinct
        # blocks of a node or two: 0.3 s): when something fits, it needs CHAIN_MIN_TIME and a
        # fifth of the limit left.
        time_left = time_limit - (time.perf_counter() - start)
        chain_time = not candidates or time_left > max(CHAIN_MIN_TIME, 0.2 * time_limit)
        if searching() and len(forward_blocks) > 1 and chain_time:
            solves = 0

            def options(sub: RematGraph) -> list[BlockOption]:
                nonlocal solves
                # Within the caller's time limit: late blocks get less, at worst no MILP solve.
                left = time_limit - (time.perf_counter() - start)
                found, count = block_options(sub, min(block_time_limit, max(0.0, left / 4)))
                solves += count
                return found

            # The heuristics' schedules, cut per block, are options too (see build_chain).
            chain = build_chain(graph, options, schedules=candidates)
            chained = schedule_chain(graph, chain, budget, slots, "rockmate")
            rotor = schedule_chain(graph, build_chain(graph), budget, slots, "rotor")
            candidates += [s for s in (chained, rotor) if s is not None]
            extra.update({"blocks": len(chain.blocks), "distinct_blocks": chain.distinct, "ilp_solves": solves,
                          "options_per_block": [len(b.options) for b in chain.blocks]})
        remaining = time_limit - (time.perf_counter() - start)
        # A flat MILP's look shorter than FLAT_ILP_MIN_LOOK never improved a schedule found, and
        # takes longer than its limit (mobilenet, 185 nodes: 1 s to build, HiGHS's presolve
        # runs 0.8 s past its limit).
        if (searching() and (len(forward_blocks) <= 1 or len(graph.nodes) <= FLAT_ILP_MAX_NODES)
                and (not candidates or remaining > FLAT_ILP_MIN_LOOK)):
            remaining = max(1.0, remaining)
            if candidates:
                # Something already fits: the flat MILP rarely improves on it on whole models
                # (GPT at 0.35 spent 63 s for nothing), so it only gets a short look, from it.
                remaining = min(remaining, max(FLAT_ILP_MIN_LOOK, 0.1 * time_limit))
            candidates.append(solve_ilp(graph, budget, time_limit=remaining, mip_rel_gap=gap, known=candidates))
    if not candidates:
        raise InfeasibleBudget(f"no schedule found within {budget} bytes ({format_bytes(budget)}); "
                               f"{bounds.describe()}")
    best = min(candidates, key=lambda s: (s.predicted_time, s.predicted_peak))
    extra["schedule_from"] = best.solver
    for key in ("status", "binaries"):
        if key in best.extra:
            extra[key] = best.extra[key]
    lower_bound = min(max(floor, best.lower_bound or 0.0), best.predicted_time)
    schedule = Schedule(best.ops, best.forward_length, solver="rockmate", budget=budget,
                        predicted_peak=best.predicted_peak, predicted_time=best.predicted_time,
                        lower_bound=lower_bound,
                        gap=(best.predicted_time - lower_bound) / best.predicted_time if best.predicted_time else 0.0,
                        extra=extra)
    schedule.solve_time = time.perf_counter() - start
    return schedule
