"""Rockmate against eager PyTorch: same outputs, gradients and buffers; measured memory in budget."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from rkgraph import RematGraph
from rockplan import Rockmate, zoo
from rockplan.budget import parse_budget
from rockplan.memory import measure_step
from rockplan.plan_file import read_plan
from rockplan.planner import OutOfTime
from rockplan.rng import replay, rng_state
from solvers import InfeasibleBudget, budget_bounds, min_feasible_budget, simulate
from solvers.simulate import freed_with, released_inside

MODELS = [name for name in zoo.ZOO if name != "hf_gpt2" or importlib.util.find_spec("transformers")]
SOLVER_OPTIONS = {"time_limit": 10}
# Budgets above the proven floor and the in-order floor of autograd's graph where the default
# portfolio stops without a schedule (OutOfTime: one may exist) on the tiny model alone, its
# loss outside: a gap in the search, issue 27's planning half. On hf_bert at 0.5 DTR runs out of
# evictable values while recomputing an attention's scores late in the backward, the
# minimum-memory family peaks above the budget and the flat MILP finds no schedule in minutes;
# the lean variant is below its own in-order floor. The zoo ResNet at 0.5 depends on the CPU:
# its budget is of a peak that holds oneDNN's convolution scratch, measured on the machine. On
# an Intel Xeon the portfolio plans it; on an AMD EPYC 0.5 (377,780 B) falls between the
# in-order floor (363,048 B) and the least peak of a known schedule (428,648 B), and neither
# the portfolio nor the flat MILP in 600 s finds a schedule there. Expected to fail that way
# only; any other refusal, or a plan, is tested as usual.
SEARCH_GAPS = {("hf_bert", 0.5), ("resnet", 0.5)}


def _step(model: torch.nn.Module, args: tuple, kwargs: dict, seed: int = 1) -> object:
    """Forward, then backward from all-ones output gradients (the graph's tangents): the step
    allocates nothing outside the planned module, so the budget can be checked to the byte."""
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    return out


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module, exact: bool = True) -> None:
    # Not exact: eager's kernels against AOTAutograd's decompositions, amplified by BatchNorm.
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=f"gradient of {name}")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, **tol, msg=f"state {name}")


def _known_feasible_minimum(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """The smallest budget at which a schedule is known to run: the bounds' schedule's peak
    (`min_feasible_budget`), as the simulator counts it, what the generated code holds beyond
    the graph's values included (copies of mutated buffers its recomputations read, recorded
    RNG states)."""
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    bounds = budget_bounds(probe.graph)
    assert bounds.upper == min_feasible_budget(probe.graph) == simulate(probe.graph, bounds.schedule).peak
    return bounds.upper


def _assert_below_the_proven_floor(model: torch.nn.Module, args: tuple, kwargs: dict, budget: float) -> None:
    """A refused budget is one no schedule of autograd's graph fits (`budget_bounds(...).lower`)."""
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    floor = budget_bounds(probe.graph).lower
    assert parse_budget(budget, probe.store_all_peak) < floor, f"{budget} refused, above the proven floor {floor} B"


def _assert_below_the_in_order_floor(model: torch.nn.Module, args: tuple, kwargs: dict, budget: float,
                                     refusal: OutOfTime) -> None:
    """A budget the search gives up on is one no schedule running autograd's graph in its order
    fits (`budget_bounds(...).in_order`, the family of every solver but the chain), and the
    refusal says so."""
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    floor = budget_bounds(probe.graph).in_order[0]
    assert parse_budget(budget, probe.store_all_peak) < floor, f"{budget} given up on, above the in-order floor {floor}"
    assert "autograd's order" in str(refusal)


