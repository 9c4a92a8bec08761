"""rockplan as a torch.compile backend, and Rockmate on models with graph breaks: each graph
Dynamo captures is planned, outputs and gradients are eager's, one budget holds for the step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import rockplan
from rkgraph.capture import CaptureError
from rockplan import Rockmate, zoo
from rockplan.graph_split import GraphOption, choose, step_peaks
from rockplan.memory import StepMemory, measure_step
from solvers import InfeasibleBudget, simulate


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # compiled graphs of one test must not serve another


class _Branching(nn.Module):
    """A data-dependent branch in the middle: two graphs, dropout and BatchNorm in the first."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(64, width), nn.Linear(width, width), nn.Linear(width, 8)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.norm(self.inp(x))), 0.2, self.training)
        h = torch.tanh(self.mid(h))
        if h.sum() > 0:
            h = h * 2
        h = F.dropout(torch.tanh(self.mid(h)), 0.2, self.training)  # `mid` again: its weight in both graphs
        return self.out(h).square().mean()


class _ItemScaled(_Branching):
    """`.item()` read in the middle: a Python float from a tensor, used by the rest."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.inp(x)), 0.2, self.training)
        scale = h.abs().mean().item()
        h = F.dropout(torch.tanh(self.mid(h * scale)), 0.2, self.training)
        return self.out(h).square().mean()


class _Deep(nn.Module):
    """A branch between two stacks of layers, one dropout in each graph: room to recompute."""

    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, width), nn.Linear(width, 8)
        self.before = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.after = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.norm(self.inp(x))), 0.2, self.training)
        for layer in self.before:
            h = torch.tanh(layer(h))
        if h.sum() > 0:
            h = h * 2
        for layer in self.after:
            h = torch.tanh(layer(h))
        return F.dropout(self.out(h), 0.2, self.training).square().mean()


class _EagerBetween(_Branching):
    """Autograd ops run by Dynamo outside any graph (a call it is told not to trace)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _untraced(torch.tanh(self.inp(x)))
        return self.out(torch.tanh(self.mid(h))).square().mean()


@torch.compiler.disable
def _untraced(h: torch.Tensor) -> torch.Tensor:
    return torch.sin(h) * 3


def _step(model: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)  # the same dropout masks as eager's, if the graphs draw as eager does
    loss = model(*inputs)
    loss.backward()
    return loss


