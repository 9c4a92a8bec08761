"""Plans against the proven floor on a launch-bound cost model: a GPU's tight-budget gap, on a CPU.

    python benchmarks/launch_bound.py                                  # hf_llama, hf_bert; 0.5, 0.35, min; bf16
    python benchmarks/launch_bound.py --models hf_llama --ratios 0.35 --dtype fp32
    python benchmarks/launch_bound.py --out docs/benchmarks/launch-bound.md   # also write the page
    python benchmarks/launch_bound.py --polish 60   # also plan with solver_options={"polish_time": 60}

On a GPU a small model's step is bound by kernel launches: each op costs about the same few
microseconds whatever its size, and plans measured there recompute hundreds of small ops. Plans
on CPU-measured profiles, where a few large ops dominate, do not show what the search does with
such costs. This plans each zoo model (captured on CPU, under torch.autocast with `--dtype` as
mixed-precision training does) on node times that imitate a GPU's: per kernel (an op that is not
a view) LAUNCH_SECONDS, plus the roofline's max(FLOPs / FLOPS, bytes / BANDWIDTH), passed to
`Rockmate` as a frozen profile. Per budget it reports the plan's predicted overhead against the
store-all step, the proven floor's, the member that planned it and the planning time: where the
two overheads differ, the search (or the floor) leaves a gap on GPU-like costs. With `--polish`,
each budget is planned again with that many seconds of `polish_time` (peak shaving searching on
from the best schedule where it leaves a gap): how much of the gap more search time closes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench import MIN_BUDGET_MARGIN  # noqa: E402  (beside this script, on its path)
from bench_page import write_page  # noqa: E402

from rkgraph.profile import estimated_seconds  # noqa: E402
from rockplan import Rockmate, zoo  # noqa: E402
from rockplan.planner import Plan  # noqa: E402
from solvers import min_feasible_budget  # noqa: E402

# A data-centre GPU's order of magnitude: the host's cost of launching one kernel through
# PyTorch (torch.profiler on an H100 counts about this much in cudaLaunchKernel alone, before
# the dispatcher's and Python's share), and the roofline `rkgraph.profile` uses for CUDA.
LAUNCH_SECONDS = 10e-6
FLOPS = 4e14
BANDWIDTH = 3e12
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def launch_bound_times(plan: Plan) -> dict[str, float]:
    """Node name -> seconds on the launch-bound model, for autograd's graph of `plan`."""
    return estimated_seconds(plan.graph, plan.joint.module, FLOPS, BANDWIDTH, LAUNCH_SECONDS)


def plan_rows(name: str, size: str, ratios: list[float | str], dtype: torch.dtype | None,
              polish: float = 0.0) -> list[str]:
    """One table row per budget (a ratio of the store-all peak, or "min") for zoo model `name`;
    with `polish` seconds, the same planned with that `polish_time` too."""
    model, args, kwargs, loss = zoo.make(name, size)
    model = zoo.WithLoss(model, loss) if loss is not None else model

    def autocast() -> contextlib.AbstractContextManager[object]:
        return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()

    with autocast():
        captured = Rockmate(model, (args, kwargs), 1.0, solver="store_all", profile="estimate")
    times = launch_bound_times(captured.plan)
    rows = []
    for ratio in ratios:
        # "min" as bench.py's: the smallest budget a schedule is known for, with its margin (memory
        # does not depend on times; at the very least only the minimum-memory schedule may fit).
        budget = int(MIN_BUDGET_MARGIN * min_feasible_budget(captured.plan.graph)) if ratio == "min" else ratio
        cells = []
        for options in ({}, {"polish_time": polish}) if polish else ({},):
            started = time.perf_counter()
            with autocast():
                planned = Rockmate(model, (args, kwargs), budget, profile=times, solver_options=options)
            seconds = time.perf_counter() - started
            schedule, reference = planned.plan.schedule, planned.plan.reference.predicted_time
            floor = schedule.lower_bound or 0.0
            cells += [f"{100 * (schedule.predicted_time / reference - 1):+.1f}%",
                      f"{100 * (floor / reference - 1):+.1f}%",
                      str(schedule.extra.get("schedule_from", schedule.solver)), f"{seconds:.1f}"]
        rows.append(f"| {name} | {ratio} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="hf_llama,hf_bert")
    parser.add_argument("--size", default="default")
    parser.add_argument("--ratios", default="0.5,0.35,min")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--polish", type=float, default=0.0,
                        help="also plan each budget with this solver option polish_time (seconds)")
    parser.add_argument("--out", type=Path, help="also write the table to this page")
    args = parser.parse_args()
    ratios = [r if r == "min" else float(r) for r in args.ratios.split(",")]
    lines = [f"Zoo models at size {args.size}, captured on CPU under torch.autocast({args.dtype}) "
             f"(none for fp32), planned on a launch-bound cost model: {LAUNCH_SECONDS * 1e6:.0f} µs per "
             f"kernel plus max(FLOPs / {FLOPS:.0e}, bytes / {BANDWIDTH:.0e}). Overheads against the step "
             "storing everything; the floor is the proven one the plan carries (no plan within the budget "
             "is faster).", "",
             "| model | budget | plan | proven floor | planned by | planning s |"
             + (f" polished {args.polish:g} s: plan | proven floor | planned by | planning s |" if args.polish else ""),
             "|---|---|---|---|---|---|" + ("---|---|---|---|" if args.polish else "")]
    print("\n".join(lines[2:]))
    for name in args.models.split(","):
        lines += plan_rows(name, args.size, ratios, DTYPES[args.dtype], args.polish)
    if args.out:
        write_page(args.out, "Plans on a launch-bound cost model", "\n".join(lines))


if __name__ == "__main__":
    main()
