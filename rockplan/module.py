"""Rockmate: the nn.Module users hold. Captures, plans and runs a training step under a budget.

Planning happens inside AOTAutograd's partition step: AOTAutograd traces the step (on fake
tensors, so nothing real runs), hands us the joint graph, `rockplan.planner.plan` plans it,
and we return the forward and backward modules generated from the schedule. AOTAutograd's own
runtime then runs them in one autograd.Function and applies buffer mutations once per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from rkgraph.capture import (
    CaptureError,
    FlatCall,
    ModuleTree,
    flat_tensors,
    flatten_call,
    joint_graph,
    module_tree,
    splits_into_graphs,
    trace,
    training_function,
)
from rkgraph.graph import RematGraph
from rkgraph.hooks import hook_ids
from rkgraph.rewrites import apply_rewrites
from rockplan import progress
from rockplan.backend import GraphBreaks, GraphPlan
from rockplan.budget import budget_bytes, check_gradients_fit
from rockplan.codegen import compile_generated, generate
from rockplan.decisions import decide
from rockplan.distributed import check_engine_order
from rockplan.explain import explain
from rockplan.inductor import decompositions, inductor_compiler, measured_step_peak, seed_random_ops
from rockplan.plan_cache import PlanCache, cache_directory
from rockplan.plan_file import export_plan
from rockplan.planner import DEFAULT_SOLVER, Plan, PlanOptions, plan, reuse
from rockplan.plots import plot_memory
from solvers import InfeasibleBudget, Schedule

log = logging.getLogger(__name__)


# Plans made again, each tighter, when Inductor's compiled step measures over the budget.
INDUCTOR_REFITS = 2

TORCH_COMPILE_WARNING = (
    "torch.compile does not compile a Rockmate module's training step: compiled, the step would "
    "keep what torch.compile's partitioner chooses, not what the plan keeps, and its memory "
    "would not be bounded by the budget. The step runs as planned, uncompiled; code around the "
    "module is still compiled. To run the planned step compiled by Inductor, build the module "
    "with Rockmate(..., backend='inductor')."
)


@dataclass
class PlannedStep:
    """A plan for one input signature, and the AOTAutograd callable that runs it."""

    plan: Plan
    compiled: Any
    flat: FlatCall
    plan_time: float  # seconds: capture, profile and solve


def _signature(tree: ModuleTree, args: tuple, kwargs: dict, parameters: tuple | None = None) -> tuple:
    """What a plan was traced under, and so must hold again for it to apply (its guards), for
    a model whose modules, parameters and buffers are `tree`:
    the inputs' structure, shapes, dtypes and devices; the parameters'; every submodule's
    train/eval mode (dropout and BatchNorm trace differently in each: a plan made in eval mode,
    as `from_pretrained` returns models, must not run after `train()`); autocast per device
    type of the tensors, with its dtype; the module hooks registered (the step calls those it
    was traced with, `rkgraph.hooks`). Grad mode needs no key: without it there is no
    backward, and `forward` runs the plain model. `parameters` stands for the parameters'
    description where the model's engine changes them itself (FSDP2 swaps sharded and gathered
    ones, in another dtype under a mixed-precision policy: `ShardedBlocks.declared`)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described = tuple(
        ("tensor", tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in leaves
    )
    if parameters is None:
        parameters = tuple((p.dtype, p.device, p.requires_grad) for p in tree.parameters)
    modes = tuple(m.training for m in tree.modules)
    return (str(spec), described, parameters, modes, autocast_state(), hook_ids(tree.modules))


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast contexts a call runs under: (device type, dtype) of each enabled one.

    A step traced under autocast has its casts in the graph (AOTAutograd traces through the
    autocast dispatch key) and runs with autocast off; a step traced without it has none and
    runs its ops as they are. Either run under the other state would compute in dtypes the
    plan did not size (or fail on a mixed-dtype product), so the state selects the plan.
    """
    return tuple((device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(device))


# Read once: Dynamo cannot trace the C function that lists them, and `torch.compile(rk)` traces
# `forward`, which reads the autocast state.
_AUTOCAST_DEVICES = tuple(torch._C._autocast_supported_devices())


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

    `sample` is a tensor, a tuple of positional arguments, or `(args, kwargs)`; None (the
    default): the first training step's input, planned inside that step (as a trainer calls
    the model, with what it adds to the batch, such as Hugging Face's `num_items_in_batch`;
    errors in capture and planning then show at that step). `budget` is
    bytes, a size string ("1.5GiB") or a ratio of the step memory without rematerialization.
    `plan_file` is a plan written by `export`: it is checked against the captured graph and
    used instead of solving (still replayed by the simulator against the budget).
    `profile`: node times "measure"d on the sample's device, "estimate"d from FLOPs and bytes
    (no replay of the step; kernels' scratch is measured op by op either way), or a
    mapping from node name to seconds, such as another plan's `profile_times()`: the same
    model and sample then plan on the same costs (measured profiles vary from run to run on a
    busy machine; a comparison of budgets or solvers should not).
    `solver_options` are the solver's keyword arguments; one it does not take is an error.

    A plan is for one input signature (shapes, dtypes, devices, structure): a training step on
    another input plans again, inside the step, with a warning the first time and a log line at
    INFO after ("error" for `on_new_input` refuses it instead). With a measured profile, that
    plan takes the held plan's node times, rescaled to the new shapes by how their roofline
    estimates grow (`rkgraph.RescaledTimes`): no replays of the step, which would cost several
    steps at every new input; a step whose graph differs is measured anew. The solver starts
    from the held plan's schedule on the new graph and stops within its gap of the held plan's
    distance to its proven floor (`rockplan.planner._solve`). With "reuse", a ratio budget is of
    the sample's step, in bytes for every input, and a held plan runs the new input when its
    graph is the same up to sizes and names and the simulator finds the plan within the budget
    there, unless storing everything fits: give the largest input as the sample, and smaller
    ones are captured but not solved (they recompute what a plan of their own might keep). The
    `max_plans` most recently used plans are held; older ones are dropped and made again if
    their input comes back (warned the first time: the inputs take more shapes than plans are
    held, and steps keep planning).
    `plan_cache`: where plans are kept between runs (`rockplan.plan_cache`): a script run again
    with the same model, shapes, budget and options traces its step but reads its plan instead
    of profiling and solving it again. A directory; None (the default) for what the
    ROCKPLAN_PLAN_CACHE environment variable says (a directory, or "off"), else
    ~/.cache/rockplan; False for none. Not for a sharded model (its ranks agree on one
    plan).
    The model's hooks run in each step as in eager, on values without autograd history, never
    while planning; a hook that returns a value is traced into the step (`rkgraph.hooks`).
    Pickling (`torch.save(rk)`, `copy.deepcopy`) keeps the model and how to plan, not the plans
    (their steps are compiled closures): they are made again at the first training step.

    A Rockmate stands in for its model where code reads the model rather than calls it, as
    `torch.compile`'s module does: attributes it lacks are the model's (`rk.config`), its
    `state_dict` is the model's (same keys), and its class, `Rockmate[ModelClass]`, has the
    model's `forward` signature. Trainers read that signature to keep the dataset's columns
    the model takes and to find its labels (Hugging Face's `Trainer` drops every column a
    `forward(*args, **kwargs)` does not name), and read attributes such as the loss type to
    count the tokens a loss averages over, or its name (`_get_name`) to shift a
    label-smoothed loss's labels: answered by the wrapper, they would train on nothing, or
    compute the loss otherwise than for the model itself.
    """

    def __new__(cls, model: nn.Module | None = None, *args: Any, **kwargs: Any) -> Rockmate:
        if cls is Rockmate and isinstance(model, nn.Module):
            cls = _wrapper_class(type(model))
        return super().__new__(cls)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (the model)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or (name.startswith("__") and name.endswith("__")):
                raise
            return getattr(model, name)

    def _get_name(self) -> str:
        # The name code dispatching on a model's kind reads (Hugging Face's Trainer shifts a
        # label-smoothed loss's labels by it, looking through PEFT's wrapper to the base model):
        # the model's, else such a loss would be computed otherwise than for the model.
        model = self._modules.get("model")
        if model is None:  # (not built yet)
            return type(self).__name__
        base = getattr(model, "get_base_model", None)  # PEFT's wrapper: the model it adapts
        return (base() if callable(base) else model)._get_name()

    def __repr__(self) -> str:  # nn.Module's, headed by the class's name, not `_get_name`'s (the model's)
        return type(self).__name__ + super().__repr__().removeprefix(self._get_name())

    def __init__(
        self,
        model: nn.Module,
        sample: Any = None,
        budget: int | float | str = 1.0,
        *,
        solver: str = DEFAULT_SOLVER,
        profile: Literal["measure", "estimate"] | Mapping[str, float] = "measure",
        backend: Literal["eager", "inductor"] = "eager",
        on_new_input: Literal["replan", "reuse", "error"] = "replan",
        solver_options: dict | None = None,
        plan_file: str | Path | None = None,
        max_plans: int = 8,
        plan_cache: str | Path | bool | None = None,
    ) -> None:
        super().__init__()
        self._sharded = check_engine_order(model, backend)  # FSDP2 from the root: run inside its hooks
        check_gradients_fit(budget, model)
        if max_plans < 1:
            raise ValueError(f"max_plans must be at least 1, got {max_plans}")
        if on_new_input not in ("replan", "reuse", "error"):
            raise ValueError(f"unknown on_new_input {on_new_input!r}; choose 'replan', 'reuse' or 'error'")
        if backend not in ("eager", "inductor"):
            raise ValueError(f"unknown backend {backend!r}; choose 'eager' or 'inductor'")
        self.model = model
        self.budget_spec = budget
        self.backend = backend
        self.on_new_input = on_new_input
        # Inductor compiles the graphs whole, so it cannot call our RNG replay: its random ops
        # are seeded instead (`seed_random_ops`); and it lowers attention its own way, so no
        # lean variant is planned for it.
        self.options = PlanOptions(solver=solver, solver_options=dict(solver_options or {}), profile=profile,
                                   plan_file=plan_file, replay_rng=backend != "inductor",
                                   lean_variant=backend != "inductor", name=type(model).__name__)
        self.max_plans = max_plans
        directory = cache_directory(plan_cache)
        # Sharded, the ranks agree on one plan (`distributed.Sharded.agree`), which a plan one
        # rank read from its own cache would bypass.
        self._plan_cache = None if directory is None or self._sharded is not None else PlanCache(directory)
        self._steps: OrderedDict[tuple, PlannedStep] = OrderedDict()  # least recently used first
        self._replanned = False  # warned once, logged after
        self._warned_torch_compile = False
        self._dropped: set[tuple] = set()  # signatures whose plans max_plans dropped
        self._warned_dropped = False
        self._sample_signature: tuple | None = None  # set by the sample's plan
        self._current: PlannedStep | None = None
        self._graph_breaks: GraphBreaks | None = None
        if isinstance(sample, (int, float, str)):
            raise TypeError(f"the sample is {sample!r}, not the model's input: Rockmate(model, sample, budget); "
                            f"to plan for the first training step's input instead, pass the budget by name "
                            f"(Rockmate(model, budget={sample!r}))")
        if sample is not None:
            self._plan_sample(*_split_sample(sample))

    def _plan_sample(self, args: tuple, kwargs: dict) -> None:
        """Plan for the sample: the input other inputs are told apart from (`on_new_input`), and
        whose step a ratio budget is of."""
        self._sample_signature = self._signature(args, kwargs)
        try:
            self._current = self._plan(args, kwargs)
        except CaptureError as e:  # not one graph: Dynamo splits it, each graph planned in the first step
            if not splits_into_graphs(e):
                raise
            if self._sharded is not None:
                raise self._sharded.graph_break_error(e) from e
            self._graph_breaks = GraphBreaks(self.model, self.budget_spec, self.options, e, self._plan_cache)

    # --- what users read -------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan for the last input signature seen (the sample's until another is run)."""
        if self._current is None:
            if self._graph_breaks is not None:
                raise RuntimeError(f"{type(self.model).__name__} has graph breaks: it has one plan per graph, "
                                   "made in the first training step; see graph_plans")
            if self._sample_signature is None:
                raise RuntimeError("no plan yet: this Rockmate was given no sample; its first training step "
                                   "plans for that step's input")
            raise RuntimeError("no plan yet: plans are not pickled, and this Rockmate was loaded or copied; "
                               "its first training step plans again")
        return self._current.plan

    @property
    def graph_plans(self) -> list[GraphPlan]:
        """For a model with graph breaks, the plan of each graph Dynamo captured (empty otherwise)."""
        return [] if self._graph_breaks is None else self._graph_breaks.graphs

    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @property
    def graph(self) -> RematGraph:
        return self.plan.graph

    @property
    def budget(self) -> int:
        return self.plan.budget

    @property
    def store_all_peak(self) -> int:
        """Bytes of the step recomputing nothing (autograd's graph): what a ratio budget is of."""
        return self.plan.reference.predicted_peak

    @property
    def store_all_time(self) -> float:
        """Predicted seconds of the step recomputing nothing (autograd's graph)."""
        return self.plan.reference.predicted_time

    @property
    def considered(self) -> dict[str, float | str]:
        """The other graph planned for this budget and not run: its plan's predicted time in
        seconds, or why it has none (empty when only one graph was planned)."""
        return dict(self.plan.considered)

    def profile_times(self) -> dict[str, float]:
        """Autograd's graph's node times in seconds, by node name (the lean variant is
        costed from them): `profile=` for another plan of the same model and sample on the same costs."""
        return dict(self.plan.times)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.load_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # The planned steps are AOTAutograd closures, which cannot be pickled: planned again.
        if self._graph_breaks is not None:
            raise TypeError(f"{type(self.model).__name__} has graph breaks, planned through torch.compile, "
                            "whose compiled graphs cannot be pickled: save rk.state_dict() (the model's) and "
                            "wrap the loaded model in a new Rockmate")
        return {**self.__dict__, "_steps": OrderedDict(), "_current": None}

    # --- planning ------------------------------------------------------------------------------
    def _signature(self, args: tuple, kwargs: dict, tree: ModuleTree | None = None) -> tuple:
        return _signature(tree or module_tree(self.model), args, kwargs,
                          None if self._sharded is None else self._sharded.declared)

    def _plan(self, args: tuple, kwargs: dict) -> PlannedStep:
        """Capture the step on fake tensors and plan it, inside AOTAutograd's partition step;
        with Inductor, measure the compiled step and plan again tighter while it exceeds the budget."""
        start = time.perf_counter()
        options = self.options
        held = next(iter(reversed(self._steps.values())), None)
        if options.profile == "measure" and held is not None and held.plan.rescaled_times is not None:
            # A new input signature of a step already measured: its times rescaled, no replays.
            # Sharded, the groups are then not gathered whole (only a replay reads their values),
            # so a graph the held times do not cover is estimated, not replayed.
            times = held.plan.rescaled_times
            options = dataclasses.replace(options, profile=times if self._sharded is None
                                          else dataclasses.replace(times, otherwise="estimate"))
        with (self._sharded.planning(values=options.profile == "measure") if self._sharded is not None
              else contextlib.nullcontext()):
            step = self._plan_within(self.budget_spec, options, args, kwargs)
        if self.backend == "inductor":
            step = self._fit_compiled_step(step, args, kwargs)
        step.plan_time = time.perf_counter() - start
        signature = self._signature(args, kwargs)
        self._steps[signature] = step
        while len(self._steps) > self.max_plans:
            self._dropped.add(self._steps.popitem(last=False)[0])
        if signature in self._dropped:
            self._report_planned_again(step)
        return step

    def _report_planned_again(self, step: PlannedStep) -> None:
        """An input whose plan `max_plans` dropped came back: the inputs take more shapes than
        plans are held, and planning now runs again and again. Warned once, as it costs every
        such step seconds and nothing else shows it (later replans are logged at INFO)."""
        if self._warned_dropped:
            return
        self._warned_dropped = True
        warnings.warn(f"{type(self.model).__name__}: planned again ({step.plan_time:.1f} s) for an input whose plan "
                      f"was dropped: the inputs take more than max_plans={self.max_plans} signatures, so their "
                      "plans are made over and over. Pad inputs to fewer shapes (a collator's pad_to_multiple_of, "
                      "or a fixed length), raise max_plans, or pass on_new_input='reuse' with the largest input as "
                      "the sample", stacklevel=3)

    def _fit_compiled_step(self, step: PlannedStep, args: tuple, kwargs: dict) -> PlannedStep:
        """The plan as Inductor runs it, within the budget as measured. Inductor fuses and
        orders the generated backward its own way (a fused kernel allocates all its outputs at
        once; a recomputation fused with a later reader is made early), so the compiled step
        can hold more than the schedule: each plan's compiled step is run once on real tensors
        and, while it peaks over the budget, the step is planned again (on the same node times)
        for the budget less the most Inductor has held over a plan's predicted peak. That excess
        is about constant across plans of one graph (the same fusions), so one replan usually
        fits; aiming only the overshoot lower would replan for a budget the last plan already
        met, and creep down by bytes. The plan keeps the user's budget."""
        budget = step.plan.budget
        planned_for, peaks, excess = budget, [], 0
        for _ in range(INDUCTOR_REFITS + 1):
            peaks.append(measured_step_peak(step.compiled, flat_tensors(self.model, step.flat, args, kwargs),
                                            len(step.flat.param_names)))
            if peaks[-1] <= budget:
                step.plan = dataclasses.replace(step.plan, budget=budget)
                return step
            excess = max(excess, peaks[-1] - step.plan.schedule.predicted_peak)
            planned_for = min(planned_for - (peaks[-1] - budget), budget - excess)
            if planned_for <= 0:
                break
            log.warning("Inductor's compiled step peaks at %d bytes, over the budget of %d: planning again "
                        "for %d bytes", peaks[-1], budget, planned_for)
            try:
                step = self._plan_within(planned_for, dataclasses.replace(self.options, profile=step.plan.times),
                                         args, kwargs)
            except InfeasibleBudget:
                break
        raise InfeasibleBudget(
            f"Inductor's compiled step does not fit the budget of {budget} bytes: it measured "
            f"{', '.join(map(str, peaks))} bytes for plans made ever tighter (Inductor fuses and orders the "
            "backward's recomputations its own way, holding more than the plan). Give a larger budget, "
            "or use backend='eager', which runs the plan as it is.")

    def _plan_within(self, budget: int | float | str, options: PlanOptions, args: tuple, kwargs: dict) -> PlannedStep:
        flat = flatten_call(self.model, args, kwargs)
        real = flat_tensors(self.model, flat, args, kwargs)
        planned: list[Plan] = []

        def plan_and_generate(joint_module: fx.GraphModule, _inputs: Any, *, num_fwd_outputs: int, **_: Any):
            if self.backend == "inductor":
                seed_random_ops(joint_module)
            joint = apply_rewrites(joint_graph(flat, joint_module, num_fwd_outputs))
            held = [s.plan for s in reversed(self._steps.values())]
            here = budget
            if self.on_new_input == "reuse" and held and budget_bytes(budget) is None:
                # A ratio is of the sample's step, the largest input: its bytes are every input's
                # (a ratio of a smaller step's own peak would refuse the held plan on each).
                here = held[0].budget
            reused = next(filter(None, (reuse(joint, here, options, p, real)
                                        for p in (held if self.on_new_input == "reuse" else ()))), None)
            if reused is not None and reused.reference.predicted_peak <= reused.budget:
                reused = None  # storing everything fits: planned anew, it recomputes nothing
            # Planned anew, from the latest plan where it is the same step at other shapes.
            planner = plan if self._plan_cache is None else self._plan_cache.plan
            planned.append(reused or planner(joint, here, options, real, held=next(iter(held), None)))
            if self._sharded is not None:
                planned[0] = self._sharded.agree(planned[0], joint, here, options, real)
            progress.stage("generate")
            modules = generate(planned[0].joint, planned[0].graph, planned[0].schedule,
                               in_place=self.backend == "eager")
            return modules if self._sharded is None else self._sharded.gather_where_read(*modules, planned[0].joint)

        if self.backend == "inductor":
            compiler = inductor_compiler(lambda: planned[0].joint.num_fwd_outputs)
            compiled = training_function(self.model, flat, plan_and_generate, compiler, decompositions())
        else:
            compiled = training_function(self.model, flat, plan_and_generate, compile_generated)
        with progress.Progress(self.options.name):
            progress.stage("capture")
            trace(self.model, flat, compiled, args, kwargs, native_kernels=self.backend != "inductor")
        if not planned:  # AOTAutograd partitions only a step with a backward
            raise ValueError(
                f"no output of {type(self.model).__name__} requires grad for this input: there is no backward to "
                "plan. Return the loss (or what it is computed from) from forward; outputs that need no grad "
                "(argmax, detached tensors, None) may come beside it. Evaluate under torch.no_grad() or after "
                "rk.eval(), where the model runs as it is.")
        return PlannedStep(planned[0], compiled, flat, 0.0)

    # --- running -------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)  # no backward to plan for: the plain forward
        # Dynamo sees True here when torch.compile traces this forward; the step runs as planned.
        if self._sharded is not None:
            return self._sharded(functools.partial(self._planned_step, torch.compiler.is_compiling()), args, kwargs)
        return self._planned_step(torch.compiler.is_compiling(), args, kwargs)

    @torch.compiler.disable
    def _planned_step(self, under_torch_compile: bool, args: tuple, kwargs: dict) -> Any:
        """The planned step, never traced by Dynamo: traced, its forward would be compiled
        again by AOTAutograd, whose partitioner (not the plan) would then decide what the
        backward keeps, and Inductor would reorder and fuse it: the step's memory would be
        neither planned nor checked against the budget."""
        if under_torch_compile and not self._warned_torch_compile:
            self._warned_torch_compile = True
            warnings.warn(TORCH_COMPILE_WARNING, stacklevel=2)
        if self._sample_signature is None:  # no sample given: this step's input is the sample
            self._plan_sample(args, kwargs)
        tree = module_tree(self.model)  # one walk for the guards and the step's inputs
        signature = self._signature(args, kwargs, tree)
        step = self._steps.get(signature)
        if step is None:
            new = signature != self._sample_signature  # or the sample's plan was dropped, or not pickled
            if new and self.on_new_input == "error":
                difference = _describe_difference(self._sample_signature, signature)
                raise ValueError(f"input differs from the planned sample: {difference}; "
                                 "pass on_new_input='replan' to plan for it")
            if self._graph_breaks is not None:
                return self._graph_breaks(*args, **kwargs)
            step = self._plan(args, kwargs)
            self._report_replan(step, signature)
        else:
            self._steps.move_to_end(signature)
        self._current = step
        out = step.compiled(*(flat_tensors(tree, step.flat, args, kwargs) if self._sharded is None
                              else self._sharded.step_tensors(step.flat, args, kwargs)))
        return step.flat.result(self.model, out)

    def _report_replan(self, step: PlannedStep, signature: tuple) -> None:
        """Planning inside a training step takes seconds to minutes: say so, with what changed."""
        what = ("the sample's input again" if signature == self._sample_signature
                else f"a new input ({_describe_difference(self._sample_signature, signature)})")
        message = (f"{type(self.model).__name__}: planned for {what} in {step.plan_time:.1f} s; "
                   f"{len(self._steps)} plan(s) held, at most max_plans={self.max_plans}")
        if self._replanned:
            log.info(message)
            return
        self._replanned = True
        warnings.warn(f"{message}. Each new input signature (shape, dtype) is planned in its training step: pad "
                      "inputs to a few shapes, pass on_new_input='reuse' with the largest input as the sample, or "
                      "'error' to refuse new ones", stacklevel=2)

    def train(self, mode: bool = True) -> Rockmate:
        super().train(mode)
        return self

    # --- inspection: what the planner decided, for the current input signature ----------------
    def export(self, path: str | Path) -> Path:
        """Write the plan (graph, schedule, decisions) to `path`; reload with `plan_file=path`."""
        return export_plan(self, path)

    def explain(self) -> str:
        """A terminal table: per block what is kept and recomputed, and totals against baselines."""
        reference = self.plan.reference
        return explain(self.graph, self.schedule, self.plan.graph_store_all,
                       reference=(reference.predicted_peak, reference.predicted_time), considered=self.considered)

    def render(self, path: str | Path, collapse: bool | None = None) -> Path:
        """Draw the graph with the decisions coloured (.pdf, .png or .svg)."""
        labels = decide(self.graph, self.schedule, self.plan.graph_store_all).labels()
        return self.graph.render(path, decisions=labels, collapse=collapse)

    def plot_memory(self, path: str | Path) -> Path:
        """Plot memory over one step against store-everything and the budget (needs matplotlib)."""
        return plot_memory(self.graph, self.schedule, path, self.budget, self.plan.graph_store_all)


@functools.cache
def _wrapper_class(model_class: type[nn.Module]) -> type[Rockmate]:
    """The subclass of Rockmate whose instances wrap models of `model_class`: its `forward` has
    the model class's signature (`Rockmate`'s docstring says why), its name says what it wraps."""

    def forward(self: Rockmate, *args: Any, **kwargs: Any) -> Any:
        return Rockmate.forward(self, *args, **kwargs)

    with contextlib.suppress(TypeError, ValueError):  # a forward without a signature keeps Rockmate's
        forward.__signature__ = inspect.signature(model_class.forward)
    def __reduce_ex__(self: Rockmate, protocol: int) -> tuple:
        # This class is not importable by name: pickled as the model's class, made again from it.
        return _unpickled, (model_class,), self.__getstate__()

    name = f"Rockmate[{model_class.__name__}]"
    forward.__qualname__ = f"{name}.forward"
    return type(name, (Rockmate,), {"forward": forward, "__reduce_ex__": __reduce_ex__, "__module__": __name__,
                                    "__qualname__": name, "__doc__": Rockmate.__doc__})


def _unpickled(model_class: type[nn.Module]) -> Rockmate:
    """An empty Rockmate of the class made for `model_class`, for pickle to fill with its state."""
    return nn.Module.__new__(_wrapper_class(model_class))


def _describe_difference(planned: tuple, got: tuple) -> str:
    for i, (a, b) in enumerate(zip(planned[1], got[1])):
        if a != b:
            return f"argument leaf {i}: planned {a}, got {b}"
    if planned[0] != got[0]:
        return f"argument structure: planned {planned[0]}, got {got[0]}"
    if planned[3] != got[3]:
        return ("submodules' train/eval modes differ from the sample's (call train() or eval() before "
                "Rockmate(...) as for the steps)")
    if planned[4] != got[4]:
        return f"autocast: planned under {planned[4] or 'none'}, called under {got[4] or 'none'}"
    if planned[5] != got[5]:
        return "module hooks were added or removed"
    return "parameters changed dtype, device or requires_grad"
