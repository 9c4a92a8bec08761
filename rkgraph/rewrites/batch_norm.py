"""BatchNorm in training mode, as the captured graph should run it.

Two rewrites of the captured graph, both free:

- `eager_kernels`: AOTAutograd decomposes BatchNorm into ATen's own kernels
  (`_native_batch_norm_legit_functional`, `native_batch_norm_backward`), while eager PyTorch on
  a GPU runs cuDNN's (`cudnn_batch_norm` and its backward), which are faster: on a convolutional
  network the difference was the whole of a plan's gap to eager where it recomputed nothing
  (the figures are in git's history). `_batch_norm_with_update_functional` and
  `batch_norm_backward` are the ATen ops eager's newer path calls: on CUDA they choose cuDNN
  exactly as eager does (`_select_batch_norm_backend`), and hand its reserve space from the
  forward to the backward. The graph is rewritten to them only where that choice is not
  ATen's own kernel: elsewhere (every CPU) the graph stays as traced.
- `drop_unread_running_stats`: the joint graph passes BatchNorm's backward the running mean and
  variance the forward updated, which in training mode it never reads (it normalises with the
  batch's statistics, `save_mean` and `save_invstd`). Read there, the updated statistics are
  values the backward needs: the forward keeps them for it, and the forward cannot write them
  into the buffers in place, as eager does (`rockplan.codegen.in_place_updates`), since
  AOTAutograd's copy into the buffer would then change a tensor saved for the backward. The
  arguments are optional: given None, the op computes the same values (the same kernels on the
  same inputs, cuDNN's included), and the updates are read by the step's outputs alone.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten

# Training-mode BatchNorm backwards: (grad_out, input, weight, running_mean, running_var,
# save_mean, save_invstd, train, eps, output_mask[, reserve]).
_BACKWARDS = (aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)
_RUNNING_STATS = (3, 4)  # the backwards' running_mean and running_var


def drop_unread_running_stats(gm: fx.GraphModule) -> int:
    """Give every training-mode BatchNorm backward of `gm`'s graph None for the running
    statistics it does not read (the caller recompiles); returns how many nodes changed."""
    count = 0
    for target in _BACKWARDS:
        for node in gm.graph.find_nodes(op="call_function", target=target):
            if node.args[7] is True and not node.kwargs and any(node.args[i] is not None for i in _RUNNING_STATS):
                for i in _RUNNING_STATS:
                    node.update_arg(i, None)
                count += 1
    return count


def eager_reserve_bytes(node: fx.Node) -> int | None:
    """The bytes of reserve space eager's BatchNorm kernel keeps for the backward, where eager
    runs another kernel than ATen's own for the training-mode BatchNorm `node`
    (`_native_batch_norm_legit_functional`): cuDNN's, on CUDA. None where eager runs ATen's,
    or where the node is not as eager would call such a kernel (an input not contiguous in its
    own memory format, no weight or bias)."""
    x, weight, bias, mean, var, training, _momentum, eps = node.args
    values = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, weight, bias, mean, var)]
    if training is not True or node.kwargs or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    x_val = values[0]
    if not x_val.is_contiguous(memory_format=torch._prims_common.suggest_memory_format(x_val)):
        return None
    backend = torch._C._select_batch_norm_backend(*values, True, eps)
    if backend == torch._C._BatchNormBackend.Cudnn:
        return torch._C._get_cudnn_batch_norm_reserve_space_size(x_val, True)
    if backend == torch._C._BatchNormBackend.Miopen:
        return 0  # MIOpen keeps no reserve (`_batch_norm_with_update_cuda`)
    return None


def eager_kernels(gm: fx.GraphModule) -> int:
    """Rewrite each training-mode `_native_batch_norm_legit_functional` of `gm`'s graph for
    which eager runs another kernel (`eager_reserve_bytes` gives a size), and the backwards
    reading its statistics, to `_batch_norm_with_update_functional` and `batch_norm_backward`,
    which hand the forward's reserve space (that many bytes) to the backward. The caller
    recompiles; returns how many BatchNorms changed."""
    graph = gm.graph
    count = 0
    for old in list(graph.find_nodes(op="call_function", target=aten._native_batch_norm_legit_functional.default)):
        if not all(user.target is operator.getitem for user in old.users):
            continue
        size = eager_reserve_bytes(old)
        if size is None:
            continue
        out, save_mean, save_invstd, new_mean, new_var = old.meta["val"]
        reserve = out.new_empty((size,), dtype=torch.uint8)
        x, weight, bias, mean, var, _training, momentum, eps = old.args
        with graph.inserting_after(old):
            new = graph.call_function(aten._batch_norm_with_update_functional.default,
                                      (x, weight, bias, mean, var, momentum, eps))
        new.meta = {**old.meta, "val": (out, save_mean, save_invstd, reserve, new_mean, new_var)}
        with graph.inserting_after(new):
            reserve_node = graph.call_function(operator.getitem, (new, 3))
        reserve_node.meta = {**old.meta, "val": reserve}
        stats = {}
        for item in list(old.users):
            index = item.args[1]
            item.update_arg(0, new)
            if index >= 3:  # the running statistics come after the reserve
                item.update_arg(1, index + 1)
            stats[index] = item
        for backward in [u for i in (1, 2) if i in stats for u in stats[i].users]:
            if (backward.target is aten.native_batch_norm_backward.default and not backward.kwargs
                    and backward.args[5] is stats.get(1) and backward.args[6] is stats.get(2)):
                with graph.inserting_before(backward):
                    replacement = graph.call_function(aten.batch_norm_backward.default,
                                                      (*backward.args, reserve_node))
                replacement.meta = dict(backward.meta)
                backward.replace_all_uses_with(replacement)
                graph.erase_node(backward)
        graph.erase_node(old)
        count += 1
    return count
