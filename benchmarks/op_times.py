"""Predicted against in-step times, per op: where a plan's measured overhead comes from.

    python benchmarks/op_times.py                       # the zoo GPT at 0.35, rockmate, 7 steps
    python benchmarks/op_times.py --model unet --budget 0.5 --steps 9
    python benchmarks/op_times.py --out docs/benchmarks/op-times.md   # also write the page

Plans the store-all step and the budget's on one measured profile, then runs both, each op of
the generated code timed inside real training steps (an fx Interpreter as AOTAutograd's
compiler, so the step is slower as a whole; the ops' own times are what is compared). Per op
kind, it prints what the plan's schedule predicts (the profile's node times, counted as often
as the schedule computes them) against the median over the steps of what the kind took in the
step. This is how the lean variant's mask packing was found priced at 1.6 ms where a step spent
12.6 ms on it (docs/design-notes.md).
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_page import write_page  # noqa: E402  (beside this script, on its path)
from torch import fx  # noqa: E402

import rockplan.module  # noqa: E402
from rkgraph.rewrites import lean_rewrites  # noqa: E402
from rockplan import Rockmate, steady_cpu_heap, zoo  # noqa: E402


class _Timed(fx.Interpreter):
    """Runs a generated graph, adding each call's seconds to `into[target]`."""

    def __init__(self, gm: fx.GraphModule, into: dict[str, float]) -> None:
        super().__init__(gm)
        self.into = into

    def run_node(self, n: fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        start = time.perf_counter()
        result = super().run_node(n)
        self.into[str(n.target)] += time.perf_counter() - start
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="default", choices=["tiny", "default"])
    parser.add_argument("--budget", type=float, default=0.35)
    parser.add_argument("--solver", default="rockmate")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rows", type=int, default=20, help="op kinds shown, largest difference first")
    parser.add_argument("--out", type=Path, help="also write the tables to this page (docs/benchmarks/op-times.md)")
    args = parser.parse_args()

    steady_cpu_heap()
    torch.manual_seed(0)
    model, model_args, kwargs, loss_fn = zoo.make(args.model, args.size)
    model = zoo.WithLoss(model, loss_fn)
    step_times: dict[str, float] = collections.defaultdict(float)

    def timing_compiler(gm: fx.GraphModule, _example_inputs):
        def run(inputs: list) -> object:
            return _Timed(gm, step_times).boxed_run(inputs)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    # A diagnostic, not an option: the runtime's compiler is swapped for this run only.
    rockplan.module.compile_generated = timing_compiler
    store_all = Rockmate(copy.deepcopy(model), (model_args, kwargs), 1.0, solver="store_all")
    plan = Rockmate(copy.deepcopy(model), (model_args, kwargs), args.budget, solver=args.solver,
                    profile=store_all.profile_times())

    def step(module: Rockmate) -> dict[str, float]:
        step_times.clear()
        module.zero_grad(set_to_none=True)
        module(*model_args, **kwargs).backward()
        return dict(step_times)

    for module in (store_all, plan):
        step(module)  # warm-up
    measured: dict[str, list[dict[str, float]]] = {"store all": [], "plan": []}
    for _ in range(args.steps):
        measured["store all"].append(step(store_all))
        measured["plan"].append(step(plan))

    def predicted(module: Rockmate) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for name in module.schedule.computes():
            node = module.graph.node(name)
            out[node.op] += node.time
        return out

    def in_step(runs: list[dict[str, float]]) -> dict[str, float]:
        return {kind: statistics.median(run.get(kind, 0.0) for run in runs) for kind in {k for r in runs for k in r}}

    rewrites = lean_rewrites(plan.graph)
    title = (f"{args.model} at {args.budget}, {args.solver}: {len(plan.graph.nodes)} nodes"
             f"{' (lean variant: ' + '; '.join(rewrites) + ')' if rewrites else ''}")
    print(title)
    page = [f"{title}; {args.steps} steps of each, after a warm-up. Per op kind, largest difference first: the "
            "profile's time summed over the schedule's computations (predicted) against the median over the steps "
            "of the kind's time inside real steps (an fx Interpreter as AOTAutograd's compiler)."]
    for label, module in (("store all", store_all), ("plan", plan)):
        pred, got = predicted(module), in_step(measured[label])
        total = (f"{label}: predicted {1e3 * sum(pred.values()):.1f} ms, its ops in the step "
                 f"{1e3 * sum(got.values()):.1f} ms (median per kind, summed)")
        print(f"\n{total}")
        print(f"  {'op':48} {'predicted ms':>12} {'in step ms':>11} {'ratio':>6}")
        page += ["", f"**{total}**", "", "| op | predicted ms | in step ms | ratio |", "|---|---|---|---|"]
        kinds = sorted(set(pred) | set(got), key=lambda k: -abs(got.get(k, 0.0) - pred.get(k, 0.0)))
        for kind in kinds[:args.rows]:
            p, g = 1e3 * pred.get(kind, 0.0), 1e3 * got.get(kind, 0.0)
            ratio = g / p if p else float("inf")
            print(f"  {kind[:48]:48} {p:12.2f} {g:11.2f} {ratio:6.2f}")
            page.append(f"| `{kind}` | {p:.2f} | {g:.2f} | {ratio:.2f} |")
    if args.out:
        write_page(args.out, "Predicted against in-step op times", "\n".join(page))


if __name__ == "__main__":
    main()
