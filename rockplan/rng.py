"""Replaying random ops: a recomputed dropout must draw the same mask as the first run.

The forward records the generator state right before each random op; a recomputation sets
that state, runs the op and puts the current state back, so the user's random stream ends
the step exactly where eager PyTorch leaves it. These functions are called from generated fx
code (plain Python calls, so the eager backend runs them; Inductor gets no replay).
"""

from __future__ import annotations

from typing import Any

import torch


def rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def replay(state: torch.Tensor, device: torch.device, op: torch._ops.OpOverload, /, *args: Any,
           **kwargs: Any) -> Any:
    """Run the random op `op` (`torch.ops.rkgraph.dropout_mask.default`) as it ran when `state`
    was recorded. fx prints an op argument as its qualified name, so the generated code stays
    source; the op is called through its C++ entry point, as `codegen.bound_op` calls the others.
    Its own parameters are positional only: the op's keywords (`aten.rand`'s `device`, as a
    drop path draws it) are the op's."""
    current = rng_state(device)
    _set_rng_state(device, state)
    try:
        return op._op(*args, **kwargs)
    finally:
        _set_rng_state(device, current)