@pytest.mark.parametrize("budget", [1.0, 0.5, "min"])
@pytest.mark.parametrize("name", MODELS)
def test_same_gradients_and_budget_honoured(name: str, budget: float | str) -> None:
    model, args, kwargs, _loss = zoo.make(name, "tiny")
    eager_model, stored_model = copy.deepcopy(model), copy.deepcopy(model)
    if budget == "min":  # feasible by construction: planned, never refused
        budget = _known_feasible_minimum(model, args, kwargs)
        rk = Rockmate(model, (args, kwargs), budget, solver_options=SOLVER_OPTIONS)
    else:
        try:
            rk = Rockmate(model, (args, kwargs), budget, solver_options=SOLVER_OPTIONS)
        except OutOfTime as e:
            if (name, budget) in SEARCH_GAPS:
                pytest.xfail(f"the search stops without a schedule: {e}")
            _assert_below_the_in_order_floor(model, args, kwargs, budget, e)
            pytest.skip(f"{budget} is below what schedules in autograd's order reach for {name}")
        except InfeasibleBudget as e:
            assert "smallest feasible budget" in str(e)
            _assert_below_the_proven_floor(model, args, kwargs, budget)
            pytest.skip(f"{budget} is below the feasible minimum for {name}")
    planned = measure_step(_step, rk, args, kwargs)
    # Against eager: AOTAutograd's decompositions may round differently (UNet's upsampling).
    torch.testing.assert_close(planned.result, _step(eager_model, args, kwargs), rtol=1e-4, atol=1e-5)
    _assert_same_state(model, eager_model, exact=False)
    # Against the same graph run without recomputation: bitwise, so recomputing changes nothing.
    stored = _step(Rockmate(stored_model, (args, kwargs), 1.0, solver="store_all"), args, kwargs)
    torch.testing.assert_close(planned.result, stored, rtol=0, atol=0)
    _assert_same_state(model, stored_model)

    measured, predicted = planned.peak, rk.schedule.predicted_peak
    assert measured <= rk.budget, f"measured {measured} B over budget {rk.budget} B"
    assert abs(measured - predicted) <= 0.10 * measured, f"predicted {predicted} B, measured {measured} B"


@pytest.mark.parametrize(("budget", "solver"), [(1.0, "store_all"), (0.6, "dtr")])
@pytest.mark.parametrize("name", MODELS)
def test_allocator_peak_is_the_prediction_to_the_byte(name: str, budget: float, solver: str) -> None:
    """The CPU allocator's peak of a planned step is the simulator's prediction (measured: equal
    to the byte at 1.0), what the generated code holds beyond the graph's values included
    (buffer copies, recorded RNG states). Kernels' scratch is in the
    graph, measured when profiling; it varies a little between runs, so below 1.0 the peak
    may differ from the prediction a little."""
    model, args, kwargs, _loss = zoo.make(name, "tiny")
    try:
        rk = Rockmate(model, (args, kwargs), budget, solver=solver)
    except InfeasibleBudget:
        _assert_below_the_proven_floor(model, args, kwargs, budget)
        pytest.skip(f"{budget} is below the feasible minimum for {name}")
    _step(rk, args, kwargs)  # warm-up: lazy allocations are not the step's memory
    rk.zero_grad(set_to_none=True)
    measured = measure_step(_step, rk, args, kwargs, method="profiler").peak
    predicted = rk.schedule.predicted_peak
    assert 0.99 * predicted <= measured <= predicted, (measured, predicted)
    assert measured <= rk.budget


class _TanhGelu(torch.nn.Module):
    """GELU's tanh approximation in Python pointwise ops, as HF's GPT-2 writes it: a chain whose
    first op reads the layer's output for the last time and whose next ops allocate temporaries."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def test_inputs_that_die_inside_a_recomputed_chain_are_not_counted_under_its_temporaries() -> None:
    """A pointwise chain recomputed in the backward whose inputs die at its first op: the
    generated code drops them there, so the chain's temporaries do not sit on top of them.
    Counted on top (HF GPT-2's GELU: 262,144 bytes over the measured peak, a failure of the
    test above on some measured profiles), the prediction overstated this plan's peak; it is
    the allocator's peak to the byte."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), _TanhGelu(), torch.nn.Linear(64, 64), _TanhGelu(),
                                torch.nn.Linear(64, 4))
    args, kwargs = (torch.randn(256, 16),), {}
    rk = Rockmate(model, (args, kwargs), 0.6, solver="dtr")
    graph, schedule = rk.graph, rk.schedule
    end = len(schedule.ops)
    released = [op.name for i, op in enumerate(schedule.ops) if i >= schedule.forward_length and op.kind == "compute"
                and released_inside(graph, graph.node(op.name), freed_with(schedule.ops, i, end)) > 0]
    assert released and all(not graph.node(name).backward for name in released)  # forward chains, recomputed
    inputs_held = copy.deepcopy(graph)
    for node in inputs_held.nodes:
        node.releases = ()
    assert simulate(inputs_held, schedule).peak > schedule.predicted_peak  # the case sets the peak
    _step(rk, args, kwargs)  # warm-up
    rk.zero_grad(set_to_none=True)
    assert measure_step(_step, rk, args, kwargs, method="profiler").peak == schedule.predicted_peak


# Saved values not on ResNet: at 0.7 its family fits only on some measured profiles (kernels'
# scratch varies).
@pytest.mark.parametrize(("name", "solver"), [("gpt", "dtr"), ("gpt", "peak_shaving"), ("gpt", "saved_values"),
                                              ("resnet", "dtr"), ("resnet", "peak_shaving")])
