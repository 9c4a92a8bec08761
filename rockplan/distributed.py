"""Which orders of rockplan and PyTorch's data-parallel engines compose, checked at construction.

A planned step runs in place of the model's forward: one traced graph over all parameters, its
backward inside one autograd Function. That suits an engine wrapped around it: DDP's gradient
hooks sit on the parameters (`DDP(Rockmate(model))`), and FSDP2's `fully_shard(Rockmate(model))`
gathers every parameter before the planned step and reduce-scatters the gradients after its
backward. A model FSDP2 already shard, `fully_shard` on its blocks and then on the model, is
run by `ShardedBlocks`: the planned step runs as the root's forward, inside the root's hooks,
with every block gathered. DDP wrapped inside is refused: its forward arms the reducer that
all-reduces the gradients, and it does not run in a planned step, so the gradients would not be
averaged across ranks; so are blocks sharded under a model that is not (no root's hooks to
gather the blocks' gradients back), each with the order that works.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from rkgraph.build import is_view
from rkgraph.capture import FlatCall, JointGraph, is_tangent

DDP_ORDER = "wrap Rockmate inside DDP: DDP(Rockmate(model, sample, budget))"
FSDP_ORDER = ("fully_shard each block, then the model itself, and plan the model: for block in blocks: "
              "fully_shard(block); fully_shard(model); Rockmate(model, sample, budget); or shard the planned module "
              "as one group: fully_shard(Rockmate(model, sample, budget))")


def check_engine_order(model: nn.Module) -> ShardedBlocks | None:
    """Raise ValueError if `model` is, or contains, a DDP module, FSDP1, FSDP2 modules under a
    root that is not one, or DTensor parameters outside FSDP2: the planned step would skip their
    forward-time communication (module docstring). A model FSDP2 shards from its root gives the
    `ShardedBlocks` that runs it; any other model None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        for path, module in model.named_modules():
            if isinstance(module, DistributedDataParallel):
                raise ValueError(f"{type(model).__name__} (its submodule {path!r}) is wrapped in "
                                 f"DistributedDataParallel inside FSDP2; {DDP_ORDER}, or {FSDP_ORDER}")
        return ShardedBlocks(model)
    for path, module in model.named_modules():
        where = f"{type(model).__name__}" + (f" (its submodule {path!r})" if path else "")
        if isinstance(module, DistributedDataParallel):
            raise ValueError(
                f"{where} is wrapped in DistributedDataParallel: a planned step runs in place of DDP's forward, which "
                f"arms its gradient all-reduce, so gradients would not be averaged across ranks; {DDP_ORDER}")
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            raise ValueError(
                f"{where} is sharded by FSDP, and {type(model).__name__} is not sharded by FSDP2 from its root: its "
                f"parameters are gathered in hooks around its forward, which a planned step does not call (it runs "
                f"one graph over all parameters); {FSDP_ORDER}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has DTensor parameters (tensor parallelism or sharding): a plan is "
                         f"made for plain tensors. For data parallelism, {DDP_ORDER}, or {FSDP_ORDER}")
    return None


