"""Rockmate: the nn.Module users hold. Captures, plans and runs a training step under a budget.

Planning happens inside AOTAutograd's partition step: AOTAutograd traces the step (on fake
tensors, so nothing real runs), hands us the joint graph, and we return the forward and
backward modules generated from the chosen schedule. AOTAutograd's own runtime then runs them
in one autograd.Function and applies buffer mutations once per step.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._dynamo.backends.debugging import boxed_nop

from rkgraph import build_graph, profile_graph, split_into_blocks
from rkgraph.capture import (
    FlatCall,
    JointGraph,
    flat_tensors,
    flatten_call,
    joint_graph,
    lean_variant,
    trace,
    training_function,
)
from rkgraph.graph import RematGraph
from rockplan.budget import format_bytes, parse_budget
from rockplan.codegen import generate, rng_state_bytes, saved_for_backward
from rockplan.decisions import decide
from rockplan.explain import explain
from rockplan.plan_file import PlanMismatch, export_plan, load_plan
from rockplan.plots import plot_memory
from solvers import RUNTIME_SOLVERS, InfeasibleBudget, Schedule, simulate, solve_store_all
from solvers.bounds import time_lower_bound

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Everything planned for one input signature."""

    graph: RematGraph
    schedule: Schedule
    budget: int
    store_all: Schedule  # the planned graph's store-everything schedule (what the plan decided against)
    reference: Schedule  # what autograd alone would do (its graph, storing everything): ratios, overheads
    times: dict[str, float]  # autograd's graph's node times, by name (`profile_times`)
    reserved: int  # bytes the generated code holds beyond the graph (buffer copies, RNG states)
    compiled: Any
    flat: FlatCall
    plan_time: float
    considered: dict[str, float | str]  # the other graph planned and not run: its time, or why it has none


