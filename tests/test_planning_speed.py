"""The faster planning paths give the answers of the plain ones they replace.

`min_memory_schedule` (bit sets of what each stage remakes), `free_at_last_use` (one backward
sweep), the proven floors' per-step memory (gradients summed as bit sets) are compared with the
plain walks they replaced, kept here as references, on Checkmate's graphs and random training
graphs. The shortcuts that skip work (the minimum-memory schedule where store-all fits, the
solve of autograd's graph where the lean variant's plan beats its floor) are checked sound.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence

import pytest
import torch
from torch import nn

from rkgraph import capture_joint
from rkgraph.graph import RematGraph
from rockplan import zoo
from rockplan.planner import PlanOptions, costed_graph, plan
from solvers import (
    CHECKMATE_GRAPHS,
    budget_bounds,
    load_checkmate_graph,
    min_feasible_budget,
    solve_dtr,
    solve_peak_shaving,
    solve_rockmate,
    solve_store_all,
)
from solvers.bounds import (
    _alive_at,
    _ancestors,
    _size,
    _step_floors,
    min_memory_schedule,
    min_memory_slower_than_store_all,
    min_memory_time_floor,
    needed_nodes,
    time_lower_bound,
)
from solvers.schedule import Op, Schedule
from solvers.simulate import InfeasibleBudget, free_at_last_use, released_inside, to_recompute
from tests.graph_factories import random_training_graph


def _graphs() -> list[RematGraph]:
    graphs = [load_checkmate_graph(CHECKMATE_GRAPHS / f"{name}.json") for name in ("vgg16", "fcn8", "unet")]
    return graphs + [random_training_graph(seed, max_forward=12) for seed in range(150)]


# --- the references: the plain walks, as they were ----------------------------------------------


def _reference_computes(graph: RematGraph, checkpoints: Iterable[str], forward_once: bool) -> tuple[list[str], int]:
    """The minimum-memory schedule's computes: each stage walks the graph for what it remakes."""
    persistent = set(graph.tangents) | set(checkpoints)
    for node in graph.nodes:
        if node.backward or node.random:
            persistent.update(node.outputs)
    available_in = {False: frozenset(d for d in persistent if graph.data[d].kind != "tangent"),
                    True: frozenset(persistent)}
    computes: list[str] = []
    forward_count = 0
    forward_nodes = len(graph.forward_nodes)
    for t, node in enumerate(graph.nodes):
        if t == forward_nodes:
            forward_count = len(computes)
        if forward_once and not node.backward:
            computes.append(node.name)
            continue
        missing = to_recompute(graph, node.inputs, available_in[node.backward])
        computes.extend(sorted(missing, key=graph.index.__getitem__))
        computes.append(node.name)
    if forward_nodes == len(graph.nodes):
        forward_count = len(computes)
    return computes, forward_count


