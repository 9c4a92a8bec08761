"""Every zoo model trains in eager mode, fast, and can be traced by AOTAutograd."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from rkgraph.capture import traced_as_compiling
from rockplan.zoo import ZOO, make

NAMES = sorted(ZOO)


def _step(entry: Any) -> torch.Tensor:
    model, args, kwargs, loss_fn = entry
    loss = loss_fn(model(*args, **kwargs), *args)
    loss.backward()
    return loss


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_gives_finite_loss_and_gradients(name: str) -> None:
    entry = make(name)
    trainable = [(n, p) for n, p in entry.model.named_parameters() if p.requires_grad]
    assert trainable, "a zoo model must have parameters to train"
    loss = _step(entry)
    assert loss.shape == () and math.isfinite(loss.item())
    # Every parameter takes part in the loss: a planner must never meet a dead weight here.
    for param_name, param in trainable:
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name


@pytest.mark.parametrize("name", NAMES)
def test_traces_with_aot_autograd_and_matches_eager(name: str) -> None:
    model, args, kwargs, loss_fn = make(name)
    model.eval()  # no dropout, BatchNorm on running stats: outputs comparable across runs
    params = dict(model.named_parameters())  # tied weights appear once
    buffers = dict(model.named_buffers())
    graphs: list[torch.fx.GraphModule] = []

    def compiler(graph_module: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    # Every tensor enters as an input: tensors closed over would be real inside the fake trace.
    def functional(parameters: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *call_args: Any) -> Any:
        return functional_call(model, {**parameters, **buffers}, call_args[:-1], call_args[-1])

    traced = aot_function(functional, fw_compiler=compiler, bw_compiler=compiler)
    with traced_as_compiling():  # as rockplan traces: library code takes its traceable path (HF's masks)
        traced_output = traced(params, buffers, *args, kwargs)
    loss_fn(traced_output, *args).backward()
    assert len(graphs) == 2  # one forward graph, one backward graph: no graph break, no eager fallback
    for traced, eager in zip(tree_leaves(traced_output), tree_leaves(model(*args, **kwargs)), strict=True):
        torch.testing.assert_close(traced, eager)


def test_make_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first, second, other = make("gpt", seed=1), make("gpt", seed=1), make("gpt", seed=2)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(first.args[0], second.args[0])
    for (_, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items()):
        assert torch.equal(a, b)
    assert not torch.equal(first.model.lm_head.weight, other.model.lm_head.weight)


def test_make_rejects_unknown_names_and_sizes() -> None:
    with pytest.raises(KeyError, match="available"):
        make("vgg")
    with pytest.raises(ValueError, match="size"):
        make("mlp", size="huge")  # type: ignore[arg-type]


def test_default_size_is_larger_than_tiny() -> None:
    for name in NAMES:
        tiny, default = make(name, "tiny").model, make(name, "default").model
        assert sum(p.numel() for p in default.parameters()) > 10 * sum(p.numel() for p in tiny.parameters())


def test_models_have_the_features_the_planner_must_handle() -> None:
    resnet = make("resnet").model
    assert any(isinstance(m, nn.ReLU) and m.inplace for m in resnet.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in resnet.modules())

    gpt, (idx,), _, _ = make("gpt")
    assert idx.dtype == torch.int64
    assert gpt.lm_head.weight is gpt.transformer["wte"].weight
    assert {m.p for m in gpt.modules() if isinstance(m, nn.Dropout)} == {0.1}
    assert "transformer.h.0.attn" in dict(gpt.named_modules())

    unet = make("unet").model
    assert any(isinstance(m, nn.ConvTranspose2d) for m in unet.modules())
    assert any(isinstance(m, nn.Upsample) for m in unet.modules())

    model, args, kwargs, _ = make("multi_output")
    assert isinstance(kwargs["scale"], float) and isinstance(kwargs["mask"], torch.Tensor)
    output = model(*args, **kwargs)
    assert isinstance(output, dict) and len(output) == 3


def test_hf_gpt2_is_registered_exactly_when_transformers_is_installed() -> None:
    assert ("hf_gpt2" in ZOO) == (importlib.util.find_spec("transformers") is not None)


def test_hf_gpt2_keeps_hf_module_paths_and_tied_weights() -> None:
    pytest.importorskip("transformers")
    model, (idx,), _, _ = make("hf_gpt2", n_layer=3)
    modules = dict(model.named_modules())
    assert {"transformer.h.0.attn", "transformer.h.2.mlp", "lm_head"} <= set(modules)
    assert "transformer.h.3" not in modules
    assert model.lm_head.weight is model.transformer.wte.weight
    logits = model(idx)
    assert type(logits) is torch.Tensor and logits.shape == (*idx.shape, model.config.vocab_size)