def _signature(model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described = tuple(
        ("tensor", tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in leaves
    )
    return (str(spec), described, tuple((p.dtype, p.device, p.requires_grad) for p in model.parameters()))


def _split_sample(sample: Any) -> tuple[tuple, dict]:
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    if isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[1], dict):
        return tuple(sample[0]) if isinstance(sample[0], (tuple, list)) else (sample[0],), sample[1]
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    return (sample,), {}


class Rockmate(nn.Module):
    """Wrap `model` so that a training step fits in `budget`, with the same outputs and gradients.

    `sample` is a tensor, a tuple of positional arguments, or `(args, kwargs)`. `budget` is
    bytes, a size string ("1.5GiB") or a ratio of the step memory without rematerialization.
    `schedule` is a plan file written by `export`: it is checked against the captured graph
    and used instead of solving (still replayed by the simulator against the budget).
    `profile`: node times "measure"d on the sample's device, "estimate"d from FLOPs and bytes
    (no run: kernels' scratch is not seen, and the step can exceed the budget by it), or a
    mapping from node name to seconds, such as another plan's `profile_times()`: the same
    model and sample then plan on the same costs (measured profiles vary from run to run on a
    busy machine; a comparison of budgets or solvers should not).
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        budget: int | float | str = 1.0,
        *,
        solver: str = "rockmate",
        profile: Literal["measure", "estimate"] | Mapping[str, float] = "measure",
        backend: Literal["eager", "inductor"] = "eager",
        on_new_input: Literal["replan", "error"] = "replan",
        solver_options: dict | None = None,
        schedule: str | Path | None = None,
    ) -> None:
        super().__init__()
        if solver not in RUNTIME_SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(RUNTIME_SOLVERS)}")
        self.model = model
        self.budget_spec = budget
        self.solver = solver
        self.profile = profile
        self.backend = backend
        self.on_new_input = on_new_input
        self.solver_options = solver_options or {}
        self.plan_file = schedule
        self._plans: dict[tuple, Plan] = {}
        args, kwargs = _split_sample(sample)
        self._sample_signature = _signature(model, args, kwargs)
        self._current = self._plan(args, kwargs)

    # --- what users read -------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self._current.schedule

    @property
    def graph(self) -> RematGraph:
        return self._current.graph

    @property
    def budget(self) -> int:
        return self._current.budget

    @property
    def reserved(self) -> int:
        return self._current.reserved

    @property
    def store_all_peak(self) -> int:
        return self._current.reference.predicted_peak

    @property
    def store_all_time(self) -> float:
        return self._current.reference.predicted_time

    @property
    def considered(self) -> dict[str, float | str]:
        """The other graph planned for this budget and not run: its plan's predicted time in
        seconds, or why it has none (empty when only one graph was planned)."""
        return dict(self._current.considered)

    def profile_times(self) -> dict[str, float]:
        """Autograd's graph's node times in seconds, by node name (the lean variant is
        costed from them): `profile=` for another plan of the same model and sample on the same costs."""
        return dict(self._current.times)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.load_state_dict(*args, **kwargs)

    # --- planning ------------------------------------------------------------------------------
    def _plan(self, args: tuple, kwargs: dict) -> Plan:
        start = time.perf_counter()
        flat = flatten_call(self.model, args, kwargs)
        real = flat_tensors(self.model, flat, args, kwargs)
        result: dict[str, Any] = {}

        def plan_and_generate(joint_module: fx.GraphModule, _inputs: Any, *, num_fwd_outputs: int, **_: Any):
            joint = joint_graph(flat, joint_module, num_fwd_outputs)
            graph = self._graph(joint, real, self.profile)
            store_all = solve_store_all(graph)
            budget = parse_budget(self.budget_spec, store_all.predicted_peak)
            log.info("planning %s: %d nodes, budget %s (store-all peak %s)", graph.name, len(graph.nodes),
                     format_bytes(budget), format_bytes(store_all.predicted_peak))
            chosen, failure = None, None
            considered: dict[str, float | str] = {}  # graphs planned but not run: predicted time, or why not
            try:
                chosen = self._solve(joint, graph, budget, store_all)
            except (InfeasibleBudget, PlanMismatch) as e:
                failure = e
            # Where the plan recomputes, the graph that holds less (attention's probabilities
            # remade inside the backward, masks kept packed) may plan faster: plan it too, on
            # the same times for the nodes both graphs share, and run the faster plan.
            # A plan file that matched autograd's graph leaves nothing to choose.
            needs_less_memory = chosen is None or (
                self.plan_file is None and chosen["schedule"].predicted_time > store_all.predicted_time)
            lean = lean_variant(joint) if needs_less_memory and self.backend != "inductor" else None
            if lean is not None:
                # Its own ops timed in place, unless the reference's times are estimates.
                own_times = "estimate" if self.profile == "estimate" else "measure"
                lean_graph = self._graph(lean, real, own_times, shared=graph)
                # No use solving it when its proven floor is above the plan in hand.
                hopeless = chosen is not None and time_lower_bound(
                    lean_graph, budget - chosen["reserved"])[0] >= chosen["schedule"].predicted_time
                try:
                    other = None if hopeless else self._solve(lean, lean_graph, budget, solve_store_all(lean_graph))
                except (InfeasibleBudget, PlanMismatch) as e:
                    # Both infeasible: the lean graph needs less, so its bound is the one to state.
                    other, failure = None, e if isinstance(e, InfeasibleBudget) else failure
                lean_outcome = ("not solved: its proven floor is above the plan of autograd's graph" if hopeless
                                else "no plan within the budget" if other is None
                                else other["schedule"].predicted_time)
                if other is not None and (chosen is None or
                                          other["schedule"].predicted_time < chosen["schedule"].predicted_time):
                    log.info("lean variant: predicted %.3f s, against %s", other["schedule"].predicted_time,
                             "no plan" if chosen is None else f"{chosen['schedule'].predicted_time:.3f} s")
                    considered["autograd's graph"] = ("no plan within the budget" if chosen is None
                                                      else chosen["schedule"].predicted_time)
                    chosen = other
                else:
                    considered["the lean variant of the graph"] = lean_outcome
            if chosen is None:
                raise failure
            chosen_joint = chosen.pop("joint")
            if log.isEnabledFor(logging.INFO):  # the floor is computed only to be shown
                schedule = chosen["schedule"]
                floor = time_lower_bound(chosen["graph"], budget - chosen["reserved"])[0]
                log.info("planned by %s: peak %s, overhead %+.1f%% (no plan within the budget can be under %+.1f%%)",
                         schedule.solver, format_bytes(schedule.predicted_peak),
                         100 * (schedule.predicted_time / store_all.predicted_time - 1),
                         100 * (floor / store_all.predicted_time - 1))
            result.update(chosen, budget=budget, reference=store_all, times={n.name: n.time for n in graph.nodes},
                          considered=considered)
            return generate(chosen_joint, chosen["graph"], chosen["schedule"])

        compiler, decompositions = boxed_nop, None
        if self.backend == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            # `_inductor` also imports the lowerings these decompositions call while tracing.
            compiler, decompositions = _inductor(result), select_decomp_table()
        compiled = training_function(self.model, flat, plan_and_generate, compiler, decompositions)
        trace(self.model, flat, compiled, args, kwargs, native_kernels=self.backend != "inductor")
        plan = Plan(compiled=compiled, flat=flat, plan_time=time.perf_counter() - start, **result)
        self._plans[_signature(self.model, args, kwargs)] = plan
        return plan

    def _graph(self, joint: JointGraph, real: list[torch.Tensor], profile: Any,
               shared: RematGraph | None = None) -> RematGraph:
        """The RematGraph of `joint` with its costs; a variant of `shared`'s graph shares its
        costs where it runs the same ops (`rkgraph.profile_graph`'s `reference`)."""
        # Inductor compiles the graphs whole, so it cannot call our RNG replay: random ops run once.
        graph = build_graph(joint, name=type(self.model).__name__, replay_rng=self.backend != "inductor")
        graph.joint = joint
        profile_graph(graph, joint, real, profile, reference=shared)
        split_into_blocks(graph)
        return graph

    def _solve(self, joint: JointGraph, graph: RematGraph, budget: int, store_all: Schedule) -> dict[str, Any]:
        """The schedule for `graph` within `budget` (or the plan file's), checked by the simulator."""
        # A backward that recomputes from a buffer the step mutates gets a copy of it, and a
        # random op that runs again its recorded generator state (see codegen); the graph
        # counts neither, so when they would not fit, their bytes are held back from the
        # solver's budget and it plans again.
        if self.plan_file is not None:
            schedule = load_plan(self.plan_file, graph)
        else:
            schedule = RUNTIME_SOLVERS[self.solver](graph, budget, **self.solver_options)
        reserved = held_back = _reserved_bytes(joint, graph, schedule)
        # Planned within less, a schedule may recompute more random ops and so hold more
        # states (GPT at its minimum budget): hold back the most seen, a few rounds at most.
        for _ in range(3):
            if schedule.predicted_peak + reserved <= budget or self.plan_file is not None:
                break
            held_back = max(held_back, reserved)
            schedule = RUNTIME_SOLVERS[self.solver](graph, budget - held_back, **self.solver_options)
            reserved = _reserved_bytes(joint, graph, schedule)
        if schedule.predicted_peak + reserved > budget and self.plan_file is None:
            raise InfeasibleBudget(
                f"budget {budget} bytes ({format_bytes(budget)}) is too small: the plans found also need "
                f"{reserved} bytes beyond the graph (copies of mutated buffers, recorded RNG states), which "
                f"do not fit beside their peak of {schedule.predicted_peak} bytes; the smallest feasible "
                f"budget lies above it and at most at {store_all.predicted_peak} bytes "
                f"({format_bytes(store_all.predicted_peak)}, recomputing nothing)")
        simulate(graph, schedule, budget - reserved)  # the referee: never run an unchecked plan
        return {"joint": joint, "graph": graph, "schedule": schedule, "store_all": store_all, "reserved": reserved}

    # --- running -------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)  # no backward to plan for: the plain forward
        signature = _signature(self.model, args, kwargs)
        plan = self._plans.get(signature)
        if plan is None:
            if self.on_new_input == "error":
                difference = _describe_difference(self._sample_signature, signature)
                raise ValueError(f"input differs from the planned sample: {difference}; "
                                 "pass on_new_input='replan' to plan for it")
            plan = self._plan(args, kwargs)
        self._current = plan
        out = plan.compiled(*flat_tensors(self.model, plan.flat, args, kwargs))
        return tuple(out) if plan.flat.returns_tuple else out

    def train(self, mode: bool = True) -> Rockmate:
        super().train(mode)
        return self

    # --- inspection: what the planner decided, for the current input signature ----------------
    def export(self, path: str | Path) -> Path:
        """Write the plan (graph, schedule, decisions) to `path`; reload with `schedule=path`."""
        return export_plan(self, path)

    def explain(self) -> str:
        """A terminal table: per block what is kept and recomputed, and totals against baselines."""
        reference = self._current.reference
        return explain(self.graph, self.schedule, self._current.store_all,
                       reference=(reference.predicted_peak, reference.predicted_time), considered=self.considered)

    def render(self, path: str | Path, collapse: bool | None = None) -> Path:
        """Draw the graph with the decisions coloured (.pdf, .png or .svg)."""
        labels = decide(self.graph, self.schedule, self._current.store_all).labels()
        return self.graph.render(path, decisions=labels, collapse=collapse)

    def plot_memory(self, path: str | Path) -> Path:
        """Plot memory over one step against store-everything and the budget (needs matplotlib)."""
        return plot_memory(self.graph, self.schedule, path, self.budget, self._current.store_all)


def _inductor(planned: dict[str, Any]) -> Callable[[fx.GraphModule, Any], Any]:
    """AOTAutograd's compiler for one planned step: Inductor for real tensors; the fx code
    itself for the fake call that triggers planning, since Inductor's kernels allocate real
    buffers. `planned` is filled by the partition step before AOTAutograd compiles anything.

    Inductor compiles the forward and the backward as two graphs and picks the layout of what
    the forward returns: with convolutions its layout optimization makes activations (and the
    weights it converts) channels-last, so what the forward hands to the backward need not
    have the strides the joint graph traced, which our backward placeholders carry. Under
    torch.compile, AOTAutograd collects the forward's output strides from the compiler
    (`TracingContext.report_output_strides`) and restrides the backward's example inputs to
    them before compiling it (`_aot_stage2b_bw_compile`); that needs a TracingContext, which
    Dynamo sets up and a bare `aot_function` does not. So this compiler does the same: the
    forward compiles first (AOTAutograd's order) and its output strides are kept; the
    backward's leading inputs (all but the tangents) are the forward's trailing outputs in
    order (codegen's convention, AOTAutograd's), and take those strides in the example inputs
    and in the placeholders' metadata. Like compile_fx's forward and backward compilers, it
    keeps eager's strides for what users see: the forward's own outputs and the gradients.
    """
    # Inductor's decompositions call into its lowerings (max-pool asks
    # torch._inductor.lowering whether to fall back), which torch.compile has imported by the
    # time it traces; a bare aot_function has not.
    from torch._inductor import config, lowering  # noqa: F401
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses import FakeTensor
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    forward_output_strides: list[tuple[int, ...] | None] = []

    def static(stride: tuple[str, ...] | None) -> tuple[int, ...] | None:
        # Inductor records strides as printed expressions: integers here (static shapes)
        try:
            return None if stride is None else tuple(int(s) for s in stride)
        except (TypeError, ValueError):
            return None

    def restride(placeholders: list[fx.Node], example_inputs: list[Any]) -> None:
        handed_over = [i for i, p in enumerate(placeholders) if not p.name.startswith("tangents")]
        if not forward_output_strides:  # none reported (as AOTAutograd without a TracingContext)
            return
        if handed_over != list(range(len(handed_over))) or len(handed_over) > len(forward_output_strides):
            raise RuntimeError("the backward's inputs do not line up with the forward's outputs")
        strides = forward_output_strides[len(forward_output_strides) - len(handed_over):]
        for i, stride in zip(handed_over, strides):
            example = example_inputs[i]
            if stride is None or not isinstance(example, torch.Tensor) or example.stride() == stride:
                continue
            example_inputs[i] = example.as_strided(example.size(), stride)
            placeholders[i].meta["val"] = example_inputs[i]
            if "tensor_meta" in placeholders[i].meta:
                placeholders[i].meta["tensor_meta"] = _extract_tensor_metadata(example_inputs[i])

    def compile(gm: fx.GraphModule, example_inputs: Any) -> Any:
        placeholders = gm.graph.find_nodes(op="placeholder")
        backward = any(p.name.startswith("tangents") for p in placeholders)
        output = gm.graph.find_nodes(op="output")[0]
        if backward:
            example_inputs = list(example_inputs)
            restride(placeholders, example_inputs)
            visible = range(len(output.args[0])) if config.bw_outputs_user_visible else range(0)
        else:  # the forward's own outputs (mutated buffers' new values, the model's outputs)
            visible = range(planned["graph"].joint.num_fwd_outputs) if config.keep_output_stride else range(0)
        output.meta["user_visible_output_idxs"] = [i for i in visible if isinstance(output.args[0][i], fx.Node)]

        on_fakes = boxed_nop(copy.deepcopy(gm), example_inputs)
        compiled = compile_fx_inner(gm, example_inputs, is_backward=backward)
        if not backward:
            forward_output_strides[:] = [static(s) for s in getattr(compiled, "output_strides", None) or []]

        def run(args: list) -> Any:
            if any(isinstance(a, FakeTensor) for a in args):
                return on_fakes(args)
            return compiled(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile


def _reserved_bytes(joint: Any, graph: RematGraph, schedule: Schedule) -> int:
    """What the generated code holds beyond the graph: copies of mutated buffers a backward
    recomputation reads, and recorded generator states of random ops that run again."""
    copies = sum(graph.data[d].size for d in saved_for_backward(graph, schedule.backward_ops) if d in joint.mutated)
    return copies + rng_state_bytes(joint, graph, schedule)


def _describe_difference(planned: tuple, got: tuple) -> str:
    for i, (a, b) in enumerate(zip(planned[1], got[1])):
        if a != b:
            return f"argument leaf {i}: planned {a}, got {b}"
    if planned[0] != got[0]:
        return f"argument structure: planned {planned[0]}, got {got[0]}"
    return "parameters changed dtype, device or requires_grad"
