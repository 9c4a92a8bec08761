"""Fuse cross-entropy's backward so it holds one gradient of the logits' size, not two.

`F.cross_entropy` traces to `_log_softmax` and `nll_loss_forward`; its backward to
`nll_loss_backward` (a gradient as large as the logits, zero but at each row's target) and
`_log_softmax_backward_data` (the logits' gradient, another such tensor), with the log-softmax
alive beside both: three logits-sized tensors at once, at the moment a language model's
training step peaks (with a large vocabulary, most of a tight budget).
`log_softmax_nll_backward` computes the same gradient, `grad_out - exp(log_probs) * rowsum(grad_out)`
where `grad_out` has one nonzero per row, writing `exp(log_probs)` once and scaling it in place:
two logits-sized tensors at that moment. Values equal the unfused ops' up to rounding (the
fused kernel may round the target entry's difference once, ATen's kernel twice or once).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # torch.nn._reduction's enum: 0 none, 1 mean, 2 sum


@torch.library.custom_op("rkgraph::log_softmax_nll_backward", mutates_args=())
def log_softmax_nll_backward(
    grad: torch.Tensor, log_probs: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """The gradient of `nll_loss(log_probs, target, reduction=..., ignore_index=...)` with respect
    to the logits `log_probs` was the log-softmax of (over dim 1), for 2-D `log_probs`."""
    valid = target != ignore_index
    # Minus what nll_loss_backward writes at each row's target: grad (per row for "none"),
    # divided by the total weight for "mean"; zero on ignored rows (whatever the division
    # gives: `where`, not a product, which would turn an infinity into NaN).
    scale = grad / total_weight if reduction == _MEAN else grad
    scale = torch.where(valid, scale.to(log_probs.dtype), 0).unsqueeze(1)
    result = torch.exp(log_probs)
    result.mul_(scale)
    result.scatter_add_(1, (target * valid).unsqueeze(1), scale.neg())  # an ignored row adds 0 at class 0
    return result


@log_softmax_nll_backward.register_fake
def _(grad: torch.Tensor, log_probs: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int,
      total_weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(log_probs)


def _base(node: fx.Node) -> fx.Node:
    while node.target in (aten.detach.default, aten.alias.default):
        node = node.args[0]
    return node


def fuse_cross_entropy_backward(gm: fx.GraphModule) -> int:
    """Replace each `_log_softmax_backward_data(nll_loss_backward(...))` pair of `gm`'s graph
    over 2-D log-probabilities, without class weights, by `log_softmax_nll_backward` (the
    caller recompiles); returns how many."""
    count = 0
    for nll in list(gm.graph.find_nodes(op="call_function", target=aten.nll_loss_backward.default)):
        grad, log_probs, target, weight, reduction, ignore_index, total_weight = nll.args
        users = list(nll.users)
        if weight is not None or reduction not in (0, _MEAN, _SUM) or len(users) != 1:
            continue
        (backward,) = users
        if (
            backward.target is not aten._log_softmax_backward_data.default
            or backward.args[2] != 1
            or _base(backward.args[1]) is not _base(log_probs)
            or _base(log_probs).target is not aten._log_softmax.default
            or log_probs.meta["val"].dim() != 2
            or backward.args[3] != log_probs.meta["val"].dtype
        ):
            continue
        with gm.graph.inserting_before(backward):
            fused = gm.graph.call_function(
                torch.ops.rkgraph.log_softmax_nll_backward.default,
                (grad, log_probs, target, reduction, ignore_index, total_weight),
            )
            fused.meta = dict(backward.meta)
        backward.replace_all_uses_with(fused)
        gm.graph.erase_node(backward)
        gm.graph.erase_node(nll)
        count += 1
    return count