def _reference_free_at_last_use(graph: RematGraph, computes: Sequence[str], forward_count: int,
                                keep: Iterable[str] = ()) -> tuple[list[Op], int]:
    """Dead work dropped in one sweep, then each value's free placed by searching its reads."""
    keep_set = (frozenset(keep) | frozenset(graph.backward_outputs) | frozenset(graph.user_outputs)
                | frozenset(graph.tangents))
    fwd_out = set(graph.forward_outputs)
    m = len(computes)
    pending: dict[str, int] = defaultdict(int)
    next_def: dict[str, int] = {}
    kept = [False] * m
    for p in reversed(range(m)):
        node = graph.node(computes[p])
        kept[p] = any(pending[d] > 0 or (d in fwd_out and p < forward_count <= next_def.get(d, m))
                      or (d in keep_set and d not in next_def) for d in node.outputs)
        if kept[p]:
            for d in node.outputs:
                pending[d] = 0
                next_def[d] = p
            for d in graph.reads[node.name]:
                pending[d] += 1
    forward_count = sum(kept[:forward_count])
    computes = [c for p, c in enumerate(computes) if kept[p]]
    held = frozenset(graph.user_outputs) | frozenset(graph.tangents) | frozenset(graph.backward_outputs)
    defs: dict[str, list[int]] = defaultdict(list)
    reads: dict[str, list[int]] = defaultdict(list)
    for p, name in enumerate(computes):
        for d in graph.reads[name]:
            reads[d].append(p)
        for d in graph.node(name).outputs:
            defs[d].append(p)
    m = len(computes)
    frees_after: dict[int, list[str]] = defaultdict(list)
    boundary: list[str] = []
    for p, name in enumerate(computes):
        for d in graph.node(name).outputs:
            k = bisect.bisect_right(defs[d], p)
            stop = defs[d][k] if k < len(defs[d]) else m
            if (d in keep_set and stop == m) or d in held:
                continue
            k = bisect.bisect_left(reads[d], stop) - 1
            last = reads[d][k] if k >= 0 and reads[d][k] > p else None
            if d in fwd_out and p < forward_count <= stop and (last is None or last < forward_count):
                boundary.append(d)
            else:
                frees_after[p if last is None else last].append(d)
    ops: list[Op] = []
    forward_length = 0
    for p, name in enumerate(computes):
        if p == forward_count:
            ops.extend(Op("free", d) for d in boundary)
        ops.append(Op("compute", name))
        ops.extend(Op("free", d) for d in frees_after.get(p, ()))
        if p == forward_count - 1:
            forward_length = len(ops)
    if forward_count == m:
        ops.extend(Op("free", d) for d in boundary)
    return ops, forward_length


def _reference_floor(graph: RematGraph, name: str, ancestors: list[int]) -> int:
    """A step's memory floor from the list of the data alive at it."""
    node = graph.node(name)
    held = [*graph.tangents, *graph.user_outputs] if node.backward else []
    freeable = set(node.inputs) - {*held, *graph.tangents, *graph.backward_outputs}
    return (_size(graph, _alive_at(graph, node, ancestors)) + node.workspace
            - released_inside(graph, node, freeable))


# --- the comparisons ---------------------------------------------------------------------------


def test_min_memory_schedule_is_the_stage_by_stage_walks() -> None:
    for graph in _graphs():
        forward = [d for n in graph.forward_nodes if not n.random for d in n.outputs if not graph.is_source(d)]
        for checkpoints, forward_once in (([], False), ([], True), (forward[::3], False), (forward[1::4], True)):
            computes, forward_count = _reference_computes(graph, checkpoints, forward_once)
            ops, forward_length = _reference_free_at_last_use(graph, computes, forward_count)
            schedule = min_memory_schedule(graph, checkpoints, forward_once=forward_once)
            assert (schedule.ops, schedule.forward_length) == (ops, forward_length), graph.name


def test_free_at_last_use_places_frees_as_the_search_of_reads_did() -> None:
    """On solvers' schedules and on sequences with useless and repeated work (what the sweep
    drops), with values kept to the end."""
    rng = random.Random(0)
    for graph in _graphs():
        peak = solve_store_all(graph).predicted_peak
        for fraction in (0.9, 0.6):
            try:
                computes = solve_dtr(graph, int(fraction * peak)).computes()
            except InfeasibleBudget:
                continue
            forward = len(graph.forward_nodes)
            noisy = [*rng.sample(computes[:forward], min(3, forward)), *computes[:forward],
                     *rng.choices(computes[:forward], k=3), *computes[forward:]]
            for sequence, count in ((computes, forward), (noisy, forward + 3)):
                keep = rng.sample(sorted(graph.data), 2)
                assert (free_at_last_use(graph, sequence, count, keep)
                        == _reference_free_at_last_use(graph, sequence, count, keep)), graph.name


def test_step_floors_are_the_sums_of_the_data_alive() -> None:
    for graph in _graphs():
        ancestors = _ancestors(graph)
        floors = _step_floors(graph, ancestors)
        assert set(floors) == needed_nodes(graph)
        for name, (floor, _) in floors.items():
            assert floor == _reference_floor(graph, name, ancestors), (graph.name, name)


# --- the shortcuts -----------------------------------------------------------------------------


