"""Plans per input signature: re-planning is visible, the plans held are bounded, and a
Rockmate survives pickling (its plans are made again, not saved)."""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch

from rockplan import Rockmate, zoo


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
    model, (idx,), _, _ = zoo.make("gpt", "tiny")
    probe = Rockmate(copy.deepcopy(model), idx, 1.0, solver="store_all", profile="estimate")
    budget = int(0.6 * probe.store_all_peak)  # bytes: the same for every input
    rk = Rockmate(copy.deepcopy(model), idx, budget, profile="estimate", on_new_input="reuse")
    largest = rk.plan
    assert largest.schedule.predicted_peak < probe.store_all_peak
    shorter = idx[:, : idx.shape[1] // 2].clone()
    with pytest.warns(UserWarning, match="planned for a new input"):
        torch.manual_seed(1)
        out = rk(shorter)
    assert rk.plan is not largest and rk.plan.schedule.extra.get("reused") is True
    assert rk.plan.schedule.ops == largest.schedule.ops
    assert rk.plan.schedule.predicted_peak <= budget
    torch.manual_seed(1)
    expected = model(shorter)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), rk.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=f"gradient of {name}")
