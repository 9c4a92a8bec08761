"""Rotor's DP and Rockmate on chains of blocks: validity, optimality against brute force, and
the promises of the default solver (never slower than a baseline, identical blocks solved once)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solvers.rockmate as rockmate
from rkgraph.blocks import backward_blocks
from rkgraph.graph import RematGraph
from solvers import (
    InfeasibleBudget,
    budget_bounds,
    simulate,
    solve_checkpoint_blocks,
    solve_dtr,
    solve_rockmate,
    solve_rotor,
    solve_store_all,
)
from solvers.bounds import chain_order_floor, time_lower_bound
from solvers.chain import build_chain, chain_fits_model, schedule_chain, store_all_option
from solvers.rockmate import block_options, chain_schedules
from solvers.simulate import schedule_from_computes
from tests.graph_factories import random_training_graph, training_graph

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def blocked_chain(sizes: list[int], times: list[float], block_size: int, **kw: object) -> RematGraph:
    graph = training_graph(sizes, times, block_size=block_size, **kw)
    graph.backward_blocks = backward_blocks(graph)
    return graph


def uniform_chain(blocks: int, per_block: int = 2) -> RematGraph:
    """Identical blocks: the same sizes and times at every position of a block."""
    n = blocks * per_block
    graph = blocked_chain([10 + 5 * (i % per_block) for i in range(n)],
                          [1.0 + (i % per_block) for i in range(n)], per_block)
    graph.block_classes = [0] * blocks
    return graph


def test_backward_nodes_follow_their_forward_block() -> None:
    graph = blocked_chain([10] * 6, [1.0] * 6, 2)
    # b_i differentiates f_i: it reads f_i's input, made by the previous block when f_i opens
    # a block, which is why the anchor is the block that reads a cut tensor, not its maker.
    assert backward_blocks(graph) == [["b1", "b0"], ["b3", "b2"], ["b5", "b4"]]


def brute_force_frontier(graph: RematGraph) -> list[tuple[int, float]]:
    """(peak, time) of every frontier-advancing schedule that recomputes only forward nodes
    (backward values are never worth recomputing: nothing frees them early)."""
    n, nf = len(graph.nodes), len(graph.forward_nodes)
    slots = [(t, i) for t in range(n) for i in range(min(t, nf))]
    found = []
    for picks in itertools.product((False, True), repeat=len(slots)):
        chosen = {slot for slot, pick in zip(slots, picks) if pick}
        stages = [[i for i in range(t) if (t, i) in chosen] + [t] for t in range(n)]
        order = [graph.nodes[i].name for stage in stages for i in stage]
        s = schedule_from_computes(graph, order, sum(map(len, stages[:nf])), solver="brute")
        found.append((s.predicted_peak, s.predicted_time))
    return found


def test_rotor_matches_brute_force_on_tiny_chains() -> None:
    # Per-node blocks, so rotor may keep or recompute every activation.
    graph = blocked_chain([10, 30, 20], [1.0, 3.0, 2.0], 1)
    frontier = brute_force_frontier(graph)
    checked = 0
    for budget in range(budget_bounds(graph).lower, solve_store_all(graph).predicted_peak + 1):
        best = min((t for peak, t in frontier if peak <= budget), default=None)
        try:
            rotor = solve_rotor(graph, budget, slots=2000)
        except InfeasibleBudget:
            continue  # rotor's model is conservative near the floor
        checked += 1
        assert best is not None and rotor.predicted_peak <= budget
        # Up to the model's rounding (the input counted throughout), rotor is the optimum.
        assert best <= rotor.predicted_time <= best + 1.0, budget
    assert checked > 0


def test_rockmate_no_slower_than_rotor_on_chains() -> None:
    graph = blocked_chain([10, 20, 10, 30, 10, 20], [1.0, 3.0, 2.0, 1.0, 1.0, 2.0], 2)
    for fraction in (1.0, 0.9, 0.8, 0.7, 0.6):
        budget = int(fraction * solve_store_all(graph).predicted_peak)
        try:
            rotor = solve_rotor(graph, budget)
        except InfeasibleBudget:
            continue
        rockmate = solve_rockmate(graph, budget, time_limit=5)
        assert rockmate.predicted_peak <= budget
        assert rockmate.predicted_time <= rotor.predicted_time + 1e-9


def test_identical_blocks_are_solved_once_and_the_chain_plan_meets_the_floor() -> None:
    graph = uniform_chain(6)
    # At 0.6 DTR (63 s) misses the proven floor (62 s); the chain plan meets it.
    budget = int(0.6 * solve_store_all(graph).predicted_peak)
    solved: list[str] = []
    chain = build_chain(graph, lambda sub: solved.append(sub.name) or block_options(sub, 1.0)[0])
    s = schedule_chain(graph, chain, budget, 500, "rockmate")
    simulate(graph, s, budget)
    # The first block reads the graph input and the last one the tangent: at most 3 distinct.
    assert len(chain.blocks) == 6 and len(solved) <= 3
    assert s.predicted_time == time_lower_bound(graph, budget)[0] < solve_dtr(graph, budget).predicted_time
    assert solve_rockmate(graph, budget, time_limit=5).gap == 0


def test_blocks_differing_only_in_measured_times_are_solved_once() -> None:
    graph = uniform_chain(6)
    for k, node in enumerate(graph.nodes):
        node.time *= 1 + 0.01 * k  # measured profiles differ a little from layer to layer
    solved: list[str] = []
    chain = build_chain(graph, lambda sub: solved.append(sub.name) or [store_all_option(sub)])
    assert len(solved) <= 3 and len(chain.blocks) == 6
    # A reused option carries the times of its own block's nodes.
    for block in chain.blocks:
        option = block.options[0]
        assert option.forward_time == pytest.approx(sum(graph.node(n).time for n in option.forward))


def test_a_gradient_a_block_reads_last_counts_only_until_that_read() -> None:
    # Block 0's backward: b1 reads g2.x1 (40, made by block 1) and x0 (10), makes g1.x0 (10)
    # and gw1 (30); g2.x1 dies; b0 makes gw0 (30). Peak at b1: 10 + 40 + 40 = 90. Charged
    # through the whole backward, the 40 would make it 40 + 70 (b0's 10 + 30 + 30) = 110.
    graph = training_graph([10, 10, 10, 10], [1.0] * 4, block_size=2, grad_sizes=[10, 10, 40, 10],
                           param_grad_size=30)
    graph.backward_blocks = backward_blocks(graph)
    first = build_chain(graph).blocks[0]
    assert (first.grad, first.grad_through) == (40, 0)
    assert first.options[0].backward_peak == 90


def test_gradients_passing_through_a_block_stay_charged() -> None:
    for seed in range(20):
        graph = random_training_graph(seed, max_forward=8)
        chain = build_chain(graph)
        for block in chain.blocks:
            assert 0 <= block.grad_through <= block.grad


def test_heuristic_schedules_cut_per_block_are_options_of_the_chain() -> None:
    graph = uniform_chain(6)
    budget = int(0.7 * solve_store_all(graph).predicted_peak)
    dtr = solve_dtr(graph, budget)
    rotor = schedule_chain(graph, build_chain(graph), budget, 500, "rotor")
    chain = build_chain(graph, schedules=[dtr])
    assert any(o.source == "cut from dtr" for block in chain.blocks for o in block.options)
    combined = schedule_chain(graph, chain, budget, 500, "rotor")
    # Rotor's whole-block choices alone: 61 s; with DTR's per-block treatments, DTR's 60 s.
    assert rotor.predicted_time == 61 and combined.predicted_time == dtr.predicted_time == 60
    simulate(graph, combined, budget)


def test_no_block_is_solved_where_the_chain_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    # One-node blocks, memory in three slots: each block's backward rounds up to a slot more than
    # it holds, so no plan of the chain fits a budget that storing everything misses by a byte,
    # whatever its blocks' options, and their MILPs are not solved.
    graph = blocked_chain([10] * 6, [1.0] * 6, 1)
    budget = solve_store_all(graph).predicted_peak - 1
    assert budget >= budget_bounds(graph).lower
    assert not chain_fits_model(build_chain(graph, rockmate.least_memory_option), budget, 3)

    def solved(*args: object) -> None:
        raise AssertionError("a block was solved")

    with monkeypatch.context() as patched:
        patched.setattr(rockmate, "block_options", solved)
        found, extra = rockmate.chain_schedules(graph, budget, [], time_limit=5, slots=3)
    assert found == [] and extra["chain_fits"] is False
    # Solved all the same, the blocks' options find no plan either.
    monkeypatch.setattr(rockmate, "chain_fits_model", lambda *args: True)
    assert rockmate.chain_schedules(graph, budget, [], time_limit=5, slots=3)[0] == []


@pytest.mark.parametrize("slots", [2, 3, 5])  # coarse memory: the least-memory chain often misses
def test_the_chain_finds_nothing_where_its_least_memory_options_do_not_fit(
        slots: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`least_memory_option` needs no more memory than any option of its block: wherever the
    chain of them does not fit, the chain of real options (MILPs, greedy, cuts of `known`,
    rotor's) finds nothing."""
    monkeypatch.setattr(rockmate, "chain_fits_model", lambda *args: True)  # solve every block
    for seed in range(12):
        graph = random_training_graph(seed, max_forward=6, weight_nodes=seed % 2 == 1)
        bounds = budget_bounds(graph)
        top = bounds.baselines[0].predicted_peak
        least = build_chain(graph, rockmate.least_memory_option)
        for budget in sorted({bounds.lower + (top - bounds.lower) * k // 4 for k in range(5)}):
            if not chain_fits_model(least, budget, slots):
                found, _ = rockmate.chain_schedules(graph, budget, [solve_dtr(graph, top)], time_limit=2,
                                                    block_time_limit=0.2, slots=slots)
                assert found == [], (seed, budget)


def test_search_stops_at_the_proven_floor() -> None:
    graph = uniform_chain(6)
    budget = int(0.7 * solve_store_all(graph).predicted_peak)
    s = solve_rockmate(graph, budget, time_limit=5)
    # DTR's schedule meets the floor: no block is solved, the answer is proven optimal.
    assert "blocks" not in s.extra and s.extra["schedule_from"] == "dtr" and s.gap == 0


def test_single_block_falls_back_to_the_flat_ilp() -> None:
    graph = training_graph([10, 20, 10, 20], [1.0, 2.0, 1.0, 2.0], block_size=4)
    budget = (budget_bounds(graph).upper + solve_store_all(graph).predicted_peak) // 2
    s = solve_rockmate(graph, budget, time_limit=5)
    assert s.predicted_peak <= budget and "blocks" not in s.extra  # the chain was never built
    assert simulate(graph, s, budget).peak == s.predicted_peak


def test_below_the_floor_names_the_floor() -> None:
    graph = uniform_chain(3)
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget"):
        solve_rockmate(graph, budget_bounds(graph).lower - 1)


@FAST
@given(seed=st.integers(0, 10_000), fraction=st.floats(0.3, 1.0))
def test_rockmate_is_valid_and_no_slower_than_baselines(seed: int, fraction: float) -> None:
    graph = random_training_graph(seed, max_forward=7)
    if graph.blocks:
        graph.backward_blocks = backward_blocks(graph)
    bounds = budget_bounds(graph)
    budget = max(bounds.lower, int(fraction * solve_store_all(graph).predicted_peak))
    try:
        s = solve_rockmate(graph, budget, time_limit=3)
    except InfeasibleBudget:
        assert bounds.upper > budget  # only when no known schedule fits
        return
    assert simulate(graph, s, budget).time == pytest.approx(s.predicted_time)
    for baseline in (solve_store_all(graph), solve_checkpoint_blocks(graph)):
        if baseline.predicted_peak <= budget:
            assert s.predicted_time <= baseline.predicted_time + 1e-9


@FAST
@given(seed=st.integers(0, 10_000), fraction=st.floats(0.3, 1.0))
def test_rotor_is_valid_or_says_infeasible(seed: int, fraction: float) -> None:
    graph = random_training_graph(seed, max_forward=7)
    store_all = solve_store_all(graph)
    budget = int(fraction * store_all.predicted_peak)
    try:
        s = solve_rotor(graph, budget)
    except InfeasibleBudget:
        # Its chain's plans include keeping every block: a refusal is right only below that.
        # Not below checkpointing every block: rotor runs a block's forward again whole, while
        # checkpoint_blocks recomputes what the backward reads, which can peak lower (a graph
        # of one block: 47 against rotor's 56 bytes).
        assert budget < store_all.predicted_peak
        return
    assert simulate(graph, s, budget).peak == s.predicted_peak <= budget


def _weight_gradients_delayed(graph: RematGraph) -> RematGraph:
    """`graph` with each weight-gradient node (bw{i}) run after the next backward node where
    that node does not read it: autograd's order interleaving blocks, which the chain's does not."""
    order = [n.name for n in graph.nodes]
    for name in [n.name for n in graph.nodes if n.name.startswith("bw")]:
        i = order.index(name)
        if i + 1 < len(order) and not set(graph.node(name).outputs) & set(graph.node(order[i + 1]).inputs):
            order[i], order[i + 1] = order[i + 1], order[i]
    return replace(graph, nodes=[graph.node(name) for name in order])


@FAST
@given(seed=st.integers(0, 10_000), fraction=st.floats(0.3, 1.0), delayed=st.booleans())
def test_no_chain_plan_peaks_below_the_chain_floor(seed: int, fraction: float, delayed: bool) -> None:
    """What the portfolio's refusal below `chain_order_floor` rests on: no plan of the chain,
    Rockmate's (MILP options and schedules cut per block) or rotor's, peaks below it; also
    where autograd's order interleaves the blocks' backward (`delayed`)."""
    graph = random_training_graph(seed, max_forward=7, weight_nodes=True)
    if delayed:
        graph = _weight_gradients_delayed(graph)
    floor = chain_order_floor(graph)[0]
    budget = int(fraction * solve_store_all(graph).predicted_peak)
    known = [s for s in (solve_store_all(graph), solve_checkpoint_blocks(graph)) if s.predicted_peak <= budget]
    for block_time in (0.0, 0.05, 0.5):  # how long each block's MILPs get changes the options
        plans, _ = chain_schedules(graph, budget, known, time_limit=2.0, block_time_limit=block_time)
        for plan in plans:
            assert plan.predicted_peak >= floor, plan.solver
