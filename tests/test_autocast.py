"""Mixed precision: autocast (bfloat16, float16 with a GradScaler) on either side of planning,
and bfloat16 weights. Each planned step is compared with eager PyTorch in the same set-up
(within the precision's tolerance: AOTAutograd's decompositions round differently from eager's
kernels, as torch.compile's do), with the same graph run without recomputation (bit for bit: a
recomputation in reduced precision changes nothing), and its peak is measured."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import rkgraph
from rockplan import Rockmate, zoo
from rockplan.memory import measure_step
from rockplan.module import autocast_state
from solvers import min_feasible_budget

SOLVER_OPTIONS = {"time_limit": 10}


def _linear_relu() -> zoo.ZooEntry:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return zoo.ZooEntry(model, (torch.randn(256, 32),), {}, lambda out, *_: out.float().logsumexp(-1).mean())


def _make(name: str) -> zoo.ZooEntry:
    return _linear_relu() if name == "linear_relu" else zoo.make(name, "tiny")


def _autocast(dtype: torch.dtype | None, device: str = "cpu") -> Callable[[], contextlib.AbstractContextManager]:
    return (lambda: torch.autocast(device, dtype=dtype)) if dtype is not None else contextlib.nullcontext


def _step(model: nn.Module, args: tuple, kwargs: dict, precision: Callable, seed: int = 1) -> torch.Tensor:
    """Forward under `precision`, backward outside it (as autocast's docs say) from all-ones
    output gradients, so the step allocates nothing outside the planned module."""
    torch.manual_seed(seed)
    with precision():
        out = model(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    return out


def _tolerance(dtype: torch.dtype | None, roundings: int = 4) -> float:
    """Largest difference from eager allowed, relative to eager's largest magnitude: a few
    roundings of the reduced precision (float32: test_runtime's tolerance)."""
    return 1e-4 if dtype in (None, torch.float32) else roundings * torch.finfo(dtype).eps


def _assert_close_to_eager(out: torch.Tensor, model: nn.Module, eager_out: torch.Tensor, eager: nn.Module,
                           dtype: torch.dtype | None, roundings: int = 4) -> None:
    assert out.dtype == eager_out.dtype
    pairs = [("output", out, eager_out)]
    pairs += [(f"gradient of {name}", p.grad, q.grad) for (name, p), q in zip(model.named_parameters(),
                                                                             eager.parameters())]
    for what, a, b in pairs:
        scale = b.float().abs().max().clamp_min(1e-12)
        difference = (a.float() - b.float()).abs().max()
        assert difference <= _tolerance(dtype, roundings) * scale, \
            f"{what}: {difference} apart, eager's magnitude {scale}"


def _assert_bitwise(out: torch.Tensor, model: nn.Module, other_out: torch.Tensor, other: nn.Module) -> None:
    torch.testing.assert_close(out, other_out, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"gradient of {name}")


def _casts(rk: Rockmate) -> int:
    return sum(n.target is torch.ops.aten._to_copy.default for n in rk.plan.joint.module.graph.nodes)


# bfloat16 autocast on the zoo's models the issue names (the Linear+ReLU net fits its smallest
# budget by freeing early, recomputing nothing: it is stepped under autocast below); float16
# autocast and bfloat16 weights on the two that exercise the rewrites (GPT: dropout, attention,
# GELU) and the buffers (ResNet).
CASES = [(name, "autocast", torch.bfloat16) for name in ("mlp", "gpt", "resnet")]
CASES += [(name, "autocast", torch.float16) for name in ("gpt", "resnet")]
CASES += [(name, "weights", torch.bfloat16) for name in ("gpt", "resnet")]


@pytest.mark.parametrize(("name", "how", "dtype"), CASES)
def test_planned_in_reduced_precision_recomputes_bitwise_within_the_budget(name: str, how: str,
                                                                          dtype: torch.dtype) -> None:
    """Planned under autocast (or on bfloat16 weights) at the smallest budget where a schedule is
    known: the joint graph holds autocast's casts, the step recomputes, equals the same graph
    storing everything bit for bit and eager within the precision's tolerance, and its measured
    peak is within the budget and near the prediction."""
    model, args, kwargs, _ = _make(name)
    precision = _autocast(dtype) if how == "autocast" else contextlib.nullcontext
    if how == "weights":
        model = model.to(dtype)
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    eager, stored_model = copy.deepcopy(model), copy.deepcopy(model)
    with precision():
        stored = Rockmate(stored_model, (args, kwargs), 1.0, solver="store_all")
        budget = min_feasible_budget(stored.graph)
        rk = Rockmate(model, (args, kwargs), budget, solver_options=SOLVER_OPTIONS)
    if how == "autocast":
        assert _casts(rk) > 0, "the joint graph was not traced under autocast"
    assert sum(op.kind == "compute" for op in rk.schedule.ops) > len(rk.graph.nodes), "nothing recomputed"
    _step(rk, args, kwargs, precision)  # warm-up: lazy allocations are not the step's memory
    rk.zero_grad(set_to_none=True)
    planned = measure_step(_step, rk, args, kwargs, precision, method="profiler")
    _assert_bitwise(planned.result, model, _step(stored, args, kwargs, precision), stored_model)
    _assert_close_to_eager(planned.result, model, _step(eager, args, kwargs, precision), eager, dtype)
    measured, predicted = planned.peak, rk.schedule.predicted_peak
    assert measured <= rk.budget, f"measured {measured} B over budget {rk.budget} B"
    assert abs(measured - predicted) <= 0.10 * measured, f"predicted {predicted} B, measured {measured} B"


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "linear_relu"])
def test_planned_in_float32_then_stepped_under_autocast(name: str) -> None:
    """The README's loop with autocast around the forward: the call under autocast is planned
    again, traced under it (the graph holds its casts), and runs like eager under autocast
    within the budget; a call outside autocast still runs the float32 plan, like eager."""
    model, args, kwargs, _ = _make(name)
    eager = copy.deepcopy(model)
    rk = Rockmate(model, (args, kwargs), 0.9, solver_options=SOLVER_OPTIONS)
    float32_plan = rk.plan
    assert _casts(rk) == 0
    bf16 = _autocast(torch.bfloat16)
    planned = _step(rk, args, kwargs, bf16)  # plans: a CPU measures the next step (`AllocatorEvents`)
    assert rk.plan is not float32_plan and _casts(rk) > 0
    _assert_close_to_eager(planned, model, _step(eager, args, kwargs, bf16), eager, torch.bfloat16)
    for module in (rk, eager):
        module.zero_grad(set_to_none=True)
    again = measure_step(_step, rk, args, kwargs, bf16, method="profiler")
    _assert_close_to_eager(again.result, model, _step(eager, args, kwargs, bf16), eager, torch.bfloat16)
    assert again.peak <= rk.budget, f"measured {again.peak} B over budget {rk.budget} B"
    for module in (rk, eager):
        module.zero_grad(set_to_none=True)
    out = _step(rk, args, kwargs, contextlib.nullcontext)
    assert rk.plan is float32_plan
    _assert_close_to_eager(out, model, _step(eager, args, kwargs, contextlib.nullcontext), eager, None)


