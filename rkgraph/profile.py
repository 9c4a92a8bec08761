"""Per-node costs: time measured on real tensors, or estimated from FLOPs and bytes moved;
and the scratch memory kernels allocate inside an op, measured from the allocator's events.

Measuring times replays the joint graph in its own order (what autograd would keep alive), so
it needs the store-everything memory; when that fails, or when asked, the estimate is used.
A graph's few ops of its own beside a measured one (the lean variant's) are timed alone on
synthetic inputs (`synthetic_times`), and a step at new input shapes takes a held plan's
times rescaled (`RescaledTimes`): neither replays the step.
The estimate is a roofline: max(flops / peak_flops, bytes / bandwidth), with rough device
figures; solvers only compare times relative to each other. Scratch cannot be estimated: a
convolution's im2col buffer or a reduction's partial sums are the kernel's business, seen only
by the allocator. It is measured op by op, each op alone on synthetic tensors
(`measure_op_scratch`), which needs neither real inputs nor the step's memory; a replay of the
step (`measure_scratch`) reads the same figures, and stays as its check. The same calls give
each value the bytes its kernel allocated for it, where they exceed its shape's.
Our own ops' scratch is known from their shapes (the rewrites' table, `rkgraph.rewrites`) and
stands in for the measurement where an op cannot run on synthetic inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
from torch import fx
from torch._C._profiler import _EventType
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import flop_registry

from rkgraph.build import storage_bytes
from rkgraph.capture import is_tangent, preserved_rng
from rkgraph.graph import ComputeNode, RematGraph, matching_nodes
from rkgraph.hooks import hooks_muted
from rkgraph.rewrites import REWRITES, known_scratch

log = logging.getLogger(__name__)

# (FLOP/s, bytes/s): order-of-magnitude figures; only ratios between nodes matter.
_DEVICE_SPEED = {"cpu": (1e11, 2e10), "cuda": (4e14, 3e12)}


def _bytes_moved(node: fx.Node) -> int:
    total = 0
    for v in [*(a.meta.get("val") for a in node.all_input_nodes), node.meta.get("val")]:
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def node_flops(node: fx.Node) -> int:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    formula = flop_registry.get(target.overloadpacket)
    if formula is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # a formula that does not cover this overload's arguments
        return 0


def estimated_seconds(graph: RematGraph, joint: fx.GraphModule, flops_per_s: float, bytes_per_s: float,
                      launch_seconds: float = 0.0) -> dict[str, float]:
    """Node name -> the roofline estimate of each compute node, max(FLOPs / `flops_per_s`,
    bytes / `bytes_per_s`) per op, plus `launch_seconds` per op that is not a view (a kernel
    launch: what a small op costs on a GPU whatever its size)."""
    fx_nodes = {n.name: n for n in joint.graph.nodes}
    seconds = {}
    for node in graph.nodes:
        members = [fx_nodes[n] for n in node.fx_nodes if fx_nodes[n].target is not operator.getitem]
        seconds[node.name] = sum(
            (0.0 if isinstance(n.target, torch._ops.OpOverload) and n.target.is_view else launch_seconds)
            + max(node_flops(n) / flops_per_s, _bytes_moved(n) / bytes_per_s) for n in members)
    return seconds


def estimated_times(graph: RematGraph, joint: fx.GraphModule, device: str = "cpu") -> dict[str, float]:
    """Node name -> the roofline estimate of each compute node, with rough figures for `device`."""
    return estimated_seconds(graph, joint, *_DEVICE_SPEED.get(device, _DEVICE_SPEED["cpu"]))


def estimate_times(graph: RematGraph, joint: fx.GraphModule, device: str = "cpu") -> None:
    """Fill `time` of every compute node with the roofline estimate."""
    seconds = estimated_times(graph, joint, device)
    for node in graph.nodes:
        node.time = seconds[node.name]


# The share of a graph's estimated time whose nodes must be found in a held plan's graph for
# that plan's times to be rescaled to it (`RescaledTimes`); below it, the graph is profiled anew.
# A rewrite can apply at one batch size and not another (the fused head and loss, a large share
# of a language model's step): half leaves such steps rescaled, and another model measured.
RESCALED_SHARE = 0.5


@dataclass(frozen=True)
class RescaledTimes:
    """Node times measured for the same step at other input shapes (a held plan's), with the
    roofline estimates of those nodes there and the graph they are of, whose nodes are found
    in another graph by what they compute, or else by where they are (`matching_nodes`). A
    profile (`profile_graph`) that gives each node its time there scaled by its estimate here
    over its estimate there, so that a step planned again for a new input signature (another
    batch size or sequence length) needs no replay of the step: the replays cost several
    steps' time, as much again at every new signature. The measured times carry what the
    estimate misses (which kernels are slow on this machine); the estimates' ratio carries how
    each op grows with its shapes. Nodes estimated at zero there (views) keep their time; nodes
    the held plan's graph lacks take their estimate on the measured clock (the held times over
    their estimates): timing them alone (`synthetic_times`) can cost more than the rest of the
    plan (a fused head and loss, written in Python a chunk at a time, on a CPU). Where less than
    `RESCALED_SHARE` of the estimated step is found there (another model, another structure),
    `profile_graph` profiles it as `otherwise` says: "measure" (replays), or "estimate" where
    the step's values cannot be replayed (a sharded model's parameters not gathered whole)."""

    times: Mapping[str, float]
    estimates: Mapping[str, float]
    graph: RematGraph
    otherwise: str = "measure"

    @classmethod
    def of_graph(cls, graph: RematGraph, joint: fx.GraphModule, device: str = "cpu") -> RescaledTimes:
        """`graph`'s node times as costed, to rescale to other input shapes."""
        return cls({node.name: node.time for node in graph.nodes}, estimated_times(graph, joint, device), graph)

    def rescaled(self, graph: RematGraph, joint: fx.GraphModule, device: str = "cpu") -> dict[str, float] | None:
        """Each node's rescaled time, by name; None when too little of `graph` is found."""
        here = estimated_times(graph, joint, device)
        found = {name: old for old, name in matching_nodes(self.graph, graph).items()}
        total = sum(here.values())
        if total <= 0 or sum(here[name] for name in found) < RESCALED_SHARE * total:
            return None
        estimated = sum(self.estimates[old] for old in found.values())
        clock = sum(self.times[old] for old in found.values()) / estimated if estimated > 0 else 1.0
        times = {}
        for name, seconds in here.items():
            old = found.get(name)
            times[name] = (seconds * clock if old is None else self.times[old] * seconds / self.estimates[old]
                           if self.estimates[old] > 0 else self.times[old])
        return times


