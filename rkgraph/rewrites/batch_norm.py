"""BatchNorm's backward in training mode reads no running statistics: it is given none.

AOTAutograd's joint graph passes `native_batch_norm_backward` the running mean and variance
the forward updated, which in training mode it never reads (it normalises with the batch's
statistics, `save_mean` and `save_invstd`). Read there, the updated statistics are values the
backward needs: the forward keeps them for it, and the forward cannot write them into the
buffers in place, as eager does (`rockplan.codegen.in_place_updates`), since AOTAutograd's
copy into the buffer would then change a tensor saved for the backward. The arguments are
optional: given None, the op computes the same values (the same kernels on the same inputs),
and the updates are read by the step's outputs alone. It costs nothing, so it is a rewrite of
the captured graph.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

_RUNNING_STATS = (3, 4)  # native_batch_norm_backward's running_mean and running_var


def drop_unread_running_stats(gm: fx.GraphModule) -> int:
    """Give every training-mode `native_batch_norm_backward` of `gm`'s graph None for the running
    statistics it does not read (the caller recompiles); returns how many nodes changed."""
    count = 0
    for node in gm.graph.find_nodes(op="call_function", target=aten.native_batch_norm_backward.default):
        if node.args[7] is True and not node.kwargs and any(node.args[i] is not None for i in _RUNNING_STATS):
            for i in _RUNNING_STATS:
                node.update_arg(i, None)
            count += 1
    return count