def test_planned_under_autocast_then_called_outside_it() -> None:
    """Planned inside autocast, called outside: float32 outputs, as eager's (they were bfloat16,
    silently), from a plan of its own."""
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    eager = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rk = Rockmate(model, (args, kwargs), 0.8, solver_options=SOLVER_OPTIONS)
        assert autocast_state() == (("cpu", torch.bfloat16),)
    assert autocast_state() == ()
    planned = _step(rk, args, kwargs, contextlib.nullcontext)  # plans: the next step is measured
    assert planned.dtype == torch.float32 and _casts(rk) == 0
    _assert_close_to_eager(planned, model, _step(eager, args, kwargs, contextlib.nullcontext), eager, None)
    for module in (rk, eager):
        module.zero_grad(set_to_none=True)
    again = measure_step(_step, rk, args, kwargs, contextlib.nullcontext, method="profiler")
    _assert_close_to_eager(again.result, model, _step(eager, args, kwargs, contextlib.nullcontext), eager, None)
    assert again.peak <= rk.budget


def test_autocast_dtype_selects_the_plan_and_is_named_when_refused() -> None:
    model, args, kwargs, _ = _linear_relu()
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all", on_new_input="error")
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast: planned under none"):
        rk(*args)
    rk = Rockmate(model, (args, kwargs), 1.0, solver="store_all")
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert rk(*args).dtype == dtype
    assert len(rk._steps) == 3  # float32, bfloat16, float16


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_float16_autocast_with_grad_scaler_trains_like_eager(name: str) -> None:
    """Three optimizer steps of float16 autocast with a GradScaler, model and loss planned as
    one module at float16's smallest budget: the same scale as eager's and the same parameters, within
    float16's tolerance of how far they moved, each step's measured peak within the budget."""
    model, args, kwargs, loss_fn = zoo.make(name, "tiny")
    model = zoo.WithLoss(model, loss_fn)
    eager = copy.deepcopy(model)
    fp16 = _autocast(torch.float16)
    with fp16():
        probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all")
        budget = min_feasible_budget(probe.graph)
        rk = Rockmate(model, (args, kwargs), budget, solver_options=SOLVER_OPTIONS)
    initial = [p.detach().clone() for p in model.parameters()]
    scales = []
    for module in (rk, eager):
        # SGD: the update is the gradient's multiple (Adam's normalisation would magnify
        # differences of gradients near zero into whole steps)
        opt, scaler = torch.optim.SGD(module.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=2.0**10)
        torch.manual_seed(3)
        for i in range(3):
            def step(module: nn.Module = module, scaler: torch.amp.GradScaler = scaler) -> None:
                with fp16():
                    loss = module(*args, **kwargs)
                scaler.scale(loss).backward()
            peak = measure_step(step, method="profiler").peak
            # The first step also makes the scaler's and the step's lazy state; `scaler.scale`
            # makes the scaled loss (a float32 scalar) outside the planned module.
            if module is rk and i > 0:
                assert peak <= rk.budget + 4, f"measured {peak} B over budget {rk.budget} B"
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scales.append(scaler.get_scale())
    assert scales[0] == scales[1]
    for (n, p), q, p0 in zip(model.named_parameters(), eager.parameters(), initial):
        difference, scale = (p - q).abs().max(), (q - p0).abs().max()
        assert difference <= _tolerance(torch.float16) * scale, f"{n}: {difference} apart, moved by {scale}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_cuda_autocast_matches_eager_within_the_budget(name: str, dtype: torch.dtype) -> None:
    """CUDA autocast, the usual way to train: planned outside autocast, stepped inside it, and
    compared with eager under the same autocast; the allocator's peak is the judge."""
    model, args, kwargs, _ = zoo.make(name, "tiny")
    model = model.cuda()
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    eager = copy.deepcopy(model)
    precision = _autocast(dtype, "cuda")
    rk = Rockmate(model, (args, kwargs), 0.6, solver_options=SOLVER_OPTIONS)
    for module in (rk, eager):  # warm-up: cuBLAS and cuDNN workspaces exist before the step
        _step(module, args, kwargs, precision)
        module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    planned = measure_step(_step, rk, args, kwargs, precision, device="cuda")
    torch.cuda.synchronize()
    assert _casts(rk) > 0
    # cuDNN and cuBLAS choose their kernels per call, so eager's and the plan's reductions may
    # run in other orders: a float16 convolution's weight gradient can be several roundings apart.
    _assert_close_to_eager(planned.result, model, _step(eager, args, kwargs, precision), eager, dtype, roundings=16)
    assert planned.peak <= rk.budget, f"measured {planned.peak} B over budget {rk.budget} B"


