"""Add up a tensor's gradients holding less: reduce each term before adding them (`sum(a + b)`
becomes `sum(a) + sum(b)` over the same dimensions), and stack the gradients of a tensor's
slices instead of adding zero-filled copies of them.

Autograd adds up the gradients of a tensor that several ops read, and where that tensor was
broadcast (an `expand`), reduces the total over the broadcast dimensions. A tensor made once,
expanded over the batch and read by every layer (MPNet's relative position bias) thus has its
gradient accumulated at full size from the last layer's backward to the first's: a tensor of
the size of an attention's scores, held through the whole backward, where tight budgets peak.
Reduced as each term is made, only the reduced sum is held. The work is about the same (a
reduction of each term instead of an add of each term); the summation order differs, so values
equal the unrewritten graph's up to rounding.

A tensor read as its slices along one dimension (`nn.MultiheadAttention` projects queries, keys
and values as one tensor and selects each) gets the gradient of each slice as a zero-filled
tensor of the whole's size (`select_backward`), and the adds of those: three whole-sized tensors
at once where one is enough. A `stack` of the slices' gradients is the same values (adding zeros
is exact) and one tensor.
"""

from __future__ import annotations

import torch
from torch import fx

from rkgraph.build import is_backward
from rkgraph.rewrites.fx_helpers import call, erase_unused

aten = torch.ops.aten


def _is_accumulation(node: fx.Node) -> bool:
    """An add of two tensors of one shape and dtype (no broadcast, no scaling)."""
    return (node.op == "call_function" and node.target is aten.add.Tensor and not node.kwargs
            and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args)
            and all(a.meta["val"].shape == node.meta["val"].shape
                    and a.meta["val"].dtype == node.meta["val"].dtype for a in node.args))


def _terms(total: fx.Node, adds: list[fx.Node]) -> list[fx.Node]:
    """The addends of the chain of adds that makes `total`, each add of the backward and read by
    the next alone; [total] when it is no such add. The chain's adds are appended to `adds`."""
    if not _is_accumulation(total):
        return [total]
    adds.append(total)
    return [term for a in total.args
            for term in (_terms(a, adds) if len(a.users) == 1 and is_backward(a) else [a])]


def reduce_before_accumulating(gm: fx.GraphModule) -> int:
    """Rewrite each `sum.dim_IntList` of `gm`'s backward over a chain of adds read by nothing
    else, where the sum is smaller than what it reduces, into a sum of each addend made right
    after it and the adds of those sums (the caller recompiles); returns how many."""
    graph = gm.graph
    count = 0
    for reduction in list(graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)):
        total = reduction.args[0]
        if (not isinstance(total, fx.Node) or not is_backward(reduction) or not is_backward(total)
                or len(total.users) != 1
                or reduction.meta["val"].numel() >= total.meta["val"].numel()):
            continue
        adds: list[fx.Node] = []
        terms = _terms(total, adds)
        # Each addend's sum goes right after the addend is made, so a gradient (a backward node's
        # value) is reduced before the backward goes on; a tangent or a forward value is not.
        if len(terms) < 2 or not all(t.op == "call_function" and is_backward(t) for t in terms):
            continue
        sums = []
        for term in terms:  # told as the term's (its layer's, in explanations), not the bias's
            with graph.inserting_after(term):
                sums.append(call(graph, aten.sum.dim_IntList, (term, *reduction.args[1:]), reduction.kwargs,
                                 term.meta))
        with graph.inserting_before(reduction):
            accumulated = sums[0]
            for partial in sums[1:]:
                accumulated = call(graph, aten.add.Tensor, (accumulated, partial), {}, reduction.meta)
        reduction.replace_all_uses_with(accumulated)
        graph.erase_node(reduction)
        erase_unused(graph, adds)
        count += 1
    return count


def stack_selected_gradients(gm: fx.GraphModule) -> int:
    """Rewrite each chain of adds of `gm`'s backward whose terms are `select_backward`s of one
    shape and dimension, one for each index of that dimension and read by the chain alone, into
    a `stack` of the selected gradients (the caller recompiles); returns how many."""
    graph = gm.graph
    count = 0
    erased: set[fx.Node] = set()  # adds of chains rewritten before, still in the list below
    for total in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        if total in erased or not is_backward(total):
            continue
        users = list(total.users)
        if len(users) == 1 and _is_accumulation(users[0]) and is_backward(users[0]):
            continue  # not the chain's last add: its last one takes the whole chain
        adds: list[fx.Node] = []
        terms = _terms(total, adds)
        if len(terms) < 2 or not all(t.target is aten.select_backward.default and len(t.users) == 1 for t in terms):
            continue
        sizes, dim = terms[0].args[1], terms[0].args[2]
        extent = sizes[dim]
        at = {t.args[3] % extent: t.args[0] for t in terms if list(t.args[1]) == list(sizes) and t.args[2] == dim}
        if len(terms) != extent or sorted(at) != list(range(extent)):
            continue
        with graph.inserting_before(total):
            stacked = call(graph, aten.stack.default, ([at[i] for i in range(extent)], dim), {}, total.meta)
        total.replace_all_uses_with(stacked)
        erase_unused(graph, [*adds, *terms])
        erased.update(adds)
        count += 1
    return count
