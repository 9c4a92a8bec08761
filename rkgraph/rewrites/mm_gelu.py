"""GELU's backward written into the product that makes its incoming gradient.

In a linear layer followed by a GELU, the backward makes the gradient of the GELU's output with
a product, `g = mm(grad_out, w)`, that only `gelu_backward(g, h)` reads; the two are alive at
once, with `h`: in a transformer's MLP three [rows, 4 * width] tensors, at the moments a tight
plan peaks. `mm_gelu_backward(a, b, h)` makes the product and applies GELU's backward to it in
place: the same kernels on the same values, so the same bits (an elementwise kernel writing
over its input), and one of the three tensors less. It costs
nothing, so it is a rewrite of the captured graph, not a variant.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.flop_counter import register_flop_formula

from rkgraph.rewrites.fx_helpers import RESHAPES, call, erase_unused, only_user

aten = torch.ops.aten


@torch.library.custom_op("rkgraph::mm_gelu_backward", mutates_args=())
def mm_gelu_backward(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, approximate: str) -> torch.Tensor:
    """`gelu_backward(mm(a, b).view(h.shape), h, approximate=approximate)`, the product's
    memory reused for the result; `h` contiguous."""
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    torch.mm(a, b, out=out.view(a.shape[0], b.shape[1]))
    return aten.gelu_backward.grad_input(out, h, approximate=approximate, grad_input=out)


@mm_gelu_backward.register_fake
def _(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@register_flop_formula(torch.ops.rkgraph.mm_gelu_backward)
def _flops(a_shape, b_shape, *_args, **_kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def fuse_mm_gelu_backward(gm: fx.GraphModule) -> int:
    """Replace every `gelu_backward` of `gm`'s graph whose incoming gradient is a product (seen
    through reshapes) that nothing else reads by `mm_gelu_backward` (the caller recompiles);
    returns how many."""
    return sum(_fuse(gm.graph, n) for n in list(gm.graph.find_nodes(op="call_function",
                                                                      target=aten.gelu_backward.default)))


def _fuse(graph: fx.Graph, node: fx.Node) -> bool:
    grad, h = node.args[:2]
    approximate = node.kwargs.get("approximate", node.args[2] if len(node.args) > 2 else "none")
    val, h_val = node.meta.get("val"), h.meta.get("val")
    if not (isinstance(val, torch.Tensor) and isinstance(h_val, torch.Tensor) and val.dtype == h_val.dtype
            and h_val.is_contiguous() and val.is_contiguous() and val.shape == h_val.shape):
        return False
    reshapes = []
    product = grad
    while product.target in RESHAPES and only_user(product) is not None:
        reshapes.append(product)
        product = product.args[0]
    if product.target is not aten.mm.default or only_user(product) is None:
        return False
    a, b = product.args
    mm_val = product.meta.get("val")
    if not (isinstance(mm_val, torch.Tensor) and mm_val.is_contiguous() and mm_val.dtype == val.dtype
            and mm_val.numel() == val.numel()):
        return False
    with graph.inserting_before(node):
        fused = call(graph, torch.ops.rkgraph.mm_gelu_backward.default, (a, b, h, approximate), {}, node.meta)
    node.replace_all_uses_with(fused)
    erase_unused(graph, [node, *reshapes, product])
    return True
