"""`solve_milp`: the time-optimal schedule under a memory budget, by Checkmate's MILP on HiGHS.

(The solver `ilp`, `solvers.portfolio.solve_ilp`, runs it warm-started from the heuristics.)

Around the model (solvers/ilp_model.py) this file does what makes it dependable:
- budgets below the proven floor are refused at once with the floor in the message;
- the best known schedule that fits the budget (the baselines', and the heuristics' that the
  caller passes as `known`: `solvers.portfolio` does) warm-starts HiGHS, so the solver starts
  from a schedule and only has to improve it (the flat MILP's weak point is finding good
  feasible schedules);
- when that schedule is already within the gap of `time_lower_bound` (a combinatorial bound,
  often far tighter than the MILP's own), the MILP is not run at all;
- whatever happens (time limit without incumbent, a model rendered infeasible by rounding
  sizes up), the best schedule that fits is returned: the MILP's if better, else a baseline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.bounds import check_budget, time_lower_bound
from solvers.ilp_model import CheckmateMilp, memory_unit
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, InvalidSchedule, OverBudget, schedule_from_computes

log = logging.getLogger(__name__)

def solve_milp(graph: RematGraph, budget: int, time_limit: float = 60, mip_rel_gap: float = 0.01,
              known: Sequence[Schedule] = (), floor: float | None = None) -> Schedule:
    """Minimise total compute time with peak memory <= budget (bytes).

    `known`: schedules a caller already found for this budget (the heuristics'); the fastest
    that fits starts HiGHS. `floor`: the proven floor on time (`time_lower_bound`), when the
    caller has computed it.

    Returns a schedule validated by the simulator, with `lower_bound` (the MILP's dual bound on
    the time) and `gap`. Raises InfeasibleBudget when the budget is below the proven floor, or
    when no schedule was found and no baseline fits.
    """
    start = time.perf_counter()
    bounds = check_budget(graph, budget)
    candidates = [*bounds.candidates, *known]
    fitting = sorted((s for s in candidates if s.predicted_peak <= budget), key=lambda s: s.predicted_time)
    store_all = next(s for s in candidates if s.solver == "store_all")
    if store_all.predicted_peak <= budget:
        # Nothing recomputed and every needed node run once: no schedule can be faster.
        return _as_ilp_result(store_all, budget, store_all.predicted_time, start,
                              {"status": "Optimal (store-all fits)", "schedule_from": store_all.solver})
    if floor is None:
        floor = time_lower_bound(graph, budget)[0]
    if fitting and fitting[0].predicted_time <= floor * (1 + mip_rel_gap):
        # Within the gap of a proven bound already: the MILP could only confirm it, slowly.
        return _as_ilp_result(fitting[0], budget, floor, start,
                              {"status": "Optimal (meets the lower bound)", "schedule_from": fitting[0].solver})

    unit = memory_unit(budget)
    model = CheckmateMilp(graph, unit, budget // unit)
    model.add_time_floor(floor)
    for schedule in fitting:  # the fastest that HiGHS accepts
        if model.warm_start(schedule.computes()):
            log.info("warm start from %s (time %.4g)", schedule.solver, schedule.predicted_time)
            break
    # Without a schedule that fits, the MILP gets a second at least, whatever building it
    # took; with one, only the limit's rest (on a large graph, building the model takes a good
    # part of a short limit).
    remaining = time_limit - (time.perf_counter() - start)
    result = model.solve(max(remaining, 0.01) if fitting else max(1.0, remaining), mip_rel_gap)
    log.info("MILP %s: %d binaries, objective %s, bound %s", result.status, result.binaries,
             result.objective, result.dual_bound)

    best: Schedule | None = None
    if result.stages is not None:
        nf = len(graph.forward_nodes)
        computes = [graph.nodes[i].name for stage in result.stages for i in stage]
        forward_count = sum(len(stage) for stage in result.stages[:nf])
        try:
            best = schedule_from_computes(graph, computes, forward_count, solver="ilp", budget=budget)
        except OverBudget as error:  # over by what only the simulator counts
            log.info("MILP schedule does not fit: %s", error)
        except InvalidSchedule as error:  # a modelling bug; never hand it to the runtime
            log.error("MILP schedule rejected by the simulator: %s", error)
    if fitting and (best is None or fitting[0].predicted_time < best.predicted_time):
        best = fitting[0]
    if best is None:
        raise InfeasibleBudget(f"no schedule found within {budget} bytes ({format_bytes(budget)}; "
                               f"MILP: {result.status}); {bounds.describe()}")
    extra = {"status": result.status, "binaries": result.binaries, "memory_unit": unit,
             "schedule_from": best.solver}
    return _as_ilp_result(best, budget, max(result.dual_bound or 0.0, floor), start, extra)


def _as_ilp_result(best: Schedule, budget: int, dual_bound: float | None, start: float,
                   extra: dict[str, object]) -> Schedule:
    """The returned schedule: `best`'s ops under the ILP's name, with bound, gap and timing."""
    schedule = Schedule(best.ops, best.forward_length, solver="ilp", budget=budget,
                        predicted_peak=best.predicted_peak, predicted_time=best.predicted_time, extra=extra)
    if dual_bound is not None:
        schedule.lower_bound = min(dual_bound, schedule.predicted_time)
        schedule.gap = ((schedule.predicted_time - schedule.lower_bound) / schedule.predicted_time
                        if schedule.predicted_time > 0 else 0.0)
    schedule.solve_time = time.perf_counter() - start
    return schedule
