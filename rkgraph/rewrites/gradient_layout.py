"""Make each gradient the step returns in its input's layout, as autograd stores it.

Where a parameter's `.grad` is None (each step after `zero_grad()`, PyTorch's default), autograd
keeps the gradient the backward returns only if its strides are the parameter's (dimensions of
size 1 aside: `obeys_layout_contract` in torch/csrc/autograd/functions/accumulate_grad.h);
otherwise it copies it into the parameter's layout after the backward has returned, with every
gradient alive: memory no plan of the graph sees. A convolution's weight gradient can come out
channels-last for a contiguous weight (ConvNeXt's and SegFormer's patch convolutions), and an
einsum's in the order of its operands (a Fourier layer's complex weights, the largest tensor of
its step). The copy is made in the graph instead, right after the gradient, where the plan
counts it and autograd then keeps it as it is.
"""

from __future__ import annotations

import torch
from torch import fx

from rkgraph.capture import is_tangent
from rkgraph.rewrites.fx_helpers import call

aten = torch.ops.aten


def obeys_layout(gradient: torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether autograd keeps `gradient` as `parameter`'s .grad without copying it (for a dense
    parameter): the same strides wherever the size is not 1, and no broadcast dimension."""
    return all((stride == expected if size != 1 else stride != 0)
               for size, stride, expected in zip(gradient.shape, gradient.stride(), parameter.stride(), strict=True))


def _memory_format(parameter: torch.Tensor) -> torch.memory_format | None:
    """The memory format `parameter` is laid out in, of those clone makes; None for another layout."""
    if parameter.is_contiguous():
        return torch.contiguous_format
    if parameter.dim() == 4 and parameter.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if parameter.dim() == 5 and parameter.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None


def gradients_in_input_layout(gm: fx.GraphModule) -> int:
    """Copy each gradient of `gm`'s joint graph whose strides autograd would not keep for its
    input into that input's layout, right after the gradient is made (the caller recompiles);
    returns how many."""
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    primals = [n for n in graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    first = len(outputs) - len(primals)  # the joint graph returns the forward's outputs, then a gradient per primal
    count = 0
    for k, (primal, gradient) in enumerate(zip(primals, outputs[first:], strict=True)):
        if not isinstance(gradient, fx.Node):
            continue
        value, expected = gradient.meta["val"], primal.meta["val"]
        memory_format = _memory_format(expected)
        if (value.layout != torch.strided or value.shape != expected.shape or memory_format is None
                or obeys_layout(value, expected) or gradient.op == "placeholder"):
            continue
        with graph.inserting_after(gradient):
            outputs[first + k] = call(graph, aten.clone.default, (gradient,), {"memory_format": memory_format},
                                      gradient.meta)
        count += 1
    if count:
        output.args = (outputs, *output.args[1:])
    return count
