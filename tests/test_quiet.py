"""Planning prints nothing on stdout: a library's output belongs to its caller (and a CLI's
stdout to its data). HiGHS prints a banner once per process when its Python wrapper is
constructed, so each check runs in a fresh interpreter, where that first construction happens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Checkmate's flat MILP, the saved-values MILP and the portfolio (whose chain stage solves
# Checkmate's MILP per block), on a graph small enough to solve in a second or two.
PLANS = """
from solvers import budget_bounds, solve_ilp, solve_rockmate, solve_saved_values, solve_store_all
from tests.graph_factories import training_graph
graph = training_graph([40, 80, 60, 80, 40, 60], [1.0, 2.0, 1.0, 3.0, 1.0, 2.0], skips=[(0, 3)], block_size=2,
                       param_grad_size=1)
peak, smallest = solve_store_all(graph).predicted_peak, budget_bounds(graph).upper
assert smallest < peak
for solve in (solve_ilp, solve_saved_values, solve_rockmate):
    solve(graph, (smallest + peak) // 2, time_limit=2)
"""


def test_planning_with_the_milps_prints_nothing_on_stdout() -> None:
    done = subprocess.run([sys.executable, "-c", PLANS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