def test_heuristic_plans_run_bitwise_like_store_all(name: str, solver: str) -> None:
    # Rockmate often returns these heuristics' schedules; each must also run as planned.
    model, args, kwargs, _loss = zoo.make(name, "tiny")
    stored_model = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 0.7, solver=solver)
    assert rk.schedule.solver == solver and sum(op.kind == "compute" for op in rk.schedule.ops) > len(rk.graph.nodes)
    planned = measure_step(_step, rk, args, kwargs)
    stored = _step(Rockmate(stored_model, (args, kwargs), 1.0, solver="store_all"), args, kwargs)
    torch.testing.assert_close(planned.result, stored, rtol=0, atol=0)
    _assert_same_state(model, stored_model)
    assert planned.peak <= rk.budget
    assert abs(planned.peak - rk.schedule.predicted_peak) <= 0.10 * planned.peak


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_parameters_identical_after_three_optimizer_steps(name: str) -> None:
    model, args, kwargs, loss_fn = zoo.make(name, "tiny")
    reference = copy.deepcopy(model)
    probe = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    budget = max(int(0.5 * probe.store_all_peak), min_feasible_budget(probe.graph))
    rk = Rockmate(model, (args, kwargs), budget, solver_options=SOLVER_OPTIONS)
    assert list(rk.parameters()) == list(model.parameters())  # the optimizer sees the same objects
    for module in (rk, reference):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        torch.manual_seed(3)
        for _ in range(3):
            loss_fn(module(*args, **kwargs), *args).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for x, y in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_gradients_accumulated_over_micro_batches_are_eager_s_within_the_budget(name: str) -> None:
    """Gradient accumulation, as users short of memory train: micro-batches stepped without
    zeroing the gradients between them. Autograd adds each returned gradient into `.grad`:
    every micro-batch's step keeps its budget, those after the first with the gradients held
    already, and the sums are eager's."""
    model, args, kwargs, loss_fn = zoo.make(name, "tiny")
    model = zoo.WithLoss(model, loss_fn)  # the loss inside the budget
    reference = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 0.6, profile="estimate", solver_options=SOLVER_OPTIONS)

    def micro_batch(module: torch.nn.Module) -> None:
        module(*args, **kwargs).backward()

    peaks = []
    for seed in range(3):
        torch.manual_seed(seed)
        peaks.append(measure_step(micro_batch, rk).peak)
        torch.manual_seed(seed)
        micro_batch(reference)
    assert max(peaks) <= rk.budget, peaks
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)  # the fused loss's rewrite rounds otherwise


def test_recomputed_dropout_reproduces_its_mask() -> None:
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    reference = copy.deepcopy(model)
    probe = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    budget = min_feasible_budget(probe.graph)
    # Roofline costs: which schedule wins at the minimum must not hang on a measured profile
    # (with one, a schedule that keeps every mask can win, and then no dropout is recomputed).
    rk = Rockmate(model, (args, kwargs), budget, solver_options=SOLVER_OPTIONS, profile="estimate")
    recomputed = {op.name for op in rk.schedule.backward_ops if op.kind == "compute"}
    assert any(rk.graph.node(name).rng for name in recomputed), "no dropout is recomputed at the minimum"
    planned = _step(rk, args, kwargs)
    rng_after_planned = torch.get_rng_state()
    torch.testing.assert_close(planned, _step(reference, args, kwargs), rtol=0, atol=0)
    _assert_same_state(model, reference)
    # replaying restores the generator: the user's random stream continues as after eager
    assert torch.equal(rng_after_planned, torch.get_rng_state())


def test_eval_and_no_grad_run_the_plain_forward() -> None:
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    rk.eval()
    assert not model.training
    torch.testing.assert_close(rk(*args, **kwargs), model(*args, **kwargs))
    rk.train()
    with torch.no_grad():
        out = rk(*args, **kwargs)
    assert not out.requires_grad
    assert rk.state_dict().keys() == model.state_dict().keys()


def test_new_input_shape_replans_or_errors() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    (x,) = args
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    bigger = torch.randn(x.shape[0] * 2, *x.shape[1:])
    out = rk(bigger)
    assert out.shape[0] == bigger.shape[0]
    assert len(rk._steps) == 2
    strict = Rockmate(model, (args, kwargs), 1.0, solver="store_all", on_new_input="error")
    with pytest.raises(ValueError, match="differs from the planned sample"):
        strict(bigger)


def test_budget_below_minimum_states_the_minimum() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget"):
        Rockmate(model, (args, kwargs), 1, solver="ilp")


