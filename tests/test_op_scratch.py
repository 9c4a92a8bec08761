"""Kernels' scratch measured op by op on synthetic inputs (`rkgraph.measure_op_scratch`), what
every profile counts, estimated ones included: it agrees with the store-everything replay's
reading of the allocator (`rkgraph.measure_scratch`), it is measured once per op signature, and
plans on estimated profiles keep their budget when run (they overran it by ATen kernels' scratch,
a CPU convolution's buffers, when only our own ops' scratch was known)."""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Callable

import pytest
import torch
import torch.utils._pytree as pytree

import rkgraph
from rkgraph import profile as rkprofile
from rkgraph.build import is_random, storage_bytes
from rkgraph.capture import flat_tensors, flatten_call
from rockplan import Rockmate, zoo
from rockplan.memory import measure_step
from solvers import min_feasible_budget

SOLVER_OPTIONS = {"time_limit": 10}


def _entry(name: str, how: str, device: str = "cpu") -> tuple[torch.nn.Module, tuple, dict,
                                                              Callable[[], contextlib.AbstractContextManager]]:
    model, args, kwargs, _ = zoo.make(name, "tiny")
    model, args = model.to(device), tuple(a.to(device) for a in args)
    if how == "bf16 weights":
        model = model.to(torch.bfloat16)
        args = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)
    if how == "bf16 autocast":
        return model, args, kwargs, lambda: torch.autocast(device, dtype=torch.bfloat16)
    return model, args, kwargs, contextlib.nullcontext


_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("name", "how", "device"), [
    ("resnet", "fp32", "cpu"), ("gpt", "fp32", "cpu"), ("resnet", "bf16 autocast", "cpu"),
    ("gpt", "bf16 weights", "cpu"),
    *(pytest.param(name, how, "cuda", marks=_CUDA) for name in ("resnet", "gpt") for how in ("fp32", "bf16 autocast")),
])
def test_op_by_op_scratch_equals_the_replay_s_on_every_node(name: str, how: str, device: str) -> None:
    """Equal, not close: both read the allocator's events of the same kernels on the same shapes,
    strides, dtypes and thread count, which size every buffer a kernel takes. The bf16 cases
    hold only because each op runs on what its inputs' ops really returned: a CPU batch norm
    under bf16 autocast saves float32 statistics where the fake tensors say bf16, and its
    backward converts its input (scratch the fake dtypes do not show)."""
    model, args, kwargs, precision = _entry(name, how, device)
    with precision():
        joint = rkgraph.capture_joint(model, args, kwargs)
    real = flat_tensors(model, flatten_call(model, args, kwargs), args, kwargs)
    replayed, op_by_op = rkgraph.build_graph(joint), rkgraph.build_graph(joint)
    base = {node.name: node.workspace for node in replayed.nodes}
    rkgraph.measure_scratch(replayed, joint.module, [*real, *rkgraph.random_tangents(joint.module, device)])
    rkprofile._op_scratch.clear()  # measured here, not taken from an earlier test's cache
    rkgraph.measure_op_scratch(op_by_op, joint.module)
    fx_nodes = {n.name: n for n in joint.module.graph.nodes}
    # Where both measure: nodes whose every op runs on synthetic inputs (not our ops the
    # rewrites' table knows, nor draws' and assertions' kin: see `measure_op_scratch`).
    both = [node.name for node in op_by_op.nodes
            if all(rkprofile._scratch_measured(fx_nodes[n]) or fx_nodes[n].target is operator.getitem
                   for n in node.fx_nodes)]
    assert len(both) > 0.8 * len(op_by_op.nodes)
    replay = {node.name: node.workspace - base[node.name] for node in replayed.nodes}
    ours = {node.name: node.workspace - base[node.name] for node in op_by_op.nodes}
    assert max(replay[name] for name in both) > 0, "no kernel scratch in this step: the comparison shows nothing"
    differing = {name: (replay[name], ours[name]) for name in both if ours[name] != replay[name]}
    assert not differing, f"(replay's, op by op) scratch differ on {differing}"


