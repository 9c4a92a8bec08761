"""Attention's probabilities made and used a few heads at a time, in the forward and the backward.

With dropout, `scaled_dot_product_attention` on CPU takes PyTorch's math path: the scores,
their softmax and its dropout are [B, H, T, S] tensors, and its backward makes three more (the
gradients of the dropped probabilities, of the probabilities and of the scores). Each is S/D
times the size of q, k or v (S keys, D features a head), and a plan that keeps the softmax for
the backward, or recomputes it there, holds one to three of them per layer on their account.

`attention(q, kt, v, bias, mask, ...)` computes `bmm(dropout(softmax(bmm(q, kt) + bias)), v)`
over a few heads at a time; `attention_backward` recomputes each chunk's probabilities and
makes the three gradients from them. That is flash attention's trade (recompute the scores
in the backward, never hold them whole) done with ATen's own kernels on slices of the
batch-of-heads dimension: each head's products, softmax and mask application are the ops the
math path runs on it, so the values are the same bits (tested against the unfused graph).

The trade costs a product and a softmax per layer in the backward, which the unfused graph
pays only when memory is short; so the rewrite is a variant of the graph (`fuse_attention`
on a copy), planned beside the unfused one when the budget forces recomputation, and the
faster plan runs. CUDA's own kernels (flash, memory-efficient) already hold no scores, and
on CPU the math path computes in float32 or float64 (it upcasts reduced precision, and so
the fused op sees float32 too).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.utils.flop_counter import register_flop_formula

from rkgraph.rewrites.dropout import apply_dropout_mask_into
from rkgraph.rewrites.fx_helpers import RESHAPES, call, detach_chains, erase_unused, only_user, positions

aten = torch.ops.aten

# Bytes of one [heads, T, S] slice: each op of a chunk makes one, a few live at once.
CHUNK_BYTES = 1 << 20


def _heads_per_chunk(q: torch.Tensor, kt: torch.Tensor, heads: int) -> tuple[int, int]:
    """How many heads a slice holds, and one head's [T, S] bytes."""
    per_head = q.shape[1] * kt.shape[2] * q.element_size()
    return max(1, min(heads, CHUNK_BYTES // max(per_head, 1))), per_head


def _chunks(q: torch.Tensor, kt: torch.Tensor, heads: int):
    """(batch index, first head, last head + 1) of slices of about CHUNK_BYTES, within one batch index
    so that a bias broadcast over the batch or the heads is a view of each slice."""
    step, _ = _heads_per_chunk(q, kt, heads)
    for b in range(q.shape[0] // heads):
        for h in range(0, heads, step):
            yield b, h, min(h + step, heads)


def _probabilities(q, kt, bias4, mask4, scale, safe, b, h0, h1, heads, keep_probs=True):
    """The chunk's softmax and its dropped copy (the same tensor without dropout, or with
    `keep_probs` false: the softmax is dropped in place and not returned)."""
    rows = slice(b * heads + h0, b * heads + h1)
    scores = torch.bmm(q[rows], kt[rows])
    if bias4 is not None:
        scores.add_(bias4[b, h0:h1])
    probs = aten._safe_softmax(scores, -1) if safe else aten._softmax(scores, -1, False)
    del scores
    if mask4 is None:
        return rows, probs, probs
    dropped = apply_dropout_mask_into(probs, mask4[b, h0:h1], scale, torch.empty_like(probs) if keep_probs else probs)
    return rows, (probs if keep_probs else None), dropped


def _bias4(q: torch.Tensor, kt: torch.Tensor, bias: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """`bias` broadcast to [B, H, T, S] (a view), or None."""
    return None if bias is None else bias.expand(q.shape[0] // heads, heads, q.shape[1], kt.shape[2])


@torch.library.custom_op("rkgraph::attention", mutates_args=())
def attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              mask: torch.Tensor | None, scale: float, heads: int, safe: bool) -> torch.Tensor:
    """`bmm(apply_dropout_mask(softmax(bmm(q, kt).view(B, H, T, S) + bias), mask, scale).view(BH, T, S), v)`
    for q [BH, T, D], kt [BH, D, S], v [BH, S, Dv], `bias` broadcastable to [B, H, T, S] (or
    None), `mask` [B, H, T, S] (None: no dropout); `safe`: `_safe_softmax`, else `_softmax`."""
    bias4 = _bias4(q, kt, bias, heads)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for b, h0, h1 in _chunks(q, kt, heads):
        rows, _, dropped = _probabilities(q, kt, bias4, mask, scale, safe, b, h0, h1, heads, keep_probs=False)
        torch.bmm(dropped, v[rows], out=out[rows])
    return out


@attention.register_fake
def _(q, kt, v, bias, mask, scale, heads, safe):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("rkgraph::attention_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None, mask: torch.Tensor | None, scale: float, heads: int,
                       safe: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `attention`'s q, kt and v for its output's gradient `grad`, each
    chunk's probabilities made again."""
    bias4 = _bias4(q, kt, bias, heads)
    grad_q, grad_kt, grad_v = _products_like(q, kt, v)
    for b, h0, h1 in _chunks(q, kt, heads):
        rows, probs, dropped = _probabilities(q, kt, bias4, mask, scale, safe, b, h0, h1, heads)
        torch.bmm(dropped.transpose(1, 2), grad[rows], out=grad_v[rows])
        del dropped
        grad_probs = torch.bmm(grad[rows], v[rows].transpose(1, 2))
        if mask is not None:
            apply_dropout_mask_into(grad_probs, mask[b, h0:h1], scale, grad_probs)
        grad_scores = aten._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        del grad_probs, probs
        torch.bmm(grad_scores, kt[rows].transpose(1, 2), out=grad_q[rows])
        torch.bmm(q[rows].transpose(1, 2), grad_scores, out=grad_kt[rows])
    return grad_q, grad_kt, grad_v


@attention_backward.register_fake
def _(grad, q, kt, v, bias, mask, scale, heads, safe):
    return _products_like(q, kt, v)


def _products_like(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A contiguous tensor of each one's shape, dtype and device: the layout of the batched
    products whose results the op's gradients replace (`bmm` makes contiguous outputs), which
    the graph's later views of them were traced on. `empty_like` would keep an input's strides:
    the gradient of a transposed `kt` came out transposed, and a view of it failed (T5)."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)


@register_flop_formula(torch.ops.rkgraph.attention)
def _flops(q_shape, kt_shape, v_shape, *_args, **_kwargs) -> int:
    return 2 * q_shape[0] * q_shape[1] * kt_shape[2] * (q_shape[2] + v_shape[2])


@register_flop_formula(torch.ops.rkgraph.attention_backward)
def _backward_flops(grad_shape, q_shape, kt_shape, v_shape, *_args, **_kwargs) -> int:
    # The scores again, then the four products of the math path's backward.
    return 2 * q_shape[0] * q_shape[1] * kt_shape[2] * (3 * q_shape[2] + 2 * v_shape[2])


def scratch_bytes(node: fx.Node) -> int:
    """What an attention node allocates and frees inside, for profiles that do not measure it:
    [heads, T, S] slices, three in the forward and four in the backward, a bound on what the
    allocator sees (the scores and their softmax, `_safe_softmax`'s test of fully masked rows,
    the dropout's slice of mask; in the backward also the gradients of the probabilities and
    the scores)."""
    backward = node.target is torch.ops.rkgraph.attention_backward.default
    q, kt = (node.args[1:3] if backward else node.args[:2])
    step, per_head = _heads_per_chunk(q.meta["val"], kt.meta["val"], node.args[7 if backward else 6])
    return (4 if backward else 3) * step * per_head


# --- the rewrite ---------------------------------------------------------------------------

_RESHAPES = (*RESHAPES, aten.expand.default)
_SOFTMAXES = (aten._safe_softmax.default, aten._softmax.default)


def _through_reshapes(node: fx.Node, shape: tuple) -> fx.Node | None:
    """Follow single-user reshapes from `node` to the one whose value has `shape`."""
    while tuple(node.meta["val"].shape) != shape:
        node = only_user(node)
        if node is None or node.target not in _RESHAPES:
            return None
    return node


def _transposed(node: fx.Node) -> fx.Node | None:
    """`x` when `node` is `transpose(x, 1, 2)` of a 3-D `x`."""
    if node.target is aten.transpose.int and tuple(node.args[1:]) in ((1, 2), (-2, -1), (1, -1), (-2, 2)):
        return node.args[0]
    return None


def fuse_attention(gm: fx.GraphModule) -> int:
    """Replace every attention of `gm`'s joint graph that the math path made (see the module
    docstring) by `attention` and `attention_backward`; the caller recompiles. Returns how many."""
    return sum(_fuse(gm.graph, sm) for sm in list(gm.graph.nodes) if sm.target in _SOFTMAXES)


def _fuse(graph: fx.Graph, sm: fx.Node) -> bool:
    val = sm.meta["val"]
    if (
        # The math path computes reduced precision in float32 on CPU: `val` is float32 then.
        val.dim() != 4 or val.device.type != "cpu" or val.dtype not in (torch.float32, torch.float64)
        or sm.args[1] not in (-1, 3) or (sm.target is aten._softmax.default and sm.args[2])
        or not val.is_contiguous()
    ):
        return False
    batch, heads, t, s = val.shape
    shape3 = (batch * heads, t, s)
    # The forward: scores = view(bmm(q, kt)) (+ bias); softmax; (dropout); view; bmm with v.
    def is_scores(node: object) -> bool:
        return (
            isinstance(node, fx.Node) and node.target in _RESHAPES and len(node.users) == 1
            and node.args[0].target is aten.bmm.default and len(node.args[0].users) == 1
            and tuple(node.args[0].meta["val"].shape) == shape3 and node.args[0].meta["val"].dtype == val.dtype
        )

    scores, bias = sm.args[0], None
    if scores.target is aten.add.Tensor and not scores.kwargs and len(scores.users) == 1:
        pair = next(((a, b) for a, b in (scores.args, scores.args[::-1]) if is_scores(a) and isinstance(b, fx.Node)),
                    None)
        if pair is None or pair[1].meta["val"].dtype != val.dtype:
            return False
        scores, bias = pair
    if not is_scores(scores):
        return False
    product = scores.args[0]
    q, kt = product.args
    saved = detach_chains(sm)
    forward_users = [u for u in sm.users if u not in saved]
    if len(forward_users) != 1:
        return False
    after, dropped, mask, scale = forward_users[0], sm, None, 1.0
    if after.target is torch.ops.rkgraph.apply_dropout_mask.default:
        dropped, (_, mask, scale) = after, after.args
        after = only_user(dropped)
    probs3 = _through_reshapes(after, shape3) if after is not None and after.target in _RESHAPES else None
    if probs3 is None or len(probs3.users) != 2:
        return False
    out = next((u for u in probs3.users if u.target is aten.bmm.default and u.args[0] is probs3), None)
    t_probs = next((u for u in probs3.users if _transposed(u) is probs3), None)
    if out is None or t_probs is None or len(t_probs.users) != 1:
        return False
    v = out.args[1]
    # The backward: grad_v = bmm(t(probs3), g); grad_probs = bmm(g, t(v)), (dropout), softmax's
    # backward against the saved softmax, reshaped, then bmm(., t(kt)) and bmm(t(q), .).
    grad_v = only_user(t_probs)
    if grad_v is None or grad_v.target is not aten.bmm.default or grad_v.args[0] is not t_probs:
        return False
    grad = grad_v.args[1]
    softmax_backward = [u for n in saved for u in n.users if u.target is aten._softmax_backward_data.default]
    if len(softmax_backward) != 1 or any(u.target is not aten.detach.default for n in saved for u in n.users
                                         if u not in softmax_backward):
        return False
    (softmax_backward,) = softmax_backward
    grad_probs = softmax_backward.args[0]
    if mask is not None:
        applied = grad_probs.target is torch.ops.rkgraph.apply_dropout_mask.default
        if not applied or grad_probs.args[1:] != (mask, scale) or len(grad_probs.users) != 1:
            return False
        grad_probs = grad_probs.args[0]
    while grad_probs.target in _RESHAPES and len(grad_probs.users) == 1:
        grad_probs = grad_probs.args[0]
    if (
        grad_probs.target is not aten.bmm.default or len(grad_probs.users) != 1 or grad_probs.args[0] is not grad
        or _transposed(grad_probs.args[1]) is not v or len(grad_probs.args[1].users) != 1
    ):
        return False
    grad_scores = _through_reshapes(only_user(softmax_backward) or softmax_backward, shape3)
    if grad_scores is None or len(grad_scores.users) != 2:
        return False
    grad_q = next((u for u in grad_scores.users if u.target is aten.bmm.default and u.args[0] is grad_scores
                   and _transposed(u.args[1]) is kt), None)
    grad_kt = next((u for u in grad_scores.users if u.target is aten.bmm.default and u.args[1] is grad_scores
                    and _transposed(u.args[0]) is q), None)
    if grad_q is None or grad_kt is None:
        return False
    op_args = (q, kt, v, bias, mask, scale, heads, sm.target is aten._safe_softmax.default)
    with graph.inserting_before(out):
        fused = call(graph, torch.ops.rkgraph.attention.default, op_args, {}, out.meta)
    out.replace_all_uses_with(fused)
    order = positions(graph)
    first = min((grad_probs, grad_v, t_probs), key=order.__getitem__)
    with graph.inserting_before(first):
        backward = call(graph, torch.ops.rkgraph.attention_backward.default, (grad, *op_args), {}, grad_v.meta)
        items = [call(graph, operator.getitem, (backward, i), {}, old.meta)
                 for i, old in enumerate((grad_q, grad_kt, grad_v))]
    for old, new in zip((grad_q, grad_kt, grad_v), items):
        old.replace_all_uses_with(new)
    dead = [grad_q, grad_kt, *grad_q.args, *grad_kt.args, grad_scores, softmax_backward, grad_v, t_probs,
            out, probs3, dropped, sm, *saved, scores, product]
    node = grad_scores
    while node is not softmax_backward:  # the reshapes between them
        node = node.args[0]
        dead.append(node)
    node = softmax_backward.args[0]
    while node is not grad:  # the dropout's application, reshapes and the product
        dead.append(node)
        dead.extend(a for a in node.args if isinstance(a, fx.Node) and a is not grad and a is not mask)
        node = node.args[0]
    node = probs3
    while node is not dropped:
        node = node.args[0]
        dead.append(node)
    dead += [a for a in sm.args if isinstance(a, fx.Node)]
    erase_unused(graph, dead)
    return True
