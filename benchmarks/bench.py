"""Side-by-side benchmark: rockplan against PyTorch's own options, measured in one process.

    python benchmarks/bench.py                       # zoo models (and HF GPT-2): docs/benchmarks/models.md
    python benchmarks/bench.py --models gpt --ratios 1.0,0.5 --repeats 3 --out gpt.md
    python benchmarks/bench.py --models hf_llama,hf_bert --out docs/benchmarks/models-hf.md

For each model and each budget (a ratio of the no-rematerialization step peak predicted from
the graph, or "min": the smallest a schedule is known for) every method trains the same steps:
rockplan (and its solvers run through the same runtime: rotor, DTR, and "torch_budget":
PyTorch's min-cut partitioner under `activation_memory_budget` on the same graph; all plan on
one measured profile of the model),
`torch.utils.checkpoint` around every block, the same with selective activation checkpointing's
op list, Hugging Face's own `gradient_checkpointing_enable()` (HF models), `torch.compile`
(aot_eager) with `activation_memory_budget` (the largest knob whose measured peak fits the
budget), and plain eager (store everything). Peaks are measured by the allocator (rockplan's
tracker: the CUDA allocator's statistics, the CPU allocator's events recorded by
torch.profiler), so kernels' scratch and compiled code count; at each budget, eager and every method that fits run their
steps in turn (E A B C E A B C ...), and times are medians reported as ratios to eager's,
because these machines are shared and noisy. Writes a markdown page (`bench_page`'s header:
machine, versions, date, command), the rows where rockplan is not the fastest with what explains
each, and a Pareto plot beside it (step time against measured peak, one line per method).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# The checkout this script is in, before any installed copy, as the other bench scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_page import PAGES, write_page  # noqa: E402  (beside this script, on its path)
from torch._dynamo.backends.debugging import aot_eager  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402

from rkgraph.rewrites import lean_rewrites  # noqa: E402
from rkgraph.units import format_bytes  # noqa: E402
from rockplan import Rockmate, zoo  # noqa: E402
from rockplan.memory import cuda_blocks_fit_requests, measure_step, steady_cpu_heap  # noqa: E402
from solvers import RUNTIME_SOLVERS, InfeasibleBudget, InvalidSchedule, min_feasible_budget  # noqa: E402
from solvers.bounds import time_lower_bound  # noqa: E402

# Containers whose children a user would wrap in torch.utils.checkpoint, per zoo model; "x.*":
# every child of x is such a container (the ResNet's stages, as many as the size has).
CHECKPOINT_CONTAINERS = {
    "gpt": ["transformer.h"], "hf_gpt2": ["transformer.h"], "resnet": ["stages.*"],
    "unet": ["down", "up"], "mlp": [""], "multi_output": ["encoder"],
    "hf_llama": ["model.layers"], "hf_bert": ["bert.encoder.layer"],
}
COMPILE_KNOBS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
# "min" among the ratios: the smallest budget a schedule is known for on the probe's graph, with
# the margin tests/test_hf_models.py gives it: a plan's capture measures kernels' scratch again,
# and it varies a little between replays.
MIN_BUDGET_MARGIN = 1.05
# Selective activation checkpointing's op list, as torchtitan's "op" policy: inside each
# checkpointed block the outputs of these compute-heavy ops are saved, everything else is
# recomputed in the backward. Names missing from this torch build are skipped.
SAC_SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)
)


@dataclass
class Row:
    model: str
    ratio: float
    budget: int
    method: str
    peak: int | None = None  # measured bytes
    rounds: list[float] = field(default_factory=list)  # per round: step time / eager's in that round
    predicted_overhead: float | None = None
    floor: float | None = None  # rockplan rows: the proven floor's overhead on the planned graph
    plan_time: float | None = None
    note: str = ""
    minimum: bool = False  # the budget is the smallest one a schedule is known for ("min")

    @property
    def time_ratio(self) -> float | None:
        """Median over rounds of step time / eager's."""
        return statistics.median(self.rounds) if self.rounds else None


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module, options: dict[str, object]) -> None:
        super().__init__()
        self.block = block
        self.options = options

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **self.options, **kwargs)


