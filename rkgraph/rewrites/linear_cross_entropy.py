"""Fuse a language model's head and its cross-entropy so the logits never exist whole.

A head `logits = x @ wt` (`x` [M, E], `wt` [E, V]) followed by the cross-entropy of some of
its rows (a next-token loss drops each sequence's last position: a slice and a copy) holds
two logits-sized tensors in the forward (the logits and their log-softmax, or the slice's
copy) and two in the backward (the log-softmax and the logits' gradient): with a large
vocabulary, much of a tight budget, whatever is recomputed. `linear_cross_entropy`
computes, a chunk of rows at a time (CHUNK_ROWS, or larger where the budget leaves room:
`fewest_chunks`), the logits, the rows' loss and the gradients of `x` and `wt` (for a loss
gradient of one), in the forward; the backward scales the two by the loss's actual gradient.
That is Liger-Kernel's fused linear cross-entropy: the same products as the unfused head's
forward and backward, one chunk of logits alive at a time, and no logits saved
for the backward.

Only scalar losses (mean or sum), no class weights, float32/float64 logits: the backward's
scaling needs one number, and reduced precision would round the chunks' log-softmax otherwise
than eager. Only heads no wider than the rows the loss reads (E <= rows): the unit gradient of
the head's weight and its scaled copy, two [V, E] tensors, must not outweigh two logits.
Values equal the unfused ops' up to rounding (the gradient of `wt` is summed by chunks).

Each chunk is a dozen kernels (its products, and the softmax's ops on its logits; per-row terms
are written into buffers and the loss summed once), and a GPU step bound by the host's op
calls pays for each launch: a loss reading all but a few rows of the head (a next-token loss)
has all rows computed, so that a chunk is a slice of `x` and of its gradient, not rows copied
in and their gradients summed back.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.flop_counter import register_flop_formula

from rkgraph.build import is_view
from rkgraph.graph import RematGraph
from rkgraph.rewrites.cross_entropy import _MEAN, _SUM
from rkgraph.rewrites.fx_helpers import RESHAPES, call, detach_chains, erase_unused, only_user, positions

aten = torch.ops.aten

# Rows per chunk as the rewrite writes the op. On CPU the gradient of `wt` accumulates one
# product per chunk, and with fewer rows its reduction dimension gets short and the op slower
# than the unfused ones; more rows hold more logits at once. Where the budget leaves room,
# `fewest_chunks` gives the op larger chunks.
CHUNK_ROWS = 256


@torch.library.custom_op("rkgraph::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    x: torch.Tensor, wt: torch.Tensor, rows: torch.Tensor | None, target: torch.Tensor, reduction: int,
    ignore_index: int, chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`nll_loss(log_softmax(logits[rows]), target, reduction, ignore_index)` for
    `logits = x @ wt` (`rows`: the rows of `logits` the loss reads, in order; None: all),
    with the loss's total weight, the gradient of `x` and the transposed gradient of `wt`
    (the graph's `mm(t(grad_logits), x)`, [V, E]), both for a loss gradient of one."""
    if rows is not None and _all_rows_cheaper(rows.numel(), x.shape[0]):
        # Every row, those the loss does not read given no target: each chunk is then a slice
        # of `x` and of its gradient, with no copy of its rows in nor sum of their gradient out.
        target = torch.full((x.shape[0],), ignore_index, dtype=target.dtype, device=target.device).index_copy_(
            0, rows, target)
        rows = None
    valid = target != ignore_index
    weight = valid.to(x.dtype)
    total_weight = weight.sum()  # a count of ones: exact in any float dtype up to 2**24 rows
    if reduction == _MEAN:
        weight = weight / total_weight
    weight = weight.unsqueeze(1)
    negative_weight = -weight
    safe_target = (target * valid).unsqueeze(1)  # an ignored row gathers class 0, weighted 0
    count = target.numel()
    # Each chunk's per-row terms are written into these, and the loss summed once after the
    # loop: a chunk costs its products and the ops on its logits, no ops on scalars.
    picked, row_max, row_sum = (x.new_empty(count, 1) for _ in range(3))
    grad_x = torch.zeros_like(x) if rows is not None else torch.empty_like(x)
    grad_wt_t = torch.zeros(wt.shape[1], wt.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, count, chunk_rows):
        stop = min(start + chunk_rows, count)
        x_rows = x[start:stop] if rows is None else x.index_select(0, rows[start:stop])
        t = safe_target[start:stop]
        chunk = x_rows @ wt  # the logits of these rows; reused in place for their gradient
        torch.gather(chunk, 1, t, out=picked[start:stop])
        torch.amax(chunk, 1, keepdim=True, out=row_max[start:stop])
        chunk.sub_(row_max[start:stop]).exp_()
        torch.sum(chunk, 1, keepdim=True, out=row_sum[start:stop])
        chunk.mul_(weight[start:stop] / row_sum[start:stop]).scatter_add_(1, t, negative_weight[start:stop])
        if rows is None:  # softmax - one-hot, weighted, times the head
            torch.mm(chunk, wt.t(), out=grad_x[start:stop])
        else:
            grad_x.index_add_(0, rows[start:stop], chunk @ wt.t())
        grad_wt_t.addmm_(chunk.t(), x_rows)
        del chunk  # else the next chunk is made while this one is still alive: two at once
    # Each row's loss, max + log(sum(exp(logits - max))) - picked, weighted, summed.
    loss = row_sum.log_().add_(row_max).sub_(picked).mul_(weight).sum()
    return loss, total_weight, grad_x, grad_wt_t