# The AllocatorEvents blocks open in this process, innermost last: only the last one's session runs.
_OPEN_EVENTS: list[AllocatorEvents] = []


class AllocatorEvents:
    """A device allocator's allocations and frees inside a ``with`` block, as torch.profiler
    records them (``profile_memory=True``): every block, kernels' scratch buffers and compiled
    code's allocations included, without changing how the code runs (a dispatch mode would make
    ``torch.compile`` fall back to eager). Ranges opened with ``record_function`` inside the
    block are kept by name, so a part of the block can be replayed on its own.

    A process has one profiler session at a time, and starting one ends the other without a
    word. So a block inside another (planning, which measures kernels' scratch, inside a
    measured step that plans: a graph break's first steps, a new input shape) ends the outer
    block's session, and the outer block says so (`replay` raises) rather than read an empty
    session as no memory. The outer session is not paused and started again around the inner
    one: an op begun under one session and ended under another is not safe. A session this
    class did not open (the user's torch.profiler) is never ended: entering a block inside one
    raises, since the user's profile would be emptied."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.events: list[tuple[int, bool, int, int]] = []  # (time ns, is allocation, address, bytes)
        self.ranges: dict[str, tuple[int, int]] = {}  # op or record_function name -> its last (start, end) ns
        self.interrupted = False  # a block inside this one ended its session
        # Kineto prints two lines to stdout per profile at its default level; read when the
        # profiler is first used, and a level the user set is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> AllocatorEvents:
        if not _OPEN_EVENTS and torch.autograd.profiler._is_profiler_enabled:
            raise RuntimeError(
                "rockplan measures the allocator with torch.profiler (kernels' scratch while planning, a step's "
                "peak in rockplan.memory on a CPU), and a torch.profiler session is already open: a second "
                "one would end it and empty your profile. Plan before opening the profiler (construct the "
                "Rockmate and run one training step at each input shape first), or measure outside it.")
        for outer in _OPEN_EVENTS:
            outer.interrupted = True
        self._profile.__enter__()
        _OPEN_EVENTS.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _OPEN_EVENTS.remove(self)
        self._profile.__exit__(*exc_info)
        if self.interrupted:  # its session ended inside: no results to read
            return
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                if fields.device.type == self.device.type and self.device.index in (None, fields.device.index):
                    self.events.append((node.start_time_ns, fields.alloc_size > 0, fields.ptr, fields.alloc_size))
            elif node.tag == _EventType.TorchOp:
                self.ranges[node.name] = (node.start_time_ns, node.end_time_ns)
        # At one instant frees come first, so an address freed and reused at once counts once.
        self.events.sort()

    def replay(self, start: int = 0, end: int | None = None) -> tuple[int, int]:
        """(peak, current) in bytes of the blocks allocated between `start` and `end` (ns): a free
        of a block allocated before `start` is not counted, as the step's own memory is measured.
        Raises where a block inside this one ended its session (see the class)."""
        if self.interrupted:
            raise RuntimeError(
                "the allocator's events were not recorded: something inside the block measured the allocator "
                "too (rockplan plans a step inside it where the step is the first at its input shape, or a "
                "graph break's first or second step, and measures kernels' scratch), and torch.profiler runs "
                "one session at a time. Measure a step that does not plan: run one training step at that "
                "shape first (two with graph breaks).")
        alive: dict[int, int] = {}
        current = peak = 0
        for when, _, address, size in self.events:
            if when < start or (end is not None and when > end):
                continue
            if size > 0:
                alive[address] = size
                current += size
                peak = max(peak, current)
            elif address in alive:
                current -= alive.pop(address)
        return peak, current


def random_tangents(joint: fx.GraphModule, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Real tensors for the joint graph's tangent placeholders (gradients of the outputs).

    Drawn from a private generator: the user's RNG stream is left alone.
    """
    generator = torch.Generator(device).manual_seed(0)
    out = []
    for p in joint.graph.find_nodes(op="placeholder"):
        if is_tangent(p):
            val = p.meta["val"]
            if val.is_floating_point():
                out.append(torch.randn(val.shape, dtype=val.dtype, device=device, generator=generator))
            else:
                out.append(torch.zeros(val.shape, dtype=val.dtype, device=device))
    return out