def test_bad_budget_units() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    with pytest.raises(ValueError, match="cannot read budget"):
        Rockmate(model, (args, kwargs), "12 parsecs", solver="store_all")


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "constant fields pass through"


class _DataclassModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> _Output:
        hidden = torch.tanh(self.inner(x)) * scale
        return _Output(self.head(hidden), hidden)


def test_dataclass_outputs_and_inputs_that_require_grad() -> None:
    torch.manual_seed(0)
    model = _DataclassModel()
    reference = copy.deepcopy(model)
    x = torch.randn(64, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    rk = Rockmate(model, ((x,), {"scale": 0.5}), 1.0, solver="store_all")
    out, expected = rk(x, scale=0.5), reference(x_ref, scale=0.5)
    assert isinstance(out, _Output) and out.note == expected.note
    (out.logits.sum() + out.hidden.square().sum()).backward()
    (expected.logits.sum() + expected.hidden.square().sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    _assert_same_state(model, reference, exact=False)


def test_an_error_inside_the_backward_loses_nothing() -> None:
    model, args, kwargs, loss_fn = zoo.make("resnet", "tiny")
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    params = [p.detach().clone() for p in model.parameters()]
    out = rk(*args, **kwargs)
    out.register_hook(lambda _grad: (_ for _ in ()).throw(RuntimeError("simulated failure")))
    with pytest.raises(RuntimeError, match="simulated failure"):
        loss_fn(out, *args).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    loss_fn(rk(*args, **kwargs), *args).backward()  # the next step works
    assert all(p.grad is not None for p in model.parameters())


def test_inductor_backend_matches_eager_backend() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    compiled_model, reference = copy.deepcopy(model), copy.deepcopy(model)
    eager_backend = Rockmate(reference, (args, kwargs), 0.85, solver_options=SOLVER_OPTIONS)
    inductor = Rockmate(compiled_model, (args, kwargs), 0.85, solver_options=SOLVER_OPTIONS,
                        backend="inductor")
    torch.testing.assert_close(_step(inductor, args, kwargs), _step(eager_backend, args, kwargs))
    _assert_same_state(compiled_model, reference, exact=False)


@pytest.mark.parametrize("name", ["resnet", "unet"])
def test_inductor_backend_on_conv_models(name: str) -> None:
    """Inductor lays conv activations out channels-last in the forward; the separately compiled
    backward must read what the forward saved with those strides (and recompute under a budget)."""
    model, args, kwargs, _ = zoo.make(name, "tiny")
    reference = copy.deepcopy(model)
    # 0.7: above both models' feasible minimum (resnet ~0.57), low enough to recompute.
    rk = Rockmate(model, (args, kwargs), 0.7, solver_options=SOLVER_OPTIONS, backend="inductor")
    assert any(not rk.graph.node(op.name).backward for op in rk.schedule.backward_ops if op.kind == "compute")
    torch.testing.assert_close(_step(rk, args, kwargs), _step(reference, args, kwargs), rtol=1e-4, atol=1e-5)
    # Inductor's float32 kernels (decomposed BatchNorm, other reduction orders) differ from
    # eager's by up to ~1e-4 of a gradient's largest entry; torch.compile's the same.
    for (param, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-3 * q.grad.abs().max().item(),
                                   msg=f"gradient of {param}")
    for (buffer, x), y in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=f"buffer {buffer}")
        if buffer.endswith("num_batches_tracked"):
            assert x.item() == 1, f"{buffer}: BatchNorm statistics updated {x.item()} times in one step"


def test_loss_inside_the_module_with_fixed_targets() -> None:
    """Targets held by the loss become constants of the traced graph (get_attr nodes)."""
    model, args, kwargs, loss_fn = zoo.make("resnet", "tiny")
    planned, reference = zoo.WithLoss(model, loss_fn), zoo.WithLoss(copy.deepcopy(model), loss_fn)
    rk = Rockmate(planned, (args, kwargs), 0.7, solver_options=SOLVER_OPTIONS)
    assert any(n.op == "get_attr" for n in rk.graph.joint.module.graph.nodes)
    step = measure_step(lambda: rk(*args, **kwargs).backward())
    reference(*args, **kwargs).backward()
    assert step.peak <= rk.budget
    _assert_same_state(planned, reference, exact=False)


def test_language_model_with_its_loss_fused_into_the_head() -> None:
    """GPT with its loss inside: the head and cross-entropy run as one fused op (no logits held);
    under a budget that recomputes, the same loss and gradients as eager, bitwise those of the
    same graph recomputing nothing, and the measured peak within the budget."""
    model, args, kwargs, loss_fn = zoo.make("gpt", "tiny")
    planned = zoo.WithLoss(model, loss_fn)
    eager, stored = zoo.WithLoss(copy.deepcopy(model), loss_fn), zoo.WithLoss(copy.deepcopy(model), loss_fn)
    rk = Rockmate(planned, (args, kwargs), 0.6, solver_options=SOLVER_OPTIONS)
    assert any(n.op == "rkgraph.linear_cross_entropy.default" for n in rk.graph.nodes)
    assert any(not rk.graph.node(op.name).backward for op in rk.schedule.backward_ops if op.kind == "compute")
    step = measure_step(_step, rk, args, kwargs)
    assert step.peak <= rk.budget
    # The loss is summed by chunks of rows: equal to eager's up to rounding.
    torch.testing.assert_close(step.result, _step(eager, args, kwargs), rtol=1e-5, atol=1e-6)
    _assert_same_state(planned, eager, exact=False)
    expected = _step(Rockmate(stored, (args, kwargs), 1.0, solver="store_all"), args, kwargs)
    torch.testing.assert_close(step.result, expected, rtol=0, atol=0)
    _assert_same_state(planned, stored)


def test_tuple_outputs_come_back_as_tuples() -> None:
    """AOTAutograd returns a flat tuple of outputs as a list; the user gets what the model returns."""

    class LossAndLogits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(8, 5)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.head(x)
            return torch.nn.functional.cross_entropy(logits, target), logits

    args = (torch.randn(16, 8), torch.randint(0, 5, (16,)))
    model = LossAndLogits()
    out, expected = Rockmate(model, args, 1.0, solver="store_all")(*args), model(*args)
    assert type(out) is tuple and len(out) == 2
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("name", ["resnet", "unet"])
def test_pytorch_partitioner_choice_runs_through_the_runtime(name: str) -> None:
    """`solver="torch_budget"` runs PyTorch's min-cut partitioner on a copy of the joint graph
    during planning, which happens inside AOTAutograd's fake trace; copying the module's real
    constants there (the labels the loss holds) failed until the copy left the fake mode."""
    model, args, kwargs, loss = zoo.make(name, "tiny")
    model = zoo.WithLoss(model, loss)
    eager_model = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 1.0, solver="torch_budget")
    torch.testing.assert_close(_step(rk, args, kwargs), _step(eager_model, args, kwargs), rtol=1e-4, atol=1e-5)
    _assert_same_state(model, eager_model, exact=False)


