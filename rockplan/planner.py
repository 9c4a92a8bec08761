"""`plan`: a captured joint graph and a budget in, a checked schedule out.

A plain function over `rkgraph.JointGraph`: it needs neither the user's nn.Module nor
AOTAutograd, so it can be called once per captured graph. `rockplan.module.Rockmate` calls it
from AOTAutograd's partition step and generates code from what it returns.

Planning is one direction: build the RematGraph (`rkgraph.build_graph`), cost it
(`rkgraph.profile_graph`), cut it into blocks, solve, and replay the schedule in the simulator
against the budget, which counts everything the generated code holds (recorded generator
states, copies of mutated buffers), so one solve suffices. Where the plan recomputes, the lean
variant of the graph (`rkgraph.rewrites.lean_variant`: attention's probabilities remade a few
heads at a time, masks kept packed) holds less for a recomputation: it is planned too, on the
same costs for the ops both graphs share, and the faster plan is returned. Where autograd's
graph's proven floor shows that it must recompute and the lean variant's plan is faster than
that floor, autograd's graph is not solved at all: none of its plans could be chosen.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from rkgraph import RescaledTimes, build_graph, joint_device, profile_graph, replayed_times, split_into_blocks
from rkgraph.capture import JointGraph
from rkgraph.graph import RematGraph, matching_nodes
from rkgraph.rewrites import lean_variant
from rkgraph.rewrites.linear_cross_entropy import fewest_chunks
from rkgraph.units import format_bytes
from rockplan import progress
from rockplan.budget import parse_budget
from rockplan.memory import cuda_blocks_fit_requests
from rockplan.plan_file import PlanMismatch, load_plan, read_plan
from solvers import (
    RUNTIME_SOLVERS,
    InfeasibleBudget,
    InvalidSchedule,
    Schedule,
    simulate,
    solve_store_all,
    solver_options,
)
from solvers.bounds import budget_bounds, memory_lower_bound, reachable_floor, time_lower_bound
from solvers.schedule import Op

log = logging.getLogger(__name__)

Profile = Literal["measure", "estimate"] | Mapping[str, float] | RescaledTimes
DEFAULT_SOLVER = "rockmate"  # the portfolio: every strategy tried, the fastest plan kept
# Relative margin by which the lean variant's plan must beat autograd's graph's proven floor
# for that graph to go unsolved: the floor's knapsacks have been seen a hair above the time of
# a schedule that fits (where store-all fits; not yet explained), far below this margin.
SETTLING_MARGIN = 1e-3


class OutOfTime(InfeasibleBudget):
    """The solver stopped without a schedule at a budget above the proven floor: one may exist.
    Where it ran out of its time limit, more time (or a larger budget) may find it; where its
    searches ended first, or where the message says the budget is below what its searches can
    reach (`BudgetBounds.reachable`), only a larger budget will."""


@dataclass(frozen=True)
class PlanOptions:
    """How to plan. `profile`: node times "measure"d on the real inputs, "estimate"d from FLOPs
    and bytes, a mapping from node name to seconds (another plan's `Plan.times`: the same
    graph then plans on the same costs), or another plan's times at other input shapes
    (a plan's `rescaled_times`: planning again for a new input signature replays nothing).
    `plan_file`: a file written by `export`, checked against the graph and used instead of
    solving. `replay_rng`: recomputed random ops replay their recorded generator state (False
    under Inductor, which cannot call the replay: random ops then run once). `lean_variant`:
    plan the lean variant too where the plan recomputes."""

    solver: str = DEFAULT_SOLVER
    solver_options: Mapping[str, Any] = field(default_factory=dict)
    profile: Profile = "measure"
    plan_file: str | Path | None = None
    replay_rng: bool = True
    lean_variant: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        check_solver(self.solver, self.solver_options)


@dataclass
class Plan:
    """A schedule for one joint graph within one budget, checked by the simulator."""

    joint: JointGraph  # the graph that runs: autograd's, or its lean variant
    graph: RematGraph  # its RematGraph, costed and cut into blocks
    schedule: Schedule
    budget: int  # bytes
    graph_store_all: Schedule  # `graph` storing everything: what the plan decided against
    reference: Schedule  # autograd's graph storing everything: the reference of ratios and budgets
    times: dict[str, float]  # autograd's graph's node times, by name: `PlanOptions.profile` for a replan
    considered: dict[str, float | str]  # the other graph planned and not run: its time, or why it has none
    # autograd's graph's times as the profile of the same step at other input shapes
    rescaled_times: RescaledTimes | None = None
    # The other graph's schedule where both were solved (the lean variant's, or autograd's
    # where the lean variant runs), with its graph: a replan's start for that graph
    runner_up: tuple[RematGraph, Schedule] | None = None


def check_solver(solver: str, options: Mapping[str, Any]) -> None:
    """ValueError naming what is accepted, for an unknown solver or an option it does not take."""
    if solver not in RUNTIME_SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(RUNTIME_SOLVERS)}")
    accepted = solver_options(solver)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"solver {solver!r} takes no option {', '.join(map(repr, unknown))}; "
                         f"its options are {', '.join(accepted) or 'none'}")


def plan(joint: JointGraph, budget: int | float | str, options: PlanOptions = PlanOptions(),
         real_inputs: list[torch.Tensor] | None = None, held: Plan | None = None) -> Plan:
    """The fastest schedule found for `joint` (as `rkgraph.capture_joint` returns it, rewritten
    by `rkgraph.rewrites.apply_rewrites`) within `budget` (bytes, a size string, or a ratio
    of the store-everything peak of autograd's graph). `real_inputs` (the primals: parameters,
    buffers, inputs) are what measured profiles run on; without them times are estimated.
    `held`: a plan of the same step at other input shapes (a replan): its schedule, replayed
    on the graph it matches, is where the default solver starts, and its search ends within
    its gap of the held plan's own distance to its floor (`_solve`).
    Raises InfeasibleBudget, stating the smallest feasible budget, when nothing fits, and
    PlanMismatch when a plan file is for another graph."""
    progress.stage("profile")
    # Measured times wait until the budget is known to need them: one the solver refuses on
    # memory alone is refused without replaying the step (several steps' time).
    replays = options.profile == "measure" and real_inputs is not None
    graph = costed_graph(joint, real_inputs, "estimate" if replays else options.profile, options)
    if any(t.device.type == "cuda" for t in real_inputs or ()) and not cuda_blocks_fit_requests():
        warnings.warn("CUDA's caching allocator without expandable segments can give a tensor a larger "
                      "cached block than it asks for, so the measured peak can exceed the plan by a few "
                      "percent; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA is first "
                      "used and the allocator's peak is the plan's", stacklevel=2)
    reference = solve_store_all(graph)
    budget = parse_budget(budget, reference.predicted_peak)
    lean = _LeanVariant(joint, graph, budget, options, real_inputs, held)
    if replays and not _refused_on_memory(graph, budget, options, lean) and replayed_times(graph, joint, real_inputs):
        reference = solve_store_all(graph)  # its time, on the measured times
    log.info("planning %s: %d nodes, budget %s (store-all peak %s)", graph.name, len(graph.nodes),
             format_bytes(budget), format_bytes(reference.predicted_peak))
    if reference.predicted_peak <= budget and fewest_chunks(
            joint.module, graph, lambda: solve_store_all(graph).predicted_peak <= budget):
        # Nothing is recomputed: the fused head's memory saving is needed only as far as the
        # budget asks (decided from the graph and the budget alone, so a plan file exported at a
        # budget matches its graph when loaded at it).
        joint.module.recompile()
    chosen: tuple[JointGraph, RematGraph, Schedule] | None = None
    runner_up: tuple[RematGraph, Schedule] | None = None
    failure: Exception | None = None
    considered: dict[str, float | str] = {}
    progress.stage("solve")
    floor, settled, proving = _settled_by_lean_variant(graph, reference, budget, options, lean)
    if settled is not None:
        # No plan of autograd's graph can beat the lean variant's: it is not solved.
        considered["autograd's graph"] = settled
        chosen = (lean.joint, lean.graph, lean.schedule)
    else:
        try:
            chosen = (joint, graph, _solve(graph, budget, options, floor, held, spent=proving))
        except (InfeasibleBudget, PlanMismatch) as e:
            failure = e
    # A plan file that matched autograd's graph leaves nothing to choose.
    needs_less_memory = not considered and (chosen is None or (
        options.plan_file is None and chosen[2].predicted_time > reference.predicted_time))
    if needs_less_memory and options.lean_variant and lean.build():
        # No use solving it when its proven floor is above the plan in hand, or within the
        # solver's gap of it: the solver's search would have stopped there.
        gap = _solver_gap(options)
        hopeless = not lean.solved(below=None if chosen is None else chosen[2].predicted_time / (1 + gap))
        other = lean.schedule
        if lean.failure is not None:
            # Both infeasible: the lean graph needs less, so its bound is the one to state.
            failure = lean.failure
        if other is not None and (chosen is None or other.predicted_time < chosen[2].predicted_time):
            log.info("lean variant: predicted %.3f s, against %s", other.predicted_time,
                     "no plan" if chosen is None else f"{chosen[2].predicted_time:.3f} s")
            considered["autograd's graph"] = "no plan within the budget" if chosen is None else chosen[2].predicted_time
            runner_up = None if chosen is None else chosen[1:]
            chosen = (lean.joint, lean.graph, other)
        else:
            runner_up = None if other is None else (lean.graph, other)
            considered["the lean variant of the graph"] = (
                "not solved: its proven floor is above the plan of autograd's graph"
                + (f" less the solver's gap ({gap:.0%})" if gap else "") if hopeless
                else "no plan within the budget" if other is None else other.predicted_time)
    if chosen is None:
        assert failure is not None
        raise failure
    chosen_joint, chosen_graph, schedule = chosen
    if options.plan_file is not None:
        # What was weighed when the file was planned, not what loading it tried (a lean
        # variant's file does not match autograd's graph, which is not a plan "not found").
        considered = read_plan(options.plan_file).considered
    if schedule.lower_bound is not None:
        log.info("planned by %s: peak %s, overhead %+.1f%% (no plan within the budget can be under %+.1f%%)",
                 schedule.solver, format_bytes(schedule.predicted_peak),
                 100 * (schedule.predicted_time / reference.predicted_time - 1),
                 100 * (schedule.lower_bound / reference.predicted_time - 1))
    return Plan(chosen_joint, chosen_graph, schedule, budget,
                reference if chosen_graph is graph else solve_store_all(chosen_graph), reference,
                {n.name: n.time for n in graph.nodes}, considered, _rescaled_times(graph), runner_up)


def _rescaled_times(graph: RematGraph) -> RescaledTimes:
    """`Plan.rescaled_times` of autograd's costed graph, estimated for the device it was traced on,
    as `rkgraph.profile_graph` estimates the graphs it is rescaled to (a sharded plan has no
    real inputs to tell it)."""
    return RescaledTimes.of_graph(graph, graph.joint.module, joint_device(graph.joint.module).type)


def _refused_on_memory(graph: RematGraph, budget: int, options: PlanOptions, lean: _LeanVariant) -> bool:
    """Whether the solver refuses `budget` whatever the node times, for autograd's graph and its
    lean variant (both are planned before a refusal; the variant costed on estimates only, kept
    so for the refusal where it is refused too): below the least peak the portfolio's searches
    reach (`reachable_floor`, where it refuses without searching), or for another solver below
    any schedule's (`memory_lower_bound`)."""
    if options.plan_file is not None or budget >= _memory_floor(graph, options):
        return False
    return not (options.lean_variant and lean.build(estimated=True)) or lean.refused()


def _memory_floor(graph: RematGraph, options: PlanOptions) -> int:
    """The budget below which `options.solver` refuses `graph` whatever its node times."""
    return (reachable_floor if options.solver == DEFAULT_SOLVER else memory_lower_bound)(graph)[0]


def _settled_by_lean_variant(graph: RematGraph, reference: Schedule, budget: int, options: PlanOptions,
                             lean: _LeanVariant) -> tuple[tuple[float, str] | None, str | None, float]:
    """(autograd's graph's proven floor within `budget`, for its solve; why that graph needs no
    solve, or None; the seconds its proofs took, the lean variant's work left out). When its
    floor shows that every plan of autograd's graph recomputes, the lean variant is planned
    whatever autograd's plan is, and runs when faster: a lean plan faster than the floor wins,
    and autograd's graph is not solved. The knapsacks' floor is tried first (`time_lower_bound`
    without `closure`: it often settles it, sooner), then the full one. (None, None, 0) where
    this cannot happen: a plan file, no lean variant asked for,
    store-all fits, a solver that takes no floor, a budget below what the portfolio's solvers
    reach (`bounds.reachable_floor`: the solver refuses it at once)."""
    if (options.plan_file is not None or not options.lean_variant or reference.predicted_peak <= budget
            or "floor" not in solver_options(options.solver)):
        return None, None, 0.0
    if budget < reachable_floor(graph)[0]:  # the solver refuses at once: no floor to prove for it
        return None, None, 0.0
    proving = 0.0
    for closure in (False, True):
        started = time.perf_counter()
        floor = time_lower_bound(graph, budget, closure=closure, intervals=False)
        proving += time.perf_counter() - started
        if (floor[0] > reference.predicted_time and lean.solved(below=floor[0]) and lean.schedule is not None
                and lean.schedule.predicted_time < floor[0] * (1 - SETTLING_MARGIN)):
            return floor, ("no plan within the budget" if math.isinf(floor[0]) else
                           f"not solved: its proven floor, {floor[0]:.3f} s, is above the lean variant's plan"), proving
    return floor, None, proving


class _LeanVariant:
    """The lean variant of a joint graph (`rkgraph.rewrites.lean_variant`), costed and solved
    once, on demand: `plan` asks for it before autograd's graph is solved (where it may win at
    once) and after (where autograd's plan recomputes)."""

    def __init__(self, joint: JointGraph, graph: RematGraph, budget: int, options: PlanOptions,
                 real_inputs: list[torch.Tensor] | None, held: Plan | None = None) -> None:
        self._of, self._reference, self._budget = joint, graph, budget
        self._options, self._inputs, self._held = options, real_inputs, held
        self._made = False
        self.joint: JointGraph | None = None
        self.graph: RematGraph | None = None
        self.floor: tuple[float, str] | None = None  # None: not proven (a budget below what it can reach)
        self.proving = 0.0  # seconds its floor's proof took (counted in its solve's time limit)
        self.schedule: Schedule | None = None
        self.failure: Exception | None = None  # InfeasibleBudget from its solve
        self._solve_done = False
        self._estimated = False  # costed on estimates only (`build`)

    def build(self, estimated: bool = False) -> bool:
        """Whether the joint graph has a lean variant; on the first call, derive it, cost it
        (a profile of its own ops) and prove its floor: seconds of work, done only when a
        caller needs the variant. With `estimated`, costed on roofline estimates only and no
        floor proven: enough to tell whether its budget is `refused` (memory alone decides),
        and costed again by a later call without, unless it is refused."""
        if not self._made:
            self._made = True
            self.joint = lean_variant(self._of)
        if self.joint is None:
            return False
        if self.graph is None or (self._estimated and not estimated and not self.refused()):
            options = self._options
            # Its own ops timed op by op on synthetic inputs, unless the reference's times are estimates.
            progress.stage("profile the lean variant")
            profile = "estimate" if estimated or options.profile == "estimate" else "measure"
            self.graph = costed_graph(self.joint, self._inputs, profile, options, shared=self._reference)
            self._estimated = estimated
            # Proven once: it says whether solving can pay, and the portfolio's search starts from
            # it; not where the portfolio refuses the budget at once. The knapsacks' floor only:
            # the portfolio proves the full one (its MILPs, a second or more) only when its search
            # ends above this one, and a lean plan often meets it.
            if not estimated and self._budget >= reachable_floor(self.graph)[0]:
                started = time.perf_counter()
                self.floor = time_lower_bound(self.graph, self._budget, closure=False, intervals=False)
                self.proving = time.perf_counter() - started
        return True

    def refused(self) -> bool:
        """Whether the solver refuses the budget for the variant whatever its times (`_memory_floor`)."""
        return self._budget < _memory_floor(self.graph, self._options)

    def solved(self, below: float | None) -> bool:
        """Whether it is solved (its `schedule`, or its `failure`), solving it now unless its
        proven floor is at or above `below` (seconds; None: no bound)."""
        if not self._solve_done and self.build():
            if below is not None and self.floor is not None and self.floor[0] >= below:
                return False
            self._solve_done = True
            progress.stage("solve the lean variant")
            floor = self.floor if "floor" in solver_options(self._options.solver) else None
            try:
                self.schedule = _solve(self.graph, self._budget, self._options, floor, self._held,
                                       spent=self.proving if floor is not None else 0.0)
            except InfeasibleBudget as e:
                self.failure = e
            except PlanMismatch:
                pass
        return self._solve_done


def reuse(joint: JointGraph, budget: int | float | str, options: PlanOptions, previous: Plan,
          real_inputs: list[torch.Tensor] | None = None) -> Plan | None:
    """`previous`'s schedule on `joint` when it is the same step at other shapes (each node of
    its graph has its counterpart there, whatever the names: `matching_nodes`, `_held_start`)
    and the simulator finds it within `budget` there; None otherwise. No solver runs: planning at the
    largest input covers smaller ones, at the cost of recomputing what they could have kept.
    Costs: the previous plan's node times rescaled to the new shapes (`rkgraph.RescaledTimes`),
    or, for a plan without (another rank's, of the same shapes), its times as they are; kernels'
    scratch is measured again at the new shapes, since the budget check needs it."""
    graph = build_graph(joint, name=options.name, replay_rng=options.replay_rng)
    variant = None
    if _counterparts(previous.graph, graph) is None:
        variant = lean_variant(joint) if options.lean_variant else None
        if variant is None or _counterparts(previous.graph,
                                            build_graph(variant, replay_rng=options.replay_rng)) is None:
            return None
    if options.profile == "estimate":
        profile: Profile = "estimate"
    elif previous.rescaled_times is not None:
        profile = previous.rescaled_times
    else:
        matched = matching_nodes(previous.graph, graph)
        profile = {matched[name]: seconds for name, seconds in previous.times.items() if name in matched}
    graph = costed_graph(joint, real_inputs, profile, options)
    reference = solve_store_all(graph)
    budget = parse_budget(budget, reference.predicted_peak)
    chosen_joint, chosen = (joint, graph) if variant is None else (variant, costed_graph(
        variant, real_inputs, "estimate" if options.profile == "estimate" else "measure", options, shared=graph))
    start = _held_start(previous, chosen, runner_up=False)  # the schedule that ran (another rank's: it has no other)
    if start is None:
        return None
    if start.predicted_peak > budget:
        log.info("the held plan peaks at %s on the new input, above the budget of %s: planning anew",
                 format_bytes(start.predicted_peak), format_bytes(budget))
        return None
    old = previous.schedule
    schedule = Schedule(start.ops, start.forward_length, solver=old.solver, budget=budget,
                        predicted_peak=start.predicted_peak, predicted_time=start.predicted_time,
                        extra={**old.extra, "reused": True})
    log.info("reused the held plan: peak %s within the budget of %s", format_bytes(start.predicted_peak),
             format_bytes(budget))
    return Plan(chosen_joint, chosen, schedule, budget, reference if variant is None else solve_store_all(chosen),
                reference, {n.name: n.time for n in graph.nodes}, {}, _rescaled_times(graph))


def _counterparts(held: RematGraph, graph: RematGraph) -> dict[str, str] | None:
    """`matching_nodes(held, graph)` where each node of `held` and of `graph` has its counterpart
    in the other (the same step, up to names and sizes); None otherwise."""
    if len(graph.nodes) != len(held.nodes):
        return None
    matched = matching_nodes(held, graph)
    return matched if len(matched) == len(graph.nodes) else None


def costed_graph(joint: JointGraph, real_inputs: list[torch.Tensor] | None, profile: Profile,
                 options: PlanOptions, shared: RematGraph | None = None) -> RematGraph:
    """The RematGraph of `joint` with its costs and blocks; a variant of `shared`'s graph
    shares its costs where it runs the same ops (`rkgraph.profile_graph`'s `reference`)."""
    graph = build_graph(joint, name=options.name, replay_rng=options.replay_rng)
    graph.joint = joint
    profile_graph(graph, joint, real_inputs, profile, reference=shared)
    split_into_blocks(graph)
    return graph


def _solve(graph: RematGraph, budget: int, options: PlanOptions,
           floor: tuple[float, str] | None = None, held: Plan | None = None, spent: float = 0.0) -> Schedule:
    """The schedule for `graph` within `budget` (or the plan file's), replayed by the simulator:
    never run an unchecked plan. `floor`: the graph's proven floor, when already computed;
    `spent`: the seconds its proof took. They count against the solver's time limit, which is
    the user's for the whole solve of the graph, not for its last part (on a graph of
    thousands of nodes the floor takes seconds).

    `held`: a plan of the same step at other shapes (a replan). Where its graph is `graph`'s
    at other sizes, its schedule replayed here is a start of the solver's search (one a little
    over the budget is repaired in a few steps) and, unless the caller set the solver's gap,
    the search ends within that gap of the held plan's own distance to its floor: a full
    search found no nearer for that plan, and a replan is planning time paid again at every
    new shape."""
    if options.plan_file is not None:
        schedule = load_plan(options.plan_file, graph)
    else:
        given = dict(options.solver_options)
        accepted = solver_options(options.solver)
        if floor is not None and "floor" in accepted:
            given.setdefault("floor", floor)
        start = _held_start(held, graph) if "known" in accepted else None
        if start is not None:
            given.setdefault("known", [start])
            if "gap" in accepted and "gap" not in options.solver_options and start.extra["held_gap"]:
                given["gap"] = _solver_gap(options) + start.extra["held_gap"]
        started = time.perf_counter() - spent
        limit = _time_limit(options)
        if limit is not None and spent > 0:
            given["time_limit"] = max(0.0, limit - spent)
        try:
            schedule = RUNTIME_SOLVERS[options.solver](graph, budget, **given)
        except InfeasibleBudget as e:
            raise _refusal(graph, budget, options, time.perf_counter() - started) from e
    result = simulate(graph, schedule)
    if result.peak > budget:
        raise InfeasibleBudget(
            f"budget {budget} bytes ({format_bytes(budget)}) is too small for the "
            f"{'plan file' if options.plan_file is not None else options.solver + ' plan'}: it peaks at "
            f"{result.peak} bytes ({format_bytes(result.peak)}), what the generated code holds included "
            f"(copies of mutated buffers, recorded generator states)")
    return schedule


def _solver_gap(options: PlanOptions) -> float:
    """The relative gap to the proven floor within which `options.solver` stops searching (0 for
    a solver that takes no gap: it stops where its search ends)."""
    parameter = inspect.signature(RUNTIME_SOLVERS[options.solver]).parameters.get("gap")
    return 0.0 if parameter is None else options.solver_options.get("gap", parameter.default)


def _held_start(held: Plan | None, graph: RematGraph, runner_up: bool = True) -> Schedule | None:
    """`held`'s schedule on `graph`, where that is the held plan's step at other input shapes: of
    the held plan's schedules (the one it runs, and with `runner_up` its `runner_up`), the one
    whose graph's nodes each have their counterpart in `graph` (`_counterparts`;
    its kind of graph, autograd's or the lean variant), each node renamed to the one that
    computes the same there, each value to the same output of the renamed node, and replayed by
    the simulator (its `extra["held_gap"]`: the held schedule's gap to its floor). None where
    neither has, or the schedule does not run on `graph`. Its peak may be over the budget: it
    is a start of the search, not a plan."""
    if held is None:
        return None
    for source in ((held.graph, held.schedule), held.runner_up if runner_up else None):
        if source is not None and (matched := _counterparts(source[0], graph)) is not None:
            return _renamed(*source, graph, matched)
    return None


def _renamed(held_graph: RematGraph, held_schedule: Schedule, graph: RematGraph,
             matched: dict[str, str]) -> Schedule | None:
    """`held_schedule` with its nodes renamed by `matched` and its values after them, replayed on
    `graph`; None where it does not run there."""
    values: dict[str, str] = {}
    for node in held_graph.nodes:
        if len(outputs := graph.node(matched[node.name]).outputs) == len(node.outputs):
            values.update(zip(node.outputs, outputs))
    ops = []
    for op in held_schedule.ops:
        name = (matched if op.kind == "compute" else values).get(op.name)
        if name is None:
            return None
        ops.append(Op(op.kind, name))
    start = Schedule(ops, held_schedule.forward_length, solver="held_plan",
                     extra={"held_gap": held_schedule.gap})
    try:
        result = simulate(graph, start)
    except InvalidSchedule:
        return None
    start.predicted_peak, start.predicted_time = result.peak, result.time
    return start


def _time_limit(options: PlanOptions) -> float | None:
    """The solver's time limit in seconds: the user's, or the solver's default (None: it has none)."""
    parameter = inspect.signature(RUNTIME_SOLVERS[options.solver]).parameters.get("time_limit")
    return None if parameter is None else options.solver_options.get("time_limit", parameter.default)


def _refusal(graph: RematGraph, budget: int, options: PlanOptions, seconds: float) -> InfeasibleBudget:
    """A solver's refusal of `budget`, as the user should read it whatever the solver. Below the
    proven floor, the floor. Above it the solver gave up (its time limit ran out, or its search
    does not cover every schedule) and nothing is proven: OutOfTime, saying how to give it more
    time, and from which budget a schedule is known."""
    bounds = budget_bounds(graph)
    if budget < bounds.lower:
        return InfeasibleBudget(f"budget {budget} bytes ({format_bytes(budget)}) is too small: {bounds.describe()}")
    known = (f"a schedule is known from {bounds.upper} bytes ({format_bytes(bounds.upper)}), and none can peak "
             f"below {bounds.lower} bytes ({format_bytes(bounds.lower)}){bounds.describe_in_order()}")
    limit = _time_limit(options)
    if limit is None:  # a solver without a time limit (DTR's is None unless given): its search ended, not its time
        return OutOfTime(f"solver {options.solver!r} found no schedule within {budget} bytes ({format_bytes(budget)}), "
                         f"but its search does not cover every schedule: {known}. Use the default solver "
                         f"{DEFAULT_SOLVER!r}, or a budget of at least {bounds.upper} bytes")
    if budget < bounds.reachable[0]:  # more time cannot help: no search in autograd's order or the chain's can fit
        return OutOfTime(f"solver {options.solver!r} found no schedule within {budget} bytes ({format_bytes(budget)}), "
                         f"below what schedules in autograd's order and plans of the chain of blocks can reach: "
                         f"{known}. Use a budget of at least {bounds.upper} bytes")
    if seconds < limit:  # its searches ended before its time did: more of it is not what they lacked
        return OutOfTime(f"solver {options.solver!r} stopped after {seconds:.1f} s, before its time limit "
                         f"({limit:g} s), without a schedule within {budget} bytes ({format_bytes(budget)}): its "
                         f"searches ended, not its time; one may exist: {known}. Use a budget of at least "
                         f"{bounds.upper} bytes")
    return OutOfTime(f"solver {options.solver!r} ran out of its time limit ({seconds:.1f} s, time_limit={limit:g} s) "
                     f"without a schedule within {budget} bytes ({format_bytes(budget)}); one may exist: {known}. Give "
                     f"it more time with solver_options={{'time_limit': {max(2 * limit, 10 * seconds, 60):.0f}}}, or a "
                     f"budget of at least {bounds.upper} bytes")