def test_the_floor_where_store_all_fits_is_its_time() -> None:
    """Nothing need be made again: the floor is every needed node once, the store-all time,
    found without the knapsacks (which are no tighter there)."""
    for graph in _graphs():
        store_all = solve_store_all(graph)
        floor, why = time_lower_bound(graph, store_all.predicted_peak)
        assert floor == pytest.approx(store_all.predicted_time, rel=1e-12) and why == "every needed node runs once"


def test_min_memory_is_skipped_only_where_it_is_slower_than_store_all() -> None:
    """Where the check says so, the schedule is slower; it says so on most graphs, and the
    portfolio answers the same with it as without it where store-all fits."""
    said = 0
    rng = random.Random(1)
    graphs = _graphs()
    for graph in graphs[3:80]:  # some with nodes that take no time (ties with store-all)
        for node in graph.nodes:
            if rng.random() < 0.4:
                node.time = 0.0
    for graph in graphs:
        if min_memory_slower_than_store_all(graph):
            said += 1
            assert min_memory_schedule(graph).predicted_time > solve_store_all(graph).predicted_time, graph.name
        budget = solve_store_all(graph).predicted_peak
        schedule = solve_rockmate(graph, budget)
        best = min((s for s in budget_bounds(graph).candidates if s.predicted_peak <= budget),
                   key=lambda s: (s.predicted_time, s.predicted_peak))
        assert (schedule.ops, schedule.extra["schedule_from"]) == (best.ops, best.solver), graph.name
    assert said > len(graphs) // 2


def test_min_memory_time_floor_is_below_its_time_and_near_it() -> None:
    """The bound that lets the portfolio leave the minimum-memory schedule unbuilt holds (and
    is close: it counts everything the backward stages remake)."""
    for graph in _graphs():
        floor, actual = min_memory_time_floor(graph), min_memory_schedule(graph).predicted_time
        assert floor <= actual * (1 + 1e-12), graph.name
        assert floor >= 0.5 * actual, graph.name


def test_portfolio_answers_the_same_without_the_min_memory_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left unbuilt where it cannot matter, the minimum-memory schedule changes no answer: the
    portfolio as it was (the schedule always among the candidates, where it fits) and as it is
    agree, wherever no time-limited search (the MILPs) decides; and it is left unbuilt often."""
    import solvers.bounds
    import solvers.portfolio

    build = solvers.bounds.min_memory_schedule
    builds: list[str] = []

    def counted(graph: RematGraph, *args, **kwargs):
        builds.append(graph.name)
        return build(graph, *args, **kwargs)

    monkeypatch.setattr(solvers.bounds, "min_memory_schedule", counted)
    compared = unbuilt = 0
    for seed in range(60):
        graph = random_training_graph(seed, max_forward=12)
        peak = solve_store_all(graph).predicted_peak
        for budget in ((budget_bounds(graph).upper + peak) // 2, peak):
            builds.clear()
            now = solve_rockmate(graph, budget, time_limit=5)
            unbuilt += not builds
            with monkeypatch.context() as always:
                always.setattr(solvers.portfolio, "min_memory_time_floor", lambda g: 0.0)
                always.setattr(solvers.portfolio, "min_memory_slower_than_store_all", lambda g: False)
                before = solve_rockmate(graph, budget, time_limit=5)
            if {now.extra["schedule_from"], before.extra["schedule_from"]} & {"ilp", "rockmate", "rotor"}:
                continue
            compared += 1
            assert (now.ops, now.extra["schedule_from"]) == (before.ops, before.extra["schedule_from"]), graph.name
    assert compared > 40 and unbuilt > 20


def test_the_lean_variant_is_not_solved_where_autograds_plan_is_within_the_gap_of_its_floor() -> None:
    """An MLP whose lean variant (GELU's product fused, dropout's masks packed) can be faster
    than autograd's plan by less than the solver's gap: solved without a gap (and slower), not
    solved with it, and the plan is the same."""
    torch.manual_seed(0)
    layers = [layer for _ in range(4) for layer in (nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64),
                                                         nn.Dropout(0.1))]
    joint = capture_joint(nn.Sequential(*layers), (torch.randn(2048, 64),), {})
    plans = {gap: plan(joint, 0.76, PlanOptions(profile="estimate", solver_options={"time_limit": 10, "gap": gap}))
             for gap in (0.0, 0.05)}
    (name, exact), = plans[0.0].considered.items()
    assert name == "the lean variant of the graph" and exact > plans[0.0].schedule.predicted_time
    assert plans[0.05].considered == {name: "not solved: its proven floor is above the plan of autograd's graph "
                                            "less the solver's gap (5%)"}
    assert plans[0.05].joint is plans[0.0].joint is joint and plans[0.05].schedule.ops == plans[0.0].schedule.ops


@pytest.mark.parametrize("ratio", [0.5, 0.7])
def test_autograd_graph_is_not_solved_where_the_lean_plan_beats_its_floor(ratio: float) -> None:
    """A GPT whose lean variant's plan runs faster than any plan of autograd's graph can (its
    proven floor): that graph is not solved, and solving it finds nothing faster."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab_size=128, block_size=256, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    joint = capture_joint(model, (torch.randint(0, 128, (2, 256)),), {})
    options = PlanOptions(profile="estimate", solver_options={"time_limit": 10})
    planned = plan(joint, ratio, options)
    (name, outcome), = planned.considered.items()
    assert name == "autograd's graph" and outcome.startswith("not solved: its proven floor")
    assert planned.joint is not joint  # the lean variant's
    autograd = costed_graph(joint, None, "estimate", options)
    try:
        solved = solve_rockmate(autograd, planned.budget, time_limit=10)
    except InfeasibleBudget:
        return  # nothing found within the budget: nothing faster either
    assert solved.predicted_time > planned.schedule.predicted_time


