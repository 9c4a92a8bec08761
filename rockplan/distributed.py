"""Which orders of rockplan and PyTorch's data-parallel engines compose, checked at construction.

A planned step runs in place of the model's forward: one traced graph over all parameters, its
backward inside one autograd Function. That suits an engine wrapped around it: DDP's gradient
hooks sit on the parameters (`DDP(Rockmate(model))`), and FSDP2's `fully_shard(Rockmate(model))`
gathers every parameter before the planned step and reduce-scatters the gradients after its
backward. It does not suit an engine wrapped inside it: DDP's forward arms the reducer that
all-reduces the gradients, and FSDP2 gathers a block's shards in hooks around the block's
forward; neither forward runs in a planned step, so the gradients would not be averaged across
ranks, or the parameters would stay shards. Those orders are refused with the order that works.
"""

from __future__ import annotations

from torch import nn

DDP_ORDER = "wrap Rockmate inside DDP: DDP(Rockmate(model, sample, budget))"
FSDP_ORDER = ("shard the planned module as one group: fully_shard(Rockmate(model, sample, budget)), "
              "with no fully_shard on the model or its blocks")


def check_engine_order(model: nn.Module) -> None:
    """Raise ValueError if `model` is, or contains, a DDP or FSDP module, or holds DTensor
    parameters: the planned step would skip their forward-time communication (module docstring)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    for path, module in model.named_modules():
        where = f"{type(model).__name__}" + (f" (its submodule {path!r})" if path else "")
        if isinstance(module, DistributedDataParallel):
            raise ValueError(
                f"{where} is wrapped in DistributedDataParallel: a planned step runs in place of DDP's forward, which "
                f"arms its gradient all-reduce, so gradients would not be averaged across ranks; {DDP_ORDER}")
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            raise ValueError(
                f"{where} is sharded by FSDP: its parameters are gathered in hooks around its forward, which a "
                f"planned step does not call (it runs one graph over all parameters); build the unsharded model "
                f"and {FSDP_ORDER}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has DTensor parameters (tensor parallelism or sharding): a plan is "
                         f"made for plain tensors. For data parallelism, {DDP_ORDER}, or {FSDP_ORDER}")