def test_batch_norm_statistics_are_sized_as_its_kernels_make_them() -> None:
    """On a half-precision input ATen's BatchNorm computes the batch's mean and inverse standard
    deviation in float32, while the meta functions the trace records give them the input's
    dtype: the captured graph holds the kernels' dtype, so plans count their real bytes."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    with _autocast(torch.bfloat16)():
        joint = rkgraph.capture_joint(model, (x,), {})
    norms = [n for n in joint.module.graph.nodes
             if n.target is torch.ops.aten._native_batch_norm_legit_functional.default]
    assert len(norms) == 1
    (norm,) = norms
    real = torch.ops.aten._native_batch_norm_legit_functional.default(
        torch.randn(2, 8, 6, 6, dtype=torch.bfloat16), torch.ones(8), torch.zeros(8), torch.zeros(8), torch.ones(8),
        True, 0.1, 1e-5)
    assert norm.meta["val"][0].dtype == torch.bfloat16
    assert [v.dtype for v in norm.meta["val"][1:3]] == [real[1].dtype, real[2].dtype] == [torch.float32] * 2
    for item in norm.users:
        if item.args[1] in (1, 2):
            assert item.meta["val"].dtype == torch.float32


class _ChannelsLastLayerNorm(nn.LayerNorm):
    """ConvNeXt's LayerNorm over the channels of an image (timm's LayerNorm2d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


@pytest.mark.parametrize("norm", ["layer_norm", "group_norm"])
def test_norm_statistics_are_sized_as_its_kernels_make_them_under_autocast(norm: str) -> None:
    """Under CPU autocast a convolution's bfloat16 output feeds a LayerNorm or GroupNorm whose
    weights stay float32; the kernel then returns its statistics in float32, where the trace's
    meta functions say bfloat16. The graph holds the kernel's dtype, and the step planned to its
    budget measures its prediction to the byte."""
    torch.manual_seed(0)
    layer = _ChannelsLastLayerNorm(16) if norm == "layer_norm" else nn.GroupNorm(4, 16)
    model = zoo.WithLoss(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), layer, nn.Conv2d(16, 8, 1)),
                         lambda out, *_: out.float().square().mean())
    x = torch.randn(4, 3, 24, 24)
    with _autocast(torch.bfloat16)():
        rk = Rockmate(copy.deepcopy(model), (x,), 1.0, solver_options=SOLVER_OPTIONS)
    op = {"layer_norm": torch.ops.aten.native_layer_norm.default,
          "group_norm": torch.ops.aten.native_group_norm.default}[norm]
    (node,) = [n for n in rk.plan.joint.module.graph.nodes if n.target is op]
    assert [v.dtype for v in node.meta["val"]] == [torch.bfloat16, torch.float32, torch.float32]

    def step(m: nn.Module) -> torch.Tensor:
        with _autocast(torch.bfloat16)():
            out = m(x)
        out.backward()
        return out

    eager = copy.deepcopy(model)
    expected = step(eager)
    planned = measure_step(step, rk, method="profiler")
    torch.testing.assert_close(planned.result, expected)
    for p, q in zip(eager.parameters(), rk.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    assert planned.peak == rk.plan.schedule.predicted_peak <= rk.budget
