"""The planner is a plain function over a captured joint graph: no nn.Module wrapper, no runtime."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from rkgraph import capture_joint
from rockplan import zoo
from rockplan.codegen import generate
from rockplan.planner import PlanOptions, check_solver, plan
from solvers import InfeasibleBudget, simulate


def test_plan_takes_a_joint_graph_and_returns_a_checked_schedule() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    joint = capture_joint(model, args, kwargs)
    planned = plan(joint, 0.9, PlanOptions(profile="estimate", solver_options={"time_limit": 5}))
    assert planned.budget == int(0.9 * planned.reference.predicted_peak)
    assert simulate(planned.graph, planned.schedule, planned.budget).peak == planned.schedule.predicted_peak
    assert planned.schedule.predicted_peak <= planned.budget < planned.graph_store_all.predicted_peak
    forward, backward = generate(planned.joint, planned.graph, planned.schedule)
    assert isinstance(forward, torch.fx.GraphModule) and isinstance(backward, torch.fx.GraphModule)


def test_plan_refuses_a_budget_below_the_floor_with_the_smallest_feasible_one() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    joint = capture_joint(model, args, kwargs)
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget"):
        plan(joint, 1, PlanOptions(profile="estimate"))


def test_unknown_solvers_and_options_are_refused_with_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        check_solver("no_such_solver", {})
    with pytest.raises(ValueError, match="takes no option 'gap'.*heuristic"):
        check_solver("dtr", {"gap": 0.1})
    with pytest.raises(ValueError, match="takes no option"):
        PlanOptions(solver="rockmate", solver_options={"timelimit": 3})
    check_solver("rockmate", {"time_limit": 3, "gap": 0.05})


@pytest.mark.parametrize("solver", ["rockmate", "dtr"])
def test_a_budget_refused_on_memory_alone_is_refused_without_replaying_the_step(
        solver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the measured profile, the step's replays (several steps' time) wait until the budget
    is known to be worth planning: one below what the solver reaches on autograd's graph and on
    its lean variant (the portfolio's searches; any schedule, for another solver) is refused
    without them, with the message the estimated profile gives, the lean variant derived once
    and none of its ops timed; a feasible one is planned on measured times."""
    import rkgraph
    import rockplan.planner
    from rkgraph.capture import flat_tensors, flatten_call

    replays, derived, timed = [], [], []
    monkeypatch.setattr(rockplan.planner, "lean_variant",
                        lambda joint: derived.append(joint) or rkgraph.lean_variant(joint))
    monkeypatch.setattr(rkgraph, "synthetic_times", lambda graph, joint, nodes, repeats=3: timed.append(nodes) or {})

    def measured(graph, joint, inputs, repeats=3):  # twice the estimate: told apart from estimated times
        replays.append(graph)
        rkgraph.estimate_times(graph, joint)
        for node in graph.nodes:
            node.time *= 2

    monkeypatch.setattr(rkgraph, "measure_times", measured)
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    joint = capture_joint(model, args, kwargs)
    real = flat_tensors(model, flatten_call(model, args, kwargs), args, kwargs)
    refusals = []
    for profile in ("measure", "estimate"):
        with pytest.raises(InfeasibleBudget) as refused:
            plan(joint, 0.1, PlanOptions(solver=solver, profile=profile), real)
        refusals.append(str(refused.value))
    assert not replays and not timed and refusals[0] == refusals[1]
    assert len(derived) == 2  # once per plan
    planned = plan(joint, 0.9, PlanOptions(solver=solver), real)
    assert len(replays) == 1
    estimates = rkgraph.estimated_times(replays[0], joint.module)
    assert planned.times == pytest.approx({name: 2 * seconds for name, seconds in estimates.items()})


def test_the_floors_proven_before_the_solve_count_against_its_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solver's time limit is the user's for the whole solve of a graph: the floor the
    planner proves before handing it over (seconds on a graph of thousands of nodes) is taken
    out of what the solver is given."""
    from rockplan import planner
    from solvers import RUNTIME_SOLVERS

    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    joint = capture_joint(model, args, kwargs)
    prove = planner.time_lower_bound
    delay = 0.5

    def slow(*a: object, **kw: object) -> tuple[float, str]:
        time.sleep(delay)
        return prove(*a, **kw)

    given: list[float] = []
    solve = RUNTIME_SOLVERS["rockmate"]

    @functools.wraps(solve)  # its signature: the options the planner checks and passes
    def spied(*a: object, time_limit: float, **kw: object) -> object:
        given.append(time_limit)
        return solve(*a, time_limit=time_limit, **kw)

    monkeypatch.setattr(planner, "time_lower_bound", slow)
    monkeypatch.setitem(RUNTIME_SOLVERS, "rockmate", spied)
    planned = plan(joint, 0.6, PlanOptions(profile="estimate", solver_options={"time_limit": 10}))
    assert planned.schedule.predicted_peak <= planned.budget
    # Autograd's graph's solve, and the lean variant's where it is solved: each after a floor of its own.
    assert given and all(limit <= 10 - delay for limit in given), given