class ShardedBlocks:
    """A model FSDP2 shards from its root, `fully_shard` on each block and then on the model
    (as torchtitan and accelerate shard it), run by one plan over all its parameters.

    The planned step runs as the root's forward, inside the root's hooks: FSDP2 gathers the
    root's own parameters there, gathers them again before the backward, and at the backward's
    end its final callback reduce-scatters the gradients of every group (it runs the
    post-backward of groups whose own hooks did not fire: the blocks here) and reshards them.
    The blocks' forwards, and so their hooks, do not run in a planned step; each block is
    gathered instead by the generated code where the plan reads its parameters, and resharded
    after their last read, in the forward and again in the backward (`gather_where_read`): as
    eager FSDP2 holds a block, in the plan's order, recomputations included. The step's inputs
    are the blocks' unsharded parameters as FSDP2 keeps them (their storage freed between
    gathers, refilled in place), so what the plan saves for the backward is gathered again
    before it is read. The gathers are calls between the plan's ops, not nodes of its graph:
    collectives are never recomputed. What FSDP2 holds is outside the budget
    (`fsdp_buffer_bytes`).
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.model = model
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.blocks = [m for m in self.units if m is not model]  # the root gathers itself
        self._unsharded: dict[str, nn.Parameter] = {}  # a block's parameter's name -> FSDP2's unsharded one

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every group's parameters whole, as planning at construction needs them (their
        shapes, and their values for a measured profile); resharded on exit."""
        for unit in self.units:
            unit.unshard()
        try:
            self._unsharded = {name: p for name, p in self.model.named_parameters()
                               if any(p is q for block in self.blocks for q in block.parameters())}
            yield
        finally:
            for unit in self.units:
                unit.reshard()

    @contextlib.contextmanager
    def traced_as_plain(self) -> Iterator[None]:
        """While a step is traced, FSDP2's forward hooks (which would gather and reshard, with
        collectives, on the traced tensors) and the call's own `forward` are set aside, so the
        trace sees the model's forward over its whole parameters; all restored on exit."""
        saved = []
        for unit in self.units:
            state = unit._get_fsdp_state()
            ids = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
            for name in _FORWARD_HOOK_DICTS:
                hooks = getattr(unit, name)
                saved.append((unit, name, hooks))
                object.__setattr__(unit, name, type(hooks)((k, v) for k, v in hooks.items() if k not in ids))
        forward = self.model.__dict__.pop("forward", None)
        try:
            yield
        finally:
            if forward is not None:
                self.model.__dict__["forward"] = forward
            for unit, name, hooks in reversed(saved):
                object.__setattr__(unit, name, hooks)

    def step_tensors(self, flat: FlatCall, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The planned step's inputs: the model's parameters, each block's as FSDP2's unsharded
        parameter (gathered by the step where it is read), then buffers and input tensors."""
        parameters = [self._unsharded.get(name, p) for name, p in self.model.named_parameters()]
        return [*parameters, *self.model.buffers(), *flat.tensors(args, kwargs)]

    def gather_where_read(self, forward: fx.GraphModule, backward: fx.GraphModule,
                          joint: JointGraph) -> tuple[fx.GraphModule, fx.GraphModule]:
        """`forward` and `backward` with each block gathered before the first op that reads
        its parameters and resharded after the last one."""
        primals = [n.name for n in joint.module.graph.find_nodes(op="placeholder") if not is_tangent(n)]
        block_of = {}
        for primal, kind, name in zip(primals, joint.input_kinds, joint.input_names):
            if kind == "param" and name in self._unsharded:
                block_of[primal] = next(i for i, b in enumerate(self.blocks)
                                        if any(self._unsharded[name] is q for q in b.parameters()))
        for module in (forward, backward):
            _insert_gathers(module, block_of, self.blocks)
        return forward, backward

    def __call__(self, planned_step: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        """`planned_step(args, kwargs)` run as the root's forward, inside its FSDP2 hooks."""
        self.model.__dict__["forward"] = lambda *args, **kwargs: planned_step(args, kwargs)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.__dict__.pop("forward", None)


def _insert_gathers(module: fx.GraphModule, block_of: dict[str, int], blocks: list[nn.Module]) -> None:
    """Insert `blocks[i].unshard()` before the first node of `module` that reads (or views)
    block i's parameter placeholders (named in `block_of`), and `blocks[i].reshard()` after the
    last one; the output (a parameter handed to the backward) is no read."""
    reads: dict[int, list[fx.Node]] = {}
    aliases: dict[fx.Node, int] = {n: block_of[n.name] for n in module.graph.find_nodes(op="placeholder")
                                   if n.name in block_of}
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        touched = {aliases[a] for a in node.all_input_nodes if a in aliases}
        for block in touched:
            reads.setdefault(block, []).append(node)
        if touched and is_view(node):
            aliases[node] = next(iter(touched))
    for block, nodes in reads.items():
        with module.graph.inserting_before(nodes[0]):
            module.graph.call_function(_Gather(blocks[block], "unshard"))
        with module.graph.inserting_after(nodes[-1]):
            module.graph.call_function(_Gather(blocks[block], "reshard"))
    module.recompile()


class _Gather:
    """A call in generated code gathering (`unshard`) or resharding a block: FSDP2's public
    methods, which collect and free the block's parameters in place."""

    def __init__(self, block: nn.Module, action: str) -> None:
        self.block, self.action = block, action
        self.__name__ = f"fsdp_{action}"

    def __call__(self) -> None:
        getattr(self.block, self.action)()


def fsdp_buffer_bytes(model: nn.Module, world_size: int) -> int:
    """The most bytes FSDP2 adds to a planned step of `model` (sharded from its root, run by
    `ShardedBlocks`) beyond its budget: every group's parameters gathered whole, held from the
    forward to the end of the backward, and, while a group's gradients are reduce-scattered
    (they are in the plan), a copy of them and their shard: the parameters' bytes plus
    (1 + 1/world_size) times the largest group's. Computed from the parameters' whole shapes."""
    from torch.distributed.fsdp import FSDPModule

    def whole_bytes(p: nn.Parameter) -> int:
        return p.numel() * p.element_size()  # a DTensor's numel is the whole tensor's

    def own(unit: nn.Module) -> list[nn.Parameter]:  # a group: its module's parameters, less nested groups'
        nested = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}
        return [p for p in unit.parameters() if id(p) not in nested]

    groups = [sum(map(whole_bytes, own(m))) for m in model.modules() if isinstance(m, FSDPModule)]
    largest = max(groups, default=0)
    return sum(whole_bytes(p) for p in model.parameters()) + largest + largest // world_size


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
