"""Turn AOTAutograd's joint fx graph into a RematGraph.

Memory is counted per storage: a view op allocates nothing and reads its base's storage, so
views are not scheduled at all; code generation re-derives them from their base wherever
they are needed. Every op that allocates heads a group; getitems of a multi-output op and
chains of cheap forward pointwise ops that read only that group (and sources) join it, so a
transformer block is a few dozen schedulable nodes rather than hundreds. A pointwise op on a
tensor the backward reads stays a node of its own: grouped, remaking its output would remake
the group's head too (GELU's output remade by re-running the matmul before it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from rkgraph.capture import JointGraph, has_side_effect, is_tangent
from rkgraph.graph import SOURCE_KINDS, ComputeNode, DataNode, RematGraph
from rkgraph.hooks import is_hook_call

# Ops whose output shares its input's storage although their schema does not say so.
_ALIASING_OPS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default}


def is_view(node: fx.Node) -> bool:
    """Allocates nothing: a view op, or an element of a view op's result list (split, unbind)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return is_view(node.args[0])
    return target in _ALIASING_OPS or (isinstance(target, torch._ops.OpOverload) and target.is_view)


def _is_pointwise(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


# Arguments through which an op is handed the random state it uses: such an op replays the
# draws of the op that made them (attention's backward on CUDA takes its forward's philox seed
# and offset) and draws nothing itself, though ATen tags some of them as seeded.
_GIVEN_RANDOM_STATE = frozenset({"philox_seed", "philox_offset", "rng_state"})


def is_random(node: fx.Node) -> bool:
    """Whether the op draws from the global generator (a recomputation must replay its state)."""
    t = node.target
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags):
        return False
    return not any(a.name in _GIVEN_RANDOM_STATE for a in t._schema.arguments)


# Namespaces of PyTorch's collective ops (functional collectives, their autograd variants, and
# c10d's own ops, as traced from tensor-parallel or user code in a forward).
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"})


def is_collective(node: fx.Node) -> bool:
    """Whether the op communicates with other ranks (or waits on such a communication). It must
    run once, as planned: a recomputation would issue a collective that the other ranks, whose
    schedules may recompute elsewhere, do not match, and would hang or mix up their messages."""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace in _COLLECTIVE_NAMESPACES


def is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def generator_state_bytes(device: torch.device) -> int:
    """Bytes of one recorded generator state on `device`: what replaying a random op holds."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device).nbytes
    return torch.get_rng_state().nbytes


def first_value(node: fx.Node) -> torch.Tensor:
    """The (fake) tensor an op returns, or the first of those it returns."""
    val = node.meta["val"]
    return val[0] if isinstance(val, (tuple, list)) else val


# The CUDA caching allocator hands out blocks in multiples of 512 bytes, and its
# statistics, which measure the step's peak, count the blocks.
CUDA_BLOCK_BYTES = 512


def storage_bytes(val: object) -> int:
    """Bytes the allocator gives the tensor's storage: exact on CPU, whole blocks on CUDA."""
    if not isinstance(val, torch.Tensor):
        return 0
    nbytes = val.untyped_storage().nbytes()
    if val.device.type == "cuda":
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES  # none for an empty storage
    return nbytes


@dataclass(eq=False)
class _Group:
    head: fx.Node
    ops: list[fx.Node] = field(default_factory=list)  # allocating ops and their getitems


@dataclass
class StorageMap:
    """Which storage (data node name) each tensor-valued fx node lives in."""

    storage_of: dict[str, str]  # fx node name -> data node name
    root_of: dict[str, fx.Node]  # data node name -> fx node holding the whole storage

    def of(self, node: fx.Node) -> str:
        return self.storage_of[node.name]


def storage_map(gm: fx.GraphModule) -> StorageMap:
    storage_of: dict[str, str] = {}
    roots: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            storage_of[node.name] = node.name
            roots[node.name] = node
        elif node.op != "call_function":
            continue
        elif is_view(node):
            base = node.args[0]
            storage_of[node.name] = storage_of[base.name]
        elif node.target is operator.getitem or isinstance(node.meta.get("val"), torch.Tensor):
            storage_of[node.name] = node.name
            roots[node.name] = node
    return StorageMap(storage_of, roots)


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    # A getitem reads an element of its op's result tuple, which is no storage of its own.
    return [] if node.target is operator.getitem else node.all_input_nodes


