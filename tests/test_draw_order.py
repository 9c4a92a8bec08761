"""Random draws run in eager's order in every schedule: with the same seed, a planned step
draws the masks eager draws, so its loss and gradients are eager's to the bit (on CPU).

Two dropouts that read nothing of each other's data could otherwise be swapped by a solver
(each would then draw the other's mask); `rkgraph.build.order_run_once` chains them in the
graph, and the simulator rejects a schedule whose first computations of draws are out of order.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rkgraph.graph import ComputeNode, DataNode, RematGraph
from rockplan import Rockmate
from rockplan.memory import measure_step
from rockplan.plan_file import export_plan
from solvers import RUNTIME_SOLVERS, InfeasibleBudget, InvalidSchedule, simulate
from solvers.bounds import min_memory_schedule
from solvers.schedule import Schedule
from solvers.simulate import free_at_last_use


class _Dropouts(nn.Module):
    """One dropout per layer, no graph break: each mask is drawn from shapes alone."""

    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, width), nn.Linear(width, 8)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = F.dropout(torch.tanh(layer(h)), 0.2, self.training)
        return self.out(h).square().mean()


# Below the store-all schedule's peak: each solver that plans here, store_all and torch_budget
# aside (their schedules free earlier), recomputes, masks included (replayed).
BUDGETS = (2_500_000, 1_600_000)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("solver", sorted(RUNTIME_SOLVERS))
def test_planned_step_draws_eager_masks(solver: str, budget: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    model = _Dropouts()
    eager = copy.deepcopy(model)
    try:
        rk = Rockmate(model, x, budget, solver=solver, profile="estimate")
    except InfeasibleBudget as e:  # OutOfTime included: a search that finds nothing this low
        pytest.skip(f"{solver} plans nothing within {budget} B: {e}")
    assert rk.schedule.predicted_peak <= budget
    torch.manual_seed(5)
    planned = measure_step(lambda: rk(x).backward() or rk.zero_grad(set_to_none=False), method="profiler")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    step = measure_step(lambda: rk(x).backward(), method="profiler")
    torch.manual_seed(5)
    loss = eager(x)
    loss.backward()
    assert planned.peak <= budget and step.peak <= budget
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"gradient of {name}")


def test_a_schedule_that_keeps_a_later_mask_draws_in_order(tmp_path: Path) -> None:
    """Keeping the second mask and recomputing the others (a candidate of greedy_checkpoints'
    search) used to drop the first mask's forward computation as dead, the mask being remade
    where it is read: the second mask was then drawn first, and the step's gradients were not
    eager's. Run here through a plan file, as a solver's schedule runs."""
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    model = _Dropouts()
    eager = copy.deepcopy(model)
    graph = Rockmate(copy.deepcopy(model), x, 1.0, solver="store_all", profile="estimate").graph
    draws = [n for n in graph.nodes if n.rng]
    schedule = min_memory_schedule(graph, [draws[1].outputs[0]])
    first = [op.name for op in schedule.ops if op.kind == "compute" and graph.node(op.name).rng]
    assert list(dict.fromkeys(first)) == [n.name for n in draws]
    rk = Rockmate(model, x, 1.0, profile="estimate", plan_file=export_plan((graph, schedule), tmp_path / "plan.json"))
    torch.manual_seed(5)
    rk(x).backward()
    torch.manual_seed(5)
    eager(x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"gradient of {name}")


def _two_draws(**flags: bool) -> RematGraph:
    """Two draws that read nothing (as dropout masks do) and a node reading both."""
    data = {"x": DataNode("x", 8, "input"), "m0": DataNode("m0", 8, "activation", "d0"),
            "m1": DataNode("m1", 8, "activation", "d1"), "y": DataNode("y", 8, "activation", "f")}
    nodes = [ComputeNode("d0", (), ("m0",), **flags), ComputeNode("d1", (), ("m1",), **flags),
             ComputeNode("f", ("x", "m0", "m1"), ("y",))]
    return RematGraph(nodes, data, ("y",), ())


@pytest.mark.parametrize("flags", [{"rng": True}, {"random": True}])
def test_simulate_rejects_draws_out_of_graph_order(flags: dict[str, bool]) -> None:
    graph = _two_draws(**flags)
    in_order = Schedule(*free_at_last_use(graph, ["d0", "d1", "f"], 3))
    simulate(graph, in_order)
    swapped = Schedule(*free_at_last_use(graph, ["d1", "d0", "f"], 3))
    with pytest.raises(InvalidSchedule, match=r"op 1 \(compute d0\): d0 is first computed after d1"):
        simulate(graph, swapped)


def test_a_recomputed_draw_replays_out_of_order() -> None:
    """Only the first computation draws from the generator: a recomputation replays its state."""
    graph = _two_draws(rng=True)
    ops, forward_length = free_at_last_use(graph, ["d0", "d1", "f", "d0"], 3, keep=["m0"])
    simulate(graph, Schedule(ops, forward_length))
