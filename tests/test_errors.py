"""Faults a user meets first: each is supported (and compared with eager PyTorch) or refused
with an error that says what is wrong and what to do, as early as it can be known."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import rockplan
from rkgraph.capture import CaptureError
from rockplan import Rockmate, zoo
from rockplan.budget import budget_bytes, parse_budget
from solvers import InfeasibleBudget


class _NeverTraced(nn.Module):
    """A model whose forward must not run: what is refused before capture never gets there."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1000))  # 4000 bytes of gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the forward was traced")


def _eager_and_planned(model: nn.Module, *args: torch.Tensor, budget: float | int | str = 1.0, **options):
    planned_model = _copy(model)
    return model, Rockmate(planned_model, args, budget, profile="estimate", **options)


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


# --- budgets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget, expected", [
    (np.int64(4096), 4096),
    (4096, 4096),
    ("4096", 4096),
    ("4KiB", 4096),
    (" 1.5 kb ", 1500),
    (np.float32(0.5), None),
    (0.5, None),
    ("0.5", None),
    (".25", None),
])
def test_budget_forms(budget: object, expected: int | None) -> None:
    assert budget_bytes(budget) == expected


def test_a_numeric_string_is_the_ratio_the_command_line_reads() -> None:
    assert parse_budget("0.5", 1000) == 500 == parse_budget(np.float64(0.5), 1000)


