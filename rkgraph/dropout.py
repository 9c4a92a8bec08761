"""Split dropout into its random mask and the mask's cheap application.

`native_dropout(x, p)` returns its output and the bool mask the backward reads. Recomputing
the output means drawing the mask again (replaying the RNG state): on CPU that draw is about
90% of the op's time. Split into `mask = dropout_mask(shape, stride, p)` and
`out = native_dropout_backward(x, mask, 1 / (1 - p))` (which is exactly "apply the mask"),
the output can be dropped and remade from `x` and the mask, which the backward keeps anyway
(softmax's backward keeps `x` in attention), for a pointwise multiply. The mask is a quarter
of the output's bytes (bool against float32).

The split must draw what eager draws. On CPU, `native_dropout` fills a contiguous bool
tensor with `bernoulli_(1 - p)` from the default generator, and so does `dropout_mask`:
the same mask, the generator left in the same state (tested against eager, bit for bit).
CUDA's fused dropout kernel draws its mask in a pattern no separate op reproduces, so CUDA
graphs are left as they are, and so are float16 and bfloat16 ones (see `_splittable`).
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


def _splittable(node: fx.Node) -> bool:
    """Whether a `native_dropout` node can be split drawing and computing exactly what it does."""
    _, p, train = (*node.args, *([None] * 3))[:3]
    train = node.kwargs.get("train", train)
    val = node.meta.get("val")
    # Reduced precision rounds `x * mask * scale` twice in `native_dropout`, once in the
    # one-op application: equal bits for float32 and float64 only.
    return (
        train is not False and isinstance(p, float) and 0.0 < p < 1.0
        and isinstance(val, (tuple, list)) and val[0].device.type == "cpu"
        and val[0].dtype in (torch.float32, torch.float64)
        and all(u.target is operator.getitem for u in node.users)
    )


def split_dropout(gm: fx.GraphModule) -> int:
    """Rewrite every CPU `native_dropout` of `gm`'s graph (see the module docstring; the caller
    recompiles); returns how many. The new nodes take the replaced node's metadata (forward or
    backward, module)."""
    count = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        if not _splittable(node):
            continue
        x, p = node.args[0], node.args[1]
        out_val, mask_val = node.meta["val"]
        with gm.graph.inserting_before(node):
            shape = (list(mask_val.shape), list(mask_val.stride()))
            mask = gm.graph.call_function(torch.ops.rkgraph.dropout_mask.default, (*shape, p, mask_val.device))
            mask.meta = {**node.meta, "val": mask_val}
            out = gm.graph.call_function(aten.native_dropout_backward.default, (x, mask, 1.0 / (1.0 - p)))
            out.meta = {**node.meta, "val": out_val}
        for item in list(node.users):
            item.replace_all_uses_with(out if item.args[1] == 0 else mask)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        count += 1
    return count