_REAL_CALLS = {"count": 0}


@torch.library.custom_op("rockplan_test::counted", mutates_args=())
def _counted(x: torch.Tensor) -> torch.Tensor:
    _REAL_CALLS["count"] += 1  # only a real kernel call gets here; fake tensors use the fake below
    return x * 2


@_counted.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_counted.register_autograd(lambda ctx, grad: grad * 2)


@pytest.mark.measures_time
def test_measured_profile_runs_real_kernels() -> None:
    """Planning runs inside AOTAutograd's fake trace; profile="measure" must still time real
    kernels: timed on fake tensors, a convolution takes a small fraction of its real time."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(_counted(self.a(x)))

    _REAL_CALLS["count"] = 0
    rk = Rockmate(Model(), torch.randn(4, 8), 1.0, profile="measure")
    assert _REAL_CALLS["count"] > 0  # timed on real tensors, before any training step
    node = next(n for n in rk.graph.nodes if "counted" in (n.op or ""))
    assert node.time > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_cuda_plan_matches_eager_within_the_allocator_budget(name: str) -> None:
    """On CUDA the sample is there, costs are measured there, and the allocator is the judge
    (with expandable segments, as conftest sets them: `cuda_blocks_fit_requests`)."""
    model, args, kwargs, _loss = zoo.make(name, "tiny")
    model = model.cuda()
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    eager_model = copy.deepcopy(model)
    # Half the step, or the least known to be feasible where that is more (CUDA's attention
    # kernels and workspaces differ from the CPU's, and so does the graph's floor).
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    budget = max(probe.store_all_peak // 2, _known_feasible_minimum(model, args, kwargs))
    rk = Rockmate(model, (args, kwargs), budget, solver_options=SOLVER_OPTIONS)
    for module in (rk, eager_model):  # warm-up: cuBLAS and cuDNN workspaces exist before the step
        _step(module, args, kwargs)
        module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    planned = measure_step(_step, rk, args, kwargs, device="cuda")
    torch.cuda.synchronize()
    torch.testing.assert_close(planned.result, _step(eager_model, args, kwargs), rtol=1e-3, atol=1e-4)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
    measured, predicted = planned.peak, rk.schedule.predicted_peak
    assert measured <= rk.budget, f"measured {measured} B over budget {rk.budget} B"
    assert abs(measured - predicted) <= 0.10 * measured, f"predicted {predicted} B, measured {measured} B"


def test_a_plan_reuses_another_plans_profile() -> None:
    """`profile=` another plan's times: the graph gets exactly those costs (plans compared on
    one profile); times measured on another model are refused, naming a missing node."""
    model, args, kwargs, _loss = zoo.make("gpt", "tiny")
    first = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    times = first.profile_times()
    assert times and all(t > 0 for t in times.values())
    second = Rockmate(copy.deepcopy(model), (args, kwargs), 0.5, solver="dtr", profile=times)
    assert second.profile_times() == times
    for name in ("mlp", "resnet"):  # the MLP's node names are all among the GPT's
        other, other_args, other_kwargs, _ = zoo.make(name, "tiny")
        with pytest.raises(ValueError, match="profile is for another graph"):
            Rockmate(other, (other_args, other_kwargs), 1.0, solver="store_all", profile=times)


def test_lean_plan_exports_and_reloads(tmp_path) -> None:
    """A plan of the lean variant written to a file plans nothing when reloaded: autograd's
    graph does not match it, the lean variant does; the same schedule, loss and gradients."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab_size=128, block_size=256, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    args, kwargs = (torch.randint(0, 128, (2, 256)),), {}
    copied = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 0.5, profile="estimate", solver_options=SOLVER_OPTIONS)
    assert "masks packed" in rk.explain()
    path = rk.export(tmp_path / "plan.json")
    assert read_plan(path).considered == rk.considered and rk.considered  # autograd's graph, not run
    reloaded = Rockmate(copied, (args, kwargs), 0.5, profile="estimate", plan_file=path)
    assert [str(op) for op in reloaded.schedule.ops] == [str(op) for op in rk.schedule.ops]
    assert reloaded.considered == rk.considered  # what the file says was weighed, not what loading it tried
    planned, again = measure_step(_step, rk, args, kwargs), measure_step(_step, reloaded, args, kwargs)
    torch.testing.assert_close(again.result, planned.result, rtol=0, atol=0)
    _assert_same_state(model, copied)


