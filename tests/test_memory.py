"""The memory tracker against byte counts computed by hand (float32: 4 bytes per element)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rockplan import zoo
from rockplan.memory import MemoryTracker, cuda_blocks_fit_requests, measure_step

F32 = 4


@pytest.fixture
def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 32)


def test_linear_forward_backward_peak_is_the_sum_of_named_tensors(linear: nn.Linear) -> None:
    x = torch.randn(16, 64, requires_grad=True)

    def step() -> torch.Tensor:
        y = linear(x)
        loss = y.sum()
        loss.backward()
        return loss

    memory = measure_step(step, method="storages")
    y = 16 * 32 * F32  # addmm output, alive until step returns
    loss = seed = F32  # the scalar loss and the ones_like gradient seed of backward
    grad_x, grad_w, grad_b = 16 * 64 * F32, 32 * 64 * F32, 32 * F32
    # AddmmBackward holds every gradient it produces until it returns: everything is live at once.
    assert memory.peak == y + loss + seed + grad_x + grad_w + grad_b == 14472
    # y and the seed die; the loss (returned) and the three .grad tensors remain.
    assert memory.end == loss + grad_x + grad_w + grad_b
    assert memory.result is not None and memory.result.shape == ()

    linear.zero_grad(set_to_none=True)
    x.grad = None
    allocator = measure_step(step, method="profiler")
    # The allocator also sees what no operator returns: mm copies the seed's gradient (expanded
    # from a scalar, stride 0) into a contiguous scratch buffer for each of its two products,
    # and frees it inside. The peak is while computing grad_w, before grad_b exists.
    copy = 16 * 32 * F32
    assert allocator.peak == y + loss + seed + grad_x + copy + grad_w == 16392
    assert allocator.end == memory.end


def test_gradient_accumulation_is_seen(linear: nn.Linear) -> None:
    x = torch.randn(16, 64)

    def step() -> None:
        linear(x).sum().backward()

    first = measure_step(step, method="storages")
    grads = 32 * 64 * F32 + 32 * F32
    assert first.end == grads  # the .grad tensors were created by the step
    # The linear's output is saved by neither addmm nor sum, so it dies before backward: the
    # peak is the loss, the ones_like seed and the gradients.
    assert first.peak == F32 + F32 + grads
    second = measure_step(step, method="storages")
    # The new gradients are allocated, then added in place into the existing .grad (aten.add_)
    # and freed: they count in the peak but nothing new survives the step.
    assert second.peak == first.peak
    assert second.end == 0


def test_views_do_not_double_count() -> None:
    with MemoryTracker(method="storages") as tracker:
        base = torch.empty(1000)
        views = [base[::2], base.view(10, 100), base.view(10, 100).t(), base.unsqueeze(0), base.detach()]
        assert tracker.current == 1000 * F32
        del base, views
        assert tracker.current == 0
    assert tracker.peak == 1000 * F32


def test_storages_alive_before_the_step_are_not_counted(linear: nn.Linear) -> None:
    x = torch.randn(16, 64)
    with MemoryTracker(method="storages") as tracker:
        x.mul_(2)
        x[1:].add_(1)
        linear.weight.data.t()
        x.view(-1).detach()
    assert tracker.peak == 0


def test_freed_tensors_decrease_current() -> None:
    x = torch.randn(256, requires_grad=True)
    with MemoryTracker(method="storages") as tracker:
        a = torch.empty(512)
        b = torch.empty(128)
        assert tracker.current == (512 + 128) * F32
        del a
        assert tracker.current == 128 * F32
        h = x.exp()  # exp saves its result for backward
        loss = h.sum()
        del h  # only autograd's saved tensors hold it now
        assert tracker.current == 128 * F32 + 256 * F32 + F32
        loss.backward()  # frees the graph and its saved result
        assert tracker.current == 128 * F32 + F32 + 256 * F32  # b, loss, x.grad
        del b
    # The peak is during backward: b, h, loss, seed and the gradient of x.
    assert tracker.peak == (128 + 256 + 1 + 1 + 256) * F32
    assert tracker.current == F32 + 256 * F32


def test_backward_allocations_are_seen() -> None:
    x = torch.randn(256, requires_grad=True)
    y = (x * 3).sum()  # built outside: only backward runs inside the tracker
    with MemoryTracker(method="storages") as tracker:
        y.backward()
    # Backward allocates the ones_like seed, then MulBackward's grad (the seed expanded, times 3)
    # which becomes x.grad; the seed dies when backward returns.
    assert tracker.peak == F32 + 256 * F32
    assert tracker.current == 256 * F32


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return 2 * x * grad


def test_autograd_function_forward_and_backward_are_seen() -> None:
    x = torch.randn(256, requires_grad=True)
    with MemoryTracker() as forward_only:
        square = _Square.apply(x)
    assert forward_only.current == 256 * F32
    del square

    def step() -> torch.Tensor:
        loss = _Square.apply(x).sum()
        loss.backward()
        return loss

    memory = measure_step(step)
    n = 256 * F32
    # The square dies once summed (sum saves nothing); backward then holds the loss, the seed,
    # `2 * x` and `(2 * x) * grad`, which becomes x.grad.
    assert memory.peak == F32 + F32 + n + n
    assert memory.end == F32 + n


def test_fx_graph_module_is_seen_and_frees_intermediates() -> None:
    graph_module = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)))
    x = torch.randn(16, 64)
    with torch.no_grad():
        memory = measure_step(graph_module, x)
    # fx's generated code drops each value after its last use: at most two activations coexist.
    assert memory.peak == 2 * 16 * 32 * F32
    assert memory.end == 16 * 8 * F32


def test_tensor_literal_created_inside_is_counted() -> None:
    with MemoryTracker(method="storages") as tracker:
        literal = torch.tensor([1.0, 2.0, 3.0])  # reaches dispatch as lift_fresh of its argument
    assert tracker.current == 3 * F32
    del literal


def test_out_variants_and_resizes_count_the_new_bytes() -> None:
    a = torch.randn(100)
    preexisting_out = torch.empty(0)
    preexisting_small = torch.empty(10)
    with MemoryTracker(method="storages") as tracker:
        new_out = torch.empty(0)
        torch.add(a, a, out=new_out)  # the kernel resizes its out tensor below the dispatcher
        assert tracker.current == 100 * F32
        torch.mul(a, 2, out=preexisting_out)  # a storage from before the step grows inside it
        assert tracker.current == 200 * F32
        preexisting_small.resize_(50)  # grows from 10 to 50 elements: 40 new
        assert tracker.current == 240 * F32
        del new_out, preexisting_out
        assert tracker.current == 40 * F32
    assert tracker.peak == 240 * F32


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=4096), min_size=1, max_size=12),
    data=st.data(),
)
def test_current_is_the_sum_of_live_tensors(sizes: list[int], data: st.DataObject) -> None:
    with MemoryTracker(method="storages") as tracker:
        tensors = {i: torch.empty(size) for i, size in enumerate(sizes)}
        freed = data.draw(st.sets(st.sampled_from(sorted(tensors))))
        for i in freed:
            del tensors[i]
        assert tracker.current == sum(t.nbytes for t in tensors.values())
    assert tracker.peak == sum(sizes) * F32


def test_tracker_is_not_readable_before_entry_and_allocator_needs_cuda() -> None:
    with pytest.raises(RuntimeError):
        _ = MemoryTracker().peak
    with pytest.raises(ValueError):
        MemoryTracker("cpu", method="allocator")
    with pytest.raises(ValueError):
        MemoryTracker("cuda", method="profiler")
    with MemoryTracker(method="profiler") as tracker, pytest.raises(RuntimeError, match="once the tracker has exited"):
        _ = tracker.current


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(min_value=1, max_value=4096), min_size=1, max_size=8), data=st.data())
def test_profiler_counts_what_the_allocator_hands_out(sizes: list[int], data: st.DataObject) -> None:
    before = torch.empty(1000)  # freed inside: not the step's memory, so not subtracted
    with MemoryTracker(method="profiler") as tracker:
        tensors = {i: torch.empty(size) for i, size in enumerate(sizes)}
        for i in data.draw(st.sets(st.sampled_from(sorted(tensors)))):
            del tensors[i]
        del before
    assert tracker.current == sum(t.nbytes for t in tensors.values())
    assert tracker.peak == sum(sizes) * F32


def test_profiler_measures_compiled_code_the_storage_count_cannot() -> None:
    """Under the storage count's dispatch mode dynamo runs the model eagerly, so every
    activation-memory knob of torch.compile looks the same; the allocator's events see the
    compiled graph recomputing instead of saving."""
    model, args, kwargs, loss_fn = zoo.make("gpt", "tiny")
    model = zoo.WithLoss(model, loss_fn)

    def peaks(budget: float) -> tuple[int, int]:
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            compiled = torch.compile(model, backend="aot_eager")
            compiled(*args, **kwargs).backward()  # compiles
        figures = []
        for method in ("profiler", "storages"):  # profiler first: once run under a mode, dynamo runs the frame eagerly
            model.zero_grad(set_to_none=True)
            figures.append(measure_step(lambda: compiled(*args, **kwargs).backward(), method=method).peak)
        return figures[1], figures[0]

    (storages_all, allocator_all), (storages_half, allocator_half) = peaks(1.0), peaks(0.5)
    torch._dynamo.reset()
    assert storages_half == storages_all
    assert allocator_half < 0.8 * allocator_all  # well below in practice: the bound only shows the knob acted


def test_a_measurement_a_planning_ends_says_so_rather_than_measure_zero() -> None:
    """torch.profiler runs one session at a time: a block measuring the allocator inside another
    (planning inside a measured step that plans: here a graph break's first step) ends the
    outer one's session. The outer measurement then raises rather than read no memory, the inner
    one measures what it ran, and a step that does not plan is measured as usual."""
    from rkgraph.profile import AllocatorEvents
    from rockplan import Rockmate

    with AllocatorEvents() as outer:
        kept = torch.empty(1 << 18)
        with AllocatorEvents() as inner:
            del kept
            torch.empty(1 << 19)
    assert inner.replay() == ((1 << 19) * F32, 0)
    with pytest.raises(RuntimeError, match="not recorded.*Measure a step that does not plan"):
        outer.replay()

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x).relu()
            if h.sum().item() < 0:  # a graph break: each graph is planned in the first training steps
                h = -h
            return self.b(h).square().sum()

    x = torch.randn(256, 64)
    rk = Rockmate(Broken(), x, 1.0)
    with pytest.raises(RuntimeError, match="not recorded"):
        measure_step(lambda: rk(x).backward())
    rk(x).backward()
    assert measure_step(lambda: rk(x).backward()).peak >= 2 * x.nbytes  # the two layers' activations


def test_planning_inside_the_users_profiler_refuses_rather_than_empty_the_profile() -> None:
    from torch.profiler import ProfilerActivity, profile

    from rockplan import Rockmate

    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).sum()
        with pytest.raises(RuntimeError, match="torch.profiler session is already open.*Plan before"):
            Rockmate(model, (args, kwargs), 1.0)
    assert any(e.name == "aten::sum" for e in prof.events())


_RSS_AFTER_FREE = """
import sys, torch
from rockplan.memory import steady_cpu_heap
fixed = steady_cpu_heap() if sys.argv[1] == "fixed" else None
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
x = torch.ones(20 << 18)  # 20 MiB, touched
before = rss()
del x
print(fixed, (before - rss()) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc thresholds")
def test_steady_cpu_heap_keeps_freed_memory_for_the_next_step() -> None:
    """With glibc's defaults a freed 20 MiB tensor goes back to the system (the next step pages
    it in again); with the thresholds fixed the process keeps it."""
    def returned(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _RSS_AFTER_FREE, mode], capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0], int(out[1])

    assert returned("default")[1] >= 19
    assert returned("fixed") == ("True", 0)


@pytest.mark.parametrize(
    ("variable", "value", "fits"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "", False),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", False),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:True", True),
    ],
)
def test_cuda_blocks_fit_requests_only_with_expandable_segments(monkeypatch, variable: str, value: str,
                                                                 fits: bool) -> None:
    """The setting read from either of PyTorch's allocator variables (planning warns on CUDA without it)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    assert cuda_blocks_fit_requests() is fits
