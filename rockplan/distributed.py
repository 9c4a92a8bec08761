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
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from rkgraph.build import is_view
from rkgraph.capture import CaptureError, FlatCall, JointGraph, is_tangent
from rkgraph.graph import RematGraph
from rkgraph.profile import RescaledTimes
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
    eager FSDP2 holds a block, in the plan's order, recomputations included; a block FSDP2 keeps
    gathered after its forward (`reshard_after_forward=False`) is resharded in the backward only.
    A block is one FSDP2 group: the modules of one `fully_shard` call. The step's inputs
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
        check_fsdp_internals(self.units)
        # FSDP2's groups, each the modules one `fully_shard` call took (`fully_shard([a, b])`
        # makes a and b one group, with one state): a group is gathered and resharded whole,
        # whichever of its modules is asked to.
        by_state: dict[int, list[nn.Module]] = {}
        for unit in self.units:
            by_state.setdefault(id(unit._get_fsdp_state()), []).append(unit)
        self.groups = list(by_state.values())
        self.blocks = [g for g in self.groups if model not in g]  # the root gathers itself
        # Blocks FSDP2 keeps gathered from their forward to their backward
        # (`reshard_after_forward=False`): so does the generated code. A block resharded onto a
        # smaller mesh after its forward (an int) is resharded fully (`_warn_partial_reshard`).
        self.kept = {i for i, block in enumerate(self.blocks) if _reshard_after_forward(block) is False}
        _warn_partial_reshard(self.blocks)
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

        sharded = [group for group in self.groups if any(isinstance(p, DTensor) for p in _group(group))]
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []  # (module, name, the unsharded parameter)
        for group in sharded:
            group[0].unshard()
            if not values:
                swapped += [(m, name, p) for unit in group for m in unit.modules() for name, p in m._parameters.items()
                            if p is not None and not isinstance(p, DTensor)]
                group[0].reshard()
        restore = [(m, name, m._parameters[name]) for m, name, _ in swapped]
        for m, name, p in swapped:
            m._parameters[name] = p
        self._unsharded = {name: p for name, p in self.model.named_parameters()
                           if any(p is q for block in self.blocks for q in _group(block))}
        hooks_saved = []
        for unit in self.units:
            ids = _forward_hook_ids(unit)
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
            # Tracing runs the generated forward, which leaves the blocks it keeps gathered for
            # the backward (`kept`) so: resharded here, where no backward follows.
            for block in self.blocks:
                block[0].reshard()
            for m, name, p in restore:
                m._parameters[name] = p
            if values:
                for group in sharded:
                    group[0].reshard()

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
        its parameters and resharded after the last one; a block FSDP2 keeps gathered after its
        forward (`kept`) is resharded in the backward only."""
        primals = [n.name for n in joint.module.graph.find_nodes(op="placeholder") if not is_tangent(n)]
        block_of = {}
        for primal, kind, name in zip(primals, joint.input_kinds, joint.input_names):
            if kind == "param" and name in self._unsharded:
                block_of[primal] = next(i for i, b in enumerate(self.blocks)
                                        if any(self._unsharded[name] is q for q in _group(b)))
        sizes = [sum(map(_whole_bytes, _group(block))) for block in self.blocks]
        most, read = _insert_gathers(forward, block_of, self.blocks, sizes, kept_on_exit=self.kept)
        self.most_gathered = max(self.most_gathered, most)
        most, _ = _insert_gathers(backward, block_of, self.blocks, sizes, held_on_entry=self.kept & read)
        self.most_gathered = max(self.most_gathered, most)
        return forward, backward

    def graph_break_error(self, error: CaptureError) -> CaptureError:
        """`error` (the model's forward does not capture as one graph, where Dynamo would break
        it) with what to do for a sharded model: a model with graph breaks is planned one Dynamo
        graph at a time, run by torch.compile, between which nothing could gather the blocks."""
        return CaptureError(
            f"{error}\n{type(self.model).__name__} is sharded by FSDP2 block by block, which rockplan runs as one "
            "planned graph, gathering each block between its ops; a model with graph breaks is planned one graph at a "
            "time and cannot be. Remove the graph break, or plan the unsharded model and shard the planned module as "
            "one group: fully_shard(Rockmate(model, sample, budget))")

    def __call__(self, planned_step: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        """`planned_step(args, kwargs)` run as the root's forward, inside its FSDP2 hooks."""
        self.model.__dict__["forward"] = lambda *args, **kwargs: planned_step(args, kwargs)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.__dict__.pop("forward", None)