def test_a_variants_own_ops_are_timed_alone_on_the_references_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a measured profile, the lean variant takes autograd's graph's times for the ops both
    run, and its own ops (fused attention, mask packing) are timed op by op on synthetic inputs,
    with no replay of the variant, then scaled by how the reference's ops they replace time in
    the step against alone: ops that run twice as slow alone as in the step (a machine slower
    while they are timed, or ops timed cold) leave the own ops' costs at half their time alone.
    An own op that cannot run alone takes its estimate on the reference's clock."""
    import rkgraph
    from rkgraph.profile import estimated_seconds

    replays: list[RematGraph] = []
    monkeypatch.setattr(rkgraph, "measure_times", lambda graph, *_a, **_k: replays.append(graph))
    torch.manual_seed(0)
    model = zoo.GPT(vocab_size=128, block_size=256, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    args, kwargs = (torch.randint(0, 128, (2, 256)),), {}
    stored = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all", profile="estimate")
    times = stored.profile_times()
    asked: list[set[str]] = []

    def alone(graph: RematGraph, joint, nodes, repeats=3):
        asked.append(set(nodes))
        if any(n.op == "rkgraph.attention.default" for n in graph.nodes):  # the variant's own ops: 2 s each
            return {name: 2.0 for name in sorted(nodes)[1:]}  # the first cannot run alone
        return {name: 2 * times[name] for name in nodes}  # the ops they replace: twice their step's time

    monkeypatch.setattr(rkgraph, "synthetic_times", alone)
    rk = Rockmate(model, (args, kwargs), 0.5, solver_options=SOLVER_OPTIONS, profile=times)
    assert "attention fused" in rk.explain() and replays == []
    own = {n.name for n in rk.graph.nodes if n.op.startswith("rkgraph.") and
           any(word in n.op for word in ("attention", "pack_mask"))}
    assert len(own) == 2 * 2 + 7 * 2  # per layer its attention and backward; 7 masks packed and unpacked
    assert asked[0] == own and asked[1] and not asked[1] & {n.name for n in rk.graph.nodes if n.name not in own}
    shared = [n for n in rk.graph.nodes if n.name not in own]
    for node in shared:
        assert node.time == times[node.name]
    estimates = estimated_seconds(rk.graph, rk.graph.joint.module, 1e11, 2e10)
    clock = sum(times[n.name] for n in shared) / sum(estimates[n.name] for n in shared)
    first = sorted(own)[0]
    for node in rk.graph.nodes:
        if node.name in own:
            assert node.time == pytest.approx(estimates[first] * clock if node.name == first else 1.0)


def test_a_variant_is_estimated_at_its_references_device_speeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the estimated profile, the lean variant's own nodes are estimated at the speeds of
    the device the step was traced on, as the reference's nodes are: estimated at another
    device's, a fused attention would be priced against the reference's ops at a CPU's speed on
    a GPU (hundreds of times too dear) and the variant could hardly win there. The trace's
    device is made to read as CUDA here, as no GPU is needed to price at its speeds."""
    import rkgraph

    monkeypatch.setattr(rkgraph, "joint_device", lambda joint: torch.device("cuda"))
    torch.manual_seed(0)
    model = zoo.GPT(vocab_size=128, block_size=256, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    rk = Rockmate(model, ((torch.randint(0, 128, (2, 256)),), {}), 0.5, solver_options=SOLVER_OPTIONS,
                  profile="estimate")
    assert "attention fused" in rk.explain()
    joint = rk.graph.joint.module
    at_cuda, at_cpu = (rkgraph.estimated_times(rk.graph, joint, device) for device in ("cuda", "cpu"))
    own = [n for n in rk.graph.nodes if n.op == "rkgraph.attention.default"]
    assert own and all(at_cuda[n.name] < at_cpu[n.name] / 10 for n in own)
    for node in rk.graph.nodes:
        assert node.time == pytest.approx(at_cuda[node.name]), node.name


def test_long_sequences_plan_with_attention_fused() -> None:
    """A GPT whose attention probabilities outweigh its activations (sequence 256, width 32):
    under a tight budget the plan runs the graph whose attention makes its probabilities again
    in the backward (and whose masks are kept packed). Same loss and gradients, bit for bit, as
    the unfused graph storing everything; the measured peak within the budget; overheads against
    that graph."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab_size=128, block_size=256, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    args, kwargs = (torch.randint(0, 128, (2, 256)),), {}
    stored_model = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 0.5, profile="estimate", solver_options=SOLVER_OPTIONS)
    assert sum(n.op == "rkgraph.attention_backward.default" for n in rk.graph.nodes) == 2
    stored = Rockmate(stored_model, (args, kwargs), 1.0, solver="store_all", profile="estimate")
    assert not any("attention" in n.op for n in stored.graph.nodes)
    assert rk.store_all_peak == stored.store_all_peak and rk.store_all_time == stored.store_all_time
    assert rk.profile_times() == {n.name: n.time for n in stored.graph.nodes}
    assert "attention fused" in rk.explain()
    # The plan of autograd's graph, not run, is reported with why: slower, or none within the budget.
    (name, outcome), = rk.considered.items()
    assert name == "autograd's graph" and "also planned, not run: autograd's graph, " in rk.explain()
    assert (outcome == "no plan within the budget" or str(outcome).startswith("not solved: its proven floor")
            or outcome >= rk.schedule.predicted_time)
    # The variant shares autograd's graph's costs where it runs the same ops; its own ops are
    # costed as the reference was (estimated here).
    unfused = {n.name: n for n in stored.graph.nodes}
    for node in rk.graph.nodes:
        if node.name in unfused and unfused[node.name].fx_nodes == node.fx_nodes:
            assert node.time == unfused[node.name].time
    forward, backward = (next(n for n in rk.graph.nodes if n.op == f"rkgraph.{op}.default")
                         for op in ("attention", "attention_backward"))
    assert 0 < forward.time < backward.time
    # Its masks kept packed: the unpacking, a lookup, is priced under a quarter of the attention.
    assert "masks packed" in rk.explain()
    unpacks = [n for n in rk.graph.nodes if n.op == "rkgraph.unpack_mask.default"]
    assert len(unpacks) == 7 and all(0 < n.time < forward.time / 4 and n.backward for n in unpacks)
    planned = measure_step(_step, rk, args, kwargs)
    torch.testing.assert_close(planned.result, _step(stored, args, kwargs), rtol=0, atol=0)
    _assert_same_state(model, stored_model)
    assert planned.peak <= rk.budget