def test_identical_layers_are_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT's blocks run the same ops on the same shapes: one call per signature, and none when
    the same graph is profiled again (a plan's lean variant, a rank, a new budget)."""
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    joint = rkgraph.capture_joint(model, args, kwargs)
    calls = []
    run = rkprofile._run_synthetic
    monkeypatch.setattr(rkprofile, "_run_synthetic", lambda target, *rest: calls.append(target) or run(target, *rest))
    rkprofile._op_scratch.clear()
    rkgraph.measure_op_scratch(rkgraph.build_graph(joint), joint.module)
    measurable = [n for n in joint.module.graph.nodes if rkprofile._scratch_measured(n)]
    assert 0 < len(calls) < len(measurable)
    first = len(calls)
    rkgraph.measure_op_scratch(rkgraph.build_graph(joint), joint.module)
    assert len(calls) == first


def _step(model: torch.nn.Module, args: tuple, kwargs: dict,
          precision: Callable[[], contextlib.AbstractContextManager]) -> None:
    with precision():
        out = model(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


@pytest.mark.parametrize(("name", "how"), [("resnet", "fp32"), ("resnet", "bf16 weights"), ("gpt", "bf16 autocast")])
def test_estimated_profile_plans_keep_the_budget(name: str, how: str) -> None:
    """Planned on an estimated profile at the smallest budget where a schedule is known (where
    every byte of a node's scratch matters): the step's measured peak, kernels' scratch
    included, is within the budget."""
    model, args, kwargs, precision = _entry(name, how)
    with precision():
        stored = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all", profile="estimate")
        rk = Rockmate(model, (args, kwargs), min_feasible_budget(stored.graph), profile="estimate",
                      solver_options=SOLVER_OPTIONS)
    assert sum(op.kind == "compute" for op in rk.schedule.ops) > len(rk.graph.nodes), "nothing recomputed"
    _step(rk, args, kwargs, precision)  # warm-up: lazy allocations are not the step's memory
    rk.zero_grad(set_to_none=True)
    peak = measure_step(_step, rk, args, kwargs, precision, method="profiler").peak
    assert peak <= rk.budget, f"measured {peak} B over the budget of {rk.budget} B"


class _AssertsAndDrops(torch.nn.Module):
    """An assertion (its synthetic input would fail it: zeros where the check wants True) and a
    dropout (a draw) in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 64), torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        torch._assert_async((hidden.abs() < 1e3).all(), "activation out of range")
        return self.second(torch.nn.functional.dropout(hidden.tanh(), 0.1)).logsumexp(-1).mean()


def test_assertions_are_not_run_and_draws_leave_the_user_s_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """An assertion is never called on synthetic values (on CUDA a failed one is a device-side
    assert, fatal to the process): it takes its known scratch, none. A draw is measured, and the
    global generator is where it was."""
    torch.manual_seed(0)
    joint = rkgraph.capture_joint(_AssertsAndDrops(), (torch.randn(32, 8),))
    calls = []
    run = rkprofile._run_synthetic
    monkeypatch.setattr(rkprofile, "_run_synthetic", lambda target, *rest: calls.append(target) or run(target, *rest))
    rkprofile._op_scratch.clear()
    state = torch.get_rng_state()
    rkgraph.measure_op_scratch(rkgraph.build_graph(joint), joint.module)
    assert torch.equal(torch.get_rng_state(), state)
    assert not any("assert" in str(target) for target in calls), calls
    draws = {n.target for n in joint.module.graph.nodes if n.op == "call_function" and is_random(n)}
    assert draws and draws <= set(calls), (draws, calls)


class _Bags(torch.nn.Module):
    """Bags of token embeddings (their mean) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.bags, self.head = torch.nn.EmbeddingBag(1000, 64, mode="mean"), torch.nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.bags(ids)), labels)


class _Folds(torch.nn.Module):
    """Columns projected and folded back into a sequence (`nn.Fold`, as ConvBERT's span convolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.project, self.fold = torch.nn.Linear(16, 144), torch.nn.Fold((64, 1), (9, 1), padding=(4, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        folded = self.fold(self.project(x).transpose(1, 2))
        return (folded * folded).tanh().mean()


@pytest.mark.parametrize("case", ["embedding bag", "fold"])
def test_values_count_the_bytes_their_kernel_allocated_not_their_shape_s(case: str) -> None:
    """A kernel may allocate more than its output's shape needs, and the step holds the storage
    as long as the value: the CPU EmbeddingBag's offset-to-bag map (saved for the backward) is
    allocated one element longer and shrunk, and the CPU fold (col2im) returns its output in a
    storage of its input's size, nine times its own here. The value's data node has the
    kernel's bytes, and the step measures what its plan predicts."""
    torch.manual_seed(0)
    model, args = ((_Bags(), (torch.randint(0, 1000, (4, 64)), torch.randint(0, 10, (4,)))) if case == "embedding bag"
                   else (_Folds(), (torch.randn(8, 64, 16),)))
    rk = Rockmate(model, args, 1.0, profile="estimate")
    fx_nodes = {n.name: n for n in rk.plan.joint.module.graph.nodes}
    grown = {name: (data.size, storage_bytes(fx_nodes[name].meta["val"])) for name, data in rk.graph.data.items()
             if data.producer is not None and data.size != storage_bytes(fx_nodes[name].meta["val"])}
    assert len(grown) == 1 and all(real > shaped for real, shaped in grown.values()), grown
    measure_step(lambda m: m(*args).backward(), rk)  # warm-up: lazy allocations are not the step's
    rk.zero_grad(set_to_none=True)
    planned = measure_step(lambda m: m(*args).backward(), rk)
    assert planned.peak == rk.schedule.predicted_peak <= rk.budget


class _NestedAssignment(torch.nn.Module):
    """An assignment into a view of a view of an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.project(x)
        out = torch.zeros_like(hidden)
        out[:, 0][:, :32] = hidden[:, 0, :32]
        return ((out + hidden) ** 2).tanh().mean()


def test_a_scatter_into_a_view_has_its_base_s_bytes() -> None:
    """Functionalized, the assignment scatters into the view (`slice_scatter` of a `select`),
    whose kernel clones the view's whole storage, its base's, where the fake tensor has the
    view's shape: the data node has the base's bytes (the synthetic input has the base's
    storage, not the probe's shared buffer)."""
    torch.manual_seed(0)
    joint = rkgraph.capture_joint(_NestedAssignment(), (torch.randn(8, 128, 32),))
    graph = rkgraph.build_graph(joint)
    rkprofile._op_scratch.clear()
    rkgraph.measure_op_scratch(graph, joint.module)
    (scatter,) = [n for n in joint.module.graph.nodes if n.target is torch.ops.aten.slice_scatter.default]
    base_bytes = scatter.args[0].meta["val"].untyped_storage().nbytes()
    assert base_bytes == 8 * 128 * 64 * 4 > storage_bytes(scatter.meta["val"])
    assert graph.data[scatter.name].size == base_bytes
