"""The memory tracker on plain eager training against the graph's store-everything prediction.

The requirement: for each zoo model, the peak the tracker measures for an eager step (forward,
then backward from ones over the outputs) is within 5% of `simulate(graph, store_all)`. The
tracker is the CPU allocator's (every allocation, kernels' scratch included) and the graph's
costs are measured, so node workspaces hold the scratch kernels allocate inside an op. It
holds where eager runs the same ATen ops as AOTAutograd's joint graph. Where it does not, a
test below bounds the gap by what its cause can hold, in bytes of the graph's tensors (not
by a ratio measured on one torch version), so a change in either side shows up. For
orientation, eager / predicted measured on CPU (torch 2.13), "tiny" sizes, not asserted:

    mlp 1.000   resnet 0.999   gpt 1.137   unet 0.998   multi_output 0.980   hf_gpt2 1.134

- resnet, unet: convolutions' scratch (im2col-style buffers the kernel frees inside the op) is a
  large part of the eager peak at these sizes; without it in the graph the ratio is far off.
- gpt, hf_gpt2: eager CPU dropout (`_dropout_impl`) keeps a float32 mask; the joint graph's
  `native_dropout` (what CUDA eager runs too, and what rockplan runs) keeps a bool mask, a
  quarter of the size. hf_gpt2 keeps a few percent more beyond that (also with dropout off): in the
  backward of HF's tanh-GELU, written as Python pointwise ops, eager's MulBackward computes
  both operand gradients while the engine still holds the incoming gradient; the graph frees
  in between.
- unet: capture hides torch._decomp's Python decomposition of `upsample_bilinear2d` while
  tracing, so the graph runs eager's kernel and its native backward. Traced through the
  decomposition (its four-corner gather and blend allocate several full-size temporaries
  each way), the graph predicts far more than eager holds.

The graphs here are captured without `rkgraph.rewrites.mm_gelu`'s rewrite (eager makes GELU's incoming
gradient and GELU's backward as two tensors; rockplan writes one into the other: with it, the
mlp's store-all peak falls well below eager's).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import rkgraph
import solvers
from rkgraph.graph import RematGraph
from rockplan import zoo
from rockplan.memory import measure_step

TOLERANCE = 0.05


@pytest.fixture(autouse=True)
def _gelu_backward_as_eager_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rkgraph.rewrites, "REWRITES",
                        tuple(r for r in rkgraph.rewrites.REWRITES if r.name != "mm_gelu_backward"))


def eager_peak(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tracker peak of one eager step whose only allocations beyond the model's are tangents."""
    for p in model.parameters():
        p.grad = None  # gradients are allocated inside the step, as in the graph

    def step() -> None:
        out = model(*args, **kwargs)
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])

    peak = measure_step(step).peak
    for p in model.parameters():
        p.grad = None
    return peak


def predicted_peak(graph: RematGraph) -> int:
    return solvers.simulate(graph, solvers.solve_store_all(graph)).peak


def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RematGraph:
    return rkgraph.capture(model, args, kwargs, profile="measure")  # kernels' scratch is measured


def without_dropout(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "dropout", None), float):  # the zoo GPT's attention dropout
            module.dropout = 0.0
    return model


@pytest.mark.parametrize("name", ["mlp", "resnet", "unet", "multi_output"])
def test_eager_peak_matches_graph(name: str) -> None:
    model, args, kwargs, _ = zoo.make(name)
    predicted = predicted_peak(capture(model, args, kwargs))
    assert eager_peak(model, args, kwargs) == pytest.approx(predicted, rel=TOLERANCE)


def test_gpt_matches_graph_without_dropout() -> None:
    # With dropout off both sides run the same ops, so the peaks agree.
    model, args, kwargs, _ = zoo.make("gpt")
    without_dropout(model)
    predicted = predicted_peak(capture(model, args, kwargs))
    assert eager_peak(model, args, kwargs) == pytest.approx(predicted, rel=TOLERANCE)


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_transformer_gap_is_eager_cpu_float_dropout_masks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager CPU dropout keeps float32 masks where the graph keeps bool ones: eager's step
    holds more than the graph predicts, by at most three bytes a mask element (every mask
    alive at the peak), plus for hf_gpt2 at most one tensor of its MLP's width (the GELU's
    backward: eager holds an operand gradient more). Counting the masks at four bytes an
    element brings the prediction to eager as for the models without dropout (gpt), or under
    it by less than that one tensor (hf_gpt2). The graph is taken in autograd's order, which
    eager runs: hoisting weight gradients lowers GPT's store-all peak further."""
    if name not in zoo.ZOO:
        pytest.skip("transformers is not installed")
    monkeypatch.setattr(rkgraph.build, "hoist_gradients", lambda nodes, *_: nodes)
    model, args, kwargs, _ = zoo.make(name)
    graph = capture(model, args, kwargs)
    measured, predicted = eager_peak(model, args, kwargs), predicted_peak(graph)

    masks = [d for n in graph.nodes if n.op == "rkgraph.dropout_mask.default" for d in n.outputs]
    drawn = graph.joint.module.graph.find_nodes(op="call_function", target=torch.ops.rkgraph.dropout_mask.default)
    assert masks and all(n.meta["val"].dtype == torch.bool for n in drawn)  # one byte an element
    float_extra = 3 * sum(graph.data[d].size for d in masks)
    gelu_extra = max((graph.data[d].size for n in graph.nodes if n.module.endswith("mlp.c_fc") and not n.backward
                      for d in n.outputs), default=0)  # HF's Python tanh-GELU only
    assert (gelu_extra > 0) == (name == "hf_gpt2")
    assert predicted < measured <= predicted + float_extra + gelu_extra

    for d in masks:
        graph.data[d].size *= torch.float32.itemsize
    corrected = predicted_peak(graph)
    if gelu_extra:
        assert corrected < measured <= corrected + gelu_extra
    else:
        assert measured == pytest.approx(corrected, rel=TOLERANCE)
