"""Split dropout into its random mask and the mask's cheap application.

`native_dropout(x, p)` returns its output and the bool mask the backward reads. Recomputing
the output means drawing the mask again (replaying the RNG state): on CPU that draw is most
of the op's time. Split into `mask = dropout_mask(shape, stride, p)` and
`out = apply_dropout_mask(x, mask, 1 / (1 - p))`, the output can be dropped and remade from
`x` and the mask, which the backward keeps anyway (softmax's backward keeps `x` in
attention), for a pointwise multiply. The mask is a quarter of the output's bytes (bool
against float32).

The split must draw what eager draws. On CPU, `native_dropout` fills a contiguous bool
tensor with `bernoulli_(1 - p)` from the default generator, and so does `dropout_mask`:
the same mask, the generator left in the same state (tested against eager, bit for bit).
CUDA's fused dropout kernel draws its mask in a pattern no separate op reproduces, so CUDA
graphs are left as they are, and so are float16 and bfloat16 ones (see `_splittable`).

The application is also the backward's op (`native_dropout_backward(grad, mask, scale)`, the
same product), and on CPU ATen's kernel makes it as `grad * (mask * scale)`: a float copy of
the mask as large as its output, alive beside it; after attention's dropout that is a copy
as large as the probabilities, at the moments a tight plan peaks. `apply_dropout_mask`
multiplies a slice at a time into the output and scales it in place: the same bits (the
mask's product is exact, the scaling rounds once either way), one slice of scratch, and on
CPU a little faster than ATen's kernel. Every CPU float32/float64 `native_dropout_backward`
of the graph is replaced by it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten


@torch.library.custom_op("rkgraph::dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_mask(size: list[int], stride: list[int], p: float, device: torch.device) -> torch.Tensor:
    """The mask (True: kept) `native_dropout(x, p)` draws on CPU, for an `x` whose mask has
    this size and stride (it keeps `x`'s layout, and the draws fill memory in order)."""
    return torch.empty_strided(size, stride, dtype=torch.bool, device=device).bernoulli_(1.0 - p)


@dropout_mask.register_fake
def _(size: list[int], stride: list[int], p: float, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=torch.bool, device=device)


# Elements multiplied at a time: the float copy of the mask ATen makes for a mixed-dtype
# product is this slice's, not the whole tensor's (256 KiB of float32).
SLICE_ELEMENTS = 1 << 16


def _multiply_by_slices(x: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
    if x.numel() <= SLICE_ELEMENTS or x.dim() == 0:
        torch.mul(x, mask, out=out)
        return
    per_row = x.numel() // x.shape[0]
    if per_row > SLICE_ELEMENTS:  # one index of the first dimension is still too large
        for i in range(x.shape[0]):
            _multiply_by_slices(x[i], mask[i], out[i])
        return
    rows = SLICE_ELEMENTS // per_row
    for i in range(0, x.shape[0], rows):
        torch.mul(x[i:i + rows], mask[i:i + rows], out=out[i:i + rows])


@torch.library.custom_op("rkgraph::apply_dropout_mask", mutates_args=(), tags=(torch.Tag.pointwise,))
def apply_dropout_mask(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`native_dropout_backward(x, mask, scale)`, bit for bit, without its mask-sized scratch."""
    return apply_dropout_mask_into(x, mask, scale, torch.empty_like(x))


def apply_dropout_mask_into(x: torch.Tensor, mask: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """`apply_dropout_mask` written into `out` (`x` itself or a tensor laid out as `x`)."""
    if x.numel():
        _multiply_by_slices(x, mask, out)
    return out.mul_(scale)


@apply_dropout_mask.register_fake
def _(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def scratch_bytes(node: fx.Node) -> int:
    """What an `apply_dropout_mask` node allocates and frees inside: one slice of the mask as
    floats, for profiles that do not measure it."""
    x = node.args[0].meta["val"]
    return min(x.numel(), SLICE_ELEMENTS) * x.element_size()


def _applicable(x: object, val: object) -> bool:
    """Whether `apply_dropout_mask(x, ...)` makes what ATen's application makes, `val`: the same
    bits on CPU in float32 and float64, and the same strides (its output is laid out as `x`)."""
    return (
        isinstance(val, torch.Tensor) and isinstance(x, torch.Tensor)
        and val.device.type == "cpu" and val.dtype in (torch.float32, torch.float64)
        and torch.empty_like(x).stride() == val.stride()
    )


def _val(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _splittable(node: fx.Node) -> bool:
    """Whether a `native_dropout` node can be split drawing and computing exactly what it does."""
    _, p, train = (*node.args, *([None] * 3))[:3]
    train = node.kwargs.get("train", train)
    val = node.meta.get("val")
    # Reduced precision rounds `x * mask * scale` twice in `native_dropout`, once in the
    # one-op application: equal bits for float32 and float64 only.
    return (
        train is not False and isinstance(p, float) and 0.0 < p < 1.0
        and isinstance(val, (tuple, list)) and _applicable(_val(node.args[0]), val[0])
        and all(u.target is operator.getitem for u in node.users)
    )


def split_dropout(gm: fx.GraphModule) -> int:
    """Rewrite every CPU `native_dropout` of `gm`'s graph, and every application of a mask
    (see the module docstring; the caller recompiles); returns how many nodes were replaced.
    The new nodes take the replaced node's metadata (forward or backward, module)."""
    count = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.native_dropout_backward.default)):
        if _applicable(_val(node.args[0]), node.meta.get("val")) and not node.kwargs:
            with gm.graph.inserting_before(node):
                applied = gm.graph.call_function(torch.ops.rkgraph.apply_dropout_mask.default, node.args)
            applied.meta = dict(node.meta)
            node.replace_all_uses_with(applied)
            gm.graph.erase_node(node)
            count += 1
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        if not _splittable(node):
            continue
        x, p = node.args[0], node.args[1]
        out_val, mask_val = node.meta["val"]
        with gm.graph.inserting_before(node):
            shape = (list(mask_val.shape), list(mask_val.stride()))
            mask = gm.graph.call_function(torch.ops.rkgraph.dropout_mask.default, (*shape, p, mask_val.device))
            mask.meta = {**node.meta, "val": mask_val}
            out = gm.graph.call_function(torch.ops.rkgraph.apply_dropout_mask.default, (x, mask, 1.0 / (1.0 - p)))
            out.meta = {**node.meta, "val": out_val}
        for item in list(node.users):
            item.replace_all_uses_with(out if item.args[1] == 0 else mask)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        count += 1
    return count