@linear_cross_entropy.register_fake
def _(x: torch.Tensor, wt: torch.Tensor, rows: torch.Tensor | None, target: torch.Tensor, reduction: int,
      ignore_index: int, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scalar = x.new_empty(())
    return scalar, scalar.clone(), torch.empty_like(x), x.new_empty(wt.shape[1], wt.shape[0])


@register_flop_formula(torch.ops.rkgraph.linear_cross_entropy)
def _flops(x_shape, wt_shape, rows_shape, target_shape, *_args, **_kwargs) -> int:
    """The unfused head's three products (logits, the gradients of `x` and `wt`) over the
    rows the loss reads: the roofline prices the op as the ops it replaces."""
    return 3 * 2 * math.prod(target_shape) * wt_shape[0] * wt_shape[1]


def _all_rows_cheaper(read: int, rows: int) -> bool:
    """Whether the op computes the logits of all `rows` rows of `x` when the loss reads `read`
    of them: where those it does not read are few (a next-token loss leaves out one position
    a sequence), their products cost less than a chunk's two ops to gather and scatter rows."""
    return 16 * (rows - read) <= read


def _computed_rows(node: fx.Node) -> int:
    """How many rows of logits a `linear_cross_entropy` fx node computes."""
    x, rows, target = (node.args[i].meta["val"] if isinstance(node.args[i], fx.Node) else None for i in (0, 2, 3))
    if rows is not None and _all_rows_cheaper(target.numel(), x.shape[0]):
        return x.shape[0]
    return target.numel()


def scratch_bytes(node: fx.Node) -> int:
    """What a `linear_cross_entropy` node allocates and frees inside (a chunk of logits, its rows
    of `x` and their product with `wt`, per-row vectors): its scratch, known from the shapes,
    for profiles that do not measure it; a bound on what the allocator sees."""
    x, wt, rows, target = (a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args[:4])
    size, (width, classes) = x.element_size(), wt.shape
    count = _computed_rows(node)
    chunk = min(node.args[6], count)
    copied_rows = 0
    if rows is not None and count == x.shape[0]:
        copied_rows = count * target.element_size()  # the targets of every row
    elif rows is not None:
        copied_rows = chunk * width * size  # index_select copies a chunk's rows
    # valid mask, weights and their negatives, targets made safe to gather, three per-row terms
    per_row = count * (1 + 5 * size + 8)
    return chunk * (classes + width) * size + copied_rows + per_row + 16 * chunk * size


# Ops that move or copy whole rows of the logits, keeping their last (class) dimension.
_ROW_OPS = (*RESHAPES, aten.slice.Tensor, aten.clone.default)
_GRAD_ROW_OPS = (*RESHAPES, aten.slice_backward.default)


def _row_args(node: fx.Node) -> tuple | None:
    """`node`'s arguments for the same op over a class dimension of one (a row index per row),
    or None when it does not only move whole rows."""
    val = node.meta["val"]
    classes, last = val.shape[-1], val.dim() - 1
    args = list(node.args)
    if node.target in RESHAPES or node.target is aten.slice_backward.default:
        if node.args[0].meta["val"].shape[-1] != classes:
            return None
        # The output's shape, not the argument's: a view's may hold a -1.
        args[1] = [*val.shape[:-1], 1]
        if node.target is aten.slice_backward.default and args[2] % val.dim() == last:
            return None
    elif node.target is aten.slice.Tensor:
        if (args[1] if len(args) > 1 else 0) % val.dim() == last:
            return None
    elif node.target is not aten.clone.default:
        return None
    return tuple(args)


def _chain(start: fx.Node, stop: fx.Node, ops: tuple) -> list[fx.Node] | None:
    """The single-user nodes of `ops` leading from `start` to `stop` (both left out), or None."""
    chain, node = [], only_user(start)
    while node is not None and node is not stop:
        if node.target not in ops or _row_args(node) is None:
            return None
        chain.append(node)
        node = only_user(node)
    return chain if node is stop else None


def _replay(chain: list[fx.Node], value: torch.Tensor) -> torch.Tensor:
    for node in chain:
        value = node.target(value, *_row_args(node)[1:], **node.kwargs)
    return value


def _row_selection(head: fx.Node, rows_chain: list[fx.Node], grad_chain: list[fx.Node]) -> bool | None:
    """Whether the forward chain picks every row of `head` (the logits) in order (True) or
    some (False), checked on real row numbers: the backward chain must put each picked row's
    gradient back at its row, zeros elsewhere. None when they do not."""
    count = head.meta["val"].shape[0]
    with unset_fake_temporarily():
        try:
            rows = _replay(rows_chain, torch.arange(count).view(count, 1)).reshape(-1)
            picked = torch.arange(1, rows.numel() + 1, dtype=torch.float64).view(-1, 1)
            placed = _replay(grad_chain, picked)
        except RuntimeError:  # a view the row numbers' layout does not allow
            return None
        expected = torch.zeros(count, dtype=torch.float64).index_put_((rows,), picked.view(-1))
        if placed.shape != (count, 1) or not torch.equal(placed.view(-1), expected):
            return None
        return torch.equal(rows, torch.arange(count))


def fuse_linear_cross_entropy(gm: fx.GraphModule) -> int:
    """Replace each head matmul and cross-entropy of `gm`'s joint graph, with its backward
    (`rkgraph.log_softmax_nll_backward`, so run `fuse_cross_entropy_backward` first), by
    `linear_cross_entropy` and two scalings in the backward (the caller recompiles); returns
    how many."""
    nlls = list(gm.graph.find_nodes(op="call_function", target=aten.nll_loss_forward.default))
    return sum(_fuse(gm.graph, nll) for nll in nlls)


def _fuse(graph: fx.Graph, nll: fx.Node) -> bool:
    log_probs, target, weight, reduction, ignore_index = nll.args
    if (
        weight is not None or reduction not in (_MEAN, _SUM) or log_probs.target is not aten._log_softmax.default
        or log_probs.args[1:] != (1, False) or log_probs.meta["val"].dtype not in (torch.float32, torch.float64)
    ):
        return False
    detached = detach_chains(log_probs)
    fused = [u for u in log_probs.users if u is not nll and u not in detached]
    if len(fused) != 1 or fused[0].target is not torch.ops.rkgraph.log_softmax_nll_backward.default:
        return False
    (fused,) = fused
    if fused.args[1:5] != (log_probs, target, reduction, ignore_index):
        return False
    # The forward: the head's product, then ops moving whole rows of it.
    head = log_probs.args[0]
    while head.op == "call_function" and head.target in _ROW_OPS:
        head = head.args[0]
    if head.target is not aten.mm.default or len(head.users) != 1:
        return False
    x, wt = head.args
    # The unit gradient of `wt` lives from the head to its scaling, where its scaled copy joins
    # it: two [V, E] tensors where the unfused ops hold two logits-sized ones at their worst
    # ([rows, V] each). A wide head over few rows (GPT-2 small on one sequence of 512: E 768,
    # 511 rows) would peak higher fused.
    if wt.meta["val"].shape[0] > target.meta["val"].numel():
        return False
    rows_chain = _chain(head, log_probs, _ROW_OPS)
    # The backward: the fused gradient, moved back to the head's rows, then the two products.
    grad_logits, grad_chain = fused, []
    while (user := only_user(grad_logits)) is not None and user.target in _GRAD_ROW_OPS:
        if _row_args(user) is None:
            return False
        grad_logits = user
        grad_chain.append(user)
    grad_x_mm, grad_wt_mm = _head_backward(grad_logits, x, wt)
    if rows_chain is None or grad_x_mm is None or grad_logits.meta["val"].shape != head.meta["val"].shape:
        return False
    all_rows = _row_selection(head, rows_chain, grad_chain)
    if all_rows is None:
        return False

    with graph.inserting_before(nll):
        rows_node = None
        if not all_rows:
            count = head.meta["val"].shape[0]
            device = x.meta["val"].device
            rows_node = call(graph, aten.arange.default, (count,), {"dtype": torch.int64, "device": device}, nll.meta)
            rows_node = call(graph, aten.view.default, (rows_node, [count, 1]), {}, nll.meta)
            for node in rows_chain:
                rows_node = call(graph, node.target, (rows_node, *_row_args(node)[1:]), dict(node.kwargs), nll.meta)
            rows_node = call(graph, aten.view.default, (rows_node, [-1]), {}, nll.meta)
        op_args = (x, wt, rows_node, target, reduction, ignore_index, CHUNK_ROWS)
        op = call(graph, torch.ops.rkgraph.linear_cross_entropy.default, op_args, {}, nll.meta)
        items = [call(graph, operator.getitem, (op, i), {}, nll.meta) for i in range(4)]
    loss_grad = fused.args[0]
    for old, unit in ((grad_x_mm, items[2]), (grad_wt_mm, items[3])):
        with graph.inserting_before(old):
            scaled = call(graph, aten.mul.Tensor, (unit, loss_grad), {}, old.meta)
        old.replace_all_uses_with(scaled)
    _sink(scaled)
    for item in list(nll.users):
        item.replace_all_uses_with(items[item.args[1]])
    dead = [*items, *nll.users, nll, *detached, log_probs, *rows_chain, head, fused, *grad_chain,
            grad_x_mm, grad_wt_mm, *grad_wt_mm.args, *grad_x_mm.args]
    erase_unused(graph, dead)
    return True


def _sink(scaled: fx.Node) -> None:
    """Move the scaling of `wt`'s gradient, with the views of it that follow, to just before
    their first other user (the tied embedding's gradient sum, or the output). The unit
    gradient is held until then instead of the scaled one, the same bytes; but the moment
    both exist moves from the backward's start, where every saved activation is alive
    (in a language model, the step's peak), to its end, where few are."""
    moved = [scaled]
    while (view := only_user(moved[-1])) is not None and is_view(view):
        moved.append(view)
    first = min((u for n in moved for u in n.users if u not in moved), key=positions(scaled.graph).__getitem__)
    for node in moved:
        first.prepend(node)


def _head_backward(grad_logits: fx.Node, x: fx.Node, wt: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """The head's two backward products from `grad_logits`: `mm(grad_logits, t(wt))` (the
    gradient of `x`) and `mm(t(grad_logits), x)` (the transposed gradient of `wt`)."""
    grad_x = grad_wt = None
    for user in grad_logits.users:
        if user.target is aten.mm.default and user.args[0] is grad_logits:
            other = user.args[1]
            if other.target is aten.t.default and other.args[0] is wt:
                grad_x = user
        elif user.target is aten.t.default and (mm := only_user(user)) is not None:
            if mm.target is aten.mm.default and mm.args == (user, x):
                grad_wt = mm
    if len(grad_logits.users) != 2 or grad_x is None or grad_wt is None:
        return None, None
    return grad_x, grad_wt


def _chunk_rows_choices(node: fx.Node) -> list[int]:
    """Rows per chunk `node` may run with, largest first: all its rows in one chunk, then
    powers of two times CHUNK_ROWS down to its current rows."""
    count, current = _computed_rows(node), node.args[6]
    choices = [count] if count > current else []
    rows = CHUNK_ROWS
    while rows * 2 < count:
        rows *= 2
    while rows > current:
        choices.append(rows)
        rows //= 2
    return choices


def fewest_chunks(module: fx.GraphModule, graph: RematGraph, fits: Callable[[], bool]) -> int:
    """Give each `linear_cross_entropy` of `module` (the joint graph `graph` was built from)
    the largest chunks with which `fits()` still holds, `graph`'s workspaces updated to match
    (the caller recompiles `module` when any changed); returns how many changed.

    Each chunk is a dozen kernels, and a GPU step bound by the host's op calls pays for each:
    a head over thousands of rows runs hundreds of them. Small chunks are what the rewrite
    holds less memory for; where the budget does not need that saving (`fits`, the caller's
    check of the step against its budget, reading the workspaces), they only cost launches.
    Larger chunks compute the same values, up to rounding as any chunks do (the gradient of
    `wt` is summed over other groups of rows, and a product's kernel may depend on its rows)."""
    nodes = {name: node for node in graph.nodes for name in node.fx_nodes}
    changed = 0
    for fx_node in module.graph.find_nodes(op="call_function", target=torch.ops.rkgraph.linear_cross_entropy.default):
        compute = nodes[fx_node.name]
        current = scratch_bytes(fx_node)
        for rows in _chunk_rows_choices(fx_node):
            old_rows = fx_node.args[6]
            fx_node.update_arg(6, rows)
            grown = scratch_bytes(fx_node) - current
            compute.workspace += grown
            if fits():
                changed += 1
                break
            compute.workspace -= grown
            fx_node.update_arg(6, old_rows)
    return changed
