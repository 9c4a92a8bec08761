"""The Checkmate paper's graphs: loading, the README's accounting, and the ILP on two of them."""

from __future__ import annotations

import pytest

from rkgraph.blocks import derived_blocks
from solvers import (
    CHECKMATE_GRAPHS,
    budget_bounds,
    checkmate_reference_peak,
    load_checkmate_graph,
    simulate,
    solve_checkpoint_blocks,
    solve_dtr,
    solve_ilp,
    solve_peak_shaving,
    solve_store_all,
)
from solvers.bounds import time_lower_bound


def test_vgg16_loads_as_a_training_graph() -> None:
    graph = load_checkmate_graph(CHECKMATE_GRAPHS / "vgg16.json")
    assert len(graph.nodes) == 45 and len(graph.forward_nodes) == 22
    assert graph.forward_outputs == ("predictions:out",)
    assert graph.backward_outputs == ("block1_conv1_backward:out",)
    assert graph.node("block1_conv2_backward").inputs == (
        "block1_conv2:out", "block1_pool:out", "block1_pool_backward:out")
    assert not any(dn.kind == "tangent" for dn in graph.data.values())


@pytest.mark.parametrize(("name", "floor"), [("vgg16", 0.83), ("fcn8", 0.61)])
def test_reference_peak_and_floor_match_the_readme(name: str, floor: float) -> None:
    graph = load_checkmate_graph(CHECKMATE_GRAPHS / f"{name}.json")
    reference = checkmate_reference_peak(graph)
    assert solve_store_all(graph).predicted_peak == reference  # same accounting as our simulator
    bounds = budget_bounds(graph)
    assert bounds.exact and bounds.lower / reference == pytest.approx(floor, abs=0.01)


@pytest.mark.parametrize(("name", "peak"), [("fcn8", 0.62), ("unet", 0.72)])
def test_a_graph_without_parameters_is_cut_into_blocks(name: str, peak: float) -> None:
    """Every activation of a graph that models no parameters is computed from its input alone:
    none is a value every block reads, so the chain is cut where one tensor crosses."""
    graph = load_checkmate_graph(CHECKMATE_GRAPHS / f"{name}.json")
    assert len(derived_blocks(graph)) > 4
    schedule = solve_checkpoint_blocks(graph)
    assert schedule.predicted_peak <= peak * checkmate_reference_peak(graph)


@pytest.mark.parametrize(("name", "fraction", "max_overhead"), [("vgg16", 0.9, 0.05), ("fcn8", 0.8, 0.02)])
def test_ilp_on_checkmate_graph(name: str, fraction: float, max_overhead: float) -> None:
    graph = load_checkmate_graph(CHECKMATE_GRAPHS / f"{name}.json")
    budget = int(fraction * checkmate_reference_peak(graph))
    s = solve_ilp(graph, budget, time_limit=20)
    assert simulate(graph, s, budget).peak == s.predicted_peak <= budget
    overhead = s.predicted_time / sum(n.time for n in graph.nodes) - 1
    assert 0 <= overhead <= max_overhead
    assert s.lower_bound is not None and s.lower_bound <= s.predicted_time


def test_ilp_under_a_short_time_limit_still_returns_a_valid_schedule() -> None:
    graph = load_checkmate_graph(CHECKMATE_GRAPHS / "unet.json")
    budget = int(0.42 * checkmate_reference_peak(graph))  # the README's hardest unet row
    s = solve_ilp(graph, budget, time_limit=3)
    assert simulate(graph, s, budget).peak <= budget
    assert s.solve_time < 10 and s.extra["status"] != "Optimal"


def test_peak_shaving_meets_the_floor_where_dtr_does_not() -> None:
    # fcn8 at 0.70 of the peak: a few backward steps are tight. DTR's eviction guess recomputes
    # the first convolutions and stays above the proven floor, which the reference MILP meets.
    graph = load_checkmate_graph(CHECKMATE_GRAPHS / "fcn8.json")
    budget = int(0.70 * checkmate_reference_peak(graph))
    s = solve_peak_shaving(graph, budget, time_limit=30)
    assert simulate(graph, s, budget).peak <= budget
    floor = time_lower_bound(graph, budget)[0]
    assert s.predicted_time <= floor * 1.0001 < solve_dtr(graph, budget).predicted_time


def test_peak_shaving_improves_on_dtrs_schedule() -> None:
    # mobilenet at 0.70: the search started from DTR's schedule (read as drops) keeps only
    # what is faster, so it ends at least as fast as DTR, here faster.
    graph = load_checkmate_graph(CHECKMATE_GRAPHS / "mobilenet.json")
    budget = int(0.70 * checkmate_reference_peak(graph))
    dtr = solve_dtr(graph, budget)
    s = solve_peak_shaving(graph, budget, time_limit=30, seeds=[dtr])
    assert simulate(graph, s, budget).peak <= budget
    assert s.predicted_time < dtr.predicted_time
