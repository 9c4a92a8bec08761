"""Our solvers on the Checkmate paper's graphs, beside the reference MILP rows of their README
(benchmarks/data/checkmate-graphs/README.md).

    python benchmarks/checkmate.py                       # fcn8 and unet, rockmate and ilp, 90 s limit
    python benchmarks/checkmate.py --graphs fcn8 segnet --time-limit 30 --out table.md
    python benchmarks/checkmate.py --graphs fcn8 unet segnet mobilenet --tenth --gap 0.00002   # the published page

The table is printed as it grows and written to docs/benchmarks/checkmate.md (`--out`), under
the header every generated benchmark page shares (`bench_page`).

Budgets are the README's fractions of the peak without rematerialization; overhead is
(schedule time / sum of all node times) - 1, as in the README. Baselines are listed once per
budget, with their own peak, when they fit. Reference and ours run on the same kind of machine
but not side by side, so compare times loosely and overheads closely. "lower bound" is
`solvers.bounds.time_lower_bound`: no schedule within the budget has a smaller overhead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_page import PAGES, write_page  # noqa: E402  (beside this script, on its path)

from solvers import (  # noqa: E402  (the path above makes the script runnable from anywhere)
    CHECKMATE_GRAPHS,
    SOLVERS,
    InfeasibleBudget,
    Schedule,
    checkmate_reference_peak,
    load_checkmate_graph,
    solve_checkpoint_blocks,
    solve_sqrt_segments,
    solve_store_all,
    solver_options,
)
from solvers.bounds import time_lower_bound  # noqa: E402

# (graph, budget fraction) -> (overhead, solve time in s): the README's HiGHS reference rows.
REFERENCE: dict[tuple[str, float], tuple[float, float]] = {
    ("fcn8", 0.90): (0.0003, 6.1), ("fcn8", 0.70): (0.0089, 28.9), ("fcn8", 0.62): (0.0292, 46.7),
    ("unet", 0.90): (0.0113, 9.0), ("unet", 0.70): (0.0297, 27.2), ("unet", 0.50): (0.0735, 39.6),
    ("unet", 0.42): (0.1229, 90.0),
    ("segnet", 0.90): (0.0010, 27.1), ("segnet", 0.70): (0.0031, 12.0), ("segnet", 0.50): (0.8105, 90.0),
    ("mobilenet", 0.90): (0.0016, 51.0), ("mobilenet", 0.70): (0.0073, 48.6),
    ("mobilenet", 0.50): (0.0181, 124.3), ("mobilenet", 0.30): (0.0512, 200.0),
}

HEADER = ("| graph | budget | solver | overhead | lower bound | peak | solve time | gap | status "
          "| ref. overhead | ref. time |\n|---|---|---|---|---|---|---|---|---|---|---|")


def row(graph: str, fraction: float, s: Schedule, total: float, reference_peak: int, bound: float) -> str:
    ref_overhead, ref_time = REFERENCE.get((graph, fraction), (None, None))
    overhead = s.predicted_time / total - 1
    gap = "" if s.gap is None else f"{s.gap:.4f}"
    status = str(s.extra.get("status", ""))
    if s.extra.get("schedule_from", s.solver) != s.solver:
        status += f" (kept {s.extra['schedule_from']})"
    ref = ("", "") if ref_overhead is None else (f"{ref_overhead:.2%}", f"{ref_time:.1f} s")
    return (f"| {graph} | {fraction:.2f} | {s.solver} | {overhead:.3%} | {bound / total - 1:.3%} "
            f"| {s.predicted_peak / reference_peak:.3f} | {s.solve_time:.1f} s | {gap} | {status} "
            f"| {ref[0]} | {ref[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", nargs="+", default=["fcn8", "unet"])
    parser.add_argument("--time-limit", type=float, default=90.0, help="seconds per solve")
    parser.add_argument("--gap", type=float, default=0.001,
                        help="relative gap at which a solve stops (the overheads compared are fractions of a percent)")
    parser.add_argument("--tenth", action="store_true",
                        help="limit each solve to a tenth of the reference's time for that row (the issue's target)")
    parser.add_argument("--solvers", nargs="+", default=["rockmate", "ilp"], choices=sorted(SOLVERS))
    parser.add_argument("--out", "--output", type=Path, default=PAGES / "checkmate.md", help="the generated page")
    args = parser.parse_args()

    lines = [HEADER]
    print(HEADER, flush=True)
    for name in args.graphs:
        graph = load_checkmate_graph(CHECKMATE_GRAPHS / f"{name}.json")
        reference_peak = checkmate_reference_peak(graph)
        total = sum(n.time for n in graph.nodes)
        baselines = [solve_store_all(graph), solve_checkpoint_blocks(graph), solve_sqrt_segments(graph)]
        for fraction in sorted((f for g, f in REFERENCE if g == name), reverse=True):
            budget = int(fraction * reference_peak)
            schedules = [b for b in baselines if b.predicted_peak <= budget]
            bound = time_lower_bound(graph, budget)[0]
            for solver in args.solvers:
                start = time.perf_counter()
                try:
                    limit = REFERENCE[name, fraction][1] / 10 if args.tenth else args.time_limit
                    options = {"time_limit": limit, "mip_rel_gap": args.gap, "gap": args.gap}
                    taken = {k: v for k, v in options.items() if k in solver_options(solver)}
                    schedules.append(SOLVERS[solver](graph, budget, **taken))
                except InfeasibleBudget as error:
                    lines.append(f"| {name} | {fraction:.2f} | {solver} | infeasible: {error} "
                                 f"({time.perf_counter() - start:.1f} s) |||||||")
                    print(lines[-1], flush=True)
            for s in schedules:
                lines.append(row(name, fraction, s, total, reference_peak, bound))
                print(lines[-1], flush=True)
    limits = ("each solve limited to a tenth of the reference's time for its row" if args.tenth
              else f"each solve limited to {args.time_limit:g} s")
    intro = (f"Our solvers ({', '.join(args.solvers)}) and the baselines that fit, on Checkmate's graphs "
             "(benchmarks/data/checkmate-graphs/, whose README gives their source, the accounting and the "
             f"reference MILP rows), one solve at a time; {limits}, relative gap {args.gap:g}. Budget: a fraction "
             "of the graph's peak without rematerialization; overhead: schedule time over the sum of all node "
             "times, minus 1; lower bound: the proven floor (`solvers.bounds.time_lower_bound`), the smallest "
             "overhead any schedule within the budget can have; peak: the schedule's simulated peak over the "
             "peak without rematerialization; status: the solver's, and which schedule it kept; ref.: the "
             "reference MILP's row, measured on another run of the same kind of machine.")
    write_page(args.out, "Checkmate's graphs: overhead and solve time", intro + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
