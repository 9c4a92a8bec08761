"""Counting the ATen ops a training step dispatches: a CPU-measurable proxy for a GPU step's kernels.

On a GPU a small model's step is bound by the host issuing kernels: each launch costs a few
microseconds whatever its size, so a planned step that runs more ops than eager is slower by
their count even where it recomputes nothing. Counting is deterministic and needs no GPU:
`count_step` runs one step under `OpCounter` and returns how often each op was dispatched, and
`kernel_ops` keeps those that launch a kernel (not views, metadata ops or bare allocations).
Our rewrites' custom ops are counted as the ATen ops their Python definitions run (what a
device executes), each also listed under its own name so a step's ops can be traced to them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that only describe or allocate memory (no kernel runs on a device): aliases of their input,
# and allocations whose contents are left undefined.
_NO_KERNEL = {
    aten.detach.default, aten.alias.default, aten._unsafe_view.default, aten.lift_fresh.default,
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default,
    aten.new_empty_strided.default,
}


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active, by its name (`aten.mm.default`). A custom op
    of a rewrite that reaches the dispatcher is counted under its name and its Python
    definition run under the counter, so the ATen ops inside it count too."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple[type, ...], args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        definition = OPDEFS.get(func._name)
        if definition is not None:
            self.ops[str(func)] += 1
            with self:
                return definition._init_fn(*args, **kwargs)
        # Inside a custom op's definition, ops that the dispatcher would decompose above this
        # mode (`matmul`) arrive whole: counted as what they decompose into, as outside one.
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:
                return func.decompose(*args, **kwargs)
        if not (func is aten.copy_.default and _same_data(args[0], args[1])):
            self.ops[str(func)] += 1
        return func(*args, **kwargs)


def _same_data(a: object, b: object) -> bool:
    """Whether tensors `a` and `b` are the same elements of the same memory: ATen's copy of one
    onto the other returns at once (AOTAutograd's copy of a buffer updated in place into itself)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype))


def launches_kernel(name: str) -> bool:
    """Whether the op named `name` (as `OpCounter` counts it) runs a kernel on a device: not a
    view, a metadata op, a bare allocation, or one of our custom ops (counted by their ATen ops)."""
    namespace, _, rest = name.partition(".")
    if namespace != "aten":
        return False
    packet, _, overload = rest.partition(".")
    op = getattr(getattr(aten, packet), overload or "default")
    return not (op.is_view or op in _NO_KERNEL)


def kernel_ops(ops: Counter[str]) -> Counter[str]:
    """The ops of `ops` that launch kernels (`launches_kernel`)."""
    return Counter({name: n for name, n in ops.items() if launches_kernel(name)})


def count_step(step: Callable[[], Any], counter: OpCounter | None = None) -> Counter[str]:
    """The ops one call of `step` (a training step: forward and backward) dispatches, counted
    (by `counter`, a fresh `OpCounter` by default) after a first call that is not: planning,
    lazy initialisation and allocator warm-up are not the step's ops."""
    step()
    counter = OpCounter() if counter is None else counter
    with counter:
        step()
    return counter.ops
