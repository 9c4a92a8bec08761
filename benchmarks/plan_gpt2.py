"""Planning speed on GPT-2 small's shape: capture, then every solver across the budget range.

    python benchmarks/plan_gpt2.py                  # 12 layers, 768 wide, sequence 512, batch 1

The table is printed as it grows and written to docs/benchmarks/planning-gpt2.md (`--out`),
under the header every generated benchmark page shares (`bench_page`).

The target of the solvers issue: rockmate plans a 12-layer, 768-wide GPT-2 in under 10 s on a
2-core CPU at any budget from the no-rematerialization peak down to near the minimum. Costs are
the roofline estimate (`profile="estimate"`): planning speed does not depend on where they come
from, and measuring 700 nodes would dominate the run. The loss is inside the planned module.
Budgets are fractions of the store-all peak, plus the smallest feasible budget found and a
budget between the proven floor and it (where the answer must be a quick, clear refusal).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_page import PAGES, write_page  # noqa: E402  (beside this script, on its path)

import rkgraph  # noqa: E402
from rkgraph.units import format_bytes  # noqa: E402
from rockplan import zoo  # noqa: E402
from solvers import SOLVERS, InfeasibleBudget, budget_bounds  # noqa: E402
from solvers.bounds import time_lower_bound  # noqa: E402

METHODS = ("rockmate", "rotor", "dtr", "checkpoint_blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="gpt2", help="hf_gpt2 size (default: GPT-2 small's shape)")
    parser.add_argument("--ratios", default="1.0,0.95,0.9,0.85,0.8")
    parser.add_argument("--out", "--output", type=Path, default=PAGES / "planning-gpt2.md", help="the generated page")
    args = parser.parse_args()

    model, inputs, kwargs, loss_fn = zoo.make("hf_gpt2", args.size)
    start = time.perf_counter()
    graph = rkgraph.capture(zoo.WithLoss(model, loss_fn), inputs, kwargs, profile="estimate")
    capture_time = time.perf_counter() - start
    bounds = budget_bounds(graph)
    store_all = SOLVERS["store_all"](graph)
    reference = store_all.predicted_peak
    budgets = [(f"{float(r):.2f}", int(float(r) * reference)) for r in args.ratios.split(",")]
    budgets += [("smallest found", bounds.upper)]
    if not bounds.exact:
        budgets += [("between floor and smallest found", (bounds.lower + bounds.upper) // 2)]

    lines = [
        f"Model: hf_gpt2 size {args.size!r}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
        f"input {tuple(inputs[0].shape)}. Captured in {capture_time:.1f} s: {len(graph.forward_nodes)} forward + "
        f"{len(graph.backward_nodes)} backward nodes, {len(graph.blocks)} blocks, "
        f"{len(set(graph.block_classes))} classes. Store-all peak {format_bytes(reference)}; "
        f"{bounds.describe()}.",
        "",
        "Cells: solve time / predicted overhead / peak as a fraction of the store-all peak. Proven floor:",
        "`solvers.bounds.time_lower_bound`, no schedule within the budget has a smaller overhead.",
        "",
        f"| budget | proven floor | {' | '.join(METHODS)} |",
        f"|---|---|{'---|' * len(METHODS)}",
    ]
    print("\n".join(lines), flush=True)
    for label, budget in budgets:
        cells = []
        for method in METHODS:
            start = time.perf_counter()
            try:
                s = SOLVERS[method](graph, budget)
                elapsed = time.perf_counter() - start
                cells.append(f"{elapsed:.1f} s / {s.predicted_time / store_all.predicted_time - 1:.1%} / "
                             f"{s.predicted_peak / reference:.3f}")
            except InfeasibleBudget:
                cells.append(f"{time.perf_counter() - start:.1f} s / infeasible")
            except Exception as error:  # noqa: BLE001  (a benchmark reports every failure and goes on)
                cells.append(f"error: {type(error).__name__}")
        floor = max(0.0, time_lower_bound(graph, budget)[0] / store_all.predicted_time - 1)  # not "-0.0%"
        lines.append(f"| {label} ({format_bytes(budget)}) | {floor:.1%} | {' | '.join(cells)} |")
        print(lines[-1], flush=True)
    write_page(args.out, "Planning speed on GPT-2 small's shape", "\n".join(lines))


if __name__ == "__main__":
    main()