def _device_of(inputs: Sequence[torch.Tensor]) -> torch.device:
    return next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _replays(
    graph: RematGraph, joint: fx.GraphModule, inputs: Sequence[torch.Tensor], runs: int,
    around: Callable[[fx.Node], AbstractContextManager[object]],
) -> None:
    """Run the joint graph `runs` times in its own order on real tensors, each op of a compute
    node inside `around(op)`. The global RNG state is restored afterwards, so profiling draws
    nothing the user would notice."""
    members = {fx_name for node in graph.nodes for fx_name in node.fx_nodes}

    class Replay(fx.Interpreter):
        def run_node(self, n: fx.Node):
            if n.op != "call_function" or n.name not in members or n.target is operator.getitem:
                return super().run_node(n)
            with around(n):
                return super().run_node(n)

    # Planning may run inside AOTAutograd's trace, under its fake mode: there the kernels
    # would run on fake tensors and the times would be dispatch overhead, a small fraction of
    # the kernels' real times. Leave the fake mode, so real kernels run.
    if any(isinstance(t, FakeTensor) for t in inputs):
        raise ValueError("profiling needs real tensors, got fake ones")
    # A step traced under autocast holds its casts as ops of the graph (planning runs inside
    # that trace, under the user's autocast): autocast off, the graph runs as it was traced.
    # A replay measures the step: the user's hooks in it (`rkgraph.hooks`) do not run.
    with preserved_rng(), torch.no_grad(), unset_fake_temporarily(), torch._C._DisableAutocast(), hooks_muted():
        for _ in range(runs):
            Replay(joint).run(*inputs)


