"""The default planner, `solve_rockmate`: a portfolio of every strategy, judged by one floor.

Every strategy wins somewhere and none everywhere, so the default runs them cheapest first and
keeps the fastest schedule that fits:
- the heuristics (`heuristic_candidates`), a fraction of a second to a few seconds each: DTR's
  variants (evicting the stalest, the next used, the largest; keeping what random ops drew),
  the saved-values MILP, peak shaving, greedy checkpoints; run again, while none meets the
  floor, on the graph in backward orders that run a branch's last node beside the other
  branch's (`solvers.backward_order`), their schedules replayed on the graph itself, where
  the quick ones (DTR's, saved values) find faster schedules there;
- where those searches found no schedule, Rockmate's chain plan (`solvers.rockmate`): each
  distinct block solved by Checkmate's MILP for a grid of budgets, one option per block
  chosen by rotor's dynamic program; and rotor's own plan of whole blocks. Its plans may run
  a block's nodes out of autograd's order, so below the in-order floor they alone can fit;
  where the heuristics found a schedule, its block MILPs (seconds to tens of seconds on
  models of a few hundred nodes) did not improve on it on the zoo, Hugging Face or
  launch-bound graphs, and are not run;
- where the heuristics found no schedule either, Checkmate's flat MILP (`solvers.ilp.solve_milp`),
  warm-started from the best of the others, on graphs small enough for it or without a chain
  of blocks: where they found one, its look of seconds did not improve on it (Checkmate's
  graphs, the zoo's CNNs).

The proven floor on time (`solvers.bounds.time_lower_bound`) is computed once per plan, here:
the search stops as soon as a schedule is within `gap` of it, and the schedule returned
carries it as `lower_bound` (with the step that sets it in `extra["floor_reason"]`), so that
callers never compute it again. The budget is refused at once, with the smallest feasible
budget, when it is below the proven memory floor (`solvers.bounds.check_budget`), or below
what every member can reach (`BudgetBounds.reachable`: the in-order floor,
`solvers.bounds.in_order_floor`, which every member but the chain's cannot go under, and the
chain's own, `solvers.bounds.chain_order_floor`). Between them only the chain stage runs.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Iterator, Sequence

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.backward_order import delayed_branches
from solvers.bounds import (
    MIN_MEMORY_MARGIN,
    check_budget,
    min_memory_slower_than_store_all,
    min_memory_time_floor,
    time_lower_bound,
)
from solvers.chain import chain_blocks
from solvers.dtr import solve_dtr
from solvers.greedy_checkpoints import solve_greedy_checkpoints
from solvers.ilp import solve_milp
from solvers.ilp_model import MILP_MAX_NODES
from solvers.peak_shaving import solve_peak_shaving
from solvers.rockmate import chain_schedules
from solvers.saved_values import saved_values_attempts
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, InvalidSchedule, schedule_from_computes

DTR_HEURISTICS = ("dtr", "next_use", "size")
QUICK_SEARCHES = ("dtr", "saved_values")  # by schedule's solver: a fraction of a second on most graphs
# Each DTR run's time limit: this share of the heuristics' time, at least DTR_MIN_LOOK seconds.
# Near its floor DTR can thrash for minutes (`solve_dtr`), while the runs that find a schedule
# take a fraction of a second (a few hundred ms on graphs of thousands of nodes).
DTR_SHARE = 0.15
DTR_MIN_LOOK = 1.0  # seconds
SUM_ROUNDING = 1e-9  # relative: far above a sum's rounding, far below any difference a choice turns on
SAVED_VALUES_LOOK = 0.5  # seconds, for the saved-values MILP where DTR already meets the floor
SHAVING_SHARE = 0.85  # of the time left after DTR: peak shaving (six starts), then greedy checkpoints
# Of the heuristics' time, for each other backward order: where an order matters, they often
# meet the floor there at once.
REORDERED_SHARE = 0.5
# A flat MILP's look shorter than this never improved a schedule found, and HiGHS's presolve
# can run past its limit.
FLAT_ILP_MIN_LOOK = 3.0  # seconds
# The heuristics' time: HEURISTICS_TIME, and on larger graphs a second per HEURISTIC_NODES_PER_SECOND
# nodes (within 0.8 of the time limit). A build of peak shaving is linear in the graph, and the
# drops a tight budget needs grow with it: where every op costs about the same (a GPU step bound
# by kernel launches, where a plan recomputes hundreds of small ops), a fixed time left the search
# far above the floor on models of several hundred nodes, while it meets the floor in a fraction
# of that time where a few large ops dominate (it then stops there).
HEURISTICS_TIME = 2.0  # seconds
HEURISTIC_NODES_PER_SECOND = 150
# Peak shaving's time to repair a replan's held plan that overshoots the new budget, before any
# other search: a hair over, it fits after a few builds, often within the gap of the floor.
HELD_REPAIR_TIME = 1.0  # seconds


def heuristic_candidates(graph: RematGraph, budget: int, time_limit: float,
                         good_enough: float = 0.0, known: Sequence[Schedule] = (),
                         to_beat: float = math.inf, starts: Sequence[Schedule] = (),
                         fits_elsewhere: bool = False) -> list[Schedule]:
    """The schedules of DTR_HEURISTICS, saved values, peak shaving and greedy checkpoints that fit `budget`,
    found within about `time_limit` seconds. Peak shaving runs only while the best so far takes
    longer than `good_enough` (a proven floor plus the caller's gap), and only where DTR's and
    saved values' schedules are faster than `to_beat` (theirs in another order of the same
    graph's nodes), or none fits: an order that does not change what these quick searches
    find did not change what the slower ones find, and those take seconds each. Greedy
    checkpoints run only where nothing else fits, here or in the other order.

    Peak shaving starts from DTR's and saved values' schedules (those that overshoot too),
    from `starts` whatever their peak (a replan's held plan), and from `known` checkpointing
    schedules that fit (the baselines): however slow a start, its drops may lead elsewhere.
    On some graphs, shaving the schedule that checkpoints every block reaches the proven floor
    where shaving DTR's, a far faster start, stops above it.

    Once a schedule fits (found here, among `known`, or the caller's: `fits_elsewhere`), no
    search starts after `time_limit` and each ends by it; until then DTR's runs get
    DTR_MIN_LOOK each whatever is left, since a search that finds nothing leaves the caller to
    search on."""
    deadline = time.perf_counter() + time_limit
    dtr_limit = max(DTR_MIN_LOOK, DTR_SHARE * time_limit)
    found = []
    fits_already = fits_elsewhere or any(s.predicted_peak <= budget for s in known)

    def look(share: float) -> float:
        """Seconds for the next search: its `share`, within the time left once something fits."""
        return min(share, deadline - time.perf_counter()) if found or fits_already else share

    def attempt(solve, *args, **options) -> bool:
        try:
            found.append(solve(graph, budget, *args, **options))
            return True
        except InfeasibleBudget:
            return False

    def searching() -> bool:
        return not found or min(s.predicted_time for s in found) > good_enough

    for heuristic in DTR_HEURISTICS:
        # Largest first only as a start of peak shaving here: in another backward order
        # (`to_beat`) the quick searches probe whether that order is faster, and its schedule,
        # many times slower than the others' (16x on hf_llama at 0.35), never is.
        if (heuristic != "size" or to_beat == math.inf) and (limit := look(dtr_limit)) > 0:
            attempt(solve_dtr, heuristic=heuristic, time_limit=limit)
    if any(node.rng for node in graph.nodes) and (limit := look(dtr_limit)) > 0:
        attempt(solve_dtr, heuristic="dtr", keep_drawn=True, time_limit=limit)
    # What the forward saves, chosen by a small MILP: its attempts that overshoot are starts
    # for peak shaving, the one that fits (the last, if any) a candidate. Where DTR's schedule
    # is already within the gap of the floor, only a short look: its MILP is solved in a tenth
    # of a second on most graphs, and often finds a faster schedule still, but on a graph of
    # thousands of nodes it takes its whole share of the time to improve on none.
    overshooting = []
    saved_values_look = look(0.2 * time_limit if searching() else min(0.2 * time_limit, SAVED_VALUES_LOOK))
    for schedule in saved_values_attempts(graph, budget, time_limit=saved_values_look) if saved_values_look > 0 else ():
        if schedule.predicted_peak <= budget:
            schedule.budget = budget
            found.append(schedule)
        else:
            overshooting.append(schedule)
    # (Within rounding: a schedule's time summed in another order differs in its last bits.)
    if found and to_beat < math.inf and min(s.predicted_time for s in found) >= to_beat * (1 - SUM_ROUNDING):
        return found
    # Not the minimum-memory schedule (its hundreds of drops take the undo seconds, for
    # nothing): only known schedules that run at most the forward again, the checkpoints.
    once = sum(n.time for n in graph.nodes)
    seeds = [*found, *overshooting, *(s for s in known if s.predicted_peak <= budget and s.predicted_time <= 2 * once),
             *starts]
    if searching() and ((shaving_look := SHAVING_SHARE * (deadline - time.perf_counter())) > 0
                        or not (found or fits_already)):
        attempt(solve_peak_shaving, good_enough=good_enough, seeds=seeds, time_limit=max(0.0, shaving_look))
    if not found and to_beat == math.inf and not fits_elsewhere and (
            not fits_already or time.perf_counter() < deadline):
        # Greedy checkpoints only where nothing else fits (here, nor in the caller's other
        # order): where another search had found a schedule, theirs was never the fastest (the
        # zoo's, Hugging Face's, launch-bound and Checkmate's graphs, budgets down to the
        # smallest), and took up to seconds.
        attempt(solve_greedy_checkpoints, time_limit=max(0.0, deadline - time.perf_counter()))
    return found


def in_graph_order(graph: RematGraph, schedules: Sequence[Schedule]) -> list[Schedule]:
    """Schedules planned on `graph` with its nodes in another order (`solvers.backward_order`),
    replayed on `graph` itself, each under its solver's name and budget."""
    replayed = []
    for schedule in schedules:
        try:
            replayed.append(schedule_from_computes(graph, schedule.computes(), schedule.forward_count,
                                                   solver=schedule.solver, budget=schedule.budget))
        except InvalidSchedule:  # an order only the other graph allows: never expected
            continue
    return replayed


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the searches run (and on again after, if it
    was). They make few reference cycles and millions of short-lived objects (the schedules they
    replay), which set off collections that each walk every object of the process, the user's
    model and the captured graphs included: in a planning process much of the time of peak
    shaving's builds. The pause is the process's, for the solve's seconds (reference counting
    still frees every object outside a cycle)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _fastest(schedules: Sequence[Schedule]) -> Schedule:
    """The fastest of `schedules`; of equally fast ones, the one that peaks lowest."""
    return min(schedules, key=lambda s: (s.predicted_time, s.predicted_peak))


@_collector_paused()
def solve_rockmate(graph: RematGraph, budget: int, time_limit: float = 60.0, slots: int = 500,
                   block_time_limit: float = 1.0, gap: float = 0.01,
                   floor: tuple[float, str] | None = None, known: Sequence[Schedule] = (),
                   polish_time: float = 0.0, prove_floor: bool = True) -> Schedule:
    """Fastest schedule found within `budget` bytes, in about `time_limit` seconds (more only
    when nothing fits yet); `block_time_limit` bounds the MILP solves of one distinct block.
    The search stops as soon as a schedule is within `gap` (relative) of the proven floor on
    time; `floor` is that floor and the step that sets it, `time_lower_bound`'s answer, when the
    caller has it (computed here otherwise). A search that ends above `floor` by more than the
    gap proves the floor again in full, with `time_lower_bound`'s MILPs, which a caller's floor
    may lack (paid only where the plan leaves a gap to explain), within the time left: the
    limit holds every floor proven here, as it holds the searches. `prove_floor` False skips
    that proof: the schedule is the same, its floor the one the search started from (still a
    floor, looser), for callers that compare plans by time and peak alone.
    `known`: schedules of `graph` to start from, whatever their peak (a replan's held plan,
    `rockplan.planner`): those that fit are candidates at once; those over the budget are
    repaired by peak shaving first (a little over, in a few builds: within the gap, that ends
    the search); and each is a start of peak shaving in the heuristics.
    `polish_time`: seconds more of peak shaving from the best schedule where it ends above the
    floor by more than the gap (0: none), after that floor is proven in full; all of it within
    `time_limit + polish_time`. The heuristics get a share of `time_limit` that grows
    with the graph, and where they find a schedule nothing uses the rest; there
    peak shaving's local search keeps finding faster schedules long after its share, in runs
    far apart (a GPU step bound by kernel launches, where a plan recomputes hundreds of small
    ops), which a caller training for days can afford to wait for.
    Raises InfeasibleBudget, with the smallest feasible budget in the message, when nothing fits."""
    start = time.perf_counter()
    bounds = check_budget(graph, budget)
    if budget < bounds.reachable[0]:  # every member's search would end without a schedule
        raise InfeasibleBudget(f"no schedule of the portfolio's solvers fits within {budget} bytes "
                               f"({format_bytes(budget)}); {bounds.describe()}")
    floor_proven = floor is None  # in full (the interval MILP's stage included), within the time allowed
    floor, floor_reason = time_lower_bound(graph, budget, time_limit=time_limit) if floor is None else floor

    def prove_floor_in_full() -> None:
        """The caller's floor proven again with `time_lower_bound`'s MILPs, within what is left
        of the time allowed (the search's and polishing's), where the search ends above it."""
        nonlocal floor, floor_reason, floor_proven
        floor_proven = True
        left = time_limit + polish_time - (time.perf_counter() - start)
        tighter, tighter_reason = time_lower_bound(graph, budget, time_limit=max(0.0, left))
        if tighter > floor:
            floor, floor_reason = tighter, tighter_reason
    store_all = bounds.baselines[0]
    candidates = [s for s in (*bounds.baselines, *known) if s.predicted_peak <= budget]
    extra: dict[str, object] = {}
    # The minimum-memory schedule (quadratic in depth) joins the candidates, at its place after
    # the baselines, only where it may matter: where storing everything fits, unless it is
    # provably slower; otherwise as a start of peak shaving (a schedule at most twice the
    # graph's time), where nothing else fits, where its time may be the best, and before the
    # chain (which cuts every candidate into block options) or the flat MILP (warm-started from
    # them). Its time is bounded below without building it (`min_memory_time_floor`).
    place = len(candidates)
    pending = not (store_all.predicted_peak <= budget and min_memory_slower_than_store_all(graph))
    slowest = None if store_all.predicted_peak <= budget or not pending else min_memory_time_floor(graph)

    def min_memory_joins(unless_slower_than: float | None = None) -> None:
        nonlocal pending
        if pending and (unless_slower_than is None or slowest is None
                        or slowest <= unless_slower_than * (1 + MIN_MEMORY_MARGIN)):
            pending = False
            if bounds.min_memory.predicted_peak <= budget:
                candidates.insert(place, bounds.min_memory)

    def searching() -> bool:
        return not candidates or min(s.predicted_time for s in candidates) > floor * (1 + gap)

    if store_all.predicted_peak <= budget:
        min_memory_joins()
    else:
        # Below the in-order floor only the chain's plans, which may run a few nodes out of
        # autograd's order, can fit: every other search would end without a schedule.
        in_order = budget >= bounds.in_order[0]
        pending = pending and in_order  # the minimum-memory schedule runs in that order: it cannot fit
        min_memory_joins(unless_slower_than=2 * sum(n.time for n in graph.nodes))  # a start of peak shaving
        # The heuristics first: they take a fraction of a second and often meet the floor, and
        # they beat the chain plan where the chain model is coarse.
        searched: list[Schedule] = []  # the heuristics' schedules that fit
        over = [s for s in known if s.predicted_peak > budget]
        if in_order and over and searching():
            # A replan's held plan over the new budget, repaired first: the repair then stands
            # for it, as a candidate and a start.
            with contextlib.suppress(InfeasibleBudget):
                repaired = solve_peak_shaving(graph, budget, time_limit=HELD_REPAIR_TIME,
                                              good_enough=floor * (1 + gap), seeds=over)
                candidates.append(repaired)
                known = [*(s for s in known if s.predicted_peak <= budget), repaired]
        # (A known schedule within the gap already, a replan's held plan, ends the search here.)
        if in_order and not any(s.predicted_peak <= budget and s.predicted_time <= floor * (1 + gap) for s in known):
            heuristics_time = max(HEURISTICS_TIME, len(graph.nodes) / HEURISTIC_NODES_PER_SECOND)
            searched += heuristic_candidates(graph, budget, time_limit=min(heuristics_time, 0.8 * time_limit),
                                             good_enough=floor * (1 + gap), known=candidates, starts=known)
            candidates += searched
            # The same searches in other backward orders, where autograd's holds a branch's gradient
            # long: searched further only where the quick searches find faster schedules in them.
            # Each within the time left where something fits already: on a graph of thousands of
            # nodes the first pass takes most of the limit, and the others would double it.
            quick = min((s.predicted_time for s in searched if s.solver in QUICK_SEARCHES), default=math.inf)
            for after in (False, True):
                share = REORDERED_SHARE * min(heuristics_time, 0.8 * time_limit)
                if searching() and (not candidates or time_limit > time.perf_counter() - start) and (
                        other := delayed_branches(graph, after)) is not None:
                    if candidates:  # (reordering a graph of thousands of nodes takes a second)
                        share = min(share, time_limit - (time.perf_counter() - start))
                    reordered = in_graph_order(graph, heuristic_candidates(
                        other, budget, time_limit=share, good_enough=floor * (1 + gap), to_beat=quick,
                        fits_elsewhere=bool(candidates)))
                    searched += reordered
                    candidates += reordered
        if candidates:
            min_memory_joins(unless_slower_than=min(s.predicted_time for s in candidates))
        else:
            min_memory_joins()
        forward_blocks, _ = chain_blocks(graph)
        if searching() and not searched and len(forward_blocks) > 1:
            min_memory_joins()
            time_left = time_limit - (time.perf_counter() - start)
            chained, found = chain_schedules(graph, budget, candidates, time_left, block_time_limit, slots)
            candidates += chained
            extra.update(found)
        remaining = time_limit - (time.perf_counter() - start)
        # The flat MILP only where the heuristics found nothing, as the chain: where they found
        # a schedule its look of seconds never improved on it (Checkmate's graphs and the zoo's
        # CNNs at budgets down to their smallest: the same schedule in all 19 cases planned;
        # in the 6 where it ran, 3 to 6 s each).
        if (in_order and searching() and not searched
                and (len(forward_blocks) <= 1 or len(graph.nodes) <= MILP_MAX_NODES)
                and (not candidates or remaining > FLAT_ILP_MIN_LOOK)):
            min_memory_joins()
            remaining = max(1.0, remaining)
            if candidates:
                # Something already fits (a checkpointing baseline, a known schedule, the chain's
                # plans, the minimum-memory schedule): the flat MILP rarely improves on it on whole
                # models, so it only gets a short look, from it.
                remaining = min(remaining, max(FLAT_ILP_MIN_LOOK, 0.1 * time_limit))
            candidates.append(solve_milp(graph, budget, time_limit=remaining, mip_rel_gap=gap, known=candidates,
                                        floor=floor))
        if polish_time > 0 and in_order and candidates and searching():
            # The full floor first: polishing stops at it, and it explains the plan's gap.
            if not floor_proven:
                prove_floor_in_full()
            polish_left = min(polish_time, time_limit + polish_time - (time.perf_counter() - start))
            if searching() and polish_left > 0:
                with contextlib.suppress(InfeasibleBudget):
                    candidates.append(solve_peak_shaving(
                        graph, budget, time_limit=polish_left, good_enough=floor * (1 + gap),
                        seeds=[_fastest(candidates)], perturb=True))
    if not candidates:
        raise InfeasibleBudget(f"no schedule found within {budget} bytes ({format_bytes(budget)}); "
                               f"{bounds.describe()}")
    best = _fastest(candidates)
    if prove_floor and not floor_proven and best.predicted_time > floor * (1 + gap):
        prove_floor_in_full()
    extra["schedule_from"] = best.solver
    extra["floor_reason"] = floor_reason
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


def solve_ilp(graph: RematGraph, budget: int, time_limit: float = 60, mip_rel_gap: float = 0.01) -> Schedule:
    """The solver `ilp`: Checkmate's flat MILP (`solvers.ilp.solve_milp`) warm-started from the heuristics' best:
    the minimum-memory and segment baselines are so slow a start that HiGHS may never improve
    on them in time."""
    bounds = check_budget(graph, budget)
    fitting = [s for s in bounds.candidates if s.predicted_peak <= budget]
    if any(s.solver == "store_all" for s in fitting):  # nothing to search: solve_ilp says so
        return solve_milp(graph, budget, time_limit=time_limit, mip_rel_gap=mip_rel_gap)
    floor = time_lower_bound(graph, budget)[0]
    known = heuristic_candidates(graph, budget, time_limit=min(10.0, 0.3 * time_limit),
                                 good_enough=floor * (1 + mip_rel_gap), known=fitting)
    return solve_milp(graph, budget, time_limit=time_limit, mip_rel_gap=mip_rel_gap, known=known, floor=floor)
