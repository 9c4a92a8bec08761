"""rockplan as a torch.compile backend: `torch.compile(model, backend=rockplan.backend(budget=...))`.

Dynamo (torch.compile's frontend) captures a program as one or more fx graphs: where the
Python cannot be one graph (a branch on a tensor's value, `.item()`, a print, a call into a
library it cannot trace) it ends a graph, runs that code itself, and starts another, with
guards (shapes, dtypes, train/eval, grad mode, autocast) deciding when a compiled graph still
applies. This backend receives each graph, runs AOTAutograd on it with rockplan's planner as
the partition step (`rockplan.planner.plan`, as `Rockmate` does for a whole step), and returns
AOTAutograd's callable running the generated forward and backward.

One budget for the whole step. Graphs run in order and their backwards in reverse order, so
while graph k runs, the graphs before it hold what they keep for their backward, and while
graph k's backward runs, the gradients the later graphs' backwards made are alive too. Dynamo
compiles graphs lazily, during the first call that reaches them, so the budget is split twice.

As a graph is captured (the first step), it is planned knowing the graphs that ran before it
in this step, but not those after it (a greedy split):

    budget of graph k = budget
                        - what the graphs whose backward is pending hold into it
                          (`SimulationResult.held_into_backward` of their plans: saved values,
                          outputs, recorded generator states, buffer copies)
                        - the gradients of their outputs (they may come from graphs after k
                          and wait through k's backward)
                        - the gradients of every trainable parameter of the step, each once

The last term is needed because a later graph may use any parameter (tied weights, a module
called on both sides of a break) and its gradient then waits through graph k's backward; the
graph's own planner also counts the gradients of its own parameters, so those are counted twice
for it, the price of not knowing the later graphs; where that leaves the graph too little (a
graph Dynamo compiles again once the budget is known, its parameters most of the step), only
the gradients of the parameters it does not take are reserved. A graph's first plan holds at most
HOLD_SHARE of its budget when a schedule within it can, to leave the unknown later graphs room.
That plan serves one step, so it is made without a search where it can be: the fastest of the
schedules built in milliseconds (storing everything, each block checkpointed, square-root
segments, the forward once and every activation remade in the backward) that fits and holds
at most that share; the planner's search runs there only where none does. What graphs hold is
tracked while the step runs (a graph's share is added when its forward runs, removed when its
backward has run), so a graph compiled late (a branch first taken in a later step) is planned
against the graphs actually before it. Parameters, buffers and inputs alive before the step are
not counted, as in `Rockmate`'s budget.

Once a step is complete (a backward ran and no graph's backward is pending), the sequence of
graphs it ran is known. For each sequence not seen before, the step ends with a joint split
(`rockplan.graph_split`): a few plans per graph, and the fastest choice of one per graph whose
step peak, by `graph_split.step_peaks`, is within the budget at every position of every
sequence seen; only the gradients of parameters that later runs use are reserved there. A
graph's plans are the ones it has had, storing everything, holding least, the planner's at the
room the others' current plans leave it (for a graph that is the whole step, the whole budget:
the plan `Rockmate` makes), and, for a graph that shares a step with others, the planner's at
budgets from its smallest feasible one up, all on the costs of its first plan. A graph not
seen yet may still follow any graph but a sequence's last (a branch first taken in a later
step, planned greedily against what the graphs before it hold), so there the joint split keeps
the greedy rule: such a graph holds at most HOLD_SHARE of the room the graphs before it left (or
what its current plan holds, if more). The plans a step's graphs ran are among the choices, so
the joint split is never predicted slower. A graph Dynamo compiles again unchanged (a guard
on state the graph does not read fails: transformers' classification losses set
`config.problem_type` in the first call) is the same ops on the same parameters and inputs
(`_graph_key`): it runs as the graph it had, on its plan, in the sequences seen, and nothing
is planned again. Plans change only between steps, all at once (a
step never mixes the plans of two splits); a graph given another plan is compiled again by
AOTAutograd on fake copies of its arguments when it next runs, which allocates nothing. With
a plan cache (`backend(plan_cache=...)`, `Rockmate`'s), every plan the planner makes is kept
and read back by a script run again (`rockplan.plan_cache`).

A ratio budget (a float in (0, 1]) is that share of the step's store-everything peak: autograd's
graph of every graph storing everything, by `step_peaks`. That is known only once every graph
has run, so the first step runs each graph on the fastest schedule built without a search
whose peak, with what the graphs before it hold, is within the ratio of the graph's own
store-everything peak (the step's is at least that, so it fits whatever the ratio resolves to);
where none is, at its smallest budget (the planner's plan there, or the one holding least,
whichever peak and held bytes sum least). The ratio is resolved as the first step ends, and the
joint split made at it. Where the ratio's bytes are below the least step peak of the graphs'
plans, even with the planner's plans at each graph's smallest budget, that step raises
InfeasibleBudget, naming the ratio that fits. Learning the graphs without running them is not
possible: Dynamo decides a branch on a tensor's value, or reads `.item()`, from the real value,
so the graphs are known only as a real step runs them.

Limits. Code Dynamo runs itself between graphs is not planned and allocates outside the
budget (the `.item()` or the branch allocate nothing; a library call on tensors can): a graph
whose input comes from autograd ops run outside any graph is refused, naming the op and the
break. Dynamo runs a whole function eagerly where a graph break falls inside a for/while loop of
it, also in a module or function the loop calls (a branch inside one block of a loop over the
blocks), so such a break is refused this way too. Shapes must be static (`dynamic=False`). A
forward whose backward never runs (its outputs dropped) leaves its share counted: the step never
completes, and no joint split is made.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import free_symbols

from rkgraph.capture import CaptureError, JointGraph, is_tangent, traced_kernels
from rkgraph.graph import RematGraph
from rkgraph.rewrites import apply_rewrites
from rkgraph.units import format_bytes
from rockplan.budget import budget_bytes
from rockplan.codegen import compile_generated, generate
from rockplan.graph_split import GraphOption, GraphSequence, choose, step_peaks
from rockplan.plan_cache import PlanCache, cache_directory, described
from rockplan.planner import DEFAULT_SOLVER, Plan, PlanOptions, Profile, costed_graph, plan, reuse
from solvers import (
    InfeasibleBudget,
    SimulationResult,
    min_feasible_budget,
    simulate,
    solve_checkpoint_blocks,
    solve_sqrt_segments,
    solve_store_all,
    solver_options,
)
from solvers.bounds import min_memory_schedule

log = logging.getLogger(__name__)


# A graph's plan may hold at most this share of its budget into its backward when a plan at a
# smaller budget can: the graphs after it are not known when it is planned, and need room.
HOLD_SHARE = 0.5
# Where between a graph's smallest feasible budget (0) and its store-everything peak (1) the
# joint split's candidate plans are made, and the first step's plans under a ratio budget tried.
CANDIDATE_SHARES = (0.0, 0.25, 0.5, 0.75)
SMALLEST_STEPS = (0.0, 0.1, 0.25, 0.5, 1.0)


@dataclass
class GraphPlan:
    """One graph Dynamo captured, planned: its plan and how its budget was split off."""

    index: int  # in compile order
    plan: Plan
    budget: int  # bytes given to its planner
    pending: int  # bytes the graphs before it held into its run (their saved values, outputs, their gradients)
    reserved: int  # bytes kept for parameter gradients
    held: int  # bytes this graph holds from its forward's end into its backward
    output_gradients: int  # bytes of the gradients of its outputs
    ends_at: str  # why Dynamo ended the graph there ("" for a graph that ends with the frame)
    # How its plan was chosen: "greedy" (as it was captured, against the graphs before it),
    # "smallest" (as it was captured, at its smallest budget: the first step under a ratio
    # budget) or "joint" (with every graph of the step known, `rockplan.graph_split`).
    split: str = "greedy"


def backend(budget: int | float | str, *, parameters: Iterable[nn.Parameter] | None = None,
            solver: str = DEFAULT_SOLVER, profile: Profile = "estimate", solver_options: dict | None = None,
            name: str = "", plan_cache: str | Path | bool | None = None) -> Backend:
    """A torch.compile backend planning every graph Dynamo captures within one step budget.

    `budget`: bytes, or a size string ("1.5GiB"), for the whole training step (not per graph);
    or a ratio in (0, 1] of the step's store-everything peak, known after the first step (the
    module docstring says how that step is planned). `parameters`: the step's trainable
    parameters, whose gradients it reserves; by default those of the modules Dynamo compiles
    (`torch.compile(model)`: the model's). `solver`, `solver_options`: as `Rockmate`'s.
    `profile` defaults to "estimate": graphs are planned inside the first step, and measuring
    replays a graph storing everything, above the budget. `plan_cache`: where plans are kept
    between runs, as `Rockmate`'s (`rockplan.plan_cache`): a script run again plans its graphs
    by reading them back.
    """
    directory = cache_directory(plan_cache)
    return Backend(budget, parameters=parameters, options=PlanOptions(
        solver=solver, solver_options=dict(solver_options or {}), profile=profile, name=name),
        plan_cache=None if directory is None else PlanCache(directory))


def _floors_not_proven(options: PlanOptions) -> PlanOptions:
    """`options` whose solver, where it can, does not prove its floor in full after its search.
    A step's graphs are each planned at several budgets (their first plans, the joint split's
    candidates and rooms), and the plans compared by time and peak alone: that proof (a MILP
    over the graph's intervals, seconds per plan where the search ends above its floor, most of
    a speech model's first step) would explain a gap nobody reads. The schedules are the same;
    a graph plan's floor is the one its search started from."""
    if "prove_floor" not in solver_options(options.solver) or "prove_floor" in options.solver_options:
        return options
    return replace(options, solver_options={**options.solver_options, "prove_floor": False})


class Backend:
    """The callable torch.compile calls with each graph. `graphs` lists each graph's current
    plan, `superseded` the plans a joint split replaced, `sequences` the orders of graphs that
    complete steps ran."""

    def __init__(self, budget: int | float | str, *, parameters: Iterable[nn.Parameter] | None,
                 options: PlanOptions, plan_cache: PlanCache | None = None) -> None:
        self.budget: int | None = budget_bytes(budget)  # None until a ratio is resolved, after the first step
        self.ratio: float | None = None if self.budget is not None else float(budget)
        self.store_all_peak: int | None = None  # the step's, by `step_peaks`, once a joint split ran
        self.options = _floors_not_proven(options)
        # `rockplan.planner.plan`, or the same reading plans kept between runs
        self._plan: Callable[..., Plan] = plan if plan_cache is None else plan_cache.plan
        self.graphs: list[GraphPlan] = []
        self.superseded: list[list[GraphPlan]] = []  # each joint split's predecessors, oldest first
        self.sequences: dict[GraphSequence, list[int]] = {}  # each with its reserves (`step_peaks`)
        self._given = None if parameters is None else [p for p in parameters if p.requires_grad]
        self._gradients: dict[int, int] = {}  # id of each trainable parameter -> bytes of its gradient
        self._parameters: dict[int, frozenset[int]] = {}  # graph index -> ids of the parameters it takes
        self._pending: list[tuple[int, int]] = []  # (graph, bytes it holds) per run whose backward is pending
        self._running: list[int] = []  # the graphs the step under way has run, in order
        self.runs = 0  # graph forwards run, ever: a training step that runs none ran unplanned
        self._options: dict[int, list[tuple[GraphOption, Plan]]] = {}  # the joint split's candidates per graph
        self._compiled: dict[int, tuple[Plan, Callable]] = {}  # graph -> its plan and AOTAutograd's callable of it
        self._joints: dict[int, JointGraph] = {}  # graph -> autograd's joint graph of it, rewritten
        self._store_all: dict[int, GraphOption] = {}  # graph -> autograd's graph storing everything (ratios)
        self._forwards: dict[int, Callable] = {}  # graph -> the callable returned to Dynamo for it
        self._same: dict[str, int] = {}  # `_graph_key` of each graph planned -> its index

    @property
    def __name__(self) -> str:  # Dynamo names backends in its logs and errors
        return "rockplan"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        _check_static(gm, example_inputs)
        self._note_parameters(example_inputs)
        _check_inputs_come_from_graphs(gm, example_inputs, self.graphs)
        kinds, names = _input_kinds(gm, example_inputs)
        key = _graph_key(gm, example_inputs, kinds)
        if key in self._same:
            # Dynamo compiles a graph again where a guard on something the graph does not read
            # fails (transformers' classification losses set `config.problem_type` in the
            # first step): the same ops on the same parameters run the earlier graph's plan, as
            # that graph, in the sequences and splits already made, with nothing planned again.
            same = self._same[key]
            log.info("graph %d compiled again by Dynamo (a guard failed), op for op on the same parameters: it runs "
                     "as graph %d, with its plan", len(self.graphs), same)
            return self._forwards[same]
        real = [*gm.parameters(), *gm.buffers(), *example_inputs]
        index = len(self.graphs)
        self._parameters[index] = frozenset(id(t) for t in real if isinstance(t, nn.Parameter) and t.requires_grad)
        self._gradients.update({id(t): t.numel() * t.element_size() for t in gm.parameters() if t.requires_grad})
        ends_at = _break_description(getattr(gm, "compile_subgraph_reason", None))
        state: dict[str, Any] = {}

        def partition(joint_module: fx.GraphModule, _inputs: Any, *, num_fwd_outputs: int, **_: Any):
            state["planning"] = True
            joint = self._joints[index] = _rewritten_joint(joint_module, num_fwd_outputs, kinds, names, index)
            pending = sum(held for _, held in self._pending)
            if self.budget is None:
                planned, held = self._plan_smallest(joint, real, index, pending)
                state["plan"] = GraphPlan(index, planned, planned.budget, pending, 0, held,
                                          _output_gradients(planned), ends_at, "smallest")
            else:
                planned, held, reserved = self._plan_greedily(joint, real, index, pending)
                state["plan"] = GraphPlan(index, planned, planned.budget, pending, reserved, held,
                                          _output_gradients(planned), ends_at)
            self.graphs.append(state["plan"])
            log.info("graph %d: %d nodes, budget %s (%s held by earlier graphs, %s of parameter gradients)",
                     index, len(planned.graph.nodes), format_bytes(state["plan"].budget), format_bytes(pending),
                     format_bytes(state["plan"].reserved))
            return generate(planned.joint, planned.graph, planned.schedule)

        try:
            compiled = self._compile(gm, example_inputs, partition, index)
        except Exception as e:
            if state.get("planning") or isinstance(e, CaptureError):
                raise
            raise CaptureError(explain_graph_failure(gm, e)) from e
        if not state.get("planning"):
            return compiled  # no backward to plan (eval or no_grad): AOTAutograd's inference graph
        self._compiled[index] = (state["plan"].plan, compiled)

        @functools.wraps(compiled)
        def forward(*args: Any) -> Any:
            mine = self.graphs[index]
            if self._compiled[index][0] is not mine.plan:  # a joint split gave it another plan
                self._compiled[index] = (mine.plan, self._compile_again(gm, list(args), kinds, names, index, mine.plan))
            out = self._compiled[index][1](*args)
            self._pending.append((index, mine.held + mine.output_gradients))
            self._running.append(index)
            self.runs += 1
            return out

        self._forwards[index] = forward
        if key is not None:
            self._same[key] = index
        return forward

    # --- compiling -------------------------------------------------------------------------
    def _compile(self, gm: fx.GraphModule, inputs: list[Any], partition: Callable, index: int) -> Any:
        """AOTAutograd's callable for `gm`, planned by `partition`; its backward tells the
        backend when it has run (what the graph held is then released)."""

        def compile_backward(gm: fx.GraphModule, inputs: Any) -> Any:
            run = compile_generated(gm, inputs)

            def backward(args: list) -> Any:
                try:
                    return run(args)
                finally:
                    self._backward_ran(index)

            backward._boxed_call = True  # type: ignore[attr-defined]
            return backward

        with traced_kernels():
            return aot_autograd(fw_compiler=compile_generated, bw_compiler=compile_backward,
                                partition_fn=partition)(gm, inputs)

    def _compile_again(self, gm: fx.GraphModule, args: list[Any], kinds: list[str], names: list[str], index: int,
                       planned: Plan) -> Any:
        """AOTAutograd's callable running `planned` (a plan of this graph made after it was
        compiled). AOTAutograd traces the graph again, on fake copies of `args` (nothing is
        allocated), and `planner.reuse` checks the trace is the graph planned and runs the
        plan's schedule on it: the number of values a forward saves is fixed when AOTAutograd
        compiles, so another plan needs another compilation."""

        def partition(joint_module: fx.GraphModule, _inputs: Any, *, num_fwd_outputs: int, **_: Any):
            joint = _rewritten_joint(joint_module, num_fwd_outputs, kinds, names, index)
            again = reuse(joint, planned.budget, replace(self.options, profile="estimate"), planned)
            if again is None:
                raise CaptureError(f"graph {index}, traced again to run the plan its joint split chose, is not the "
                                   "graph that was planned (tracing it is not deterministic); this is a bug in "
                                   "rockplan: please report it with the model")
            return generate(again.joint, again.graph, again.schedule)

        return self._compile(gm, args, partition, index)

    # --- one step --------------------------------------------------------------------------
    def _backward_ran(self, index: int) -> None:
        """Release what the latest run of graph `index` held; when nothing is pending, the step
        is complete, and a sequence of graphs not seen before is split jointly now, between
        steps (its plans run from the next step on): planning then runs inside the step that
        revealed the sequence (the first, mostly), not inside one a user may be measuring."""
        for i in range(len(self._pending) - 1, -1, -1):  # backwards run in reverse order
            if self._pending[i][0] == index:
                del self._pending[i]
                break
        if not self._pending and self._running:
            sequence, self._running = tuple(self._running), []
            if sequence not in self.sequences:
                self.sequences[sequence] = self._reserves(sequence)
                self._split_jointly()

    def _reserves(self, sequence: GraphSequence) -> list[int]:
        """Per position, the gradients of the parameters the runs after it take, each once."""
        reserves = []
        for p in range(len(sequence)):
            later = set().union(*(self._parameters[g] for g in sequence[p + 1:]))
            reserves.append(sum(self._gradients[i] for i in later))
        return reserves

    # --- planning ----------------------------------------------------------------------------
    def _plan_greedily(self, joint: JointGraph, real: list[Any], index: int,
                       pending: int) -> tuple[Plan, int, int]:
        """The first plan of graph `index`, what it holds into its backward, and the bytes of
        parameter gradients reserved beside it: every trainable parameter's of the step, or,
        where that leaves too little, only those of the parameters the graph does not take,
        or, where that still does, only those of the parameters no graph run so far in the step
        takes. Its planner counts its own parameters' gradients, so the first counts them twice
        (a later graph may use them too, and make their gradients before this graph's backward
        runs); the second counts them once, as `Rockmate` does; the third leaves out the
        gradients of the graphs run before it, made after its backward (unless a later graph
        takes their parameters too: the joint split at the step's end knows). Dynamo compiles
        a frame again where a guard fails, after the first step (a graph unchanged runs as the
        one it had, but a frame whose code took another path once an attribute was set, or that
        sees a new input shape, is a new graph on the same parameters): once the budget is
        known, reserving gradients that cannot be alive beside it can leave no room at all (a
        smaller input than the first step's was refused at a budget of 1.0)."""
        reserved = sum(self._gradients.values())
        others = reserved - sum(self._gradients[i] for i in self._parameters[index])
        ran = self._parameters[index].union(*(self._parameters[g] for g in self._running))
        unseen = sum(size for i, size in self._gradients.items() if i not in ran)
        failure: InfeasibleBudget | None = None
        for reserve in dict.fromkeys((reserved, others, unseen)):
            budget = self.budget - pending - reserve
            if budget <= 0:
                failure = failure or InfeasibleBudget(
                    f"budget {format_bytes(self.budget)} leaves nothing for graph {index}: the graphs before it "
                    f"hold {format_bytes(pending)} into its backward and the step's parameter gradients take "
                    f"{format_bytes(reserve)}; give a larger budget")
                continue
            try:
                return (*self._plan_leaving_room(joint, budget, real), reserve)
            except InfeasibleBudget as e:
                failure = failure or InfeasibleBudget(
                    f"graph {index} of the step gets {format_bytes(budget)} of the budget {format_bytes(self.budget)} "
                    f"(the graphs before it hold {format_bytes(pending)} into its backward, the step's parameter "
                    f"gradients take {format_bytes(reserve)}), and that is too little: {e}")
                failure.__cause__ = e
        assert failure is not None
        raise failure

    def _plan_leaving_room(self, joint: JointGraph, budget: int, real: list[Any]) -> tuple[Plan, int]:
        """The first step's plan of a graph within `budget`, and what it holds into its backward.
        Made without a search where it can be: once the step is complete, the joint split
        (`_split_jointly`) plans each graph knowing the others, so a search here (seconds, a
        minute at tight budgets) would be spent on one step. Of the schedules made in
        milliseconds (`_quick_plans`), the fastest within the budget that holds at most
        HOLD_SHARE of it, so that the graphs after it (unknown yet) are left room; where none
        does, the planner's plan, or where that holds more than the share, the quick schedule
        within the budget holding least, if it holds less. Without the share, a graph storing
        everything when it can would leave the next one too little (a greedy split)."""
        inputs = real if self.options.profile == "measure" else None
        quick = self._quick_plans(joint, inputs)
        fitting = [(result, p) for result, p in quick if result.peak <= budget]
        within = [(result.time, i) for i, (result, _) in enumerate(fitting)
                  if result.held_into_backward <= HOLD_SHARE * budget]
        if within:
            result, best = fitting[min(within)[1]]
            best_held = result.held_into_backward
        else:
            try:
                best = self._plan(joint, budget, self._planned_on(quick[0][1].times), inputs)
            except InfeasibleBudget:  # (a search out of time where a quick schedule fits)
                if not fitting:
                    raise
                best = fitting[0][1]
            best_held = simulate(best.graph, best.schedule).held_into_backward
            least = [(result.held_into_backward, i) for i, (result, _) in enumerate(fitting)
                     if result.held_into_backward < best_held]
            if best_held > HOLD_SHARE * budget and least:
                result, best = fitting[min(least)[1]]
                best_held = result.held_into_backward
        best.budget = budget  # what the graph was given; its schedule may fit a smaller one
        return best, best_held

    def _quick_plans(self, joint: JointGraph, inputs: list[Any] | None) -> list[tuple[SimulationResult, Plan]]:
        """Plans of autograd's graph of `joint` made without a search, each with the simulator's
        replay of it: storing everything first, then those holding little (`_holding_little`)."""
        graph = costed_graph(joint, inputs, self.options.profile, self.options)
        store_all = solve_store_all(graph)
        stored = Plan(joint, graph, store_all, store_all.predicted_peak, store_all, store_all,
                      {n.name: n.time for n in graph.nodes}, {})
        return [(simulate(p.graph, p.schedule), p) for p in (stored, *_holding_little(stored))]

    def _plan_smallest(self, joint: JointGraph, real: list[Any], index: int, pending: int) -> tuple[Plan, int]:
        """Under a ratio budget, before the step's peak is known: the fastest of the schedules
        made without a search (`_quick_plans`; not the one holding least, whose backward remakes
        the forward again and again) whose peak, with what the graphs before it hold
        (`pending`), is within the ratio of this graph's own store-everything peak. The step's
        store-everything peak is at least that, so this fits any budget the ratio can resolve
        to. Where none does, the plan at the smallest budget a schedule is known at or the one
        holding least, whichever sum of peak and held bytes is less (the graphs after this one
        are not known yet: its peak adds to theirs only through what it holds); this searches
        (`_smallest_solved`). Notes autograd's graph storing everything, what the ratio is of
        (`_resolve_ratio`)."""
        assert self.ratio is not None
        quick = self._quick_plans(joint, real if self.options.profile == "measure" else None)
        store_all, stored = quick[0]
        self._store_all[index] = GraphOption(store_all.peak, store_all.held_into_backward + _output_gradients(stored),
                                             store_all.time)
        fitting = [(result.time, i) for i, (result, _) in enumerate(quick[:-1])
                   if result.peak + pending <= self.ratio * store_all.peak]
        if fitting:
            result, best = quick[min(fitting)[1]]
            return best, result.held_into_backward
        solved = self._smallest_solved(joint, stored.graph, store_all.peak, self._planned_on(stored.times))
        found = [(simulate(p.graph, p.schedule), p) for p in ((solved,) if solved is not None else ())]
        result, best = min([*found, quick[-1]], key=lambda f: f[0].peak + f[0].held_into_backward)
        return best, result.held_into_backward

    def _smallest_solved(self, joint: JointGraph, graph: RematGraph, largest: int, options: PlanOptions) -> Plan | None:
        """The planner's plan of `joint` at the smallest budget a schedule of its graph `graph`
        is known at, or the first above it on the way to its store-everything peak `largest`
        that it finds a plan within; None where it finds none."""
        smallest = min_feasible_budget(graph)
        for share in SMALLEST_STEPS:
            try:
                return self._plan(joint, max(smallest, round(smallest + share * (largest - smallest))), options)
            except InfeasibleBudget:
                continue
        return None

    def _candidates(self, index: int) -> list[tuple[GraphOption, Plan]]:
        """A few plans of graph `index`, each with its `GraphOption`: the plans it has had, its
        graph storing everything and holding least (`_holding_least`), and, where the graph
        shares a step with others, the planner's at budgets from its smallest feasible one up
        (`CANDIDATE_SHARES` of the way to storing everything), none above the step's budget,
        on the costs of its first plan. A graph that is every step's only graph needs none of
        those: the planner's plan at the whole budget (`_room_plan`) is its fastest."""
        first = self.graphs[index].plan
        graph = first.graph
        plans = [g.plan for g in (self.graphs[index], *(s[index] for s in self.superseded if index < len(s)))]
        plans.append(replace(first, schedule=first.graph_store_all, considered={},
                             budget=simulate(graph, first.graph_store_all).peak))
        plans.append(_holding_least(first))
        smallest, largest = min_feasible_budget(graph), plans[-2].budget
        alone = all(sequence == (index,) for sequence in self.sequences if index in sequence)
        for share in () if alone else CANDIDATE_SHARES:
            budget = round(smallest + share * (largest - smallest))
            if self.budget is not None and budget > self.budget:
                continue
            with contextlib.suppress(InfeasibleBudget):
                plans.append(self._plan(self._joints[index], budget, self._planned_on(self.graphs[index].plan.times)))
        return _distinct_options(plans)

    def _planned_on(self, times: dict[str, float]) -> PlanOptions:
        """The planning options for a graph planned again: on `times`, the node times its first
        plan measured (where they were measured), so that nothing is replayed and its plans'
        times compare."""
        return self.options if self.options.profile == "estimate" else replace(self.options, profile=times)

    def _room_plan(self, index: int, current: dict[int, GraphOption]) -> Plan | None:
        """The planner's plan of graph `index` at the room the current plans leave it: the step's
        budget less, at each position the graph runs at, what the runs before it hold and the
        gradients reserved for the runs after it (the least of those rooms); None where nothing
        fits there. For a graph that is the whole step, the whole budget: the plan `Rockmate`
        would make. It is planned on the graph's first costs (its times, where measured)."""
        assert self.budget is not None
        room = self.budget
        for sequence, reserves in self.sequences.items():
            before = 0
            for graph, reserve in zip(sequence, reserves, strict=True):
                if graph == index:
                    room = min(room, self.budget - before - reserve)
                before += current[graph].held
        try:
            return self._plan(self._joints[index], room, self._planned_on(self.graphs[index].plan.times))
        except InfeasibleBudget:
            return None

    def _split_jointly(self) -> None:
        """Choose every graph's plan at once (`graph_split.choose`) among its candidates, for
        every sequence of graphs complete steps ran, and swap them in for the steps to come.
        Under a ratio budget the budget is resolved first. Under a budget in bytes the current
        plans are among the candidates and fit (the first step ran them), so a split is always
        found; under a ratio they may peak above it, and where no split fits, InfeasibleBudget."""
        graphs = sorted({g for s in self.sequences for g in s})
        new = [g for g in graphs if g not in self._options]
        for g in new:
            self._options[g] = self._candidates(g)
        if self.budget is None:
            self._resolve_ratio(graphs)
        assert self.budget is not None
        current = {g: next(option for option, planned in self._options[g] if planned is self.graphs[g].plan)
                   for g in graphs}
        for g in new:
            room = self._room_plan(g, current)
            if room is not None:
                self._options[g] = _distinct_options([room], self._options[g])
        chosen = choose({g: [option for option, _ in self._options[g]] for g in graphs}, self.sequences, self.budget,
                        share=HOLD_SHARE, current=current)
        if chosen is None:
            ran = max(max(step_peaks(s, current, r)) for s, r in self.sequences.items())
            if ran > self.budget:  # a ratio resolved below the first step's peak, and no split within it
                raise InfeasibleBudget(
                    f"no split of the budget {format_bytes(self.budget)} across the step's graphs {graphs} was found "
                    f"(the least step peak rockplan finds is {format_bytes(self._least_step_peak(graphs))}); "
                    "give a larger budget")
            log.warning("no joint split of the budget %s across graphs %s found: the plans stay as they are",
                        format_bytes(self.budget), graphs)
            return
        picked = {g: self._options[g][o] for g, o in chosen.items()}
        if all(planned is self.graphs[g].plan for g, (_, planned) in picked.items()):
            return
        self.superseded.append(list(self.graphs))
        graphs_now = list(self.graphs)
        for g, (option, planned) in picked.items():
            before, reserved = 0, 0
            for sequence, reserves in self.sequences.items():
                held = [picked[h][0].held if h in picked else 0 for h in sequence]
                for p in (p for p, h in enumerate(sequence) if h == g):
                    before, reserved = max(before, sum(held[:p])), max(reserved, reserves[p])
            old = self.graphs[g]
            graphs_now[g] = replace(old, plan=planned, budget=planned.budget, pending=before, reserved=reserved,
                                    held=option.held - old.output_gradients, split="joint")
        self.graphs = graphs_now
        log.info("joint split of %s across graphs %s: predicted %.4f s over the sequences seen, was %.4f s",
                 format_bytes(self.budget), graphs, self.predicted_time(), self.predicted_time(self.superseded[-1]))

    def _resolve_ratio(self, graphs: list[int]) -> None:
        """The ratio budget in bytes: that share of the step's store-everything peak (autograd's
        graph of every graph storing everything, as `Rockmate`'s ratio is of, by `step_peaks`,
        the largest over the sequences seen). Where it is below the step's least peak among
        the candidates (each graph's option whose peak and held bytes sum least), the planner's
        plans at each graph's smallest budget join them (`_smallest_solved`); where it is below
        still, InfeasibleBudget, naming the ratio that fits: no split rockplan finds does better."""
        store_all = {g: self._store_all[g] for g in graphs}
        self.store_all_peak = max(max(step_peaks(s, store_all, r)) for s, r in self.sequences.items())
        budget = int(self.ratio * self.store_all_peak)
        if budget < self._least_step_peak(graphs):
            for g in graphs:
                solved = self._smallest_solved(self._joints[g], self.graphs[g].plan.graph, self._store_all[g].peak,
                                               self._planned_on(self.graphs[g].plan.times))
                if solved is not None:
                    self._options[g] = _distinct_options([solved], self._options[g])
        least = self._least_step_peak(graphs)
        if budget < least:
            raise InfeasibleBudget(
                f"budget ratio {self.ratio} of the step's store-everything peak {format_bytes(self.store_all_peak)} is "
                f"{format_bytes(budget)}, below the smallest step peak rockplan finds, {format_bytes(least)} (every "
                f"graph at its smallest budget): give a ratio of at least "
                f"{math.ceil(100 * least / self.store_all_peak) / 100:.2f}")
        self.budget = budget
        log.info("ratio budget %s: %s of the step's store-everything peak %s", self.ratio, format_bytes(budget),
                 format_bytes(self.store_all_peak))

    def _least_step_peak(self, graphs: list[int]) -> int:
        """The step's peak over the sequences seen, each graph running its candidate whose peak
        and held bytes sum least."""
        least = {g: min((option for option, _ in self._options[g]), key=lambda o: o.peak + o.held) for g in graphs}
        return max(max(step_peaks(s, least, r)) for s, r in self.sequences.items())

    def predicted_time(self, graphs: list[GraphPlan] | None = None) -> float:
        """Predicted seconds of the steps seen, summed over the sequences' runs, with `graphs`'
        plans (the current ones by default)."""
        graphs = self.graphs if graphs is None else graphs
        return sum(simulate(graphs[g].plan.graph, graphs[g].plan.schedule).time
                   for sequence in self.sequences for g in sequence)

    def _note_parameters(self, example_inputs: list[Any]) -> None:
        """Every trainable parameter the step may use, once: the ones given, or those of the
        modules in the frame Dynamo compiles (the model, for `torch.compile(model)`), and the
        graph's own."""
        found: list[torch.Tensor] = [t for t in example_inputs if isinstance(t, nn.Parameter) and t.requires_grad]
        if self._given is not None:
            found += self._given
        else:
            for value in _frame_locals().values():
                if isinstance(value, nn.Module):
                    found += [p for p in value.parameters() if p.requires_grad]
        for p in found:
            self._gradients[id(p)] = p.numel() * p.element_size()


def _holding_least(planned: Plan) -> Plan:
    """`planned`'s graph run holding the least into its backward: its forward once, keeping
    only what cannot be made again (outputs, random draws that cannot be replayed), and each
    activation made again in the backward where it is read (`min_memory_schedule`). For a
    graph early in the step, what the chain program's "forward keeping only the input" is for
    a block: the graphs after it get the most room, at the cost of a second forward."""
    schedule = min_memory_schedule(planned.graph, forward_once=True)
    return replace(planned, schedule=schedule, budget=schedule.predicted_peak, considered={})


def _holding_little(planned: Plan) -> list[Plan]:
    """Schedules of `planned`'s graph that hold little into its backward, each made in
    milliseconds: each block checkpointed (what `torch.utils.checkpoint` per layer keeps), square-root
    segments, and the schedule holding least (`_holding_least`)."""
    graph = planned.graph
    plans = [replace(planned, schedule=schedule, budget=schedule.predicted_peak, considered={})
             for schedule in (solve_checkpoint_blocks(graph), solve_sqrt_segments(graph))]
    return [*plans, _holding_least(planned)]


def _distinct_options(plans: list[Plan], known: Sequence[tuple[GraphOption, Plan]] = ()
                      ) -> list[tuple[GraphOption, Plan]]:
    """`known` options, then each of `plans` with its `GraphOption` (`solvers.simulate` of it)
    unless one alike came before."""
    found = {(option.peak, option.held, option.time): (option, planned) for option, planned in known}
    for candidate in plans:
        result = simulate(candidate.graph, candidate.schedule)
        option = GraphOption(result.peak, result.held_into_backward + _output_gradients(candidate), result.time)
        found.setdefault((option.peak, option.held, option.time), (option, candidate))
    return list(found.values())


def _output_gradients(planned: Plan) -> int:
    """Bytes of the gradients of a graph's outputs (its backward's tangents)."""
    return sum(planned.graph.data[t].size for t in planned.graph.tangents)


def _rewritten_joint(joint_module: fx.GraphModule, num_fwd_outputs: int, kinds: list[str], names: list[str],
                     index: int) -> JointGraph:
    """AOTAutograd's joint graph of graph `index` as the planner takes it, rewritten."""
    primals = [p for p in joint_module.graph.find_nodes(op="placeholder") if not is_tangent(p)]
    if len(primals) != len(kinds):  # AOTAutograd merged inputs that alias each other
        raise CaptureError(f"graph {index} has inputs that alias one another; rockplan plans graphs "
                           "whose inputs are distinct tensors")
    _annotate_modules(joint_module)
    mutated = _mutated(joint_module, primals)
    return apply_rewrites(JointGraph(joint_module, num_fwd_outputs, kinds, names, mutated))


def _frame_locals() -> dict[str, Any]:
    """The locals of the frame Dynamo is compiling. Dynamo keeps no public handle on them;
    without one, `parameters=` must be given."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is None:
        raise RuntimeError("rockplan.backend cannot see the compiled frame's modules: pass "
                           "parameters=model.parameters() to rockplan.backend")
    return dict(tx.f_locals)


def _break_description(reason: Any) -> str:
    """Why Dynamo ended a graph, and the user's line where it did ("" for the frame's end)."""
    text = (str(getattr(reason, "reason", "") or "").strip().splitlines() or [""])[0]
    stack = getattr(reason, "user_stack", None) or []
    if stack:
        text += f" (at {stack[-1].filename}:{stack[-1].lineno}: {(stack[-1].line or '').strip()})"
    return text


def _check_static(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        example = node.meta.get("example_value", value)
        if not isinstance(value, torch.Tensor) or free_symbols(example):
            raise CaptureError(
                f"Dynamo made input {node.name} of a graph dynamic (its size changed between calls); rockplan "
                "plans graphs with static shapes: compile with torch.compile(model, backend=..., dynamic=False)")


def _check_inputs_come_from_graphs(gm: fx.GraphModule, example_inputs: list[Any], graphs: list[GraphPlan]) -> None:
    """Refuse a graph fed by autograd ops that ran outside any graph: what they keep for the
    backward is in no plan, so the budget could not be kept."""
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        grad_fn = _made_outside_graphs(value) if isinstance(value, torch.Tensor) else None
        if grad_fn is None:
            continue
        op = type(grad_fn).__name__.removesuffix("Backward0").removesuffix("Backward1").removesuffix("Backward")
        where = graphs[-1].ends_at if graphs else "before the first graph"
        raise CaptureError(
            f"input {node.name} of a graph was made by {op} (autograd node {type(grad_fn).__name__}) run outside "
            f"any captured graph, after the break: {where}. Dynamo ran it in Python, so what it keeps for the "
            "backward is outside the plan and the budget. Make the call traceable (for a library op: "
            "torch.library.custom_op with register_fake), or move it out of the planned step. If it is the "
            "model's own code, Dynamo ran a whole function eagerly: " + _LOOP_BREAK)


_MADE_BY_GRAPHS = ("CompiledFunctionBackward", "AccumulateGrad")  # a graph's autograd node; a leaf's


def _made_outside_graphs(value: torch.Tensor) -> Any:
    """The autograd node run outside any graph that made `value`, a graph's input, or None where
    graphs made it, or ops that keep nothing for the backward and allocate nothing:

    - a copy into a graph's input: a graph that writes into its input in place (`x[mask] = v`
      on an activation, where a break ends the graph) returns the new value, and AOTAutograd
      copies it into the input after the graph (`copy_`);
    - views of a graph's output (or of a leaf): Qwen2-VL splits its vision attention by image
      sizes read with `.tolist()`, a break, so the split runs in Python between graphs. A view
      holds its base's memory, which the graph that made it counts, and its backward keeps
      no tensors (only sizes), as every node on the way must."""
    base = value._base if value._is_view() else None
    borrowed = base is not None and (base.grad_fn is None or type(base.grad_fn).__name__ in _MADE_BY_GRAPHS)
    pending = [value.grad_fn]
    while pending:
        fn = pending.pop()
        if fn is None or type(fn).__name__ in _MADE_BY_GRAPHS:
            continue
        if not (type(fn).__name__ == "CopyBackwards" or borrowed and not _keeps_tensors(fn)):
            return fn
        pending += [next_fn for next_fn, _ in fn.next_functions]
    return None


def _keeps_tensors(grad_fn: Any) -> bool:
    """Whether an autograd node saved tensors for its backward (its `_saved_*` attributes)."""
    saved = (getattr(grad_fn, name) for name in dir(grad_fn) if name.startswith("_saved_"))
    return any(isinstance(x, torch.Tensor) for v in saved for x in (v if isinstance(v, (tuple, list)) else [v]))


# Why Dynamo runs a model's own function eagerly, and what to do about it.
_LOOP_BREAK = (
    "a graph break inside a for/while loop, even one inside a module or function the loop calls (a branch on "
    "a tensor in a block of a loop over blocks), makes Dynamo skip the frame with the loop (TORCH_LOGS="
    "graph_breaks: \"graph break in loop\", \"frame skipped\"). Move the break out of the loop (before or "
    "after it, or between the model and its loss) or make it branchless (torch.where, torch.cond). A branch "
    "on a random draw that skips a layer (LayerDrop: `layerdrop`, `encoder_layerdrop`, `decoder_layerdrop` "
    "in a Hugging Face config) cannot be made branchless: set its probability to 0 to train with rockplan.")


def _graph_key(gm: fx.GraphModule, example_inputs: list[Any], kinds: list[str]) -> str | None:
    """A hash of everything AOTAutograd's trace of `gm` on `example_inputs` and the plan of it
    depend on, naming no node (Dynamo names a graph's inputs by the path it read them from,
    which differs between two compilations of one frame): each op and its arguments by
    position, each input's kind, the identity of each parameter (the backend's reserves count
    them by identity), the shapes, strides, dtypes, devices and storage sharing of the other inputs,
    and the grad and autocast modes the graph is traced under. None where the graph holds
    attributes of its own (constants, submodules), which are not compared: such a graph is
    planned as new."""
    if (gm.graph.find_nodes(op="get_attr") or gm.graph.find_nodes(op="call_module")
            or len(kinds) != len(example_inputs)):
        return None
    position: dict[fx.Node, int] = {}
    digest = hashlib.sha256()
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        target = node.target if node.op in ("call_function", "call_method") else ""
        arguments = fx.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        digest.update(f"{node.op} {target} {described(arguments)}\n".encode())
    storages: dict[int, int] = {}
    for i, (kind, value) in enumerate(zip(kinds, example_inputs, strict=True)):
        if isinstance(value, nn.Parameter):
            part = f"{kind} parameter {id(value)} {value.requires_grad}"
        elif isinstance(value, torch.Tensor):
            shared = storages.setdefault(value.untyped_storage().data_ptr(), i)
            part = f"{kind} {described(value)} on {value.device} offset {value.storage_offset()} storage of {shared}"
        else:
            part = f"{kind} {value!r}"
        digest.update(f"{part}\n".encode())
    modes = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    modes += [(torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")]
    digest.update(repr(modes).encode())
    return digest.hexdigest()


def _input_kinds(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[list[str], list[str]]:
    """Per primal of AOTAutograd (the module's own parameters and buffers, then the graph's
    inputs), "param", "buffer" or "input", and a name: the source Dynamo read it from."""
    kinds = ["param" for _ in gm.parameters()] + ["buffer" for _ in gm.buffers()]
    names = [n for n, _ in gm.named_parameters()] + [n for n, _ in gm.named_buffers()]
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        source = getattr(node.meta.get("grapharg"), "source", None)
        label = source.name if source is not None else node.name
        names.append(label() if callable(label) else str(label))
        kinds.append("param" if isinstance(value, nn.Parameter)
                     else "buffer" if "._buffers[" in names[-1] else "input")
    return kinds, names


def _mutated(joint: fx.GraphModule, primals: list[fx.Node]) -> frozenset[str]:
    """The primals the graph mutates (BatchNorm's statistics): AOTAutograd describes each
    output of the joint graph, the new values of mutated inputs as InputMutationAOTOutput."""
    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput, PlainAOTInput

    descriptions = joint.graph.find_nodes(op="output")[0].meta.get("desc")
    if descriptions is None:
        raise CaptureError("AOTAutograd did not describe the graph's outputs: rockplan cannot tell which "
                           "inputs the step mutates (this torch is older or newer than it knows)")
    return frozenset(primals[d.mutated_input.idx].name for d in descriptions
                     if isinstance(d, InputMutationAOTOutput) and isinstance(d.mutated_input, PlainAOTInput))


def _annotate_modules(joint: fx.GraphModule) -> None:
    """Name each node's module as `Rockmate`'s capture does (`meta["custom"]["module"]`), from the
    module stack Dynamo recorded, so blocks and explanations name modules."""
    for node in joint.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack and "module" not in node.meta.get("custom", {}):
            path = list(stack.values())[-1][0]
            node.meta.setdefault("custom", {})["module"] = _module_path(path)


def _module_path(dynamo_path: str) -> str:
    # Dynamo writes "L['self'].layers[0].attn" or "L['self']._modules['layers']...": keep the dotted tail.
    path = dynamo_path.split("]", 1)[1] if dynamo_path.startswith("L[") else dynamo_path
    return path.replace("._modules['", ".").replace("']", "").replace("[", ".").replace("]", "").lstrip(".")


def explain_graph_failure(gm: fx.GraphModule, error: Exception) -> str:
    """What could not be traced in a graph Dynamo captured: the op, the user's line, a remedy."""
    op = getattr(error, "func", None)
    what = str(op) if op is not None else (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = _user_line(str(error))
    if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
        if where == "unknown location":
            where = _value_shaped_line(gm) or where
        return (f"cannot plan a graph of the step: {what} makes a tensor whose shape depends on the values of "
                f"its input (a boolean mask's indexing or masked_select, nonzero)\n  at {where}\n"
                "No plan can size its output before the step runs. Compute that part outside the planned "
                "module (a loss, say: call the model without its labels and compute the loss from its "
                "outputs), or write it without a value-dependent shape (torch.where with a fixed shape).")
    return (f"cannot plan a graph of the step: {type(error).__name__}: {what}\n  at {where}\n"
            "AOTAutograd traces each graph on fake tensors: an op needs a fake (meta) implementation. For an "
            "op of your own or a library's, register one (torch.library.register_fake), or wrap the call in "
            "torch.compiler.disable so that Dynamo leaves it out of the graph.")


# Calls whose output shape can depend on the values of their inputs, as Dynamo records them
# (functions, and methods by name); indexing with a boolean mask is the other way.
_VALUE_SHAPED = frozenset({torch.nonzero, torch.masked_select, torch.argwhere, torch.unique,
                           "nonzero", "masked_select", "argwhere", "unique"})
_INDEXING = frozenset({operator.getitem, operator.setitem, "__getitem__", "__setitem__"})


def _value_shaped_line(gm: fx.GraphModule) -> str | None:
    """The user's line of the first call in Dynamo's graph `gm` whose output shape can depend on
    values (`_VALUE_SHAPED`, or indexing with a boolean mask). Such a failure may come while the
    backward is traced, far from any frame of the user's code."""
    def boolean_mask(arg: object) -> bool:
        value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.dtype == torch.bool

    for node in (n for n in gm.graph.nodes if n.op in ("call_function", "call_method")):
        index = node.args[1] if node.target in _INDEXING and len(node.args) > 1 else None
        masks = index if isinstance(index, (tuple, list)) else (index,)
        if node.target in _VALUE_SHAPED or any(boolean_mask(m) for m in masks):
            trace = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip()]
            return " ".join(trace[-2:]) if trace else f"{node.name} ({node.target})"
    return None


def _user_line(message: str) -> str:
    """The innermost user frame of fx's "Original traceback" note, else "unknown location"."""
    lines = [line.strip() for line in message.splitlines()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ") and "/torch/" not in line]
    if not frames:
        return "unknown location"
    i = frames[-1]
    return f"{lines[i]}: {lines[i + 1]}" if i + 1 < len(lines) else lines[i]


class GraphBreaks:
    """`Rockmate`'s path for a model that is not one graph: the model compiled by Dynamo with
    this backend, and the backend's record of the graphs (`graphs`). Called as the model is;
    errors of planning come out as rockplan's own (InfeasibleBudget, CaptureError), not
    wrapped in Dynamo's BackendCompilerFailed."""

    def __init__(self, model: nn.Module, budget: int | float | str, options: PlanOptions, why: CaptureError,
                 plan_cache: PlanCache | None = None) -> None:
        if options.plan_file is not None or not options.replay_rng:
            raise ValueError(f"{why}\nDynamo can split it into graphs, planned one at a time, but not with "
                             "plan_file= or backend='inductor'") from why
        # Graphs are planned inside the first step: measuring would replay each one storing
        # everything, above the budget.
        profile = "estimate" if options.profile == "measure" else options.profile
        self.backend = Backend(budget, parameters=model.parameters(), options=replace(options, profile=profile),
                               plan_cache=plan_cache)
        self.compiled = torch.compile(model, backend=self.backend, dynamic=False)
        self.model = model
        self.why = why
        log.info("%s is not one graph (%s): planning each graph Dynamo captures", options.name,
                 str(why).splitlines()[0])

    @property
    def graphs(self) -> list[GraphPlan]:
        return self.backend.graphs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import BackendCompilerFailed

        runs = self.backend.runs
        try:
            # Dynamo traces NumPy code into torch ops, and by default draws NumPy's random numbers
            # from torch's generator: a step then draws other values than eager does (wav2vec 2.0's
            # SpecAugment masks), and moves torch's generator, dropout's masks with it.
            with torch._dynamo.config.patch(use_numpy_random_stream=True):
                out = self.compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            cause = e.inner_exception
            if isinstance(cause, CaptureError):
                raise self._with_why(cause) from None
            if isinstance(cause, InfeasibleBudget):
                raise cause from None
            raise
        except CaptureError as e:
            raise self._with_why(e) from None
        training = torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters())
        if training and self.backend.runs == runs:  # no graph ran: the step ran in Python, unplanned
            if not self.graphs:
                # Dynamo compiles no frame of PyTorch's own modules alone: a loop over them that it
                # skips leaves the whole step eager, unplanned and over the budget, with no error.
                raise self._with_why(CaptureError(
                    f"Dynamo captured no graph of {type(self.model).__name__}'s training step: it ran all of it in "
                    "Python, so nothing was planned and the budget would not be kept. It ran a whole function "
                    "eagerly: " + _LOOP_BREAK))
            # Dynamo compiles a frame again for each new input shape, and past its recompile limit
            # runs the frame in Python from then on, saying so only in a log line.
            raise CaptureError(
                f"Dynamo ran this training step of {type(self.model).__name__} without any of its graphs: it ran "
                "all of it in Python, so nothing was planned and the budget was not kept. It captured graphs in "
                f"earlier steps; most often it has hit torch._dynamo.config.recompile_limit "
                f"({torch._dynamo.config.recompile_limit}) compiling the model again for new input shapes (each new "
                "shape is new graphs, planned again). Pad inputs to fewer shapes (a collator's pad_to_multiple_of, "
                "or a fixed length), or raise the limit.")
        return out

    def _with_why(self, error: CaptureError) -> CaptureError:
        """`error` with where the step stopped being one graph: often the very branch Dynamo could
        not keep in a graph either (a branch on a tensor in a loop over layers)."""
        first = [line.strip() for line in str(self.why).splitlines()[:2]]
        return CaptureError(f"{error}\nTraced as one graph first, the step stopped here: " + "\n  ".join(first))