@pytest.mark.parametrize(("budget", "solver"), [(1.0, "store_all"), (0.5, "dtr")])
def test_generated_code_derives_a_view_once_while_its_base_lives(budget: float, solver: str) -> None:
    """Each view op of the generated step runs once per value of its base (a recomputed base
    gives its views anew): a view derived again at every use cost an op call each time."""
    from rkgraph.build import is_view
    from rockplan.codegen import generate

    model, args, kwargs, _loss = zoo.make("gpt", "tiny")
    rk = Rockmate(model, (args, kwargs), budget, solver=solver)
    plan = rk._current.plan
    for module in generate(plan.joint, plan.graph, plan.schedule):
        views = [(n.target, n.args, tuple(n.kwargs.items())) for n in module.graph.nodes if is_view(n)]
        assert views and len(views) == len(set(map(repr, views))), module.code


@pytest.mark.parametrize("recompute", [False, True])
def test_a_planned_step_calls_its_ops_without_the_python_op_wrapper(recompute: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated step calls each ATen op through its C++ entry point (`codegen.bound_op`),
    not `OpOverload.__call__`, a Python frame per op call that a small model's GPU step waits
    on, a recomputed dropout's replay included; and our rewrites' custom ops (dropout's here)
    as the Python functions they are, not through the dispatcher's Python autograd layer.
    Gradients stay eager's. (Those functions call ATen as they like: only calls from the
    step's own code count.)"""
    from rockplan import rng

    model, args, kwargs, _loss = zoo.make("gpt", "tiny")
    eager = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    if recompute:  # as test_recomputed_dropout_reproduces_its_mask plans it
        rk = Rockmate(model, (args, kwargs), min_feasible_budget(rk.graph), solver_options=SOLVER_OPTIONS,
                      profile="estimate")
        assert any(op.kind == "compute" and rk.graph.node(op.name).rng for op in rk.schedule.backward_ops)
    _step(rk, args, kwargs)  # the first step compiles the backward
    model.zero_grad(set_to_none=True)
    calls: list[str] = []
    wrapper = torch._ops.OpOverload.__call__

    def counted(op: torch._ops.OpOverload, *a: object, **kw: object) -> object:
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith("<eval_with_key>") or caller == rng.__file__:  # fx's generated code, or replay
            calls.append(str(op))
        return wrapper(op, *a, **kw)

    redispatch = torch._ops.OpOverload.redispatch

    def counted_redispatch(op: torch._ops.OpOverload, *a: object, **kw: object) -> object:
        if op.namespace == "rkgraph":
            calls.append(f"{op} through the dispatcher")
        return redispatch(op, *a, **kw)

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", counted)
    monkeypatch.setattr(torch._ops.OpOverload, "redispatch", counted_redispatch)
    _step(rk, args, kwargs)
    monkeypatch.undo()
    assert calls == []
    _step(eager, args, kwargs)
    _assert_same_state(model, eager)


def test_a_replayed_random_op_takes_its_own_device_keyword() -> None:
    """A drop path draws with `torch.rand(shape, dtype=..., device=x.device)`: its recomputation
    is generated as `replay(state, device, aten.rand.default, shape, dtype=..., device=...)`,
    whose keywords are the op's (Swin-T's plan for a second batch size recomputed one)."""
    state = rng_state(torch.device("cpu"))
    drawn = torch.rand([2, 3], dtype=torch.float32, device=torch.device("cpu"))
    again = replay(state, torch.device("cpu"), torch.ops.aten.rand.default, [2, 3], dtype=torch.float32,
                   device=torch.device("cpu"), pin_memory=False)
    assert torch.equal(again, drawn)


@pytest.mark.parametrize("loss", ["mse", "smooth_l1", "bce", "soft_margin"])
def test_a_loss_kept_in_its_unreduced_buffer_is_counted(loss: str) -> None:
    """Some losses' CPU kernels reduce into their unreduced buffer and return the loss as a
    view of it; the trace records a tensor of its own. The plan counts the buffer the kernel
    keeps (for the whole step: the loss is the step's output), so the step at its store-all
    budget measures what was predicted, to the byte."""
    functions = {"mse": F.mse_loss, "smooth_l1": F.smooth_l1_loss, "soft_margin": F.soft_margin_loss,
                 "bce": lambda out, target: F.binary_cross_entropy(torch.sigmoid(out), target)}

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 256)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return functions[loss](self.lin(x), target)

    torch.manual_seed(0)
    x, target = torch.randn(32, 64), torch.rand(32, 256)
    rk = Rockmate(Regressor(), (x, target), 1.0, solver="store_all", profile="estimate")
    rk(x, target).backward()  # warm-up
    rk.zero_grad(set_to_none=True)
    measured = measure_step(lambda: rk(x, target).backward(), method="profiler").peak
    assert measured == rk.schedule.predicted_peak <= rk.budget
