"""Which orders of rockplan and PyTorch's data-parallel engines compose, checked at construction.

A planned step runs in place of the model's forward: one traced graph over all parameters, its
backward inside one autograd Function. That suits an engine wrapped around it: DDP's gradient
hooks sit on the parameters (`DDP(Rockmate(model))`), and FSDP2's `fully_shard(Rockmate(model))`
gathers every parameter before the planned step and reduce-scatters the gradients after its
backward. A model FSDP2 already shards, `fully_shard` on its blocks and then on the model, is
run by `ShardedBlocks`: the planned step runs as the root's forward, inside the root's hooks,
and the generated code gathers each block where the plan reads it. DDP wrapped inside is
refused: its forward arms the reducer that all-reduces the gradients, and it does not run in a
planned step, so the gradients would not be averaged across ranks; so are blocks sharded under
a model that is not (no root's hooks to reduce-scatter the blocks' gradients), each with the
order that works.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from rkgraph.build import is_view
from rkgraph.capture import FlatCall, JointGraph, is_tangent
from rkgraph.graph import RematGraph
from rockplan.planner import Plan, PlanOptions, reuse
from solvers.schedule import Schedule

DDP_ORDER = "wrap Rockmate inside DDP: DDP(Rockmate(model, sample, budget))"
FSDP_ORDER = ("fully_shard each block, then the model itself, and plan the model: for block in blocks: "
              "fully_shard(block); fully_shard(model); Rockmate(model, sample, budget); or shard the planned module "
              "as one group: fully_shard(Rockmate(model, sample, budget))")


def check_engine_order(model: nn.Module, backend: str = "eager") -> ShardedBlocks | None:
    """Raise ValueError if `model` is, or contains, a DDP module, FSDP1, FSDP2 modules under a
    root that is not one, or DTensor parameters outside FSDP2: the planned step would skip their
    forward-time communication (module docstring). A model FSDP2 shards from its root gives the
    `ShardedBlocks` that runs it (with `backend` "eager": Inductor would compile the gathers
    inserted between the plan's ops with them); any other model None."""
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
        if backend != "eager":
            raise ValueError(f"{type(model).__name__} is sharded by FSDP2, whose gathers run between the planned "
                             "ops: plan it with backend='eager', or build fully_shard(Rockmate(model, sample, budget, "
                             "backend='inductor')) from the unsharded model")
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
        self.most_gathered = 0  # bytes of blocks the generated code holds gathered at once, over its plans
        # The parameters as the model declares them (sharded, in their own dtype), for the plan
        # key: FSDP2 swaps them for gathered ones, in a policy's `param_dtype`, in each step.
        self.declared = tuple((p.dtype, p.device, p.requires_grad) for p in model.parameters())
        # The ranks sharing the model: those that must run one plan (`agree`).
        self.mesh = next(p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh"))

    @contextlib.contextmanager
    def planning(self, values: bool) -> Iterator[None]:
        """What tracing and planning a step needs: the parameters whole, and FSDP2's forward
        hooks (which would gather and reshard, with collectives, on the traced tensors) and the
        call's own `forward` set aside, so the trace sees the model's forward over its whole
        parameters. The trace runs on fake tensors, which need only shapes: each sharded group is
        gathered in turn, for FSDP2 to make its unsharded parameters, and resharded at once, and
        those (their storage freed) stand in the modules for the sharded ones while planning;
        so planning holds at most one group gathered. With `values` (a measured profile runs the
        graph on real tensors), every sharded group is gathered instead. All restored on exit:
        planning inside a step (a new input) leaves the root gathered, as its hooks left it."""
        from torch.distributed.tensor import DTensor

        sharded = [unit for unit in self.units if any(isinstance(p, DTensor) for p in _group(unit))]
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []  # (module, name, the unsharded parameter)
        for unit in sharded:
            unit.unshard()
            if not values:
                swapped += [(m, name, p) for m in unit.modules() for name, p in m._parameters.items()
                            if p is not None and not isinstance(p, DTensor)]
                unit.reshard()
        restore = [(m, name, m._parameters[name]) for m, name, _ in swapped]
        for m, name, p in swapped:
            m._parameters[name] = p
        self._unsharded = {name: p for name, p in self.model.named_parameters()
                           if any(p is q for block in self.blocks for q in _group(block))}
        hooks_saved = []
        for unit in self.units:
            state = unit._get_fsdp_state()
            ids = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
            for name in _FORWARD_HOOK_DICTS:
                hooks = getattr(unit, name)
                hooks_saved.append((unit, name, hooks))
                object.__setattr__(unit, name, type(hooks)((k, v) for k, v in hooks.items() if k not in ids))
        forward = self.model.__dict__.pop("forward", None)
        try:
            yield
        finally:
            if forward is not None:
                self.model.__dict__["forward"] = forward
            for unit, name, hooks in reversed(hooks_saved):
                object.__setattr__(unit, name, hooks)
            for m, name, p in restore:
                m._parameters[name] = p
            if values:
                for unit in sharded:
                    unit.reshard()

    def agree(self, mine: Plan, joint: JointGraph, budget: int | float | str, options: PlanOptions,
              real: list[torch.Tensor] | None) -> Plan:
        """Rank 0's plan, on every rank of the model's device mesh. The generated code gathers
        a block where the plan first reads it, so the order of the ranks' all-gathers is their
        plans' order and must be one: two ranks may plan differently even on estimated times,
        as the solvers stop at wall-clock limits. Every rank plans (each needs its own graph and
        generated code), which makes planning collective, as FSDP2's gathers already make it;
        rank 0's schedule is then checked on this rank's graph by the simulator (`reuse`)."""
        import torch.distributed as dist

        mesh = self.mesh
        # Along each dimension from its first coordinate: every rank ends with the plan of the
        # mesh's rank at coordinates (0, ..., 0).
        chosen = _SentPlan(mine.graph, mine.times, mine.schedule)
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if dist.get_world_size(group) > 1:
                sent = [chosen]
                with unset_fake_temporarily():  # planning runs inside AOTAutograd's fake mode
                    dist.broadcast_object_list(sent, group=group, group_src=0)
                chosen = sent[0]
        if chosen.schedule.ops == mine.schedule.ops:
            return mine
        adopted = reuse(joint, budget, options, chosen, real)  # type: ignore[arg-type]  # what reuse reads
        if adopted is None:
            raise RuntimeError(
                f"rank {dist.get_rank()} cannot run the plan rank 0 made for the same step within the budget "
                f"(their graphs differ, or this rank's measured kernel scratch is larger): plan with "
                f"profile='estimate' and the same sample on every rank")
        return adopted

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
                                        if any(self._unsharded[name] is q for q in _group(b)))
        sizes = [sum(map(_whole_bytes, _group(block))) for block in self.blocks]
        for module in (forward, backward):
            self.most_gathered = max(self.most_gathered, _insert_gathers(module, block_of, self.blocks, sizes))
        return forward, backward

    def __call__(self, planned_step: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        """`planned_step(args, kwargs)` run as the root's forward, inside its FSDP2 hooks."""
        self.model.__dict__["forward"] = lambda *args, **kwargs: planned_step(args, kwargs)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.__dict__.pop("forward", None)


def _insert_gathers(module: fx.GraphModule, block_of: dict[str, int], blocks: list[nn.Module],
                    sizes: list[int]) -> int:
    """Insert `blocks[i].unshard()` before the first node of `module` that reads (or views)
    block i's parameter placeholders (named in `block_of`), and `blocks[i].reshard()` after the
    last one; the output (a parameter handed to the backward) is no read. Returns the most
    bytes of blocks gathered at once (`sizes[i]`: block i's)."""
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
    order = {node: i for i, node in enumerate(module.graph.nodes)}
    changes = sorted([(order[nodes[0]], sizes[block]) for block, nodes in reads.items()]
                     + [(order[nodes[-1]] + 0.5, -sizes[block]) for block, nodes in reads.items()])
    gathered = most = 0
    for _, change in changes:
        gathered += change
        most = max(most, gathered)
    for block, nodes in reads.items():
        with module.graph.inserting_before(nodes[0]):
            module.graph.call_function(_Gather(blocks[block], "unshard"))
        with module.graph.inserting_after(nodes[-1]):
            module.graph.call_function(_Gather(blocks[block], "reshard"))
    module.recompile()
    return most


class _Gather:
    """A call in generated code gathering (`unshard`) or resharding a block: FSDP2's public
    methods, which collect and free the block's parameters in place."""

    def __init__(self, block: nn.Module, action: str) -> None:
        self.block, self.action = block, action
        self.__name__ = f"fsdp_{action}"

    def __call__(self) -> None:
        getattr(self.block, self.action)()


def fsdp_buffer_bytes(rk: nn.Module) -> int:
    """The most bytes FSDP2 adds beyond the budget to the planned steps of `rk` (a Rockmate of
    a model FSDP2 shards from its root, after its first plan): the root's group gathered
    through the step (its hooks), the blocks its plans hold gathered at once
    (`ShardedBlocks.most_gathered`), and the flat buffers of a group's all-gather (while it is
    copied out) or reduce-scatter (a copy of its gradients, and their shard), (1 + 1/world
    size) times the largest group's bytes. The gradients of the whole parameters are in the
    plan, so in the budget."""
    import torch.distributed as dist

    sharded: ShardedBlocks | None = getattr(rk, "_sharded", None)
    if sharded is None:
        raise ValueError(f"{type(rk).__name__} is not a Rockmate of a model sharded by FSDP2 from its root")
    groups = [sum(map(_whole_bytes, _group(unit))) for unit in sharded.units]
    root = sum(map(_whole_bytes, _group(sharded.model))) if sharded.model in sharded.units else 0
    largest = max(groups, default=0)
    return root + sharded.most_gathered + largest + largest // dist.get_world_size()


@dataclasses.dataclass(frozen=True)
class _SentPlan:
    """What `planner.reuse` reads of a plan, sent from rank 0 to the others."""

    graph: RematGraph
    times: dict[str, float]
    schedule: Schedule


def _whole_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()  # a DTensor's numel is the whole tensor's


def _group(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters of FSDP2's group of `unit`: its module's, less those of groups nested in it."""
    from torch.distributed.fsdp import FSDPModule

    nested = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
              for p in sub.parameters()}
    return [p for p in unit.parameters() if id(p) not in nested]


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
