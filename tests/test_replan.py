"""Plans per input signature: re-planning is visible, the plans held are bounded, and a
Rockmate survives pickling (its plans are made again, not saved)."""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import pickle

import pytest
import torch

from rkgraph import capture_joint, node_keys
from rkgraph.graph import ComputeNode, DataNode, RematGraph, matching_nodes
from rockplan import Rockmate, zoo
from rockplan.planner import PlanOptions, plan, reuse


def _mlp(batch: int) -> torch.Tensor:
    return torch.randn(batch, 32)


def _planned_mlp(**options) -> tuple[torch.nn.Module, Rockmate]:
    model, _, _, _ = zoo.make("mlp", "tiny")
    return model, Rockmate(model, _mlp(64), 1.0, profile="estimate", **options)


def test_a_new_shape_replans_with_a_warning_then_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    _, rk = _planned_mlp()
    with pytest.warns(UserWarning, match=r"planned for a new input \(argument leaf 0: .*\(64, 32\).*\(32, 32\).*\) "
                                         r"in [0-9.]+ s; 2 plan\(s\) held, at most max_plans=8"):
        rk(_mlp(32))
    with caplog.at_level(logging.INFO, logger="rockplan.module"):
        rk(_mlp(16))
    assert any("planned for a new input" in r.getMessage() and "(16, 32)" in r.getMessage() for r in caplog.records)
    assert len(rk._steps) == 3
    with caplog.at_level(logging.INFO, logger="rockplan.module"):
        caplog.clear()
        rk(_mlp(32))  # held: nothing planned
    assert not any("planned" in r.getMessage() for r in caplog.records)


def test_plans_held_are_the_most_recently_used(recwarn: pytest.WarningsRecorder) -> None:
    _, rk = _planned_mlp(max_plans=2)
    sample = next(iter(rk._steps))
    rk(_mlp(64))  # the sample's plan, now the most recently used
    rk(_mlp(32))
    rk(_mlp(64))
    rk(_mlp(16))  # drops the batch of 32's plan, the least recently used
    assert len(rk._steps) == 2 and sample in rk._steps
    assert [key[1][0][1] for key in rk._steps] == [(64, 32), (16, 32)]
    with pytest.raises(ValueError, match="max_plans must be at least 1"):
        _planned_mlp(max_plans=0)


def test_plans_dropped_and_made_again_are_warned_once(recwarn: pytest.WarningsRecorder) -> None:
    """Inputs of more shapes than plans held make steps plan over and over: said once."""
    _, rk = _planned_mlp(max_plans=2)
    for batch in (32, 16):  # the sample's plan dropped at 16: not warned (it may never come back)
        rk(_mlp(batch))
    assert not [w for w in recwarn if "dropped" in str(w.message)]
    rk(_mlp(64))  # back: planned again
    dropped = [str(w.message) for w in recwarn if "dropped" in str(w.message)]
    assert len(dropped) == 1 and "more than max_plans=2 signatures" in dropped[0]
    assert "pad_to_multiple_of" in dropped[0]
    for batch in (32, 16, 64):
        rk(_mlp(batch))
    assert len([w for w in recwarn if "dropped" in str(w.message)]) == 1


