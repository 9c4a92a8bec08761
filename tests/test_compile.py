"""torch.compile and Inductor: `torch.compile(rk)` and `Rockmate(..., backend="inductor")`,
each compared with eager PyTorch (or with torch.compile of the model, where Inductor's random
numbers differ from eager's by design) and measured against the budget.

What is compared with dropout: Inductor draws its random numbers from one seed per step
(`inductor_seeds`) with its own generator, not eager's, so with dropout active the planned
step is compared with `torch.compile(model)` from the same `torch.manual_seed`: the same
seeds, the same masks, so outputs and gradients agree within Inductor's tolerance. At p=0 it
is compared with eager itself."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import rockplan.module
from rockplan import Rockmate, zoo
from rockplan.memory import measure_step
from rockplan.module import TORCH_COMPILE_WARNING
from solvers import InfeasibleBudget, min_feasible_budget

SOLVER_OPTIONS = {"time_limit": 10}


def _step(model: nn.Module, args: tuple, kwargs: dict, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    out.backward(torch.ones_like(out))
    return out


def _assert_close(out: torch.Tensor, model: nn.Module, other_out: torch.Tensor, other: nn.Module,
                  tolerance: float) -> None:
    """Outputs and gradients apart by at most `tolerance` of the other's largest magnitude."""
    pairs = [("output", out, other_out)]
    pairs += [(f"gradient of {n}", p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), other.parameters())]
    for what, a, b in pairs:
        difference, scale = (a - b).abs().max(), b.abs().max().clamp_min(1e-12)
        assert difference <= tolerance * scale, f"{what}: {difference} apart, magnitude {scale}"


def _measured(rk: Rockmate, step_of: nn.Module, args: tuple, kwargs: dict) -> object:
    _step(step_of, args, kwargs)  # warm-up: compilation and lazy allocations are not the step's memory
    rk.zero_grad(set_to_none=True)
    return measure_step(_step, step_of, args, kwargs, method="profiler")


def test_torch_compile_of_a_planned_module_runs_the_plan_and_says_so() -> None:
    """torch.compile(rk): the step runs as planned (Dynamo does not trace it, so torch.compile's
    partitioner cannot override what the plan keeps), with one warning saying so; the same
    results as eager, the measured peak within the budget."""
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    eager = copy.deepcopy(model)
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    rk = Rockmate(model, (args, kwargs), min_feasible_budget(probe.graph), solver_options=SOLVER_OPTIONS)
    compiled = torch.compile(rk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = _measured(rk, compiled, args, kwargs)
    assert [str(w.message) for w in caught if w.message.args[0] == TORCH_COMPILE_WARNING] == [TORCH_COMPILE_WARNING]
    _assert_close(planned.result, model, _step(eager, args, kwargs), eager, 1e-4)
    assert planned.peak <= rk.budget, f"measured {planned.peak} B over budget {rk.budget} B"


def test_inductor_with_dropout_draws_torch_compiles_masks_within_the_budget() -> None:
    """backend="inductor" on a model with dropout (it failed in Inductor's lowering of aten.rand):
    the masks are torch.compile's, so the step agrees with torch.compile(model); measured peak
    within the budget."""
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    reference = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 0.6, backend="inductor", solver_options=SOLVER_OPTIONS)
    assert any("inductor_random" in n.op for n in rk.graph.nodes)
    planned = _measured(rk, rk, args, kwargs)
    compiled = torch.compile(reference)
    _step(compiled, args, kwargs)
    reference.zero_grad(set_to_none=True)
    _assert_close(planned.result, model, _step(compiled, args, kwargs), reference, 1e-4)
    assert planned.peak <= rk.budget, f"measured {planned.peak} B over budget {rk.budget} B"


def test_inductor_at_dropout_zero_equals_eager_within_the_budget() -> None:
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    for block in model.transformer["h"]:
        block.attn.dropout = 0.0
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    eager = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 0.6, backend="inductor", solver_options=SOLVER_OPTIONS)
    planned = _measured(rk, rk, args, kwargs)
    _assert_close(planned.result, model, _step(eager, args, kwargs), eager, 1e-4)
    assert planned.peak <= rk.budget, f"measured {planned.peak} B over budget {rk.budget} B"


def test_inductor_step_measured_over_the_budget_is_planned_again_tighter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's compiled step can hold more than the schedule: measured over the budget, the
    step is planned again for a budget smaller by the excess, and the plan keeps the user's
    budget; when no plan fits, the refusal gives the measured figures."""
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    measure, budget, excess = rockplan.module.measured_step_peak, 450_000, 4096  # storing all: about 420 kB
    peaks: list[int] = []

    def over_the_first_time(*step: object) -> int:
        peaks.append(measure(*step))
        return budget + excess if len(peaks) == 1 else peaks[-1]

    monkeypatch.setattr(rockplan.module, "measured_step_peak", over_the_first_time)
    rk = Rockmate(model, (args, kwargs), budget, backend="inductor", solver_options=SOLVER_OPTIONS)
    assert len(peaks) == 2 and rk.budget == budget
    assert rk.schedule.predicted_peak <= budget - excess and peaks[-1] <= budget
    monkeypatch.setattr(rockplan.module, "measured_step_peak", lambda *step: 10**12)
    with pytest.raises(InfeasibleBudget, match="Inductor's compiled step does not fit"):
        Rockmate(copy.deepcopy(model), (args, kwargs), budget, backend="inductor", solver_options=SOLVER_OPTIONS)