def _insert_gathers(module: fx.GraphModule, block_of: dict[str, int], blocks: list[list[nn.Module]],
                    sizes: list[int], held_on_entry: set[int] = frozenset(),
                    kept_on_exit: set[int] = frozenset()) -> tuple[int, set[int]]:
    """Insert a gather of block i before the first node of `module` that reads (or views)
    block i's parameter placeholders (named in `block_of`), and its reshard after the last one,
    unless i is in `kept_on_exit` (then it stays gathered past the module's end); the output (a
    parameter handed to the backward) is no read. Blocks in `held_on_entry` are gathered when
    the module starts (their gather is then a no-op). Returns the most bytes of blocks gathered
    at once (`sizes[i]`: block i's) and the blocks read."""
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
    end = len(order)
    first = {block: order[nodes[0]] for block, nodes in reads.items()}
    last = {block: end if block in kept_on_exit else order[nodes[-1]] for block, nodes in reads.items()}
    for block in held_on_entry:
        first[block] = -1
        last.setdefault(block, end)  # not read here: resharded by FSDP2 after the backward
    changes = sorted([(first[b], sizes[b]) for b in first] + [(last[b] + 0.5, -sizes[b]) for b in last])
    gathered = most = 0
    for _, change in changes:
        gathered += change
        most = max(most, gathered)
    for block, nodes in reads.items():
        with module.graph.inserting_before(nodes[0]):
            module.graph.call_function(_Gather(blocks[block][0], "unshard"))
        if block not in kept_on_exit:
            with module.graph.inserting_after(nodes[-1]):
                module.graph.call_function(_Gather(blocks[block][0], "reshard"))
    module.recompile()
    return most, set(reads)


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
    size) times the largest group's bytes. Over gloo, one more of the largest group's bytes:
    gloo runs a collective on its own thread and holds its tensors until it is done, so the
    reduce-scatter input of the group before may still be alive when the next group's is
    made (FSDP2 drops its own reference first; over NCCL that frees it). The gradients of the
    whole parameters are in the plan, so in the budget."""
    import torch.distributed as dist

    sharded: ShardedBlocks | None = getattr(rk, "_sharded", None)
    if sharded is None:
        raise ValueError(f"{type(rk).__name__} is not a Rockmate of a model sharded by FSDP2 from its root")
    groups = [sum(map(_whole_bytes, _group(group))) for group in sharded.groups]
    root = sum(map(_whole_bytes, _group([sharded.model]))) if sharded.model in sharded.units else 0
    largest = max(groups, default=0)
    in_flight = largest if dist.get_backend() == "gloo" else 0
    return root + sharded.most_gathered + largest + largest // dist.get_world_size() + in_flight


@dataclasses.dataclass(frozen=True)
class _SentPlan:
    """What `planner.reuse` reads of a plan, sent from rank 0 to the others."""

    graph: RematGraph
    times: dict[str, float]
    schedule: Schedule
    rescaled_times: RescaledTimes | None = None  # the same input signature on every rank: its times as they are


def _whole_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()  # a DTensor's numel is the whole tensor's


def _group(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of FSDP2's group of `modules` (the modules one `fully_shard` call took):
    theirs, less those of groups nested in them, each once (a tied one included)."""
    from torch.distributed.fsdp import FSDPModule

    nested = {id(p) for unit in modules for sub in unit.modules() if sub not in modules and isinstance(sub, FSDPModule)
              for p in sub.parameters()}
    found = {id(p): p for unit in modules for p in unit.parameters() if id(p) not in nested}
    return list(found.values())


