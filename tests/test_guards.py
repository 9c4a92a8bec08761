"""When a plan still applies (its guards), and what module hooks do in planned steps.

A plan is traced under the sample's shapes, the submodules' train/eval modes and the autocast
state; a step under others is planned anew (or refused with on_new_input="error"), never run
on a plan traced for something else. Hooks are traced: their effect on tensors applies in
every step; that their Python side effects do not is said when planning.
"""

from __future__ import annotations

import copy
import warnings

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


def _hooked_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)), \
        torch.randn(5, 8)


def test_hooks_that_change_tensors_apply_in_every_step() -> None:
    model, x = _hooked_mlp()
    model[1].register_forward_pre_hook(lambda _m, args: (args[0] * 0.5,))
    model[2].register_forward_hook(lambda _m, _args, out: out + 1.0)
    model[3].register_full_backward_hook(lambda _m, grad_in, _grad_out: (grad_in[0] * 3.0,))
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="module hooks"):
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
    for seed in (1, 2):  # every step, not only the first
        model.zero_grad()
        reference.zero_grad()
        torch.testing.assert_close(_step(rk, (x,), {}, seed), _step(reference, (x,), {}, seed))
        _assert_same_gradients_and_state(model, reference)
    plain = copy.deepcopy(reference)
    for m in plain.modules():  # the hooks do change the step: without them it differs
        m._forward_hooks.clear(), m._forward_pre_hooks.clear(), m._backward_hooks.clear()
    assert not torch.allclose(plain(x), reference(x))


def test_hooks_that_record_are_said_not_to_run_per_step() -> None:
    model, x = _hooked_mlp()
    recorded: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda _m, _args, out: recorded.append(out))
    with pytest.warns(UserWarning, match=r"2\.forward_hooks.*not in each step") as caught:
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
    assert caught[0].filename == __file__  # the warning names the user's line
    recorded.clear()
    _step(rk, (x,), {})
    assert recorded == []  # as the warning said


def test_no_hook_no_warning() -> None:
    model, x = _hooked_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Rockmate(model, (x,), 1.0, solver="store_all")