def build_graph(joint: JointGraph, name: str = "", replay_rng: bool = True) -> RematGraph:
    """`replay_rng`: random ops may be recomputed (the runtime replays their RNG state); when
    False they are flagged `random`, to be computed once."""
    gm = joint.module
    storages = storage_map(gm)

    data: dict[str, DataNode] = {}
    # Tensors the trace lifted as constants (a loss's fixed targets): alive before the step.
    for node in gm.graph.find_nodes(op="get_attr"):
        data[node.name] = DataNode(node.name, storage_bytes(node.meta.get("val")), "buffer")
    primal_index = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        size = storage_bytes(node.meta.get("val"))
        if is_tangent(node):
            data[node.name] = DataNode(node.name, size, "tangent")
        else:
            data[node.name] = DataNode(node.name, size, joint.input_kinds[primal_index],
                                       mutated=node.name in joint.mutated)
            primal_index += 1

    # 1. Groups: one per allocating op; getitems join their op's group.
    saved = {storages.of(a) for node in gm.graph.nodes
             if node.op == "call_function" and is_backward(node) for a in _tensor_inputs(node)}
    group_of: dict[str, _Group] = {}
    groups: list[_Group] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_view(node):
            continue
        if node.target is operator.getitem:
            group = group_of[node.args[0].name]
            group.ops.append(node)
            group_of[node.name] = group
            continue
        producers = {group_of[storages.of(a)] for a in _tensor_inputs(node) if storages.of(a) in group_of}
        # Only forward chains are grouped: a backward chain's inputs (gradients) usually die
        # inside it, which a group's workspace, charged on top of its inputs, would overstate.
        # Nor does anything join a random op: what follows a draw is recomputed without one.
        # Nor an op on a tensor the backward reads: that tensor is kept or remade anyway, and on
        # its own the op's output can be dropped and remade for the op alone (a GELU after a
        # linear layer: the GELU, not the matmul).
        if (_is_pointwise(node) and not is_random(node) and len(producers) == 1 and not is_backward(node)
                and not any(storages.of(a) in saved for a in _tensor_inputs(node))):
            (group,) = producers
            if not is_backward(group.head) and not any(is_random(n) for n in group.ops):
                group.ops.append(node)
                group_of[node.name] = group
                continue
        group = _Group(node, [node])
        groups.append(group)
        group_of[node.name] = group

    # 2. Which storages are used outside their group (those become data nodes).
    output_node = gm.graph.find_nodes(op="output")[0]
    outputs = list(output_node.args[0])
    escaping: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_view(node):
            continue
        for a in _tensor_inputs(node):
            s = storages.of(a)
            if s in group_of and group_of[s] is not group_of[node.name]:
                escaping.add(s)
    required = [storages.of(o) for o in outputs if isinstance(o, fx.Node)]
    escaping.update(s for s in required if s in group_of)

    # 3. Compute nodes with exact output sizes and the workspace of their internal temporaries.
    nodes: list[ComputeNode] = []
    effects: dict[bool, list[str]] = {False: [], True: []}  # forward's and backward's, see below
    for group in groups:
        outs, inputs, workspace, releases = _group_dataflow(group, storages, escaping)
        head = group.head
        draws = [n for n in group.ops if is_random(n)]
        draws_random = bool(draws)
        # Run once, as unreplayed draws are: a collective (see `is_collective`), a user's hook
        # (`rkgraph.hooks`: it runs in each step as eager runs it, once).
        runs_once = any(is_collective(n) or is_hook_call(n) for n in group.ops)
        for s in outs:
            data[s] = DataNode(s, storage_bytes(storages.root_of[s].meta.get("val")), "activation", head.name)
        if not outs and has_side_effect(head):
            # Nothing reads what it does (an assertion): a zero-byte value the step must
            # produce, as a forward output or a gradient, keeps it in every schedule.
            data[head.name] = DataNode(head.name, 0, "activation", head.name)
            outs = [head.name]
            effects[is_backward(head)].append(head.name)
        nodes.append(ComputeNode(
            name=head.name,
            inputs=tuple(inputs),
            outputs=tuple(outs),
            backward=is_backward(head),
            workspace=workspace,
            random=(draws_random and not replay_rng) or runs_once,
            rng=draws_random and replay_rng,
            rng_state=sum(generator_state_bytes(first_value(n).device) for n in draws) if replay_rng else 0,
            module=head.meta.get("custom", {}).get("module", ""),
            op=str(head.target),
            fx_nodes=tuple(n.name for n in group.ops),
            releases=_freeable_releases(releases, data),
        ))

    def storages_of(values: list) -> tuple[str, ...]:
        """Distinct data nodes behind graph outputs (None for inputs that get no gradient)."""
        return tuple(dict.fromkeys(storages.of(o) for o in values if isinstance(o, fx.Node)))

    n_fwd = joint.num_fwd_outputs
    # AOTAutograd lists the new values of mutated inputs first, then the user's outputs.
    user = storages_of(outputs[len(joint.mutated): n_fwd])
    forward_outputs = storages_of(outputs[:n_fwd]) + tuple(effects[False])
    gradients = storages_of(outputs[n_fwd:]) + tuple(effects[True])
    nodes = order_run_once(nodes, data)
    # 4. Weight gradients as early as they can go where that frees more than it holds.
    nodes = hoist_gradients(nodes, data, frozenset(gradients), frozenset(forward_outputs))
    graph = RematGraph(nodes, data, forward_outputs, gradients, name=name,
                       user_outputs=tuple(d for d in user if data[d].kind not in SOURCE_KINDS))
    graph.validate()
    return graph


