"""Planning under torch.compile: the first steps of `torch.compile(model, backend=rockplan.backend(...))`.

    python benchmarks/compile_time.py                       # the models below, at 0.7 of the peak
    python benchmarks/compile_time.py --models gpt,llama --ratio 0.5

The backend plans inside the training steps (`rockplan/backend.py`): the first step captures
each graph with Dynamo and AOTAutograd and runs a schedule built without a search; it ends by
resolving a ratio budget and splitting the budget across the graphs with the planner's plans;
the second step compiles the chosen plans again. Per model, in a fresh interpreter
(`--one NAME` is that child's entry point), with the plan cache in a temporary directory of
its own:
- the seconds of the first four training steps (forward and backward) under torch.compile
  with rockplan's backend, and what capture, planning and compiling added to the first three
  (their sum less three fourth steps: a guard that fails in the second step, as transformers'
  classification losses make one fail by setting `config.problem_type`, has Dynamo capture the
  graph again, which then runs the plan it had, compiled again for the joint split's plan
  where that changed);
- the same in another fresh interpreter with the cache the first one wrote, as a script run
  again (restart);
- torch.compile with AOTAutograd and no planning (`backend="aot_eager"`): what compiling alone
  adds to its first three steps, and its step;
- the predicted time of the backend's plans (summed over its graphs) over the predicted time
  of `Rockmate`'s plan at the same budget in bytes, on the same estimated costs: 1.00 where the
  backend's plan of a model that is one graph is Rockmate's.
Models are `plan_time.build`'s (the loss inside the module). The page is
docs/benchmarks/compile-time.md (`--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_page import PAGES, child_row, write_page  # noqa: E402  (beside this script, on its path)
from plan_time import build  # noqa: E402

MODELS = ("gpt", "resnet", "unet", "hf-gpt2", "vit", "hf-resnet50", "bert")
STEPS = 4  # the last is steady: a graph changed by a guard failing in the second step is planned in it


def _call(module: object, sample: object) -> object:
    """`module` called on `sample` as `Rockmate` takes it: a tensor, a tuple of arguments, or
    (args, kwargs)."""
    if isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[1], dict):
        return module(*sample[0], **sample[1])
    return module(*sample) if isinstance(sample, tuple) else module(sample)


def _steps(module: object, sample: object) -> list[float]:
    """Seconds of each of STEPS training steps of `module` (forward, backward of its loss)."""
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        _call(module, sample).backward()
        seconds.append(time.perf_counter() - start)
    return seconds


def compile_one(name: str, ratio: float, cache: str, restart: bool) -> dict[str, object]:
    """The steps of model `name` under torch.compile with rockplan's backend at `ratio`, plans
    kept in `cache`; unless `restart`, also with aot_eager, and Rockmate's plan at the same bytes."""
    import torch
    import torch._dynamo

    import rockplan
    from rockplan import Rockmate
    from solvers import InfeasibleBudget, simulate

    torch.manual_seed(0)
    model, sample = build(name)
    backend = rockplan.backend(ratio, plan_cache=cache)
    try:
        steps = _steps(torch.compile(model, backend=backend, dynamic=False), sample)
    except InfeasibleBudget as e:  # raised as the first step ends: the ratio's bytes are below what fits
        return {"model": name, "infeasible": str(e)}
    row: dict[str, object] = {"model": name, "graphs": len(backend.graphs), "steps": steps,
                              "nodes": sum(len(g.plan.times) for g in backend.graphs)}
    if restart:
        return row
    torch._dynamo.reset()
    row["aot_eager"] = _steps(torch.compile(model, backend="aot_eager", dynamic=False), sample)
    predicted = sum(simulate(g.plan.graph, g.plan.schedule).time for g in backend.graphs)
    if len(backend.graphs) == 1:
        torch._dynamo.reset()
        planned = Rockmate(model, sample, backend.budget, profile="estimate", plan_cache=False).plan
        row["versus_rockmate"] = predicted / simulate(planned.graph, planned.schedule).time
    return row


def _child(name: str, ratio: float, cache: str, restart: bool = False) -> dict[str, object] | None:
    """`compile_one`'s row, from a fresh interpreter (None, said on stderr, when it failed)."""
    return child_row(__file__, "--one", name, "--ratio", str(ratio), "--cache", cache,
                     *(["--restart"] if restart else []), label=name)


def _added(steps: list[float]) -> float:
    """What the first steps took beyond as many steps like the last."""
    return sum(steps[:-1]) - (len(steps) - 1) * steps[-1]


def _seconds(steps: list[float]) -> str:
    return ", ".join(f"{s:.1f}" for s in steps)


def markdown(rows: list[dict[str, object]], ratio: float) -> str:
    lines = [
        f"Budget: {ratio} of the step's peak without rematerialization (a ratio: the first step runs each graph "
        "on a schedule built without a search, and the budget is resolved and split as it ends). Seconds per "
        "training step (forward and backward); *planning added* = the first three steps less three fourth steps "
        "(Dynamo's and AOTAutograd's capture, the planning, compiling the chosen plans again; a graph Dynamo "
        "compiles again unchanged in the second step runs the plan it had). *Restart*: a fresh process with the "
        "plan cache the first wrote. *aot_eager*: torch.compile with AOTAutograd and no planning, what compiling "
        "adds to its first three steps, and its fourth. *Plan vs "
        "Rockmate's*: the predicted time of the backend's plans over Rockmate's plan at the same budget in "
        "bytes, estimated costs (one-graph models).",
        "",
        "| model | graphs | nodes | steps 1, 2, 3 s | step 4 s | planning added s | restart: steps 1, 2, 3 s | "
        "restart: added s | aot_eager: compile added s | aot_eager: step s | plan vs Rockmate's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "infeasible" in r:
            lines.append(f"| {r['model']} | {r['infeasible']} |" + " |" * 9)
            continue
        steps, again, eager = r["steps"], r.get("restart"), r["aot_eager"]
        versus = r.get("versus_rockmate")
        lines.append(
            f"| {r['model']} | {r['graphs']} | {r['nodes']} | {_seconds(steps[:-1])} | {steps[-1]:.2f} | "
            f"{_added(steps):.1f} | {'' if again is None else _seconds(again[:-1])} | "
            f"{'' if again is None else f'{_added(again):.1f}'} | {_added(eager):.1f} | {eager[-1]:.2f} | "
            f"{'' if versus is None else f'{versus:.3f}'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ratio", type=float, default=0.7)
    parser.add_argument("--out", type=Path, default=PAGES / "compile-time.md", help="the generated page")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: run this model, print JSON
    parser.add_argument("--cache", help=argparse.SUPPRESS)  # the child's plan cache
    parser.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)  # the child runs again
    args = parser.parse_args()
    if args.one:
        print(json.dumps(compile_one(args.one, args.ratio, args.cache, args.restart)))
        return
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="rockplan-plans-") as cache:
            row = _child(name, args.ratio, cache)
            again = None if row is None or "infeasible" in row else _child(name, args.ratio, cache, restart=True)
        if row is None:
            continue
        row["restart"] = None if again is None else again["steps"]
        rows.append(row)
        print(f"{name}: {row.get('infeasible') or row['steps']}", flush=True)
        write_page(args.out, "Planning under torch.compile", markdown(rows, args.ratio))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
