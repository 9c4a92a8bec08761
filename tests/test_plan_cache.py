"""Plans kept on disk between runs (`rockplan.plan_cache`): read back in place of the profile's
replays and the solve where everything planning depends on is the same, planned anew where
anything differs or the cached plan no longer matches, never an error of its own."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import rkgraph
from rkgraph import capture_joint
from rockplan import Rockmate, zoo
from rockplan.plan_cache import ENVIRONMENT, PlanCache, cache_directory, plan_key, profile_key
from rockplan.plan_file import read_plan
from rockplan.planner import PlanOptions


def _gpt() -> tuple[torch.nn.Module, tuple, dict]:
    """A GPT whose plan at half its peak is the lean variant's, with dropout replayed."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab_size=128, block_size=256, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    return model, (torch.randint(0, 128, (2, 256)),), {}


def _step(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    torch.manual_seed(1)
    out = model(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    return out


def _entries(directory: Path) -> list[Path]:
    return sorted((directory / "plans").glob("*.json"))


def test_a_plan_is_read_back_instead_of_profiled_and_solved(tmp_path: Path, rockmate_calls: list,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The second Rockmate of the same model, sample, budget and options replays nothing and
    solves nothing: it runs the same schedule (here the lean variant's, which autograd's graph
    does not match), says what was weighed when it was planned, and trains as the first."""
    replays = []
    measure = rkgraph.measure_times
    monkeypatch.setattr(rkgraph, "measure_times", lambda *a, **k: replays.append(1) or measure(*a, **k))
    model, args, kwargs = _gpt()
    copied = copy.deepcopy(model)
    first = Rockmate(model, (args, kwargs), 0.5, plan_cache=tmp_path)
    assert rockmate_calls and replays and len(_entries(tmp_path)) == 1
    assert first.considered  # autograd's graph, weighed and not run
    rockmate_calls.clear()
    replays.clear()
    second = Rockmate(copied, (args, kwargs), 0.5, plan_cache=tmp_path)
    assert not rockmate_calls and not replays
    assert "autograd's graph" in first.considered and "masks packed" in second.explain()
    assert [str(op) for op in second.schedule.ops] == [str(op) for op in first.schedule.ops]
    assert second.considered == first.considered and second.budget == first.budget
    assert second.schedule.lower_bound == first.schedule.lower_bound
    assert second.profile_times() == first.profile_times()
    torch.testing.assert_close(_step(second, args, kwargs), _step(first, args, kwargs), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), copied.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=f"gradient of {name}")
    # Another budget is another plan: solved on the times measured before (no replay), and kept
    # beside the first.
    Rockmate(copy.deepcopy(copied), (args, kwargs), 0.6, plan_cache=tmp_path)
    assert rockmate_calls and not replays and len(_entries(tmp_path)) == 2


def test_a_cached_plan_that_no_longer_matches_is_planned_anew(tmp_path: Path, rockmate_calls: list) -> None:
    """An entry whose graph differs from the one captured (here a node's scratch changed, as
    another kernel would change it) or that is damaged is planned anew, without an error, and
    written again."""
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    Rockmate(copy.deepcopy(model), idx, 0.5, profile="estimate", plan_cache=tmp_path)
    (path,) = _entries(tmp_path)
    document = json.loads(path.read_text())
    workspace = document["graph"]["nodes"][3]["workspace"]
    document["graph"]["nodes"][3]["workspace"] += 1
    path.write_text(json.dumps(document))
    rockmate_calls.clear()
    Rockmate(copy.deepcopy(model), idx, 0.5, profile="estimate", plan_cache=tmp_path)
    assert rockmate_calls
    assert read_plan(path).graph.nodes[3].workspace == workspace  # written again
    path.write_text("{not json")
    rockmate_calls.clear()
    Rockmate(copy.deepcopy(model), idx, 0.5, profile="estimate", plan_cache=tmp_path)
    assert rockmate_calls and read_plan(path).graph.nodes[3].workspace == workspace
    rockmate_calls.clear()
    Rockmate(copy.deepcopy(model), idx, 0.5, profile="estimate", plan_cache=tmp_path)
    assert not rockmate_calls


def test_the_keys_hold_the_graph_budget_and_options() -> None:
    """The same step traced twice has the same keys; another profile or input shape has
    another profile key, and another budget or solver option another plan key only."""
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    joint = capture_joint(model, (idx,))
    options = PlanOptions(profile="estimate")
    profiled = profile_key(joint, options)
    assert profile_key(capture_joint(model, (idx,)), options) == profiled
    tuned = PlanOptions(profile="estimate", solver_options={"time_limit": 5})
    assert profile_key(joint, tuned) == profiled
    assert len({profiled, profile_key(joint, PlanOptions(profile="measure")),
                profile_key(capture_joint(model, (idx[:, :-1].clone(),)), options)}) == 3
    assert len({plan_key(profiled, 0.5, options), plan_key(profiled, 0.6, options),
                plan_key(profiled, 0.5, tuned)}) == 3


def test_the_least_recently_used_plans_are_removed(tmp_path: Path) -> None:
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    joint = capture_joint(model, (idx,))
    cache = PlanCache(tmp_path, entries=2)
    options = PlanOptions(profile="estimate")
    for budget in (0.5, 0.6, 0.7):
        cache.plan(joint, budget, options)
    kept = {path.stem for path in _entries(tmp_path)}
    assert kept == {plan_key(profile_key(joint, options), budget, options) for budget in (0.6, 0.7)}
    assert len(list((tmp_path / "times").glob("*.json"))) == 1  # one step, one profile


def test_where_plans_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_directory(None) == tmp_path / "rockplan"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_directory(None) == tmp_path / "home" / ".cache" / "rockplan"
    with monkeypatch.context() as homeless:
        homeless.setattr(os.path, "expanduser", lambda path: path)  # "~" left as it is: no home directory
        assert cache_directory(None) is None
    assert cache_directory(tmp_path / "mine") == tmp_path / "mine"
    assert cache_directory(False) is None
    monkeypatch.setenv(ENVIRONMENT, str(tmp_path / "env"))
    assert cache_directory(None) == tmp_path / "env"
    monkeypatch.setenv(ENVIRONMENT, "off")
    assert cache_directory(None) is None
    assert cache_directory(tmp_path / "given") == tmp_path / "given"  # an explicit directory wins
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    Rockmate(model, idx, 0.5, profile="estimate", plan_cache=False)
    assert not (tmp_path / "rockplan").exists()


def test_a_new_input_shape_is_read_back_too(tmp_path: Path, rockmate_calls: list) -> None:
    """The plan for a new input signature, made in the step on the first plan's times rescaled,
    is cached as any plan: run again, neither the sample's plan nor that one is solved."""
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    shorter = idx[:, : 3 * idx.shape[1] // 4].clone()
    outputs = []
    for run in range(2):
        rockmate_calls.clear()
        rk = Rockmate(copy.deepcopy(model), idx, 0.5, plan_cache=tmp_path)
        with pytest.warns(UserWarning, match="planned for a new input"):
            torch.manual_seed(1)
            outputs.append(rk(shorter))
        assert bool(rockmate_calls) == (run == 0)
    assert len(_entries(tmp_path)) == 2
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
