"""Schedule -> forward and backward fx GraphModules, in AOTAutograd's partition convention.

The forward module takes the primals and returns (forward outputs..., saved...); the backward
module takes (saved..., tangents...) and returns the gradients. Ops are emitted in schedule
order; a recomputed group is copied again as fresh nodes. fx's generated code drops each
value after its last use, and the boxed calling convention (set by the compiler we hand to
AOTAutograd) releases saved tensors as the backward goes, so the run frees what the
schedule frees. Views are never scheduled: a view is derived from its base where first used
and reused while that same base is alive; once the base is freed or recomputed, the next use
derives it again. A view kept longer would hold its base's storage past the schedule's free,
and one derived at every use costs an op call each time (on a GPU, whose step waits on the
host's op calls, that was a tenth of the ops of an HF Llama step).

The eager backend runs the modules as fx wrote them, with one change (`compile_generated`):
each op is called through a callable bound once (`bound_op`: an ATen op's C++ entry point, one
of our custom ops' Python definition), not through `OpOverload.__call__` and the dispatcher's
Python layers, frames per op call that a small model's GPU step waits on.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.debugging import boxed_nop
from torch._library.custom_ops import OPDEFS

from rkgraph.build import first_value, is_random, is_view
from rkgraph.capture import JointGraph, is_tangent
from rkgraph.graph import RematGraph
from rockplan.rng import replay, rng_state

aten = torch.ops.aten


class CodegenError(RuntimeError):
    pass


class _Emitter:
    def __init__(self, joint: fx.GraphModule, graph: RematGraph, record: Collection[str] = (),
                 in_place: Collection[str] = ()) -> None:
        self.fx_nodes = {n.name: n for n in joint.graph.nodes}
        self.in_place = set(in_place)  # fx nodes to run as their in-place op, at their first run
        self.written: set[str] = set()  # getitems of an in-place op's updates, set to their buffers
        self.remat = graph
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.record = record  # random fx nodes that run again later: their first run records the state
        self.rng_states: dict[str, fx.Node] = {}  # random fx node -> its recorded generator state
        # view fx node -> (its node here, the nodes here of the values it was derived from)
        self.views: dict[str, tuple[fx.Node, tuple[fx.Node, ...]]] = {}

    def placeholder(self, name: str) -> None:
        node = self.graph.placeholder(name)
        node.meta = dict(self.fx_nodes[name].meta)
        self.env[name] = node

    def value(self, node: fx.Node) -> fx.Node:
        if node.name in self.env:
            return self.env[node.name]
        if is_view(node):
            return self._view(node)
        if node.op == "get_attr":  # a constant of the joint module, copied over by GraphModule
            self.env[node.name] = self.graph.node_copy(node)
            return self.env[node.name]
        raise CodegenError(f"{node.name} is needed but was freed or never computed")

    def _view(self, node: fx.Node) -> fx.Node:
        """`node` (a view) derived from its inputs as they are now: the earlier copy if every
        input is still the node it was derived from, else a fresh copy."""
        inputs = tuple(self.value(i) for i in node.all_input_nodes)
        cached = self.views.get(node.name)
        if cached is not None and cached[1] == inputs:
            return cached[0]
        view = self.graph.node_copy(node, self.value)
        self.views[node.name] = (view, inputs)
        return view

    def compute(self, name: str) -> None:
        node = self.remat.node(name)
        for fx_name in node.fx_nodes:
            original = self.fx_nodes[fx_name]
            if fx_name in self.written:
                self.written.discard(fx_name)
                continue  # an update the in-place op wrote into its input: set with the op
            if fx_name in self.in_place:
                self.in_place.discard(fx_name)
                self._in_place(original)
            elif node.rng and is_random(original):
                self.env[fx_name] = self._random(original)
            else:
                self.env[fx_name] = self.graph.node_copy(original, self.value)

    def _in_place(self, original: fx.Node) -> None:
        """`original` (an update of a buffer, `in_place_updates`) as the in-place op writing the
        buffer: the buffer's node stands for the update, and the op's other outputs are its own."""
        args, kwargs = fx.node.map_arg((original.args, original.kwargs), self.value)
        if original.target in _BATCH_NORM_IN_PLACE:
            in_place, first = _BATCH_NORM_IN_PLACE[original.target]
            node = self.graph.call_function(in_place, args, kwargs)
            node.meta = {**original.meta, "val": original.meta["val"][:first]}
            for item in original.users:
                if item.args[1] >= first:  # the new running mean and variance: written into the buffers
                    self.env[item.name] = args[_RUNNING_STATS[item.args[1] - first]]
                    self.written.add(item.name)
        else:
            node = self.graph.call_function(_IN_PLACE[original.target], args, kwargs)
            node.meta = dict(original.meta)
        self.env[original.name] = node

    def _random(self, original: fx.Node) -> fx.Node:
        """First run: record the generator state, then draw as eager does. Later runs: replay."""
        out = first_value(original)
        device = out.device
        state = self.rng_states.get(original.name)
        if state is None and original.name not in self.record:
            return self.graph.node_copy(original, self.value)
        if state is None:
            state = self.graph.call_function(rng_state, (device,))
            # AOTAutograd reads the metadata of every saved value.
            fake_mode = out.fake_mode
            state.meta["val"] = fake_mode.from_tensor(rng_state(device))
            self.rng_states[original.name] = state
            return self.graph.node_copy(original, self.value)
        args, kwargs = fx.node.map_arg((original.args, original.kwargs), self.value)
        node = self.graph.call_function(replay, (state, device, original.target, *args), kwargs)
        node.meta = dict(original.meta)
        return node

    def free(self, data: str) -> None:
        self.env.pop(data, None)

    def run(self, ops: list[Any]) -> None:
        for op in ops:
            if op.kind == "compute":
                self.compute(op.name)
            else:
                self.free(op.name)

    def module(self, root: fx.GraphModule, outputs: list[Any]) -> fx.GraphModule:
        self.graph.output(tuple(
            self.value(o) if isinstance(o, fx.Node) and o.graph is not self.graph else o for o in outputs
        ))
        self.graph.lint()
        return fx.GraphModule(root, self.graph)


def saved_for_backward(graph: RematGraph, backward_ops: list[Any]) -> list[str]:
    """Data the backward reads before (re)computing it: what the forward must hand over (no
    `order_only` value: those order the schedule and hold no tensor)."""
    saved: list[str] = []
    present: set[str] = set()
    for op in backward_ops:
        if op.kind != "compute":
            present.discard(op.name)
            continue
        node = graph.node(op.name)
        for d in node.inputs:
            dn = graph.data[d]
            if d not in present and dn.kind != "tangent" and not dn.order_only and d not in saved:
                saved.append(d)
        present.update(node.outputs)
    return saved


def _random_ops_in(graph: RematGraph, ops: list[Any], fx_nodes: dict[str, fx.Node]) -> list[str]:
    """Random fx nodes that `ops` recompute (in order, once each)."""
    found: dict[str, None] = {}
    for op in ops:
        if op.kind == "compute" and graph.node(op.name).rng:
            found.update((n, None) for n in graph.node(op.name).fx_nodes if is_random(fx_nodes[n]))
    return list(found)


def _rerun_random_ops(graph: RematGraph, ops: list[Any], fx_nodes: dict[str, fx.Node]) -> list[str]:
    """Random fx nodes that `ops` run more than once (their first run records the state)."""
    runs = Counter(op.name for op in ops if op.kind == "compute" and graph.node(op.name).rng)
    return [n for name, count in runs.items() if count > 1 for n in graph.node(name).fx_nodes if is_random(fx_nodes[n])]


# Out-of-place ops a step updates a buffer with, and their in-place forms (writing their first
# argument); BatchNorm's functional ops are handled apart (their updates are two of their outputs).
_IN_PLACE = {aten.add.Tensor: aten.add_.Tensor}
# BatchNorm's functional ops: the op writing the running statistics in place (same arguments),
# and the index of the first of the two updates among the outputs (those before it are its own).
_BATCH_NORM_IN_PLACE = {
    aten._native_batch_norm_legit_functional.default: (aten._native_batch_norm_legit.default, 3),
    aten._batch_norm_with_update_functional.default: (aten._batch_norm_with_update.default, 4),
}
_RUNNING_STATS = (3, 4)  # the arguments of BatchNorm's running mean and variance


def in_place_updates(joint: JointGraph, graph: RematGraph, schedule: Any, saved: Collection[str]) -> list[str]:
    """The fx nodes of `joint` that update a mutated buffer (BatchNorm's running statistics and
    batch count) and can write it in place, as eager does: each buffer they update is read by
    them alone and not saved for the backward, the update is read by the step's outputs alone
    (AOTAutograd copies it into the buffer after the forward), and the schedule runs them once.

    Run out of place, each update is a new tensor that AOTAutograd's epilogue then copies into
    the buffer: a kernel per buffer that eager does not run (three per BatchNorm), each a
    launch a GPU step bound by the host's op calls pays for. In place, the forward returns the
    buffer itself as its update, and a copy onto itself runs no kernel."""
    runs = Counter(op.name for op in schedule.ops if op.kind == "compute")
    group = {fx_name: node.name for node in graph.nodes for fx_name in node.fx_nodes}
    nodes = joint.module.graph.nodes
    output = next(n for n in reversed(nodes) if n.op == "output")

    def only_updates(buffer: fx.Node, update: fx.Node, reader: fx.Node) -> bool:
        return (buffer.op == "placeholder" and buffer.name in joint.mutated and buffer.name not in saved
                and list(buffer.users) == [reader] and list(update.users) == [output])

    found = []
    for node in nodes:
        if node.op != "call_function" or runs[group.get(node.name, "")] != 1:
            continue
        if node.target in _BATCH_NORM_IN_PLACE:
            first = _BATCH_NORM_IN_PLACE[node.target][1]
            updates = [item for item in node.users if item.args[1] >= first]
            if len(updates) == 2 and all(only_updates(node.args[_RUNNING_STATS[item.args[1] - first]], item, node)
                                         for item in updates):
                found.append(node.name)
        elif node.target in _IN_PLACE:
            value, buffer = node.meta.get("val"), node.args[0]
            original = buffer.meta.get("val") if isinstance(buffer, fx.Node) else None
            if (isinstance(value, torch.Tensor) and isinstance(original, torch.Tensor)
                    and (value.shape, value.dtype) == (original.shape, original.dtype)
                    and only_updates(buffer, node, node)):
                found.append(node.name)
    return found


def generate(joint: JointGraph, graph: RematGraph, schedule: Any,
             in_place: bool = False) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward modules of `schedule`; with `in_place`, buffers updated as eager
    updates them (`in_place_updates`: for a backend that runs the modules as written)."""
    gm = joint.module
    placeholders = gm.graph.find_nodes(op="placeholder")
    outputs = list(gm.graph.find_nodes(op="output")[0].args[0])
    forward_ops = schedule.ops[: schedule.forward_length]
    backward_ops = schedule.ops[schedule.forward_length:]
    # Constants of the joint module are read by each module directly, never handed over.
    constants = {n.name for n in gm.graph.find_nodes(op="get_attr")}
    saved = [d for d in saved_for_backward(graph, backward_ops) if d not in constants]

    fx_nodes = {n.name: n for n in gm.graph.nodes}
    fw = _Emitter(gm, graph, record=set(_rerun_random_ops(graph, schedule.ops, fx_nodes)),
                  in_place=in_place_updates(joint, graph, schedule, saved) if in_place else ())
    for p in placeholders:
        if not is_tangent(p):
            fw.placeholder(p.name)
    fw.run(forward_ops)
    missing = [d for d in saved if d not in fw.env]
    if missing:
        raise CodegenError(f"the backward needs {missing[0]}, which the forward does not keep")
    # A data node is named after the joint node that allocates its storage. An input the step
    # mutates (BatchNorm running stats) is updated after the forward, so a backward
    # recomputation must read a copy of its value from before.
    kept = [fw.graph.call_function(aten.clone.default, (fw.env[d],)) if d in joint.mutated else fw.fx_nodes[d]
            for d in saved]
    replayed = _random_ops_in(graph, backward_ops, fw.fx_nodes)
    missing = [r for r in replayed if r not in fw.rng_states]
    if missing:
        raise CodegenError(f"random op {missing[0]} first runs in the backward: its draws would differ from eager")
    fw_module = fw.module(gm, outputs[: joint.num_fwd_outputs] + kept + [fw.rng_states[r] for r in replayed])

    bw = _Emitter(gm, graph)
    for d in saved:
        bw.placeholder(d)
    for r in replayed:
        bw.rng_states[r] = bw.graph.placeholder(f"rng_state_{r}")
        bw.rng_states[r].meta["val"] = fw.rng_states[r].meta["val"]
    for p in placeholders:
        if is_tangent(p):
            bw.placeholder(p.name)
    bw.run(backward_ops)
    bw_module = bw.module(gm, outputs[joint.num_fwd_outputs:])
    return fw_module, bw_module


