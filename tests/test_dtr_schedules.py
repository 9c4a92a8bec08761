"""DTR's schedules are pinned: the incremental bookkeeping of `solvers.dtr` (cached
recomputability and eviction costs, updated only where an eviction or a computation changes
them) must evict exactly what the plain recursive replay evicted.

tests/data/dtr_schedules.json holds, per case, a fingerprint of the schedule (its ops and phase
split), its predicted time and peak, or "infeasible". It was written by the recursive
implementation, before the rewrite (`python tests/test_dtr_schedules.py` writes it again from
the code in the tree: only do that for a deliberate change of DTR's choices, and say why).
The cases cover Checkmate's graphs (single-output nodes, real costs) and random training graphs
(multi-output backward nodes, random nodes, workspaces, integer costs full of ties), with and
without replayable random nodes kept, from no rematerialization down to failure.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rkgraph.graph import RematGraph  # noqa: E402
from solvers import (  # noqa: E402
    CHECKMATE_GRAPHS,
    InfeasibleBudget,
    budget_bounds,
    load_checkmate_graph,
    solve_dtr,
    solve_store_all,
)
from solvers.dtr import HEURISTICS  # noqa: E402
from tests.graph_factories import chain_graph, random_training_graph  # noqa: E402

EXPECTED = Path(__file__).resolve().parent / "data" / "dtr_schedules.json"
CHECKMATE_RATIOS = (0.95, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2)
# On the small random graphs, budgets between the smallest known to fit and the store-all peak
# (0 is the smallest known, 1 the peak; below 0, toward the proven floor).
RANDOM_STEPS = (0.8, 0.5, 0.25, 0.1, 0.0, -0.5)
RANDOM_SEEDS = range(40)


def _with_replayable_draws(graph: RematGraph) -> RematGraph:
    """Every third forward node draws replayable random numbers (`rng`): what `keep_drawn` keeps."""
    for node in graph.forward_nodes[1::3]:
        if not node.random:
            node.rng = True
    return graph


def _budgets(graph: RematGraph, ratios: tuple[float, ...]) -> dict[str, int]:
    peak = solve_store_all(graph).predicted_peak
    return {str(ratio): int(ratio * peak) for ratio in ratios}


def _stepped_budgets(graph: RematGraph) -> dict[str, int]:
    peak = solve_store_all(graph).predicted_peak
    bounds = budget_bounds(graph)
    span = {True: peak - bounds.upper, False: bounds.upper - bounds.lower}
    return {f"step{step}": int(bounds.upper + step * span[step >= 0]) for step in RANDOM_STEPS}


def _graphs() -> dict[str, tuple[RematGraph, dict[str, int], bool]]:
    """name -> (graph, budgets by label, whether to also run keep_drawn)."""
    graphs = {}
    for path in sorted(CHECKMATE_GRAPHS.glob("*.json")):
        graph = load_checkmate_graph(path)
        graphs[path.stem] = (graph, _budgets(graph, CHECKMATE_RATIOS), False)
    for seed in RANDOM_SEEDS:
        graph = random_training_graph(seed, max_forward=16)
        graphs[f"random{seed}"] = (graph, _stepped_budgets(graph), False)
        graph = _with_replayable_draws(random_training_graph(seed, max_forward=16))
        graphs[f"random{seed}-rng"] = (graph, _stepped_budgets(graph), True)
    return graphs


def fingerprint(graph: RematGraph, budget: int, heuristic: str, keep_drawn: bool) -> dict[str, object] | str:
    try:
        schedule = solve_dtr(graph, budget, heuristic=heuristic, keep_drawn=keep_drawn)
    except InfeasibleBudget:
        return "infeasible"
    text = "\n".join(f"{op.kind} {op.name}" for op in schedule.ops) + f"\n{schedule.forward_length}"
    return {"ops": hashlib.sha256(text.encode()).hexdigest()[:16], "time": schedule.predicted_time,
            "peak": schedule.predicted_peak}


def observed() -> dict[str, object]:
    found: dict[str, object] = {}
    for name, (graph, budgets, rng) in _graphs().items():
        for keep_drawn in (False, True) if rng else (False,):
            for heuristic in HEURISTICS:
                for label, budget in budgets.items():
                    key = f"{name} {heuristic}{' keep_drawn' if keep_drawn else ''} {label}"
                    found[key] = fingerprint(graph, budget, heuristic, keep_drawn)
    return found


def test_dtr_schedules_are_those_of_the_recursive_replay() -> None:
    expected = json.loads(EXPECTED.read_text())
    found = observed()
    assert found.keys() == expected.keys()
    differ = [key for key in expected if found[key] != expected[key]]
    assert not differ, f"{len(differ)} of {len(expected)} DTR schedules changed, first: {differ[0]}: " \
                       f"{found[differ[0]]} instead of {expected[differ[0]]}"
    # The cases reach both ends (failures, and hundreds of distinct schedules that fit).
    assert "infeasible" in expected.values()
    assert len({str(v) for v in expected.values()}) > 300


if __name__ == "__main__":
    EXPECTED.write_text(json.dumps(observed(), indent=0, sort_keys=True) + "\n")


def test_dtr_runs_on_chains_longer_than_the_recursion_limit() -> None:
    graph = chain_graph(3 * sys.getrecursionlimit())
    schedule = solve_dtr(graph, int(0.3 * solve_store_all(graph).predicted_peak))
    assert schedule.predicted_time > sum(node.time for node in graph.nodes)  # it recomputed


def test_dtr_gives_up_at_its_time_limit_and_the_portfolio_gives_each_run_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Near its floor DTR can thrash for minutes (evicting what it must recompute soon); with a
    time limit it stops with InfeasibleBudget, which the portfolio takes as no schedule, and
    the portfolio limits every DTR run it makes."""
    from solvers import portfolio

    graph = chain_graph(50)
    budget = int(0.3 * solve_store_all(graph).predicted_peak)
    assert solve_dtr(graph, budget, time_limit=None).predicted_peak <= budget
    with pytest.raises(InfeasibleBudget, match="time limit"):
        solve_dtr(graph, budget, time_limit=0.0)
    limits: list[float | None] = []

    def spied(*args: object, time_limit: float | None = None, **kwargs: object) -> object:
        limits.append(time_limit)
        return solve_dtr(*args, time_limit=time_limit, **kwargs)

    monkeypatch.setattr(portfolio, "solve_dtr", spied)
    portfolio.heuristic_candidates(graph, budget, time_limit=2.0)
    assert limits and all(limit is not None and limit <= portfolio.DTR_MIN_LOOK for limit in limits)


@pytest.mark.parametrize("heuristic", ["dtr", "next_use"])
def test_a_held_eviction_cost_is_the_one_its_neighbourhoods_give(
        heuristic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DTR holds each tensor's eviction cost until a change of state forgets either of its
    neighbourhoods: every cost it answers from what it holds is the one computed afresh."""
    from solvers import dtr

    costed = dtr._DtrRun.eviction_cost
    answered = []

    def checked(run: dtr._DtrRun, d: str) -> float:
        cost = costed(run, d)
        held = run.cost_of.pop(d)
        assert costed(run, d) == held == cost, d
        answered.append(d)
        return cost

    monkeypatch.setattr(dtr._DtrRun, "eviction_cost", checked)
    for seed in range(8):
        graph = random_training_graph(seed)
        low = budget_bounds(graph).upper
        for budget in (low, (low + solve_store_all(graph).predicted_peak) // 2):
            solve_dtr(graph, budget, heuristic=heuristic)
    assert answered
