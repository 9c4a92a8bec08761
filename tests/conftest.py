"""Plans in tests never hang on a freshly measured time.

A measured profile changes from run to run (more so on a busy 2-core CI machine), and with it
the schedule a test plans and runs: a test that holds for most schedules then fails by chance.
So wherever a test plans on a "measured" profile (Rockmate's default, also inside the lean
variant's profile, which times its own ops alone, `rkgraph.synthetic_times`, even when given
another plan's times), node times are the roofline estimate (`rkgraph.estimate_times`): a
function of the graph alone. The rest of the measurement stays real: the warm-up replay and the
ops timed alone run the real kernels, and the kernels' scratch is measured op by op from the
allocator's events as in any profile. Tests of the measurement
itself opt out with `@pytest.mark.measures_time`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence

import hypothesis
import pytest
import torch
from torch import fx

import rkgraph
from rkgraph.graph import RematGraph
from rkgraph.profile import joint_device

# CUDA tests measure with the allocator set as the README advises (read when CUDA is first used):
# without expandable segments a cached block larger than the request counts whole.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
# Each test plans afresh (its solver calls, its profile), never reading a plan cached by an earlier
# test or run: tests of the cache give it a directory of their own.
os.environ["ROCKPLAN_PLAN_CACHE"] = "off"
# Every property test draws the same examples on every run, on every machine: a test must not
# fail by the draw on CI. (The examples still change with hypothesis's version, hence its pin.)
hypothesis.settings.register_profile("derandomized", derandomize=True)
hypothesis.settings.load_profile("derandomized")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "measures_time: plans on node times measured on this machine")


@pytest.fixture(autouse=True)
def _frozen_node_times(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("measures_time"):
        return
    measure = rkgraph.measure_times

    def estimated(graph: RematGraph, joint: fx.GraphModule, inputs: Sequence[torch.Tensor], repeats: int = 3) -> None:
        measure(graph, joint, inputs, repeats=0)  # the warm-up replay only: nothing is timed
        device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
        rkgraph.estimate_times(graph, joint, device)

    monkeypatch.setattr(rkgraph, "measure_times", estimated)
    alone = rkgraph.synthetic_times

    def estimated_alone(graph: RematGraph, joint: fx.GraphModule, nodes: Iterable[str], repeats: int = 3) -> dict:
        timed = alone(graph, joint, nodes, repeats)  # the ops run as measured: only their times are replaced
        seconds = rkgraph.estimated_times(graph, joint, joint_device(joint).type)
        return {name: seconds[name] for name in timed}

    monkeypatch.setattr(rkgraph, "synthetic_times", estimated_alone)


@pytest.fixture
def rockmate_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[RematGraph, int, dict]]:
    """(graph, budget, options) of each call of the default solver the planner makes, which
    still runs; wrapped so the planner checks the options against the solver's own signature."""
    from solvers import RUNTIME_SOLVERS

    calls: list[tuple[RematGraph, int, dict]] = []
    solve = RUNTIME_SOLVERS["rockmate"]

    @functools.wraps(solve)
    def recorded(graph: RematGraph, budget: int, **options: object) -> object:
        calls.append((graph, budget, options))
        return solve(graph, budget, **options)

    monkeypatch.setitem(RUNTIME_SOLVERS, "rockmate", recorded)
    return calls