def checkpoint_every_block(model: torch.nn.Module, containers: list[str], **options: object) -> torch.nn.Module:
    """A copy of `model` with every child of each container wrapped in torch.utils.checkpoint
    (non-reentrant), as a user would wrap a model's blocks; `options` go to `checkpoint`."""
    model = copy.deepcopy(model)
    for path in containers:
        if path.endswith(".*"):
            found = list(model.get_submodule(path[:-2]).children())
        else:
            found = [model.get_submodule(path) if path else model]
        for container in found:
            for name, child in list(container.named_children()):
                setattr(container, name, _Checkpointed(child, options))
    return model


def _save_listed_ops(_context: object, op: object, *_args: object, **_kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def fixed_peers(name: str, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The methods whose memory does not depend on the budget, each a copy of `model` (a
    zoo.WithLoss): torch.utils.checkpoint around every block, the same with selective activation
    checkpointing's op list (SAC_SAVED_OPS), and for a Hugging Face model its own
    `gradient_checkpointing_enable()` on every layer, non-reentrant as HF recommends. Each is measured once
    and timed at every budget its peak fits."""
    containers = [f"model.{c}".rstrip(".") for c in CHECKPOINT_CONTAINERS[name]]
    peers = [
        ("torch.utils.checkpoint per block", checkpoint_every_block(model, containers)),
        ("SAC per block (op list)", checkpoint_every_block(
            model, containers, context_fn=functools.partial(create_selective_checkpoint_contexts, _save_listed_ops))),
    ]
    if getattr(model.model, "supports_gradient_checkpointing", False):
        hf = copy.deepcopy(model)
        # transformers 5 renamed it activation_checkpointing_enable, the old name a deprecated alias.
        if hasattr(hf.model, "activation_checkpointing_enable"):
            hf.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peers.append(("HF gradient_checkpointing_enable", hf))
    return peers


def aot_eager_with_budget(knob: float) -> Callable[..., object]:
    """torch.compile's aot_eager backend with `activation_memory_budget` set to `knob`."""
    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        with torch._functorch.config.patch(activation_memory_budget=knob):
            return aot_eager(gm, example_inputs)
    return backend


def round_robin(steps: list[Callable[[], object]], repeats: int,
                sync: Callable[[], object] = lambda: None) -> list[list[float]]:
    """Each step's times, one per round, the steps run in turn after one warm-up each, the order
    rotated each round (a b c, b c a, c a b, ...): methods compared at a budget share the same
    moments of a noisy machine, and each runs after each other as often (on CPU the step before
    shapes the heap a step finds; see rockplan.steady_cpu_heap).

    `sync` waits for the device's queued work (`torch.cuda.synchronize` on CUDA), before a step's
    clock starts and before it stops: a CUDA step returns once its kernels are queued, and
    without it a step's kernels are charged to whichever later step waits on the device."""
    times: list[list[float]] = [[] for _ in steps]
    for i in range(repeats + 1):
        for k in (*range(i % len(steps), len(steps)), *range(i % len(steps))):
            sync()
            start = time.perf_counter()
            steps[k]()
            sync()
            if i:
                times[k].append(time.perf_counter() - start)
    logging.info("medians (ms): %s", " ".join(f"{1e3 * statistics.median(t):.1f}" for t in times))
    return times


def ratios_to_first(steps: list[Callable[[], object]], repeats: int,
                    sync: Callable[[], object] = lambda: None) -> list[list[float]]:
    """Per round, each step's time over the first's (eager's) in that round, measured round
    robin (`sync` as there): a ratio within one round cancels the machine's slower and faster
    spells."""
    times = round_robin(steps, repeats, sync)
    return [[t / e for t, e in zip(ts, times[0])] for ts in times[1:]]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def bench_model(name: str, size: str, ratios: list[float | str], repeats: int, solvers: list[str],
                knobs: tuple[float, ...] = COMPILE_KNOBS, autocast: torch.dtype | None = None,
                export: Path | None = None) -> list[Row]:
    """Every method's rows for zoo model `name` at each ratio of the predicted store-all peak
    ("min": the smallest budget a schedule is known for, MIN_BUDGET_MARGIN above it).

    With `autocast` (a dtype), every method's forward runs under `torch.autocast` with it, as
    mixed-precision training does, and rockplan plans under the same autocast (its graph holds
    the casts). With `export` (a folder), each plan is written there as a plan file
    (`Rockmate.export`: the graph with the costs measured here, and the schedule), named
    `{model}-{ratio}-{solver}.json`: a GPU's plans, studied on a machine without one."""
    model, args, kwargs, loss_fn = zoo.make(name, size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def amp() -> contextlib.AbstractContextManager:
        return torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
    # The loss inside the module: every method's measured step is the whole step, loss included.
    model = zoo.WithLoss(model, loss_fn).to(device)
    args, kwargs = tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor) else a, (args, kwargs))

    def step(module: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            module.zero_grad(set_to_none=True)
            with amp():
                loss = module(*args, **kwargs)
            loss.backward()
            return loss.detach()
        return run

    def peak(module: torch.nn.Module) -> int:
        step(module)()  # warm-up: compilation and lazy allocations are not the step's memory
        module.zero_grad(set_to_none=True)
        return measure_step(step(module), device=device).peak

    eager = copy.deepcopy(model)
    with amp():
        probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    reference = probe.store_all_peak
    # Every plan of this model on the probe's measured costs: a profile measured anew per row
    # moved predictions by up to 10 points, so rows were not comparable.
    times = probe.profile_times()
    rows = [Row(name, 1.0, reference, "eager (store all)", peak(eager), [1.0])]
    logging.info("%s: eager peak %s, predicted store-all %s", name, format_bytes(rows[0].peak), format_bytes(reference))

    peers = [(method, module, peak(module)) for method, module in fixed_peers(name, model)]
    for method, _, measured in peers:
        logging.info("%s: %s: peak %s", name, method, format_bytes(measured))

    # One compiled copy per knob, kept for the budgets' timings. Each gets its own backend,
    # which applies the knob while AOTAutograd partitions: dynamo keys its cache entries by
    # backend, so each copy keeps its own graph (copies sharing a backend shared one: every
    # knob measured the 1.0 copy's peak), and no reset between knobs drops the kept ones.
    torch._dynamo.reset()
    compiled: list[tuple[Row, torch.nn.Module]] = []
    for knob in knobs:
        module = torch.compile(copy.deepcopy(model), backend=aot_eager_with_budget(knob))
        start = time.perf_counter()
        measured = peak(module)  # compiles
        plan_time = time.perf_counter() - start
        compiled.append((Row(name, 0.0, 0, f"torch.compile budget={knob}", measured, plan_time=plan_time), module))
        logging.info("%s: torch.compile, activation_memory_budget=%s: peak %s", name, knob, format_bytes(measured))

    for given in ratios:
        budget = (int(MIN_BUDGET_MARGIN * min_feasible_budget(probe.graph)) if given == "min"
                  else int(float(given) * reference))
        ratio = budget / reference
        planned: list[tuple[Row, torch.nn.Module]] = []
        for solver in solvers:
            row = Row(name, ratio, budget, f"rockplan ({solver})", minimum=given == "min")
            rows.append(row)
            try:
                start = time.perf_counter()
                with amp():
                    rk = Rockmate(copy.deepcopy(model), (args, kwargs), budget, solver=solver, profile=times)
                row.plan_time = time.perf_counter() - start
            except (InfeasibleBudget, InvalidSchedule) as e:
                row.note = str(e).splitlines()[0][:240]
                continue
            row.peak = peak(rk)
            row.predicted_overhead = rk.schedule.predicted_time / rk.store_all_time - 1
            row.floor = time_lower_bound(rk.graph, rk.schedule.budget or budget)[0] / rk.store_all_time - 1
            row.note = f"proven floor {row.floor:+.1%}"
            if lean_rewrites(rk.graph):
                row.note += " (of the lean variant of the graph, which this plan runs)"
            planned.append((row, rk))
            if export is not None:
                export.mkdir(parents=True, exist_ok=True)
                rk.export(export / f"{name}-{'min' if given == 'min' else f'{ratio:.2f}'}-{solver}.json")
        fixed = []
        for method, module, measured in peers:
            fixed.append(Row(name, ratio, budget, method, minimum=given == "min"))
            if measured <= budget:
                fixed[-1].peak = measured
                planned.append((fixed[-1], module))
            else:
                fixed[-1].note = f"peak {format_bytes(measured)}"
        # PyTorch's knob: the largest whose measured peak fits, as a user would search from 1.0
        # down (peaks are not monotonic in the knob: GPT's 0.2 peaks above its 0.6).
        fit = next(((r, m) for r, m in compiled if r.peak <= budget), None)
        knob_row = Row(name, ratio, budget, "torch.compile activation_memory_budget", note="no knob fits",
                       minimum=given == "min")
        if fit is not None:
            knob_row.peak, knob_row.plan_time, knob_row.note = fit[0].peak, fit[0].plan_time, fit[0].method.split()[-1]
            planned.append((knob_row, fit[1]))
        # Every method that fits this budget, and eager, timed in turn.
        for (row, _), rounds in zip(planned, ratios_to_first([step(eager), *(step(m) for _, m in planned)],
                                                             repeats, sync)):
            row.rounds = rounds
        rows.append(knob_row)
        rows += fixed
    return rows


def markdown(rows: list[Row], device: str, heap: str) -> str:
    """The page's body: the measured rows, then rockplan paired with each other method."""
    lines = [
        f"Device: {device}; {heap}. Budget = ratio of "
        "the no-rematerialization step peak predicted from the graph (kernels' scratch included); peaks "
        "measured by rockplan's tracker (the allocator: CUDA's statistics, or the CPU allocator's events "
        "recorded by torch.profiler) and include the loss; time vs eager = median over rounds of the step "
        "time over eager's in the same round (quartiles in brackets), eager and the methods that fit a "
        "budget running their steps in turn. "
        "The proven floor (rockplan rows) is `solvers.bounds.time_lower_bound` on the planned graph: no "
        "schedule within the budget has a smaller predicted overhead.",
        "",
        "| model | budget | method | measured peak | peak / budget | time vs eager | predicted overhead "
        "| plan time | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fraction = f"{r.peak / r.budget:.2f}" if r.peak and r.budget else "-"
        lines.append(
            f"| {r.model} | {_budget(r)} | {r.method} | "
            f"{format_bytes(r.peak) if r.peak else '-'} | {fraction} | "
            f"{_spread(r.rounds)} | "
            f"{f'{r.predicted_overhead:+.1%}' if r.predicted_overhead is not None else '-'} | "
            f"{f'{r.plan_time:.1f} s' if r.plan_time is not None else '-'} | {r.note} |"
        )
    return "\n".join([*lines, *against_others(rows), *not_fastest(rows)]) + "\n"


def _budget(row: Row) -> str:
    return f"{row.ratio:.2f}{' min' if row.minimum else ''} ({format_bytes(row.budget)})"


def _spread(rounds: list[float]) -> str:
    if not rounds:
        return "-"
    q1, median, q3 = quartiles(rounds)
    return f"{median:.2f}" if q1 == q3 else f"{median:.2f} ({q1:.2f}-{q3:.2f})"


def against_others(rows: list[Row]) -> list[str]:
    """The targets' comparison: at each budget, the first rockplan row (the default solver)
    against every other method timed there, paired per round."""
    lines = [
        "",
        "### rockplan against each method, paired per round",
        "",
        "Per round, the default solver's step time over the method's (both run in the same round); "
        "median and quartiles over the rounds. \"faster\" or \"slower\" when both quartiles are on "
        "one side of 1, else \"within noise\". The target asks rockplan to be at or below every "
        "method whose measured peak is at or below its own.",
        "",
        "| model | budget | method | its peak / rockplan's | rockplan / method | rockplan is |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours = next((o for o in rows if o.model == r.model and o.ratio == r.ratio and o.rounds
                     and o.method.startswith("rockplan")), None)
        if ours is None or r is ours or not r.rounds or r.method.startswith("eager"):
            continue
        q1, median, q3 = quartiles([a / b for a, b in zip(ours.rounds, r.rounds)])
        verdict = "faster" if q3 < 1 else "slower" if q1 > 1 else "within noise"
        lines.append(f"| {r.model} | {_budget(r).split(' (')[0]} | {r.method} | {r.peak / ours.peak:.2f} | "
                     f"{median:.2f} ({q1:.2f}-{q3:.2f}) | {verdict} |")
    return lines


def not_fastest(rows: list[Row]) -> list[str]:
    """The target's exceptions, stated: each budget where the default solver did not plan, or
    where a method whose measured peak is at or below the budget (eager included, where it fits)
    has a lower median time than the default solver's, with the reading the columns support:
    the pair within noise, the plan above its proven floor (a better search could gain up to
    the difference), or the plan at its floor (no schedule of the planned graph is predicted
    faster, so the other method's step is faster than the planned graph's ops are priced: the
    cost lies in the runtime or the profile, shown by measured over predicted)."""
    lines = [
        "",
        "### Where rockplan is not the fastest",
        "",
        "Per budget, the fastest method whose measured peak is at or below the budget, where it is "
        "not the default solver; \"rockplan / it\" is paired per round as above. \"measured / "
        "predicted\": rockplan's time vs eager over 1 + its predicted overhead; above 1, its step costs "
        "more than its plan predicts relative to eager.",
        "",
        "| model | budget | fastest method | its time vs eager | rockplan's | rockplan / it | rockplan's predicted "
        "overhead | proven floor | measured / predicted | reading |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    budgets = dict.fromkeys((r.model, r.ratio) for r in rows if r.method.startswith("rockplan"))
    for model, ratio in budgets:
        group = [r for r in rows if r.model == model and (r.ratio == ratio or r.method.startswith("eager"))]
        ours = next((r for r in group if r.method.startswith("rockplan")), None)
        fitting = [r for r in group if r is not ours and r.rounds and r.peak is not None
                   and r.peak <= ours.budget]
        if not fitting:
            continue
        if not ours.rounds:
            lines.append(f"| {model} | {_budget(ours)} | {min(fitting, key=lambda r: r.time_ratio).method} | - | - | - "
                         f"| - | - | - | {ours.method} did not plan: {ours.note} |")
            continue
        best = min(fitting, key=lambda r: r.time_ratio)
        if best.time_ratio >= ours.time_ratio:
            continue
        # Eager's rounds are its own clock: rockplan over eager per round is rockplan's ratio.
        others = best.rounds if not best.method.startswith("eager") else [1.0] * len(ours.rounds)
        q1, median, q3 = quartiles([a / b for a, b in zip(ours.rounds, others)])
        measured_over_predicted = ours.time_ratio / (1 + ours.predicted_overhead)
        if q1 <= 1 <= q3:
            reading = "within noise: the paired quartiles straddle 1"
        elif ours.predicted_overhead - ours.floor > 0.01:
            reading = (f"the plan is {ours.predicted_overhead - ours.floor:.1%} above its proven floor: a better "
                       "search could gain up to that")
        else:
            reading = ("the plan is at its proven floor (within 1 point): the gap lies in the step's cost "
                       "outside the schedule (the runtime, the profile's prices: see measured / predicted)")
        lines.append(
            f"| {model} | {_budget(ours)} | {best.method} | {_spread(best.rounds)} | {_spread(ours.rounds)} | "
            f"{median:.2f} ({q1:.2f}-{q3:.2f}) | {ours.predicted_overhead:+.1%} | {ours.floor:+.1%} | "
            f"{measured_over_predicted:.2f} | {reading} |")
    if len(lines) == 7:
        lines.append("| (none) | | | | | | | | | |")
    return lines


def pareto_plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r.model for r in rows})
    methods = sorted({r.method.split(" budget=")[0] for r in rows})
    colour = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}  # one colour per method
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        by_method: dict[str, dict[int, tuple[float, float, float]]] = {}
        for r in rows:
            if r.model == name and r.peak and r.rounds:
                by_method.setdefault(r.method.split(" budget=")[0], {})[r.peak] = quartiles(r.rounds)
        for method, points in sorted(by_method.items()):
            peaks = sorted(points)
            low, mid, high = (np.array([points[p][i] for p in peaks]) for i in range(3))
            # The median, with a bar from the first to the third quartile over the rounds.
            ax.errorbar([p / 2**20 for p in peaks], mid, yerr=[mid - low, high - mid], marker="o", capsize=2,
                        label=method, color=colour[method])
        ax.set_title(name)
        ax.set_xlabel("measured step peak (MiB)")
        ax.set_ylabel("step time / eager")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Hugging Face GPT-2 (random weights, built from a config) when transformers is installed.
    models = ["mlp", "resnet", "gpt", "unet", *(["hf_gpt2"] if "hf_gpt2" in zoo.ZOO else [])]
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--size", default="default", choices=["tiny", "default", "large"],
                        help="large: the zoo's GPU sizes, whose steps keep a GPU busy (gpt, resnet, hf_llama, hf_bert)")
    parser.add_argument("--ratios", default="1.0,0.7,0.5,0.35,min",
                        help="ratios of the predicted store-all peak; min: the smallest budget a schedule is known for")
    parser.add_argument("--knobs", default=",".join(map(str, COMPILE_KNOBS)),
                        help="torch.compile's activation_memory_budget values tried (one compile each)")
    parser.add_argument("--solvers", default="", help="comma list; default: rockmate (or ilp), rotor, dtr")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(PAGES / "models.md"), help="the generated page (and its plot beside it)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's CPU threads (default: torch's choice). On a machine shared with other jobs, "
                             "1: a thread descheduled stalls the others at every op, and steps slow and scatter")
    parser.add_argument("--autocast", choices=["bf16", "fp16"],
                        help="every method's forward under torch.autocast with this dtype (rockplan planned under it)")
    parser.add_argument("--export-plans", metavar="DIR",
                        help="write each plan (graph with its measured costs, schedule) to DIR as a plan file")
    parser.add_argument("--default-heap", action="store_true",
                        help="leave glibc's malloc thresholds adaptive (see steady_cpu_heap)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    default = [s for s in ("rockmate", "rotor", "dtr", "torch_budget") if s in RUNTIME_SOLVERS] or ["ilp"]
    solvers = args.solvers.split(",") if args.solvers else default
    if "rockmate" not in RUNTIME_SOLVERS and "ilp" not in solvers:
        solvers.insert(0, "ilp")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    if torch.cuda.is_available():
        heap = ("CUDA caching allocator, expandable segments" if cuda_blocks_fit_requests() else
                "CUDA caching allocator, default segments (cached blocks may be handed over whole: "
                "`rockplan.memory.cuda_blocks_fit_requests`)")
    elif not args.default_heap and steady_cpu_heap():
        heap = "CPU heap: glibc's malloc thresholds fixed (mmap 32 MiB, no trim; `steady_cpu_heap`)"
    else:
        heap = "CPU heap: glibc's adaptive thresholds"
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast]
    if autocast:
        heap += f"; every method's forward under torch.autocast({autocast})"
    out = Path(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    knobs = tuple(float(k) for k in args.knobs.split(","))
    command_line = (f"python benchmarks/bench.py --models {args.models} --size {args.size} --ratios {args.ratios} "
                    f"--repeats {args.repeats}{' --solvers ' + args.solvers if args.solvers else ''}"
                    f"{'' if knobs == COMPILE_KNOBS else ' --knobs ' + args.knobs}"
                    f"{f' --threads {args.threads}' if args.threads else ''}"
                    f"{f' --autocast {args.autocast}' if args.autocast else ''}"
                    f"{' --default-heap' if args.default_heap else ''}"
                    f"{' --export-plans ' + args.export_plans if args.export_plans else ''}"
                    f"{'' if out.resolve() == (PAGES / 'models.md').resolve() else ' --out ' + args.out}")
    rows: list[Row] = []
    for name in args.models.split(","):
        ratios = [r if r == "min" else float(r) for r in args.ratios.split(",")]
        rows += bench_model(name, args.size, ratios, args.repeats, solvers, knobs, autocast,
                            Path(args.export_plans) if args.export_plans else None)
        # After each model: a long run keeps what it measured.
        write_page(out, "Models: measured step peak and step time", markdown(rows, device, heap), command_line)
        pareto_plot(rows, out.with_suffix(".png"))
    print(out.read_text())


if __name__ == "__main__":
    main()