def measure_times(
    graph: RematGraph, joint: fx.GraphModule, inputs: Sequence[torch.Tensor], repeats: int = 3
) -> None:
    """Fill `time` of every compute node: the sum over its ops of each op's median time over
    `repeats` replays of the whole graph in order, after one untimed replay.

    `inputs` are the joint graph's placeholders in order (primals, then tangents). Timing whole
    replays, not each op `repeats` times in a row, gives every op the cache state and fresh
    allocations it meets in a step: ops recomputed inside a real step run slower than the same
    ops timed in place, warm, many times in a row.
    """
    device = _device_of(inputs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {}
    timing = False

    @contextmanager
    def timed(n: fx.Node) -> Iterator[None]:
        sync()
        start = time.perf_counter()
        yield
        sync()
        if timing:
            samples.setdefault(n.name, []).append(time.perf_counter() - start)

    _replays(graph, joint, inputs, 1, timed)  # warm-up: one-time allocations, caches, lazy init
    timing = True
    _replays(graph, joint, inputs, repeats, timed)
    for node in graph.nodes:
        node.time = sum(statistics.median(samples[n]) for n in node.fx_nodes if n in samples)


# Ops measured on synthetic inputs: PyTorch's own and ours (`rkgraph.rewrites`). Other
# namespaces are skipped: collectives would talk to other ranks, a user's hook
# (`rockplan::call_hook`) runs once and only in a step, and a library's op may have effects we
# cannot see.
_SYNTHETIC_NAMESPACES = frozenset({"aten", "prims", "rkgraph"})
# Tags of ops whose run on synthetic values means nothing: an output whose size depends on the
# values (nonzero, unique, masked_select). Draws are measured: the generators are restored after.
_UNSYNTHETIC_TAGS = frozenset({torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape})
# An assertion on synthetic values fails (on CUDA as a device-side assert, fatal to the process).
_UNSYNTHETIC_OPS = frozenset({torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg,
                              torch.ops.aten._assert_scalar.default,
                              torch.ops.aten._functional_assert_async.msg})
# Op signature -> (scratch bytes, what the op returns, described as `_described` does, the bytes
# of the storages it returned, as `_fresh_storages` gives them); scratch None and no storages
# where the op cannot run on synthetic inputs. The signature holds everything the kernel's
# choice of buffers depends on, so a measurement holds for the process.
_op_scratch: dict[tuple, tuple[int | None, object, object]] = {}
_OP_SCRATCH_HELD = 1 << 16  # signatures held before the oldest are dropped
# Op signature -> seconds of one call on synthetic inputs (`synthetic_times`); None where it
# cannot run on them.
_op_time: dict[tuple, float | None] = {}


class _Unsynthetic(Exception):
    """An argument no synthetic input can stand for: a symbolic size, a tensor subclass."""


_UNKNOWN = object()  # the description of a value no synthetic input can stand for


def _described(value: object) -> object:
    """`value` with each tensor replaced by ("tensor", shape, stride, dtype, device, storage
    offset, storage bytes): what a synthetic tensor is made from. The storage is part of it: a
    kernel may allocate by its input's storage, not its shape (a functional `copy` or `*_scatter`
    clones its input's whole storage, a view's base included). Raises _Unsynthetic for a
    symbolic size or stride, or for a tensor that is not plain and strided (a subclass, sparse)."""
    if isinstance(value, torch.Tensor):
        if not (type(value) is torch.Tensor or isinstance(value, FakeTensor)) or value.layout is not torch.strided:
            raise _Unsynthetic(type(value).__name__)
        shape, stride = tuple(value.shape), tuple(value.stride())
        offset, nbytes = value.storage_offset(), value.untyped_storage().nbytes()
        if not all(type(v) is int for v in (*shape, *stride, offset, nbytes)):
            raise _Unsynthetic("symbolic size")
        return ("tensor", shape, stride, value.dtype, value.device, offset, nbytes)
    if isinstance(value, (list, tuple)):
        return type(value)(_described(v) for v in value)
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise _Unsynthetic("symbolic value")
    return value


def _is_tensor_description(value: object) -> bool:
    return isinstance(value, tuple) and value[:1] == ("tensor",)


def _signature_of(arguments: object, described: dict[str, object], first: dict[str, int]) -> object:
    """A hashable form of an op's arguments: nodes by what `described` holds for them (tensors
    with the place of the node among the op's arguments, `first`, so that an argument given
    twice stays one tensor)."""
    if isinstance(arguments, fx.Node):
        value = described[arguments.name]
        if _is_tensor_description(value):
            return ("node", first.setdefault(arguments.name, len(first)), value)
        if value is _UNKNOWN or isinstance(value, (list, tuple)):  # a tensor list is given by its items
            raise _Unsynthetic(arguments.name)
        return ("const", value)
    if isinstance(arguments, (list, tuple)):
        return (type(arguments).__name__, *(_signature_of(v, described, first) for v in arguments))
    if isinstance(arguments, dict):
        return ("dict", *((k, _signature_of(v, described, first))
                          for k, v in sorted(arguments.items(), key=lambda kv: kv[0])))
    if isinstance(arguments, torch.Tensor | torch.SymInt | torch.SymFloat | torch.SymBool | torch.Generator):
        raise _Unsynthetic("a tensor or symbol that is no graph value, or a generator (the user's)")
    hash(arguments)  # dtypes, devices, numbers, strings, memory formats, None
    return ("const", arguments)


def _synthesizable(node: fx.Node) -> bool:
    """Whether `node`'s op can run on synthetic inputs (see `measure_op_scratch`)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace in _SYNTHETIC_NAMESPACES and target not in _UNSYNTHETIC_OPS
            and not any(tag in _UNSYNTHETIC_TAGS for tag in target.tags))


def _scratch_measured(node: fx.Node) -> bool:
    """Whether `node`'s op is run for its scratch (see `measure_op_scratch`): not our ops whose
    scratch the rewrites' table knows."""
    return _synthesizable(node) and not any(node.target in r.scratch for r in REWRITES)


def _synthetic(description: tuple, fills: dict[tuple, torch.Tensor] | None, own: bool = False) -> torch.Tensor:
    """A real tensor of the description's shape, strides, dtype, device and storage (offset and
    bytes): normal floats (one block drawn from a private generator, so the user's stream is
    untouched, and tiled: drawing every element would cost more than the ops measured), zeros
    otherwise, so that indices index the first element and masks select nothing. With no
    `fills`, a meta tensor.

    Unless `own`, the tensor's storage lies at the start of one filled buffer per dtype and
    device (`fills`), grown to the largest storage asked for: filling every input afresh cost
    more than running the ops, and inputs allocate nothing in the measured range either way. Its
    storage is one of the description's bytes, not the buffer (a storage over the buffer's
    memory that does not own it; the tensor holds the buffer), so that a kernel that allocates by
    its input's storage allocates what it does in the step. An op that writes into its inputs
    gets buffers of its `own`, so what it writes reaches no other op's inputs."""
    _, shape, stride, dtype, device, offset, nbytes = description
    elements = -(-nbytes // dtype.itemsize)
    if fills is None:
        return torch.empty(elements, dtype=dtype, device="meta").as_strided(shape, stride, offset)
    base = None if own else fills.get((dtype, device))
    if base is None or base.numel() < elements:
        base = _filled(max(elements, 1), dtype, device, fills)
        if not own:
            fills[dtype, device] = base
    if _storage_over is None:  # a torch without it: a view of the buffer, whose storage is the buffer's
        return base.as_strided(shape, stride, offset)
    storage = _storage_over(base.data_ptr(), base.device, nbytes)
    tensor = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)
    tensor.synthetic_buffer = base  # the storage does not own its memory: the buffer lives as long as the tensor
    return tensor


# A storage over memory it does not own (what inductor's CUDA graph trees use), private to torch.
_storage_over = getattr(torch._C, "_construct_storage_from_data_pointer", None)


def _filled(extent: int, dtype: torch.dtype, device: torch.device, fills: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """`extent` elements: normal floats tiled from one drawn block (`_synthetic`), else zeros."""
    if dtype.is_floating_point and dtype.itemsize > 1 or dtype.is_complex:
        block = fills.get(("block", dtype, device))
        if block is None:
            generator = torch.Generator(device).manual_seed(0)
            block = fills["block", dtype, device] = torch.randn(_FILL_BLOCK, dtype=dtype, device=device,
                                                                generator=generator)
        base = torch.empty(extent, dtype=dtype, device=device)
        whole = extent // _FILL_BLOCK * _FILL_BLOCK
        base[:whole].view(-1, _FILL_BLOCK).copy_(block)
        base[whole:].copy_(block[:extent - whole])
        return base
    return torch.zeros(extent, dtype=dtype, device=device)  # integers, booleans, float8 (no random fill)


_FILL_BLOCK = 4099  # elements drawn once per dtype and device; prime, so rows of a tensor differ


def _arguments(signature: object, made: dict[int, torch.Tensor],
               fills: dict[tuple, torch.Tensor] | None, own: bool = False) -> object:
    """The op's arguments rebuilt from their signature (`_signature_of`), tensors synthetic
    (`_synthetic`, with `own`)."""
    kind = signature[0]
    if kind == "node":
        _, place, description = signature
        if place not in made:
            made[place] = _synthetic(description, fills, own)
        return made[place]
    if kind == "const":
        return signature[1]
    if kind == "dict":
        return {k: _arguments(v, made, fills, own) for k, v in signature[1:]}
    parts = [_arguments(v, made, fills, own) for v in signature[1:]]
    return tuple(parts) if kind == "tuple" else parts


def _first_device(signature: object) -> torch.device | None:
    """The device of the first tensor among an op's arguments (`_signature_of`)."""
    if isinstance(signature, tuple):
        if signature[:1] == ("node",):
            return signature[2][4]
        if signature[:1] != ("const",):
            return next((d for part in signature[1:] if (d := _first_device(part)) is not None), None)
    return None


def _on_device(description: object, device: torch.device | None) -> object:
    """A description (`_described`) of meta tensors with their device set to `device`."""
    if _is_tensor_description(description):
        return (*description[:4], device, *description[5:])
    if isinstance(description, (list, tuple)):
        return type(description)(_on_device(d, device) for d in description)
    return description


def _run_synthetic(target: torch._ops.OpOverload, signature: tuple, fills: dict[tuple, torch.Tensor],
                   label: str) -> tuple[object, object]:
    """Call `target` once on synthetic inputs inside `record_function(label)`, and describe
    what it returned and the storages it allocated for it (`_fresh_storages`). The inputs are
    made before the range opens and everything is freed after it closes, so the range holds
    the call's own allocations, its outputs among them."""
    made: dict[int, torch.Tensor] = {}
    args, kwargs = _arguments(signature[1], made, fills, own=target._schema.is_mutable)
    sync = torch.cuda.synchronize if any(t.device.type == "cuda" for t in made.values()) else (lambda: None)
    sync()
    with record_function(label):
        result = target(*args, **kwargs)
        sync()  # scratch is freed in stream order: the call is over once the device is
    inputs = {t.untyped_storage().data_ptr() for t in made.values()}
    return _described(result), _fresh_storages(result, inputs)


def _fresh_storages(result: object, inputs: set[int]) -> object:
    """`result` with each tensor replaced by the bytes the allocator gave its storage
    (`rkgraph.build.storage_bytes`), and by None where it is no tensor or lives in one of the
    `inputs`' storages (by address). A kernel may allocate more than its output's shape needs
    and shrink it (the CPU EmbeddingBag's offset-to-bag map, one element longer): the storage
    keeps the bytes, and the fake tensor the graph was built from does not show them."""
    if isinstance(result, torch.Tensor):
        if result.layout is not torch.strided or result.untyped_storage().data_ptr() in inputs:
            return None
        return storage_bytes(result)
    if isinstance(result, (list, tuple)):
        return [_fresh_storages(r, inputs) for r in result]
    return None


def measure_op_scratch(graph: RematGraph, joint: fx.GraphModule, nodes: Iterable[str] | None = None) -> None:
    """Add to each compute node's `workspace` (of `nodes`, by name; all when None) the scratch its
    kernels allocate and free inside one op (the largest among the node's ops): each op called
    once on its own, on synthetic real tensors, under the allocator's events (`AllocatorEvents`);
    its scratch is its peak minus what it returns or keeps. No replay of the step, so planning
    needs no more memory than one op's inputs, outputs and scratch, which any schedule of the
    step holds anyway; and no real inputs, so it works on fake tensors, on every rank alike.

    The ops run in the graph's order, each on tensors of the shapes, strides and dtypes its
    inputs' ops really returned (a fake tensor's can differ: a CPU batch norm of bfloat16 saves
    float32 statistics, and its backward then converts its input, scratch the fake dtype would
    not show). Each op signature (op, arguments' shapes, strides, dtypes and devices, other
    arguments, the CPU's thread count, which sizes kernels' per-thread buffers) is measured
    once for the process: a model's identical layers cost one call.

    Ops not run on synthetic inputs take our own ops' known scratch (the rewrites' table,
    `rkgraph.rewrites.known_scratch`; 0 for any other op): our ops the table knows (their
    bounds are checked against the allocator in the rewrites' tests, and these ops, written
    in Python a slice at a time, cost the most to run), those of other namespaces than PyTorch's
    and ours (collectives, users' hook calls, libraries' ops), ops whose output size depends on
    values, assertions, ops on symbolic sizes or tensor subclasses, and any op that fails on
    the synthetic values. Draws are measured, the generators restored after."""
    fx_nodes = {n.name: n for n in joint.graph.nodes}
    names = None if nodes is None else set(nodes)
    wanted = [node for node in graph.nodes if names is None or node.name in names]
    signatures = _op_signatures(joint)

    def scratch(name: str) -> int:
        measured = _op_scratch.get(signatures.get(name), (None,))[0]
        return known_scratch(fx_nodes[name]) if measured is None else measured

    for node in wanted:
        node.workspace += max((scratch(name) for name in node.fx_nodes), default=0)
    _grow_to_real_storages(graph, fx_nodes, signatures, wanted)


def _grow_to_real_storages(graph: RematGraph, fx_nodes: dict[str, fx.Node], signatures: dict[str, tuple],
                           wanted: list[ComputeNode]) -> None:
    """Give each data node an op made the bytes the op's real kernel allocated for it, where
    they exceed what its fake tensor says (`_fresh_storages`): a step holds the real storage
    as long as the value, and a plan on the fake size overruns its budget by the difference.
    Every data node: a variant's (`lean_variant`) come from building, not from its reference.
    A value that lives inside its node (no data node) adds the difference to the workspace of
    the nodes in `wanted`, those whose scratch is measured here. `fx_nodes`: the joint graph's
    nodes by name."""
    group_of = {fx_name: node for node in graph.nodes for fx_name in node.fx_nodes}
    wanted_names = {node.name for node in wanted}
    for name, signature in signatures.items():
        measured = _op_scratch.get(signature)
        if measured is None or measured[2] is None:
            continue
        op, real = fx_nodes[name], measured[2]
        if isinstance(real, list):  # one value per returned tensor, each read by a getitem
            values = [(user.name, real[user.args[1]]) for user in op.users if user.target is operator.getitem]
        else:
            values = [(name, real)]
        for value, real_bytes in values:
            val = fx_nodes[value].meta.get("val")
            if real_bytes is None or not isinstance(val, torch.Tensor) or real_bytes <= (shaped := storage_bytes(val)):
                continue
            data = graph.data.get(value)
            if data is not None and data.producer is not None:
                data.size = max(data.size, real_bytes)
            elif data is None and (node := group_of.get(name)) is not None and node.name in wanted_names:
                node.workspace += real_bytes - shaped


def synthetic_times(graph: RematGraph, joint: fx.GraphModule, nodes: Iterable[str],
                    repeats: int = 3) -> dict[str, float]:
    """Seconds of each compute node of `nodes` (by name) whose ops all run on synthetic inputs
    (`measure_op_scratch`'s): the sum over its ops of each op's median time over `repeats`
    calls, after one untimed call. Each op signature is timed once for the process, so
    identical layers cost one op's calls, and no replay of the step is needed: a graph's few
    ops of its own (a rewrite's fused ops) are timed without running the whole graph again.
    An op timed alone, warm, runs faster than in a step (`measure_times`): callers put these
    times on a replay's clock."""
    fx_nodes = {n.name: n for n in joint.graph.nodes}
    signatures = _op_signatures(joint)
    wanted = set(nodes)
    seconds: dict[str, float] = {}
    with (preserved_rng(), torch.no_grad(), unset_fake_temporarily(), torch._C._DisableAutocast(), hooks_muted()):
        for node in graph.nodes:
            if node.name not in wanted:
                continue
            ops = [fx_nodes[name] for name in node.fx_nodes]
            ops = [op for op in ops if op.op == "call_function" and op.target is not operator.getitem]
            times = [_op_seconds(op.target, signatures[op.name], repeats) if op.name in signatures else None
                     for op in ops]
            if None not in times:
                seconds[node.name] = sum(times)
    return seconds


def _op_seconds(target: torch._ops.OpOverload, signature: tuple, repeats: int) -> float | None:
    """The median time of `repeats` calls of `target` on synthetic inputs of `signature`, after
    one untimed call; None when it cannot run on them. Held for the process."""
    if signature in _op_time:
        return _op_time[signature]
    made: dict[int, torch.Tensor] = {}
    seconds = None
    try:
        args, kwargs = _arguments(signature[1], made, {}, own=True)
        sync = torch.cuda.synchronize if any(t.device.type == "cuda" for t in made.values()) else (lambda: None)
        samples = []
        for _ in range(repeats + 1):
            sync()
            start = time.perf_counter()
            target(*args, **kwargs)
            sync()
            samples.append(time.perf_counter() - start)
        seconds = statistics.median(samples[1:])
    except Exception as e:  # noqa: BLE001  (any failure: not timed, as documented)
        log.debug("%s not timed on synthetic inputs: %s", target, e)
    _op_time[signature] = seconds
    _held(_op_time)
    return seconds


def joint_device(joint: fx.GraphModule) -> torch.device:
    """The device of the joint graph's first tensor input, as traced (CPU when it has none)."""
    return next((v.device for p in joint.graph.find_nodes(op="placeholder")
                 if isinstance(v := p.meta.get("val"), torch.Tensor)), torch.device("cpu"))


def _op_signatures(joint: fx.GraphModule) -> dict[str, tuple]:
    """The signature of each op of `joint` that can run on synthetic inputs, by fx node name,
    measuring the scratch of the signatures the cache lacks (`measure_op_scratch`)."""
    device = joint_device(joint)
    recorded: dict[tuple, str] = {}
    if device.type == "cuda":
        torch.cuda.init()  # before its generators are saved: draws on a fresh context restore too
    try:
        signatures = _run_ops(joint, device, recorded)
    except BaseException:
        for signature in recorded:  # unread: measured again next time, not held unmeasured
            _op_scratch.pop(signature, None)
        raise
    _held(_op_scratch)
    return signatures


def _held(cache: dict) -> None:
    """Drop a per-signature cache's oldest entries beyond `_OP_SCRATCH_HELD`."""
    while len(cache) > _OP_SCRATCH_HELD:
        del cache[next(iter(cache))]


def _run_ops(joint: fx.GraphModule, device: torch.device, recorded: dict[tuple, str]) -> dict[str, tuple]:
    """`_op_signatures`' loop: each op in order, on what its inputs' ops returned; the signatures
    it measures go into `recorded` (signature -> its range's label) as they run."""
    described: dict[str, object] = {}
    signatures: dict[str, tuple] = {}  # fx node name -> its op's signature, for the synthesizable ops
    fills: dict[tuple, torch.Tensor] = {}
    labels = (f"rkgraph::op{i}" for i in itertools.count())  # one per call: failed calls' ranges too

    def fake(node: fx.Node) -> object:
        try:
            return _described(node.meta.get("val"))
        except _Unsynthetic:
            return _UNKNOWN

    # Planning may run inside AOTAutograd's trace, under its fake mode, and under the user's
    # autocast: leave both, so real kernels run as the graph was traced; the user's hooks and
    # generators are left alone, as in `_replays`.
    with (preserved_rng(), torch.no_grad(), unset_fake_temporarily(), torch._C._DisableAutocast(), hooks_muted(),
          AllocatorEvents(device) as events):
        for node in joint.graph.nodes:
            if node.target is operator.getitem and isinstance(parent := described.get(node.args[0].name), list | tuple):
                described[node.name] = parent[node.args[1]]
                continue
            signature = None
            if _synthesizable(node):
                try:
                    signature = (str(node.target), _signature_of((node.args, node.kwargs), described, {}),
                                 torch.get_num_threads())
                except (_Unsynthetic, TypeError):  # TypeError: an unhashable argument
                    pass
            if signature is not None:
                signatures[node.name] = signature
            if signature is None or not _scratch_measured(node):
                described[node.name] = fake(node)
                continue
            if signature not in _op_scratch and node.target.is_view:
                # A view allocates nothing: only its strides are wanted, which its meta kernel
                # gives as the real one does, without making or reading its input.
                args, kwargs = _arguments(signature[1], {}, None)
                with contextlib.suppress(Exception):  # no meta kernel: run as the other ops are
                    _op_scratch[signature] = (0, _on_device(_described(node.target(*args, **kwargs)),
                                                           _first_device(signature[1])), None)
            if signature not in _op_scratch:
                label = next(labels)
                storages = None
                try:
                    returned, storages = _run_synthetic(node.target, signature, fills, label)
                    recorded[signature] = label
                except Exception as e:  # noqa: BLE001  (any failure: not measurable, as documented)
                    log.debug("scratch of %s not measured on synthetic inputs: %s", node.target, e)
                    returned = fake(node)
                _op_scratch[signature] = (None, returned, storages)
            described[node.name] = _op_scratch[signature][1]
    for signature, label in recorded.items():
        span = events.ranges.get(label)
        if span is not None:
            peak, current = events.replay(*span)
            _op_scratch[signature] = (max(peak - max(current, 0), 0), *_op_scratch[signature][1:])
    return signatures


def measure_scratch(
    graph: RematGraph, joint: fx.GraphModule, inputs: Sequence[torch.Tensor], warm_up: bool = True
) -> None:
    """Add to each compute node's `workspace` the scratch its kernels allocate and free inside
    one op (the largest among the node's ops), read from the allocator's events of one replay.
    Profiles use `measure_op_scratch` (the same figures, without the store-everything memory
    this replay needs); this is its check.

    `inputs` as for `measure_times`. `warm_up` replays once before recording, so one-time
    allocations (caches) are not taken for scratch; not needed right after `measure_times`.
    """
    device = _device_of(inputs)

    def labelled(n: fx.Node) -> AbstractContextManager[object]:
        return record_function(f"rkgraph::{n.name}")

    if warm_up:
        _replays(graph, joint, inputs, 1, labelled)
    with AllocatorEvents(device) as recorded:
        _replays(graph, joint, inputs, 1, labelled)
    group_of = {fx_name: node for node in graph.nodes for fx_name in node.fx_nodes}
    scratch = dict.fromkeys((node.name for node in graph.nodes), 0)
    for fx_name, node in group_of.items():
        span = recorded.ranges.get(f"rkgraph::{fx_name}")
        if span is not None:
            peak, current = recorded.replay(*span)
            scratch[node.name] = max(scratch[node.name], peak - max(current, 0))
    for node in graph.nodes:
        node.workspace += scratch[node.name]


def share_profile(graph: RematGraph, reference: RematGraph) -> list[str]:
    """Give each node of `graph`, a variant of `reference`'s graph (`lean_variant`), made of the
    same fx nodes as one of `reference`'s the time and workspace of that node, so that plans of
    both compare on the same costs; returns the names of the others, the variant's own nodes
    (what its rewrites made), for the caller to cost."""
    same = {node.name: node for node in reference.nodes}
    own = []
    for node in graph.nodes:
        other = same.get(node.name)
        if other is not None and other.fx_nodes == node.fx_nodes:
            node.time, node.workspace = other.time, other.workspace
        else:
            own.append(node.name)
    return own