def test_polish_time_shaves_on_from_the_best_schedule_where_it_leaves_a_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """`polish_time`: where the portfolio's best schedule is above the floor by more than the gap,
    peak shaving searches on from it for that long; its schedule is a candidate, so the plan is
    never slower. Where a schedule meets the floor (storing everything fits), nothing more runs."""
    import solvers.portfolio

    graph = random_training_graph(5, max_forward=24)
    low, high = min_feasible_budget(graph), solve_store_all(graph).predicted_peak
    budget = int(low + 0.2 * (high - low))
    # No gap allowed: every schedule above the floor leaves one (the plans here are well above it).
    assert solve_rockmate(graph, budget, time_limit=5).predicted_time > time_lower_bound(graph, budget)[0]
    calls = []
    shave = solvers.portfolio.solve_peak_shaving

    def recorded(graph: RematGraph, budget: int, **options: object) -> Schedule:
        calls.append(options)
        return shave(graph, budget, **options)

    monkeypatch.setattr(solvers.portfolio, "solve_peak_shaving", recorded)
    # (A limit the search never reaches: polishing gets what the search leaves of the two.)
    polished = solve_rockmate(graph, budget, time_limit=30, gap=0.0, polish_time=0.5)
    last = calls[-1]
    assert last["time_limit"] == 0.5 and len(last["seeds"]) == 1 and last["perturb"]
    (seed,) = last["seeds"]
    assert seed.predicted_peak <= budget and seed.predicted_time >= polished.predicted_time
    assert polished.predicted_peak <= budget
    calls.clear()
    solve_rockmate(graph, high, time_limit=5, gap=0.0, polish_time=0.5)
    assert calls == []


def test_perturbed_peak_shaving_leaves_the_local_optimum_of_single_rule_outs() -> None:
    """From DTR's schedule, peak shaving's single rule-outs stall (in a few milliseconds here); the
    kicks of `perturb` (a few drops ruled out at once, from a fixed seed) then find a faster
    schedule within the time limit."""
    graph = random_training_graph(6, max_forward=24)
    low, high = min_feasible_budget(graph), solve_store_all(graph).predicted_peak
    budget = int(low + 0.4 * (high - low))
    seed = solve_dtr(graph, budget)
    stalled = solve_peak_shaving(graph, budget, time_limit=3, seeds=[seed])
    kicked = solve_peak_shaving(graph, budget, time_limit=3, seeds=[seed], perturb=True)
    assert kicked.predicted_peak <= budget
    assert kicked.predicted_time < stalled.predicted_time