# FSDP2's private details this module relies on (torch 2.13; `check_fsdp_internals` fails
# loudly where a torch release changes them, and tests/test_distributed.py checks each):
# - `FSDPModule._get_fsdp_state()`: a group's state, one per `fully_shard` call (so the groups).
# - `FSDPState._pre_forward_hook_handle` and `_post_forward_hook_handle`: the handles of the
#   forward hooks FSDP2 registers on a group's modules (for `fully_shard([a, b])` one
#   `_MultiHandle` whose `handles` are every module's), set aside while planning (`planning`).
# - `FSDPState._fsdp_param_groups` and `FSDPParamGroup.post_forward_mesh_info` and `mesh_info`:
#   whether a group reshards after its forward, fully or onto a smaller mesh (`_reshard_after_forward`).
# - `FSDPState._root_post_backward_final_callback`, queued by the root's pre-backward hook: it
#   runs the post-backward (reduce-scatter, or accumulation without gradient sync, then the
#   reshard) of every group whose own backward hook did not fire, which is how the blocks'
#   gradients, computed inside the planned step, reach FSDP2.
_FSDP_FINAL_CALLBACK = "_root_post_backward_final_callback"


def check_fsdp_internals(units: list[nn.Module]) -> None:
    """Raise RuntimeError if FSDP2's private details listed above are not as this module
    reads them (a torch release changed them): a sharded model would otherwise run a step whose
    blocks are not gathered, or whose gradients are not reduced."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    changed = [] if callable(getattr(FSDPState, _FSDP_FINAL_CALLBACK, None)) else [f"FSDPState.{_FSDP_FINAL_CALLBACK}"]
    for unit in units:
        try:
            registered = {k for name in _FORWARD_HOOK_DICTS for k in getattr(unit, name)}
            if not _forward_hook_ids(unit) & registered:  # a group's handles: some on its other modules
                changed.append("FSDPState's forward hook handles are not its modules' forward hooks")
            _reshard_after_forward([unit])
        except AttributeError as e:
            changed.append(str(e))
    if changed:
        raise RuntimeError(
            f"torch {torch.__version__} changed a private detail of FSDP2 that rockplan reads to run a model sharded "
            f"from its root ({'; '.join(sorted(set(changed)))}): rockplan supports it as torch 2.13 has it. Plan the "
            "unsharded model and shard the planned module instead: fully_shard(Rockmate(model, sample, budget))")


def _forward_hook_ids(unit: nn.Module) -> set[int]:
    """The keys of FSDP2's forward hooks on `unit` in its hook dicts (its group's, all modules')."""
    state = unit._get_fsdp_state()
    handles = [state._pre_forward_hook_handle, state._post_forward_hook_handle]
    return {h.id for handle in handles for h in getattr(handle, "handles", (handle,))}


def _reshard_after_forward(group: list[nn.Module]) -> bool | None:
    """FSDP2's `reshard_after_forward` of `group` as it runs it: True (resharded fully, or no
    parameters to hold), False (kept gathered to the backward), or None (resharded onto a smaller
    mesh: an int)."""
    param_groups = group[0]._get_fsdp_state()._fsdp_param_groups
    if not param_groups:
        return True
    post_forward = param_groups[0].post_forward_mesh_info
    if post_forward is None:
        return False
    return True if post_forward == param_groups[0].mesh_info else None


def _warn_partial_reshard(blocks: list[list[nn.Module]]) -> None:
    """Warn about blocks sharded with an int `reshard_after_forward` (resharded after the
    forward onto a smaller mesh, for a backward gather within it): FSDP2 does that only inside
    its forward hooks, which a planned step does not run, so the generated code reshards them
    fully, as `True` does. That holds less than eager FSDP2 (within the same memory rule) and
    gives the same gradients; only the backward's gathers span the whole mesh."""
    partial = [type(block[0]).__name__ for block in blocks if _reshard_after_forward(block) is None]
    if partial:
        warnings.warn(f"{len(partial)} block(s) ({partial[0]}, ...) are sharded with an int reshard_after_forward: "
                      "a planned step reshards them fully after the forward (as reshard_after_forward=True), so the "
                      "backward gathers them over the whole mesh; pass True, or False to keep them gathered",
                      stacklevel=4)


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