def test_without_a_sample_the_first_training_step_is_planned() -> None:
    """No sample: the first training step's input is the sample (a trainer's batch, as it
    calls the model); evaluation plans nothing; the step matches eager."""
    torch.manual_seed(0)
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    eager = copy.deepcopy(model)
    rk = Rockmate(model, budget=0.6, profile="estimate", on_new_input="error")
    with pytest.raises(RuntimeError, match="no plan yet: this Rockmate was given no sample"):
        _ = rk.plan
    with torch.no_grad():
        rk(idx)
    assert not rk._steps  # no backward, nothing planned
    for m in (rk, eager):
        torch.manual_seed(1)
        m(idx).sum().backward()
    assert rk.plan.budget < rk.plan.reference.predicted_peak  # a ratio of this step's peak
    assert rk.plan.schedule.predicted_peak <= rk.plan.budget
    for p, q in zip(eager.parameters(), rk.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    with pytest.raises(ValueError, match="differs from the planned sample"):
        rk(idx[:1])


def test_a_number_given_as_the_sample_is_refused_saying_to_name_the_budget() -> None:
    model, _, _, _ = zoo.make("mlp", "tiny")
    with pytest.raises(TypeError, match=r"the sample is 0.5, not the model's input.*Rockmate\(model, budget=0.5\)"):
        Rockmate(model, 0.5)


def test_a_subclass_of_rockmate_is_copied_as_itself() -> None:
    """Only the class made per model class (`Rockmate[MLP]`) pickles through the model's class."""

    class Logged(Rockmate):
        pass

    model, _, _, _ = zoo.make("mlp", "tiny")
    assert type(copy.deepcopy(Logged(model, budget=1.0))) is Logged
    assert type(copy.deepcopy(Rockmate(model, budget=1.0))).__name__ == f"Rockmate[{type(model).__name__}]"


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_rockmate_pickles_and_plans_again_at_its_first_step(how: str) -> None:
    torch.manual_seed(0)
    model, rk = _planned_mlp(on_new_input="error")
    x = _mlp(64)
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(rk, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    else:
        loaded = copy.deepcopy(rk)
    assert loaded.state_dict().keys() == rk.state_dict().keys()
    with pytest.raises(RuntimeError, match="no plan yet: plans are not pickled"):
        _ = loaded.plan
    with pytest.warns(UserWarning, match="planned for the sample's input again"):
        out = loaded(x)  # the sample's signature plans again, even with on_new_input="error"
    out.sum().backward()
    model(x).sum().backward()
    for p, q in zip(model.parameters(), loaded.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    assert loaded.plan.budget == rk.plan.budget
    with pytest.raises(ValueError, match="differs from the planned sample"):
        loaded(_mlp(8))
    pickle.dumps(loaded)  # and again, with plans made


def test_a_plan_at_the_largest_input_runs_smaller_ones_when_the_simulator_fits_it() -> None:
    """A held plan runs a shorter input when the simulator fits it there; its predicted time is
    the shorter step's (the held plan's measured times rescaled), not the longer one's."""
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    probe = Rockmate(copy.deepcopy(model), idx, 1.0, solver="store_all", profile="estimate")
    budget = int(0.6 * probe.store_all_peak)  # bytes: the same for every input
    rk = Rockmate(copy.deepcopy(model), idx, budget, on_new_input="reuse")
    largest = rk.plan
    assert largest.schedule.predicted_peak < probe.store_all_peak
    shorter = idx[:, : 3 * idx.shape[1] // 4].clone()  # (at half the length, storing everything fits)
    with pytest.warns(UserWarning, match="planned for a new input"):
        torch.manual_seed(1)
        out = rk(shorter)
    assert rk.plan is not largest and rk.plan.schedule.extra.get("reused") is True
    assert rk.plan.schedule.ops == largest.schedule.ops
    assert rk.plan.schedule.predicted_peak <= budget < rk.plan.reference.predicted_peak
    assert rk.plan.schedule.predicted_time < 0.85 * largest.schedule.predicted_time
    torch.manual_seed(1)
    expected = model(shorter)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), rk.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=f"gradient of {name}")


def test_a_ratio_budget_reuses_the_held_plan_within_the_samples_bytes() -> None:
    """With a ratio budget, a smaller input runs the held plan within the bytes the ratio gave
    the sample's step (the memory the user accepted), not within the ratio of its own smaller
    peak, which the held plan overshoots on every smaller input; or stores everything, where
    that fits."""
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    rk = Rockmate(copy.deepcopy(model), idx, 0.5, profile="estimate", on_new_input="reuse")
    largest = rk.plan
    shorter = idx[:, : 3 * idx.shape[1] // 4].clone()
    with pytest.warns(UserWarning, match="planned for a new input"):
        torch.manual_seed(1)
        out = rk(shorter)
    assert rk.plan.schedule.extra.get("reused") is True and rk.plan.budget == largest.budget
    assert 0.5 * rk.plan.reference.predicted_peak < rk.plan.schedule.predicted_peak <= largest.budget
    torch.manual_seed(1)
    torch.testing.assert_close(out, model(shorter))
    # Where storing everything fits those bytes, it is planned anew: nothing recomputed.
    rk(idx[:, : idx.shape[1] // 4].clone())
    assert rk.plan.reference.predicted_peak <= rk.plan.budget == largest.budget
    assert "reused" not in rk.plan.schedule.extra
    assert rk.plan.schedule.predicted_time == rk.plan.reference.predicted_time


def test_a_held_plan_runs_the_same_step_traced_under_other_names() -> None:
    """Reuse matches the held graph's nodes by what they compute (`matching_nodes`), not by
    name: the schedule it runs is the held one with each node renamed."""
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    options = PlanOptions(profile="estimate")
    held = plan(capture_joint(model, (idx,)), 0.5, options)
    shorter = (idx[:, : idx.shape[1] // 2].clone(),)
    same = reuse(capture_joint(model, shorter), held.budget, options, held)
    renamed = capture_joint(model, shorter)
    for node in renamed.module.graph.nodes:
        if node.op == "call_function":
            node._rename(f"{node.name}_again")
    again = reuse(renamed, held.budget, options, held)
    assert same is not None and again is not None
    assert again.schedule.ops != same.schedule.ops
    assert [(op.kind, matching_nodes(same.graph, again.graph).get(op.name)) for op in same.schedule.ops
            if op.kind == "compute"] == [(op.kind, op.name) for op in again.schedule.ops if op.kind == "compute"]
    assert again.schedule.predicted_peak == same.schedule.predicted_peak


class _Doubled(torch.nn.Module):
    """Doubles a batch of more than one example: its graph at a batch of one has an op less."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 1 else x


class _Tripled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


def test_a_new_shape_is_planned_on_the_held_plans_times_rescaled(monkeypatch: pytest.MonkeyPatch,
                                                                 recwarn: pytest.WarningsRecorder) -> None:
    """With a measured profile, a step at a new input signature replays nothing: each node takes
    the held plan's measured time scaled by its roofline estimate at the new shapes over the old
    (here a machine twice as slow as the estimate, five times for the tripling, stays so at the
    new shapes), found by what it computes or where it is in the step, not by fx's numbering:
    planned at a batch of one, the graph has a multiplication less, and at a larger batch the
    doubling takes the tripling's name. The doubling, not in the held graph, takes its estimate on the held plan's
    clock. A profile rescaled from another model's plan covers none of its graph: measured, or
    estimated where it says so."""
    import rkgraph

    replays = []

    def slower(module: str) -> float:
        return 5.0 if module == "3" else 2.0

    def measured(graph, joint, inputs, repeats=3):
        replays.append(graph)
        rkgraph.estimate_times(graph, joint)
        for node in graph.nodes:
            node.time *= slower(node.module)

    monkeypatch.setattr(rkgraph, "measure_times", measured)
    model = torch.nn.Sequential(_Doubled(), torch.nn.Linear(32, 64), torch.nn.Tanh(), _Tripled(),
                                torch.nn.Linear(64, 1))
    rk = Rockmate(model, _mlp(1), 1.0)
    first = rk.plan
    assert len(replays) == 1 and not any(n.module == "0" for n in first.graph.nodes)
    for batch in (64, 32):
        rk(_mlp(batch)).sum().backward()
    assert len(replays) == 1 and len(rk._steps) == 3
    held_estimates = rkgraph.estimated_times(first.graph, first.joint.module)
    clock = sum(first.times.values()) / sum(held_estimates.values())
    for again in [step.plan for step in rk._steps.values()][1:]:
        modules = {n.name: n.module for n in first.graph.nodes}
        renamed = [n for n in again.graph.nodes if n.name in modules and modules[n.name] != n.module]
        assert renamed and all(n.op == "aten.mul.Tensor" for n in renamed)
        estimates = rkgraph.estimated_times(again.graph, again.joint.module)
        factor = {n.name: clock if n.module == "0" else slower(n.module) for n in again.graph.nodes}
        assert again.times == pytest.approx({name: factor[name] * estimates[name] for name in factor})
    other = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    Rockmate(copy.deepcopy(other), _mlp(64), 1.0, profile=first.rescaled_times)
    assert len(replays) == 2
    # Where the step's values cannot be replayed (sharded parameters not gathered): estimated.
    estimated = Rockmate(other, _mlp(64), 1.0, profile=dataclasses.replace(first.rescaled_times, otherwise="estimate"))
    assert len(replays) == 2
    assert estimated.plan.times == rkgraph.estimated_times(estimated.plan.graph, estimated.plan.joint.module)


def _two_products(rename: str, weight_first: bool, cloned: bool = False) -> RematGraph:
    """A linear layer's backward as autograd writes it: the input's gradient (from the weight)
    and the weight's (from the input), two products of one op; names suffixed with `rename`,
    the weight's gradient made first where `weight_first`, the input cloned first where `cloned`."""
    def n(name: str) -> str:
        return name + rename if name not in {"x", "w", "tangent"} else name

    data = {d: DataNode(d, 8, kind) for d, kind in (("x", "input"), ("w", "param"), ("tangent", "tangent"))}
    nodes = [ComputeNode(n("clone"), ("x",), (n("xc"),), op="aten.clone.default")] if cloned else []
    nodes.append(ComputeNode(n("mm"), (n("xc") if cloned else "x", "w"), (n("y"),), op="aten.mm.default",
                             module="linear"))
    grad_input = ComputeNode(n("mm_a"), ("tangent", "w"), (n("gx"),), backward=True, op="aten.mm.default",
                             module="linear")
    grad_weight = ComputeNode(n("mm_b"), ("tangent", n("xc") if cloned else "x"), (n("gw"),), backward=True,
                              op="aten.mm.default", module="linear")
    nodes += [grad_weight, grad_input] if weight_first else [grad_input, grad_weight]
    for node in nodes:
        for d in node.outputs:
            data[d] = DataNode(d, 8, producer=node.name)
    return RematGraph(nodes, data, (n("y"),), (n("gx"), n("gw")), user_outputs=(n("y"),))


def test_a_replan_starts_each_graph_from_the_held_plans_schedule_of_its_kind(rockmate_calls: list) -> None:
    """Where the first plan solved both autograd's graph and its lean variant, the plan keeps the
    one that lost (`runner_up`), and a replan's solve of each graph starts from the held schedule
    of the same kind of graph: the lean variant's solve is no longer a search from nothing."""
    torch.manual_seed(0)
    layers = [layer for _ in range(4) for layer in (torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                         torch.nn.Linear(256, 64), torch.nn.Dropout(0.1))]
    model = torch.nn.Sequential(*layers)
    options = PlanOptions(profile="estimate", solver_options={"time_limit": 10, "gap": 0.0})
    held = plan(capture_joint(model, (torch.randn(2048, 64),), {}), 0.76, options)
    assert held.runner_up is not None and len(held.runner_up[0].nodes) != len(held.graph.nodes)
    again = plan(capture_joint(model, (torch.randn(1792, 64),), {}), 0.76, options, held=held)
    assert again.schedule.predicted_peak <= again.budget
    started = {len(graph.nodes): [op.kind for op in given["known"][0].ops]
               for graph, _, given in rockmate_calls if given.get("known")}
    assert started == {len(graph.nodes): [op.kind for op in schedule.ops]
                       for graph, schedule in ((held.graph, held.schedule), held.runner_up)}


def test_a_held_graphs_nodes_are_matched_by_what_they_compute_not_by_name_or_place() -> None:
    """At another batch size the same step is traced under other names, and autograd may run a
    layer's two gradient products the other way round: each node is matched to the one that
    computes the same op of the same module from matched inputs, or else at the same place."""
    held, here = _two_products("", weight_first=False), _two_products("_7", weight_first=True)
    assert [n.name for n in here.nodes] == ["mm_7", "mm_b_7", "mm_a_7"]
    assert matching_nodes(held, here) == {"mm": "mm_7", "mm_a": "mm_a_7", "mm_b": "mm_b_7"}
    # Positions alone would pair the input's gradient with the weight's.
    assert node_keys(held)["mm_a"] == node_keys(here)["mm_b_7"]
    # A node one graph lacks leaves its descendants unmatched by what they compute (they read
    # other values): those are matched by where they are.
    assert matching_nodes(held, _two_products("_1", weight_first=False, cloned=True)) == {
        "mm": "mm_1", "mm_a": "mm_a_1", "mm_b": "mm_b_1"}


def test_a_new_shape_is_planned_from_the_held_plan(rockmate_calls: list) -> None:
    """Planned anew for a new input signature, the default solver gets the held plan's schedule
    on the new graph as a start, and ends its search within its gap of the held plan's own
    distance to its floor: a replan pays planning time again at every new shape."""
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    rk = Rockmate(model, idx, 0.5, profile="estimate")
    first = rk.plan
    assert first.schedule.gap is not None
    rockmate_calls.clear()
    with pytest.warns(UserWarning, match="planned for a new input"):
        rk(idx[:, : idx.shape[1] - 8]).sum().backward()
    # (The plan held may be the lean variant's: its graph's solve starts from it.)
    started = [options for *_, options in rockmate_calls if options.get("known")]
    (start,) = started[-1]["known"]
    assert start.solver == "held_plan" and len(start.ops) == len(first.schedule.ops)
    assert [op.kind for op in start.ops] == [op.kind for op in first.schedule.ops]
    assert started[-1]["gap"] == pytest.approx(0.01 + first.schedule.gap)
    again = rk.plan
    assert again is not first and again.schedule.predicted_peak <= again.budget
    # A caller's own gap is the caller's.
    rockmate_calls.clear()
    rk = Rockmate(copy.deepcopy(model), idx, 0.5, profile="estimate", solver_options={"gap": 0.0, "time_limit": 3})
    with pytest.warns(UserWarning, match="planned for a new input"):
        rk(idx[:, : idx.shape[1] - 8]).sum().backward()
    started = [options for *_, options in rockmate_calls if options.get("known")]
    assert started and all(options["gap"] == 0.0 for options in started)
