"""solvers: a solver is a function (graph, budget, **options) -> Schedule; `simulate` referees.

Each solver takes its own keyword options and refuses others (`solver_options` lists them)."""

import inspect
from collections.abc import Callable

from solvers.bounds import budget_bounds, min_feasible_budget
from solvers.checkmate_graphs import CHECKMATE_GRAPHS, checkmate_reference_peak, load_checkmate_graph
from solvers.checkpoint_blocks import solve_checkpoint_blocks
from solvers.dtr import solve_dtr
from solvers.greedy_checkpoints import solve_greedy_checkpoints
from solvers.peak_shaving import solve_peak_shaving
from solvers.portfolio import solve_ilp, solve_rockmate
from solvers.rotor import solve_rotor
from solvers.saved_values import solve_saved_values
from solvers.schedule import Op, Schedule
from solvers.simulate import InfeasibleBudget, InvalidSchedule, SimulationResult, free_at_last_use, simulate
from solvers.sqrt_segments import solve_sqrt_segments
from solvers.store_all import solve_store_all
from solvers.torch_budget import solve_torch_budget

SOLVERS: dict[str, Callable[..., Schedule]] = {
    "store_all": solve_store_all,
    "checkpoint_blocks": solve_checkpoint_blocks,
    "sqrt_segments": solve_sqrt_segments,
    "greedy_checkpoints": solve_greedy_checkpoints,
    "ilp": solve_ilp,
    "rotor": solve_rotor,
    "rockmate": solve_rockmate,
    "dtr": solve_dtr,
    "peak_shaving": solve_peak_shaving,
    "saved_values": solve_saved_values,
}
# Every solver in SOLVERS runs on any graph, imported ones included; these need a captured
# graph (`graph.joint`), so the runtime offers them but graph-only tools do not.
CAPTURED_GRAPH_SOLVERS: dict[str, Callable[..., Schedule]] = {"torch_budget": solve_torch_budget}
RUNTIME_SOLVERS = SOLVERS | CAPTURED_GRAPH_SOLVERS


def solver_options(name: str) -> list[str]:
    """The keyword options solver `name` takes (after the graph and the budget)."""
    return list(inspect.signature(RUNTIME_SOLVERS[name]).parameters)[2:]

__all__ = [
    "CAPTURED_GRAPH_SOLVERS", "CHECKMATE_GRAPHS", "RUNTIME_SOLVERS", "SOLVERS", "InfeasibleBudget",
    "InvalidSchedule", "Op", "Schedule", "SimulationResult", "budget_bounds", "checkmate_reference_peak",
    "free_at_last_use", "load_checkmate_graph", "min_feasible_budget", "simulate",
    "solver_options", "solve_checkpoint_blocks", "solve_dtr", "solve_greedy_checkpoints", "solve_ilp",
    "solve_peak_shaving", "solve_rockmate", "solve_rotor", "solve_saved_values", "solve_sqrt_segments",
    "solve_store_all", "solve_torch_budget",
]