def order_run_once(nodes: list[ComputeNode], data: dict[str, DataNode]) -> list[ComputeNode]:
    """`nodes` with each one that draws, communicates or calls a hook (`random` or `rng`)
    reading a zero-byte `order_only` value made by the previous one, so that every schedule
    first computes them in graph order, as eager runs them.

    Two dropouts that do not read each other's data are otherwise free to swap: with the same
    seed, each would draw the other's mask (a recomputation replays its recorded state, so only
    the first computation draws from the generator). Collectives must match across ranks, and
    hooks run in the user's order. A dependency in the graph binds every solver, which
    each orders its computations by the graph's data flow; the value weighs nothing, and code
    generation, which emits the ops of a node's fx nodes, emits nothing for it."""
    ordered: list[ComputeNode] = []
    previous: str | None = None
    for node in nodes:
        if node.random or node.rng:
            token = f"{node.name}.drawn"
            data[token] = DataNode(token, 0, "activation", node.name, order_only=True)
            inputs = node.inputs if previous is None else (*node.inputs, previous)
            node = replace(node, inputs=inputs, outputs=(*node.outputs, token))
            previous = token
        ordered.append(node)
    return ordered


def hoist_gradients(nodes: list[ComputeNode], data: dict[str, DataNode], gradients: frozenset[str],
                    held: frozenset[str] = frozenset()) -> list[ComputeNode]:
    """`nodes` in an order where each backward node that makes only gradients runs as soon as
    its inputs exist, if it is then the last reader of inputs larger than its outputs.

    AOTAutograd orders a linear layer's backward as autograd does: the input's gradient, then
    the weight's. The weight's gradient is the last reader of the layer's input, so in that
    order the input (in a transformer's MLP, the GELU's output) and the new input gradient are
    alive together. Gradients are held to the step's end whenever they are made, so moving
    their op earlier costs its outputs over the interval and frees the inputs it reads last as
    much earlier: a move is taken only where that nets memory back (never for a bias gradient,
    whose input the input gradient still reads). `held`: data never freed early (outputs)."""
    readers: dict[str, list[str]] = {}
    for n in nodes:
        for d in dict.fromkeys(n.inputs):
            readers.setdefault(d, []).append(n.name)
    order = list(nodes)
    backward_start = next((i for i, n in enumerate(nodes) if n.backward), len(nodes))
    position = {m.name: i for i, m in enumerate(order)}  # kept up to date as nodes move
    for node in [n for n in nodes if n.backward and n.outputs and all(d in gradients for d in n.outputs)]:
        at = position[node.name]
        producers = [position[data[d].producer] for d in node.inputs if data[d].producer is not None]
        earliest = max(backward_start, 1 + max(producers, default=-1))
        if earliest >= at:
            continue
        freed = sum(data[d].size for d in dict.fromkeys(node.inputs)
                    if data[d].producer is not None and d not in held and d not in gradients
                    and all(position[r] < earliest for r in readers[d] if r != node.name))
        if freed > sum(data[d].size for d in node.outputs):
            order.insert(earliest, order.pop(at))
            for i in range(earliest, at + 1):  # only the nodes it passed moved
                position[order[i].name] = i
    return order