def _assert_same_step(planned: nn.Module, eager: nn.Module) -> None:
    for (name, p), q in zip(planned.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
    for (name, b), c in zip(planned.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=f"buffer {name}")


def _store_all_peak(factory: Callable[[], nn.Module], x: torch.Tensor) -> int:
    """The step's measured peak when every graph stores everything (a budget nothing reaches)."""
    torch._dynamo.reset()
    model = factory()
    compiled = torch.compile(model, backend=rockplan.backend(10**12, solver="store_all"), dynamic=False)
    _step(compiled, x)  # compiles
    model.zero_grad(set_to_none=True)
    peak = measure_step(_step, compiled, x).peak
    torch._dynamo.reset()
    return peak


def _predicted_step_peak(backend: rockplan.backend) -> int:
    """The step's peak as `graph_split.step_peaks` predicts it from each graph's current plan
    replayed by the simulator, the largest over the sequences of graphs the steps ran."""
    chosen = {}
    for g in backend.graphs:
        result = simulate(g.plan.graph, g.plan.schedule)
        chosen[g.index] = GraphOption(result.peak, result.held_into_backward + g.output_gradients, result.time)
    return max(max(step_peaks(s, chosen, r)) for s, r in backend.sequences.items())


def _predicted_store_all_peak(factory: Callable[[], nn.Module], x: torch.Tensor) -> int:
    """The step's peak every graph storing everything, as `_predicted_step_peak` predicts it."""
    torch._dynamo.reset()
    backend = rockplan.backend(10**12, solver="store_all")
    _step(torch.compile(factory(), backend=backend, dynamic=False), x)
    torch._dynamo.reset()
    return _predicted_step_peak(backend)


def _input_and_budget(factory: Callable[[], nn.Module]) -> tuple[torch.Tensor, int]:
    """The tests' input, and 0.9 of the model's measured store-everything peak on it."""
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    return x, int(0.9 * _store_all_peak(factory, x))


def _compiled(factory: Callable[[], nn.Module], budget: int) -> tuple[nn.Module, nn.Module, rockplan.backend, Callable]:
    """A seeded model, its eager twin, our backend at `budget`, and the model compiled with it."""
    torch.manual_seed(0)
    model = factory()
    eager = copy.deepcopy(model)
    backend = rockplan.backend(budget)
    return model, eager, backend, torch.compile(model, backend=backend, dynamic=False)


def _recomputes(backend: rockplan.backend) -> bool:
    return any(sum(op.kind == "compute" for op in g.plan.schedule.ops) > len(g.plan.graph.nodes)
               for g in backend.graphs)


@pytest.mark.parametrize(("factory", "graphs"), [(_Branching, 2), (_ItemScaled, 2)])
def test_graph_breaks_planned_within_one_budget(factory: Callable[[], nn.Module], graphs: int) -> None:
    x, budget = _input_and_budget(factory)
    model, eager, backend, compiled = _compiled(factory, budget)
    # Dynamo captures and we plan inside this step; its end splits the budget jointly. Steps
    # that plan measure kernels' scratch with torch.profiler, so the CPU tracker cannot measure
    # them (`AllocatorEvents`): the first step is measured only on CUDA (test_cuda_*).
    first = _step(compiled, x)
    torch.testing.assert_close(first, _step(eager, x), rtol=1e-5, atol=1e-6)
    _assert_same_step(model, eager)
    assert len(backend.graphs) == graphs
    greedy = backend.superseded[0] if backend.superseded else list(backend.graphs)  # the first step's plans
    assert {g.split for g in greedy} == {"greedy"}
    assert _recomputes(backend), "the budget is below storing everything: some graph must recompute"
    # Later graphs are planned against what the earlier ones hold, and the step's parameter gradients.
    assert greedy[1].pending >= greedy[0].held > 0
    assert all(g.reserved == sum(p.numel() * 4 for p in model.parameters()) for g in greedy)
    assert backend.sequences == {tuple(range(graphs)): backend._reserves(tuple(range(graphs)))}
    for step in range(2):  # the joint split holds (the second step compiles its plans: not measured)
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        if step == 0:
            loss = _step(compiled, x)
        else:
            later = measure_step(_step, compiled, x)
            loss = later.result
            assert later.peak <= budget, f"step {step + 2} peaked at {later.peak} B, budget {budget} B"
        torch.testing.assert_close(loss, _step(eager, x), rtol=1e-5, atol=1e-6)
        _assert_same_step(model, eager)
    assert len(backend.graphs) == graphs  # the guards held: nothing compiled again by Dynamo
    assert backend.superseded == [greedy] and {g.split for g in backend.graphs} <= {"greedy", "joint"}
    assert _predicted_step_peak(backend) <= budget
    # The greedy plans are among the joint split's candidates, so it is never slower.
    assert backend.predicted_time() <= backend.predicted_time(greedy)


def test_joint_split_is_faster_than_the_greedy_one() -> None:
    """Planned as it is captured, each graph reserves the gradients of every parameter of the
    step (the graphs after it are unknown, and may use any); once both graphs are known, only
    those of the parameters later graphs use are, and the last graph gets that room to
    recompute less, within the same budget."""
    x, budget = _input_and_budget(_Branching)
    model, eager, backend, compiled = _compiled(_Branching, budget)
    for module in (compiled, eager):
        _step(module, x)
    [greedy] = backend.superseded  # the first step's plans, replaced as it ended
    for measured in (False, True):  # the second step compiles the joint plans: the third is measured
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        joint = measure_step(_step, compiled, x) if measured else None
        torch.testing.assert_close(joint.result if joint else _step(compiled, x), _step(eager, x),
                                   rtol=1e-5, atol=1e-6)
        _assert_same_step(model, eager)
    assert joint.peak <= budget and _predicted_step_peak(backend) <= budget
    assert backend.graphs[1].split == "joint" and backend.graphs[1].reserved == 0 < greedy[1].reserved
    assert backend.predicted_time() < backend.predicted_time(greedy)


class _SignBranch(_Branching):
    """Which graph follows the first depends on the input's sign: two sequences of graphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.norm(self.inp(x))), 0.2, self.training)
        if x.mean() > 0:
            h = torch.tanh(self.mid(h))
        else:
            h = torch.sin(self.mid(h) * 0.5) * torch.tanh(h)
        return self.out(h).square().mean()


def test_joint_split_holds_for_every_sequence_of_graphs_seen() -> None:
    """Steps taking either branch run graph 0 then one of two graphs: the joint split made
    after both were seen fits the budget in both sequences."""
    torch.manual_seed(0)
    x = torch.randn(512, 64).abs()
    # What storing everything is predicted to need: a graph first run in a later step (the
    # other branch) must find room beside what the graph before it holds, under either split.
    budget = max(_predicted_store_all_peak(_SignBranch, x), _predicted_store_all_peak(_SignBranch, -x))
    model, eager, backend, compiled = _compiled(_SignBranch, budget)
    for i, inputs in enumerate((x, -x, x, -x, x, -x)):
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        # The steps that plan (each sequence's first, and the one compiling the split after
        # both) cannot be measured on a CPU (`AllocatorEvents`): the last two are.
        step = measure_step(_step, compiled, inputs) if i >= 4 else None
        torch.testing.assert_close(step.result if step else _step(compiled, inputs), _step(eager, inputs),
                                   rtol=1e-5, atol=1e-6)
        _assert_same_step(model, eager)
        assert step is None or step.peak <= budget
    assert set(backend.sequences) == {(0, 1), (0, 2)}
    assert {g.split for g in backend.graphs} == {"joint"}  # the split after the second sequence covers all three
    assert _predicted_step_peak(backend) <= budget


def test_choose_finds_the_fastest_split_within_the_budget_at_every_position() -> None:
    """Hand-made options: graph 0 either holds much and is fast or holds little and is slow;
    graph 1 either needs room and is fast or not. Budget 100, graph 1's parameters' gradients
    (10) reserved while graph 0's backward runs."""
    fast_holding, slow_lean = GraphOption(peak=60, held=50, time=1.0), GraphOption(peak=60, held=10, time=3.0)
    roomy, tight = GraphOption(peak=60, held=0, time=1.0), GraphOption(peak=30, held=0, time=2.0)
    options = {0: [fast_holding, slow_lean], 1: [roomy, tight]}
    sequences = {(0, 1): [10, 0]}
    # 50 + 60 > 100: graph 0 holding much leaves graph 1 its tight plan (3.0), holding little its roomy one (4.0).
    assert choose(options, sequences, 100) == {0: 0, 1: 1}
    assert max(step_peaks((0, 1), {0: fast_holding, 1: tight}, [10, 0])) == 80
    # Graph 0 may hold at most half the room it is left (45): only the lean plan does.
    assert choose(options, sequences, 100, share=0.5, current={0: slow_lean, 1: roomy}) == {0: 1, 1: 0}
    # Unless the plan it runs already holds more: then as much as that.
    assert choose(options, sequences, 100, share=0.5, current={0: fast_holding, 1: tight}) == {0: 0, 1: 1}
    # A graph run twice: what its first run holds is alive while the second runs (50 + 60 + 10).
    assert choose(options, {(0, 0, 1): [10, 10, 0]}, 100) == {0: 1, 1: 0}
    assert choose({0: [fast_holding], 1: [tight]}, {(0, 0, 1): [10, 10, 0]}, 100) is None


def test_zoo_model_without_breaks_is_one_graph() -> None:
    model, args, kwargs, _loss = zoo.make("gpt", "tiny")
    eager = copy.deepcopy(model)

    def step(m: Callable) -> torch.Tensor:
        torch.manual_seed(1)
        out = m(*args, **kwargs)
        out.backward(torch.ones_like(out))
        return out

    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
    budget = max(int(0.7 * probe.store_all_peak), 2 * sum(p.numel() * 4 for p in model.parameters()))
    backend = rockplan.backend(budget, solver_options={"time_limit": 10})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    planned = step(compiled)  # plans: measured only on CUDA (`AllocatorEvents`)
    torch.testing.assert_close(planned, step(eager), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    assert len(backend.graphs) == 1
    # The first step ran a schedule built without a search; it ended by planning the graph at
    # the whole budget, as Rockmate plans the model.
    for measured in (False, True):  # the second step compiles that plan: the third is measured
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        again = measure_step(step, compiled) if measured else None
        torch.testing.assert_close(again.result if again else step(compiled), step(eager), rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    assert again.peak <= budget
    [first] = backend.superseded
    assert first[0].split == "greedy" and first[0].plan.schedule.solver != "rockmate"
    rk = Rockmate(copy.deepcopy(model), (args, kwargs), budget, profile="estimate", solver_options={"time_limit": 10})
    joint = backend.graphs[0].plan
    assert backend.graphs[0].split == "joint" and joint.budget == budget
    assert joint.schedule.predicted_time == pytest.approx(rk.plan.schedule.predicted_time, rel=1e-9)


def test_rockmate_falls_back_to_dynamo_on_a_graph_break() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    budget = int(0.9 * _store_all_peak(_Branching, x))
    torch.manual_seed(0)
    model = _Branching()
    eager = copy.deepcopy(model)
    rk = Rockmate(model, x, budget)  # whole-graph capture fails on the branch: no error
    with pytest.raises(RuntimeError, match="graph breaks"):
        _ = rk.plan
    for i in range(3):  # the first two steps plan: the third is measured (`AllocatorEvents`)
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        planned = measure_step(_step, rk, x) if i == 2 else None
        torch.testing.assert_close(planned.result if planned else _step(rk, x), _step(eager, x), rtol=1e-5, atol=1e-6)
        _assert_same_step(model, eager)
    assert len(rk.graph_plans) == 2 and planned.peak <= budget
    rk.eval()
    with torch.no_grad():
        torch.testing.assert_close(rk(x), eager.eval()(x))


class _SplitBySizes(nn.Module):
    """Split by sizes read from a tensor (`.tolist()`, a break: Qwen2-VL's vision attention
    splits its images so), then a second break: the graph between them is the split alone,
    views of its input, with no forward node; its backward joins their gradients (`cat`)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        p, q = torch.split(self.a(x), sizes.tolist(), dim=1)
        torch._dynamo.graph_break()
        return (self.b(p) * q).square().mean()


def test_a_graph_of_views_alone_is_planned() -> None:
    torch.manual_seed(0)
    model, x, sizes = _SplitBySizes(), torch.randn(4, 8), torch.tensor([4, 4])
    eager = copy.deepcopy(model)
    rk = Rockmate(model, (x, sizes), 1.0, profile="estimate")
    for _ in range(3):  # planned, split jointly, then run
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        torch.testing.assert_close(_step(rk, x, sizes), _step(eager, x, sizes), rtol=0, atol=0)
        _assert_same_step(model, eager)
    assert [len(g.plan.graph.forward_nodes) for g in rk.graph_plans] == [1, 0, 4]


class _SplitInPython(nn.Module):
    """Qwen2-VL's vision attention: queries and keys split per image by sizes read with
    `.tolist()` inside a comprehension, so Dynamo runs the splits in Python, between graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        splits = [torch.split(t, sizes.tolist(), dim=0) for t in (self.a(x), self.b(x))]
        return sum((q @ k.T).softmax(-1).square().mean() for q, k in zip(*splits, strict=True))


def test_views_made_between_graphs_are_planned() -> None:
    """A view of a graph's output made in Python holds the graph's memory and keeps nothing for
    its backward: the graph it feeds is planned (it was refused as an op run outside any graph)."""
    torch.manual_seed(0)
    model, x, sizes = _SplitInPython(), torch.randn(6, 8), torch.tensor([2, 4])
    eager = copy.deepcopy(model)
    rk = Rockmate(model, (x, sizes), 1.0, profile="estimate")
    for _ in range(3):
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        torch.testing.assert_close(_step(rk, x, sizes), _step(eager, x, sizes), rtol=0, atol=0)
        _assert_same_step(model, eager)
    assert len(rk.graph_plans) == 2


def test_graphs_are_planned_from_the_plan_cache_when_run_again(tmp_path: Path, rockmate_calls: list) -> None:
    """A script run again (a fresh Dynamo, a new Rockmate) with the plan cache of the first
    run: every graph's plans, the first step's and the joint split's, are read back (the
    solver is not called), and the steps are the first run's."""
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    budget = int(0.9 * _store_all_peak(_Deep, x))
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Deep()
        rk = Rockmate(model, x, budget, plan_cache=tmp_path)
        rockmate_calls.clear()
        losses = [_step(rk, x) for _ in range(3)]
        runs.append((losses, [g.plan.schedule.ops for g in rk.graph_plans], len(rockmate_calls),
                     [p.grad for p in model.parameters()]))
    (first, first_ops, first_calls, first_grads), (again, again_ops, again_calls, again_grads) = runs
    assert first_calls > 0 and again_calls == 0
    assert [str(op) for ops in again_ops for op in ops] == [str(op) for ops in first_ops for op in ops]
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(again_grads, first_grads, rtol=0, atol=0)


def test_rockmate_with_graph_breaks_states_what_it_needs() -> None:
    x = torch.randn(512, 64)
    # Above the parameters' gradients (340,000 B: refused before capture below that), under
    # what graph 0 needs beside them.
    rk = Rockmate(_Branching(), x, 400_000)
    with pytest.raises(InfeasibleBudget, match="graph 0"):
        _step(rk, x)


def test_ratio_budget_across_graph_breaks() -> None:
    """A ratio is of the step's store-everything peak, known once the first step has run every
    graph; that step runs each graph at its smallest budget, the next ones at the ratio."""
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    model = _Deep()
    eager = copy.deepcopy(model)
    rk = Rockmate(model, x, 0.8)
    backend = rk._graph_breaks.backend
    torch.testing.assert_close(_step(rk, x), _step(eager, x), rtol=1e-5, atol=1e-6)
    _assert_same_step(model, eager)
    # The ratio is resolved, and the budget split, as the first step ends.
    assert [g.split for g in backend.superseded[0]] == ["smallest", "smallest"]
    for i in range(2):  # the second step compiles the split's plans: the third is measured (`AllocatorEvents`)
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        third = measure_step(_step, rk, x) if i == 1 else None
        torch.testing.assert_close(third.result if third else _step(rk, x), _step(eager, x), rtol=1e-5, atol=1e-6)
        _assert_same_step(model, eager)
    assert backend.store_all_peak == _predicted_store_all_peak(_Deep, x)
    assert backend.budget == int(0.8 * backend.store_all_peak)
    assert third.peak <= backend.budget
    assert _predicted_step_peak(backend) <= backend.budget
    assert backend.predicted_time() < backend.predicted_time(backend.superseded[0])  # room to store more


def test_ratio_below_the_smallest_step_says_which_ratio_fits() -> None:
    x = torch.randn(512, 64)
    compiled = torch.compile(_Branching(), backend=rockplan.backend(0.2), dynamic=False)
    with pytest.raises(InfeasibleBudget, match=r"ratio 0.2 .* give a ratio of at least 0\.\d\d"):
        _step(compiled, x)  # as the first step ends, and the step's peak is known


class _SetsItsModeOnce(nn.Module):
    """Wide layers (their gradients are a large part of the step), and an attribute the
    first call sets, as transformers' classification losses set `config.problem_type`: Dynamo's
    guard on it fails in the second step, which compiles the graph again: the same graph, or
    with `changes` another one (the loss written another way once the mode is set)."""

    def __init__(self, width: int = 512, depth: int = 6, changes: bool = False) -> None:
        super().__init__()
        hidden = [module for _ in range(depth) for module in (nn.Linear(width, width), nn.Tanh())]
        self.layers = nn.Sequential(nn.Linear(64, width), nn.Tanh(), *hidden, nn.Linear(width, 8))
        self.mode: str | None = None
        self.changes = changes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        if self.mode is None:
            self.mode = "squared"
        elif self.changes:
            return (y * y).mean()
        return y.square().mean()


def _steps_as_eager(model: nn.Module, backend: rockplan.backend, x: torch.Tensor, steps: int) -> StepMemory:
    """Training steps of `model` compiled with `backend` beside eager's, checked equal; the last
    measured (those before it plan, which a CPU cannot measure: `AllocatorEvents`)."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    for i in range(steps):
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        last = measure_step(_step, compiled, x) if i == steps - 1 else None
        torch.testing.assert_close(last.result if last else _step(compiled, x), _step(eager, x), rtol=1e-5, atol=1e-6)
        _assert_same_step(model, eager)
    return last


def test_a_graph_compiled_again_once_the_budget_is_known_fits_beside_the_others_gradients() -> None:
    """The second step compiles another graph on the same parameters after the ratio is
    resolved: every parameter's gradient reserved beside it, its own counted twice, leaves it
    too little, so it reserves only the gradients of parameters it does not take (none)."""
    torch.manual_seed(0)
    x = torch.randn(1024, 64)
    backend = rockplan.backend(0.8)
    last = _steps_as_eager(_SetsItsModeOnce(changes=True), backend, x, steps=4)  # the third compiles graph 1's split
    assert len(backend.graphs) == 2  # graph 1: the loss written the other way
    first = next((graphs[1] for graphs in backend.superseded if len(graphs) > 1), backend.graphs[1])
    assert first.split == "greedy" and first.reserved == 0
    assert last.peak <= backend.budget


class _TanhStacks(nn.Module):
    """Two stacks of tanh layers around a branch: every activation is read by a backward
    (a tanh's by its own, a linear's input by its), so each graph holds about all it makes."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                   nn.Linear(width, width), nn.Tanh())
        self.second = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                    nn.Linear(width, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if h.sum() > 0:
            h = h * 2
        return self.second(h).square().sum()


def test_a_smaller_input_after_the_first_step_fits_the_budget_the_first_resolved() -> None:
    """A new input shape compiles new graphs once the budget is known, each planned before the
    step's next graphs are known. Graph 2, the first half at the new shape, holds what the
    first half held (as much as the budget allows); graph 3, the second half, then had only what
    is left less every parameter's gradient, and the step was refused though the input is
    smaller: the first half's gradients are made after the second half's backward. Now those
    are not reserved beside it where that is what leaves room."""
    torch.manual_seed(0)
    model = _TanhStacks()
    eager = copy.deepcopy(model)
    x = torch.randn(256, 16)
    rk = Rockmate(model, x, 1.0, profile="estimate", plan_cache=False)
    for i, rows in enumerate((256, 256, 250, 250, 250)):  # the first two at a shape plan: the last is measured
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
        measured = measure_step(_step, rk, x[:rows]) if i == 4 else None
        loss = measured.result if measured else _step(rk, x[:rows])
        torch.testing.assert_close(loss, _step(eager, x[:rows]), rtol=1e-5, atol=1e-6)
        _assert_same_step(model, eager)
    backend = rk._graph_breaks.backend
    assert len(backend.graphs) == 4 and measured.peak <= backend.budget


def test_a_step_dynamo_runs_without_graphs_past_its_recompile_limit_is_refused() -> None:
    """Each new input shape compiles the frames again; past Dynamo's recompile limit it runs
    them in Python, unplanned, saying so in a log line only: that step is an error."""
    torch.manual_seed(0)
    rk = Rockmate(_TanhStacks(width=32), budget=1.0, profile="estimate", plan_cache=False)
    x = torch.randn(64, 16)
    with torch._dynamo.config.patch(recompile_limit=2):
        for rows in (64, 60):
            _step(rk, x[:rows])
        with pytest.raises(CaptureError, match=r"without any of its graphs.*recompile_limit \(2\).*Pad inputs"):
            _step(rk, x[:56])


def test_the_same_graph_compiled_again_runs_the_plan_it_has() -> None:
    """Dynamo compiles the same graph again in the second step (a guard on the attribute the
    first set): it runs as graph 0, on graph 0's plan, and nothing is planned again."""
    torch.manual_seed(0)
    x = torch.randn(1024, 64)
    backend = rockplan.backend(0.8)
    plans = []
    planner = backend._plan

    def counted(*args: object, **kwargs: object) -> object:
        plans.append(len(backend.sequences))
        return planner(*args, **kwargs)

    backend._plan = counted
    last = _steps_as_eager(_SetsItsModeOnce(), backend, x, steps=3)
    assert len(backend.graphs) == 1 and list(backend.sequences) == [(0,)]
    assert plans and all(after_steps <= 1 for after_steps in plans)  # all within the first step
    assert last.peak <= backend.budget


def test_graph_key_tells_apart_what_a_plan_depends_on() -> None:
    """Two compilations of one frame on the same parameters share a key whatever Dynamo named
    their inputs; another module's parameters, other shapes, or grad mode off do not."""
    from rockplan.backend import _graph_key, _input_kinds

    captured = []

    def recorded(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        captured.append(_graph_key(gm, example_inputs, _input_kinds(gm, example_inputs)[0]))
        return gm.forward

    torch.manual_seed(0)
    model, other = _SetsItsModeOnce(width=16, depth=1), _SetsItsModeOnce(width=16, depth=1)
    x = torch.randn(4, 64)
    compiled = torch.compile(model, backend=recorded, dynamic=False)
    for _ in range(2):  # the second call compiles again: the guard on `mode` fails
        compiled(x).backward()
    other.mode = "set otherwise"  # else Dynamo runs graph 0 on its parameters: they are the graph's inputs
    torch.compile(other, backend=recorded, dynamic=False)(x)
    torch.compile(model, backend=recorded, dynamic=False)(torch.randn(8, 64))
    with torch.no_grad():
        torch.compile(model, backend=recorded, dynamic=False)(x)
    assert len(captured) == 5 and captured[0] is not None
    assert captured[1] == captured[0]
    assert len(set(captured[1:])) == 4


def test_autograd_ops_outside_the_graphs_are_refused_with_the_op_and_a_remedy() -> None:
    model = _EagerBetween()
    compiled = torch.compile(model, backend=rockplan.backend(10**9), dynamic=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failure:
        _step(compiled, torch.randn(64, 64))
    error = failure.value.inner_exception
    assert isinstance(error, CaptureError)
    message = str(error)
    assert "Mul" in message and "outside" in message and "custom_op" in message


class _BranchInLoopBlock(nn.Module):
    """A branch inside one block of a loop over blocks: Dynamo skips the looping forward
    ("graph break in loop"), running it eagerly; the block frames alone are compiled."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, width), nn.Linear(width, 8)
        self.blocks = nn.ModuleList(_BranchingBlock(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) * 2
        for block in self.blocks:
            h = block(h)
        return self.out(h).square().mean()


class _BranchingBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        return h * 2 if h.sum() > 0 else h


def test_a_break_inside_a_loop_is_refused_naming_the_loop() -> None:
    compiled = torch.compile(_BranchInLoopBlock(), backend=rockplan.backend(10**9), dynamic=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failure:
        _step(compiled, torch.randn(32, 64))
    message = str(failure.value.inner_exception)
    assert "Mul" in message and "before the first graph" in message and "graph break in loop" in message


class _LayerDrop(nn.Module):
    """Hugging Face's LayerDrop: each layer skipped at random in training, a branch on a drawn
    tensor inside the loop over layers (M2M100 and NLLB by default, HuBERT and Wav2Vec2)."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layerdrop = layerdrop
        self.inp, self.out = nn.Linear(64, 64), nn.Linear(64, 8)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop:  # (as HF writes it)
                continue
            h = torch.tanh(layer(h))
        return self.out(h).square().mean()


def test_layerdrop_is_refused_saying_to_set_its_probability_to_zero() -> None:
    """A layer skipped at random is another graph at each draw: no plan can follow it, and it
    cannot be written branchless. The refusal says what the user can do: turn it off."""
    x = torch.randn(32, 64)
    # The loop calls only PyTorch's own modules, which Dynamo does not compile alone: skipping
    # the loop's frame captured no graph at all, and the step ran unplanned, saying nothing.
    with pytest.raises(CaptureError, match=r"(?s)captured no graph.*graph break in loop.*LayerDrop: `layerdrop`.*"
                                           r"set its probability to 0.*stopped here: .*torch\.rand"):
        Rockmate(_LayerDrop(0.1), x, 10**9)(x)
    model = _LayerDrop(0.0)
    eager = copy.deepcopy(model)
    planned = Rockmate(model, x, 10**9)
    torch.testing.assert_close(planned(x), eager(x))


def test_rockmate_refusing_a_break_inside_a_loop_names_the_branch() -> None:
    """Through `Rockmate` (the model is not one graph, so Dynamo splits it), the refusal of a
    break inside a loop also says where the one-graph capture stopped: the branch itself."""
    model = _BranchInLoopBlock()
    x = torch.randn(32, 64)
    with pytest.raises(CaptureError, match=r"(?s)graph break in loop.*Traced as one graph first, the step stopped "
                                           r"here: .*return h \* 2 if h\.sum\(\) > 0 else h"):
        Rockmate(model, x, 10**9)(x)
