"""When a plan still applies (its guards).

A plan is traced under the sample's shapes, the submodules' train/eval modes, the autocast
state and the module hooks registered; a step under others is planned anew (or refused with
on_new_input="error"), never run on a plan traced for something else. What hooks do in planned
steps: tests/test_hooks.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rockplan import Rockmate, zoo
from solvers import min_feasible_budget


def _step(model: nn.Module, args: tuple, kwargs: dict, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    out.backward(torch.ones_like(out))
    return out


def _assert_same_gradients_and_state(model: nn.Module, reference: nn.Module) -> None:
    # Not bitwise: eager's kernels against AOTAutograd's decompositions (BatchNorm's).
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    for (name, x), y in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=f"state {name}")


@pytest.mark.parametrize("name", ["gpt", "resnet"])  # dropout; BatchNorm
def test_planned_in_eval_mode_then_trained_matches_eager(name: str) -> None:
    """As `from_pretrained` returns a model: in eval mode. The plan traced then has dropout off
    and BatchNorm on its running statistics; after train() the step must be eager's."""
    model, args, kwargs, _ = zoo.make(name, "tiny")
    model.eval()
    reference = copy.deepcopy(model).train()
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    rk.train()
    out = _step(rk, args, kwargs)
    torch.testing.assert_close(out, _step(reference, args, kwargs), rtol=1e-4, atol=1e-5)
    _assert_same_gradients_and_state(model, reference)
    assert len(rk._steps) == 2  # the eval-mode plan and the training one


def test_a_submodule_switched_to_eval_is_planned_anew() -> None:
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    first_dropout = next(m for m in model.modules() if isinstance(m, nn.Dropout))
    first_dropout.eval()  # one dropout off, the rest on: eager's step differs from the sample's
    reference = copy.deepcopy(model)
    out = _step(rk, args, kwargs)
    torch.testing.assert_close(out, _step(reference, args, kwargs), rtol=0, atol=0)
    _assert_same_gradients_and_state(model, reference)


def test_mode_change_is_refused_when_asked_and_named() -> None:
    model, args, kwargs, _ = zoo.make("resnet", "tiny")
    model.eval()
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all", on_new_input="error")
    rk.train()
    with pytest.raises(ValueError, match="train/eval modes differ"):
        rk(*args, **kwargs)


def test_autocast_state_selects_its_own_plan() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    reference = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _step(rk, args, kwargs)
        expected = _step(reference, args, kwargs)
    assert len(rk._steps) == 2
    assert out.dtype == expected.dtype == torch.bfloat16  # traced under autocast, not the fp32 plan
    with torch.autocast("cpu", dtype=torch.bfloat16):
        strict = Rockmate(model, (args, kwargs), 1.0, solver="store_all", on_new_input="error")
    with pytest.raises(ValueError, match="autocast"):
        strict(*args, **kwargs)


def test_batchnorm_statistics_are_updated_once_per_step_when_recomputed() -> None:
    model, args, kwargs, _ = zoo.make("resnet", "tiny")
    reference = copy.deepcopy(model)
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all", profile="estimate")
    rk = Rockmate(model, (args, kwargs), min_feasible_budget(probe.graph), profile="estimate")
    recomputed = [op.name for op in rk.schedule.backward_ops if op.kind == "compute"]
    assert any("batch_norm_legit" in name for name in recomputed), "no BatchNorm forward is recomputed"
    for _ in range(2):
        _step(rk, args, kwargs)
        _step(reference, args, kwargs)
    _assert_same_gradients_and_state(model, reference)
    counts = {m.num_batches_tracked.item() for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
    assert counts == {2}