def _freeable_releases(releases: list[tuple[tuple[str, ...], int]],
                       data: dict[str, DataNode]) -> tuple[tuple[tuple[str, ...], int], ...]:
    """`ComputeNode.releases`: of the inputs read for the last time, only those a schedule can
    free (not sources, not tangents); empty when none dies before the node's last op."""
    kept: list[tuple[tuple[str, ...], int]] = []
    for read, bytes_after in releases:
        read = tuple(d for d in read if data[d].kind not in SOURCE_KINDS and data[d].kind != "tangent")
        if kept and kept[-1][0] == read:
            kept[-1] = (read, max(kept[-1][1], bytes_after))
        else:
            kept.append((read, bytes_after))
    return tuple(kept) if len(kept) > 1 else ()


def _group_dataflow(group: _Group, storages: StorageMap, escaping: set[str]):
    """Outputs, inputs and workspace of a group, by replaying its ops with frees at last use;
    and the peaks of its allocations after inputs are read for the last time (`releases`)."""
    members = {n.name for n in group.ops}
    allocated: list[str] = []
    inputs: list[str] = []
    for n in group.ops:
        for a in _tensor_inputs(n):
            s = storages.of(a)
            if s not in members and s not in inputs:
                inputs.append(s)
        if n.target is operator.getitem or isinstance(n.meta.get("val"), torch.Tensor):
            allocated.append(n.name)
    outs = [s for s in allocated if s in escaping]

    # Temporaries: multi-output ops allocate every element at once, used or not.
    last_use: dict[str, int] = {}
    for i, n in enumerate(group.ops):
        for a in _tensor_inputs(n):
            last_use[storages.of(a)] = i
    live, peak = 0, 0
    alive: dict[str, int] = {}
    # (inputs read for the last time before an op, the peak of the group's allocations from it on)
    releases: list[tuple[tuple[str, ...], int]] = []
    for i, n in enumerate(group.ops):
        if n.target is operator.getitem:
            continue
        val = n.meta.get("val")
        new = [storage_bytes(v) for v in val] if isinstance(val, (tuple, list)) else [storage_bytes(val)]
        live += sum(new)
        peak = max(peak, live)
        read = tuple(s for s in inputs if last_use[s] < i)
        if releases and releases[-1][0] == read:
            releases[-1] = (read, max(releases[-1][1], live))
        else:
            releases.append((read, live))
        if isinstance(val, (tuple, list)):
            kept = {u.args[1]: u.name for u in n.users if u.target is operator.getitem}
            for idx, size in enumerate(new):
                if idx in kept:
                    alive[kept[idx]] = size
                else:
                    live -= size  # an element nobody reads dies at once
        else:
            alive[n.name] = new[0]
        for s in list(alive):
            if s not in escaping and last_use.get(s, -1) <= i:
                live -= alive.pop(s)
    out_bytes = sum(alive.get(s, 0) for s in outs)
    return outs, inputs, max(0, peak - out_bytes), releases