@pytest.mark.parametrize("budget, error, match", [
    ("0", ValueError, "must be positive"),
    ("0.0001 B", ValueError, "must be positive"),
    ("1.5", ValueError, r"ratio budget must be in \(0, 1\]"),
    (np.float64(2.0), ValueError, r"ratio budget must be in \(0, 1\]"),
    (np.int32(-3), ValueError, "must be positive"),
    ("half", ValueError, "cannot read budget"),
    (True, TypeError, "budget must be bytes"),
    (None, TypeError, "budget must be bytes"),
    ([1], TypeError, "budget must be bytes"),
])
def test_bad_budgets_are_refused_before_capture(budget: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Rockmate(_NeverTraced(), torch.zeros(1), budget)


@pytest.mark.parametrize("budget", [3999, "3.9KB", np.int64(100)])
def test_a_budget_below_the_gradients_is_refused_before_capture(budget: object) -> None:
    with pytest.raises(InfeasibleBudget, match=r"smallest feasible budget is at least 4000 bytes .* gradients"):
        Rockmate(_NeverTraced(), torch.zeros(1), budget)


def test_a_budget_above_the_gradients_goes_on_to_capture() -> None:
    with pytest.raises(Exception, match="the forward was traced"):
        Rockmate(_NeverTraced(), torch.zeros(1), 4000)


# --- outputs that need no gradient -----------------------------------------------------------------


class _LossAndPrediction(nn.Module):
    """Returns the loss beside outputs that need no gradient, as training loops do."""

    def __init__(self, extra: str) -> None:
        super().__init__()
        self.extra = extra
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> tuple:
        logits = self.body(x)
        loss = logits.logsumexp(-1).mean()
        if self.extra == "argmax":
            return loss, logits.argmax(-1)
        if self.extra == "detached":
            return loss, logits.detach()
        if self.extra == "none":
            return loss, None
        return logits.argmax(-1), (logits > 0).sum()  # nothing that needs a gradient


@pytest.mark.parametrize("extra", ["argmax", "detached", "none"])
def test_outputs_that_need_no_gradient_are_forward_outputs(extra: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    eager, rk = _eager_and_planned(_LossAndPrediction(extra), x)
    expected, got = eager(x), rk(x)
    expected[0].backward()
    got[0].backward()
    assert type(got) is tuple and len(got) == 2
    torch.testing.assert_close(got[0], expected[0])
    if expected[1] is None:
        assert got[1] is None
    else:
        assert not got[1].requires_grad
        torch.testing.assert_close(got[1], expected[1])
    for p, q in zip(eager.parameters(), rk.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_a_step_with_no_output_that_needs_a_gradient_says_what_to_return() -> None:
    with pytest.raises(ValueError, match="no output of _LossAndPrediction requires grad.*Return the loss"):
        Rockmate(_LossAndPrediction("nothing"), torch.randn(16, 8), profile="estimate")


# --- solvers that give up ----------------------------------------------------------------------------


def _mlp_with_loss() -> tuple[nn.Module, tuple]:
    model, args, _, loss_fn = zoo.make("mlp", "tiny")
    return zoo.WithLoss(model, loss_fn), args


def _saved_values_refusal(time_limit: float) -> str:
    """The refusal of saved values making no attempt within `time_limit` seconds, at a budget
    where a schedule exists: OutOfTime, importable from rockplan (one may exist)."""
    model, args = _mlp_with_loss()
    with pytest.raises(rockplan.OutOfTime) as refused:
        Rockmate(model, args, 0.9, solver="saved_values", solver_options={"time_limit": time_limit, "attempts": 0},
                 profile="estimate")
    return str(refused.value)


def test_a_solver_out_of_time_says_so_and_how_to_give_it_more() -> None:
    message = _saved_values_refusal(0)  # no attempt within no time
    assert "ran out of its time limit" in message and "solver_options={'time_limit': " in message, message
    assert "a schedule is known from" in message and "too small" not in message, message


def test_a_solver_whose_searches_end_before_its_time_asks_for_a_budget_not_more_time() -> None:
    """A solver that stops well within its time limit without a schedule did not lack time:
    the error says so and gives the budget a schedule is known from, not a larger time limit."""
    message = _saved_values_refusal(600)
    assert "before its time limit (600 s)" in message and "its searches ended, not its time" in message, message
    assert "time_limit': " not in message and "Use a budget of at least" in message, message


def test_a_solver_below_the_floor_states_the_floor_whatever_the_solver() -> None:
    model, args = _mlp_with_loss()
    with pytest.raises(rockplan.InfeasibleBudget, match="too small: the smallest feasible budget") as refused:
        Rockmate(model, args, 0.05, solver="saved_values", profile="estimate")
    assert "time" not in str(refused.value) and not isinstance(refused.value, rockplan.OutOfTime)


# --- side effects without an output ------------------------------------------------------------------


class _Checked(nn.Module):
    """Asserts on an activation, as models check their inputs or the finiteness of a value."""

    def __init__(self, message: bool) -> None:
        super().__init__()
        self.message = message
        layers = [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]
        self.body = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), *layers, nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body[0](x)
        in_range = (hidden.abs() < 1e3).all()
        if self.message:
            torch._assert_async(in_range, "activation out of range")
        else:
            torch._assert_async(in_range)
        return self.body[1:](hidden).logsumexp(-1).mean()


@pytest.mark.parametrize("message", [False, True])
def test_an_assertion_in_the_forward_is_kept(message: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    eager, rk = _eager_and_planned(_Checked(message), x, budget=0.7)
    assert rk.schedule.predicted_time > rk.store_all_time  # the plan recomputes
    eager(x).backward()
    rk(x).backward()
    for p, q in zip(eager.parameters(), rk.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    with pytest.raises(RuntimeError):
        eager(x * 1e6)
    with pytest.raises(RuntimeError):
        rk(x * 1e6)


# --- tensors a forward leaves on its modules ------------------------------------------------------------


class _RoutedBlock(nn.Module):
    """A mixture-of-experts block as MoE code writes it: the router's load-balancing loss is
    stored on the module during the forward and read by the training loop afterwards."""

    def __init__(self, width: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.Parameter(torch.randn(experts, width, width) / width**0.5)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)  # dense routing: every expert, weighted
        self.aux_loss = (gates.mean(0) ** 2).sum() * gates.shape[-1]
        return x + torch.tanh(torch.einsum("be,eij,bj->bi", gates, self.experts, x))


class _MoE(nn.Module):
    def __init__(self, container: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_RoutedBlock() for _ in range(4)))
        self.container = container
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(x)
        if self.container:
            self.losses.append(out.mean())
        return out.pow(2).mean()


def _aux_losses(model: _MoE) -> torch.Tensor:
    return sum(block.aux_loss for block in model.blocks)


def test_an_auxiliary_loss_stored_on_a_module_is_set_after_each_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    eager, rk = _eager_and_planned(_MoE(), x, budget=0.7)
    planned = rk.model
    assert all(block.aux_loss is None for block in planned.blocks)  # planning left the model as it was
    assert rk.schedule.predicted_time > rk.store_all_time  # the plan recomputes
    for step in range(2):
        x = torch.randn(256, 32)
        expected, got = eager(x), rk(x)
        assert all(isinstance(b.aux_loss, torch.Tensor) and b.aux_loss.grad_fn is not None for b in planned.blocks)
        torch.testing.assert_close(_aux_losses(planned), _aux_losses(eager))
        (expected + 0.1 * _aux_losses(eager)).backward()
        (got + 0.1 * _aux_losses(planned)).backward()
        for (name, p), q in zip(eager.named_parameters(), planned.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"gradient of {name} at step {step}")


def test_tensors_added_to_a_module_container_are_refused_naming_it() -> None:
    model = _MoE(container=True)
    with pytest.raises(RuntimeError, match=r"adds tensors to losses \(a list\) in place.*Return the tensor"):
        Rockmate(model, torch.randn(256, 32), profile="estimate")
    assert model.losses == [] and all(block.aux_loss is None for block in model.blocks)


def test_a_value_dependent_shape_in_a_graph_is_refused_naming_the_line() -> None:
    """Writing one value per position into a boolean mask's positions is one graph to Dynamo,
    but its backward gathers by the mask (nonzero): no plan can size that before the step. The
    refusal says so and names the user's line, not a missing fake implementation at an unknown
    location. (One value for every position is traced as torch.where and plans: test_capture.)"""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.fill = nn.Linear(8, 8), nn.Parameter(torch.zeros(2, 8))  # a row per True

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h[mask] = self.fill
            return h.square().mean()

    x, mask = torch.randn(4, 8), torch.tensor([True, False, True, False])
    with pytest.raises(CaptureError, match=r"(?s)shape depends on the values of its input.*h\[mask\] = self\.fill"
                                           r".*outside the planned module") as refused:
        Rockmate(Masked(), (x, mask), 1.0)(x, mask)  # the graph break path plans in the first step
    assert "fake (meta) implementation" not in str(refused.value)


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant, self.a, self.b = reentrant, nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: self.a(t).relu().exp(), x, use_reentrant=self.reentrant)
        return self.b(h).square().mean()


def test_reentrant_checkpointing_is_refused_saying_to_turn_it_off() -> None:
    """Its backward runs a backward inside autograd's, which cannot be traced: the refusal names
    the checkpoint and how to turn it off, not a branch on tensor values at an unknown line."""
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(CaptureError, match=r"use_reentrant=True.*gradient_checkpointing_disable\(\).*"
                                           r"use_reentrant=False") as refused:
        Rockmate(_Checkpointed(reentrant=True), x, 1.0, profile="estimate")
    assert "unknown location" not in str(refused.value) and "branch" not in str(refused.value)


def test_non_reentrant_checkpointing_is_traced_through_with_eagers_gradients() -> None:
    """What the error advises: the checkpoint is traced as if it were not there, and rockplan plans."""
    x = torch.randn(4, 8, requires_grad=True)
    eager = _Checkpointed(reentrant=False)
    plain = _copy(eager)
    plain.forward = lambda t: plain.b(plain.a(t).relu().exp()).square().mean()
    rk = Rockmate(_copy(eager), x, 1.0, profile="estimate")
    unchecked = Rockmate(plain, x, 1.0, profile="estimate")
    assert [n.op for n in rk.graph.nodes] == [n.op for n in unchecked.graph.nodes]
    for module in (eager, rk):
        module(x).backward()
    for p, q in zip(rk.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("bag", [False, True])
def test_a_sparse_embedding_is_refused_naming_it_and_the_dense_option(bag: bool) -> None:
    """Its weight's gradient is a sparse tensor, which building the graph could not size (it
    failed with "Cannot access storage of SparseTensorImpl")."""

    class Embedded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = (nn.EmbeddingBag if bag else nn.Embedding)(100, 8, sparse=True)
            self.head = nn.Linear(8, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.table(ids) if bag else self.table(ids).mean(1)).square().mean()

    with pytest.raises(CaptureError, match=r"table: .*sparse_coo tensor.*Pass sparse=False"):
        Rockmate(Embedded(), torch.randint(0, 100, (4, 6)), 1.0, profile="estimate")


def test_dtr_refusing_a_budget_above_the_floor_says_what_it_ran_out_of() -> None:
    """DTR has a time limit only when given one: without, its refusal says its search does not
    cover every schedule; with one that runs out, how to give it more time."""
    from rockplan.planner import OutOfTime
    from solvers import budget_bounds

    model, args, kwargs, _ = zoo.make("resnet", "tiny")
    # The least budget a search in autograd's order may reach: DTR's run does not.
    floor = budget_bounds(Rockmate(model, (args, kwargs), 1.0, solver="store_all").graph).reachable[0]
    with pytest.raises(OutOfTime, match="does not cover every schedule"):
        Rockmate(model, (args, kwargs), floor, solver="dtr")
    with pytest.raises(OutOfTime, match="ran out of its time limit"):
        Rockmate(model, (args, kwargs), floor, solver="dtr", solver_options={"time_limit": 0.0})