@functools.cache
def bound_op(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """`op` as the step calls it: its C++ entry point, what `OpOverload.__call__` calls (the
    same op, dispatched the same way, without a Python frame), or for a custom op defined in
    Python with nothing but its definition (our rewrites' ops), that definition. Named as `op`
    (`aten.add.Tensor`): fx's generated code calls it as the global `aten_add_Tensor`, where it
    wrote `torch.ops.aten.add.Tensor` (an attribute lookup per namespace level and a Python
    call per op call)."""
    call = functools.partial(_python_definition(op) or op._op)
    call.__module__, call.__name__ = op.namespace, f"{op._opname}.{op._overloadname}"
    return call


def _python_definition(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """The Python function that defines custom op `op` (`torch.library.custom_op`) where
    calling it is all the dispatcher would do in a generated step, else None.

    Through the dispatcher, a Python custom op's call runs its autograd layer, a check that the
    output aliases no input and a wrapper keeping Dynamo out before it reaches the function:
    several Python frames per call, dearer than the small kernels it wraps. A step's modules run
    without grad (the forward inside AOTAutograd's autograd.Function, the backward inside
    autograd's engine), so the autograd layer only passes the call on. An op with more than its
    definition (a kernel per device, an autograd formula, a rule for a dispatch mode, vmap or
    autocast, a disabled kernel), or whose definition's fields this torch names otherwise, is
    called through the dispatcher."""
    definition = OPDEFS.get(op._name)
    if definition is None or op._overloadname != "default":
        return None
    only_defined = (set(getattr(definition, "_backend_fns", ())) == {None}
                    and getattr(definition, "_backward_fn", True) is None
                    and getattr(definition, "_torch_dispatch_fns", None) == {}
                    and getattr(definition, "_vmap_fn", True) is None
                    and getattr(definition, "_autocast_dtype", None) == {}
                    and getattr(definition, "_disabled_kernel", None) == set())
    return definition._init_fn if only_defined else None


def compile_generated(module: fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
    """The eager backend's compiler: a generated module as the boxed callable AOTAutograd runs
    in each step, its ops called through `bound_op`. On a GPU a small model's step waits on the
    host's op calls, and the Python frames per op were a visible share of them.
    Subclasses of `OpOverload` (TorchBind ops) call through their own `__call__`, and are left."""
    for node in module.graph.nodes:
        if node.op == "call_function" and type(node.target) is torch._ops.OpOverload:
            node.target = bound_op(node.target)
    return boxed_nop(module, inputs)
