"""Per-node time: measured on real tensors, or estimated from FLOPs and bytes moved.

Measuring replays the joint graph once in its own order (what autograd would keep alive), so
it needs the store-everything memory; when that fails, or when asked, the estimate is used.
The estimate is a roofline: max(flops / peak_flops, bytes / bandwidth), with rough device
figures; solvers only compare times relative to each other.
"""

from __future__ import annotations

import logging
import operator
import statistics
import time
from collections.abc import Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils.flop_counter import flop_registry

from rkgraph.graph import RematGraph

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


def estimate_times(graph: RematGraph, joint: fx.GraphModule, device: str = "cpu") -> None:
    """Fill `time` of every compute node with the roofline estimate."""
    flops_per_s, bytes_per_s = _DEVICE_SPEED.get(device, _DEVICE_SPEED["cpu"])
    fx_nodes = {n.name: n for n in joint.graph.nodes}
    for node in graph.nodes:
        members = [fx_nodes[n] for n in node.fx_nodes if fx_nodes[n].target is not operator.getitem]
        node.time = sum(max(node_flops(n) / flops_per_s, _bytes_moved(n) / bytes_per_s) for n in members)


def random_tangents(joint: fx.GraphModule, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Real tensors for the joint graph's tangent placeholders (gradients of the outputs).

    Drawn from a private generator: the user's RNG stream is left alone.
    """
    generator = torch.Generator(device).manual_seed(0)
    out = []
    for p in joint.graph.find_nodes(op="placeholder"):
        if p.name.startswith("tangents"):
            val = p.meta["val"]
            if val.is_floating_point():
                out.append(torch.randn(val.shape, dtype=val.dtype, device=device, generator=generator))
            else:
                out.append(torch.zeros(val.shape, dtype=val.dtype, device=device))
    return out


def measure_times(
    graph: RematGraph, joint: fx.GraphModule, inputs: Sequence[torch.Tensor], repeats: int = 3
) -> None:
    """Fill `time` of every compute node with the median of `repeats` timed runs on real tensors.

    `inputs` are the joint graph's placeholders in order (primals, then tangents). The global
    RNG state is restored afterwards, so profiling draws nothing the user would notice.
    """
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    group_of = {fx_name: node for node in graph.nodes for fx_name in node.fx_nodes}
    times = {node.name: 0.0 for node in graph.nodes}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    class Timer(fx.Interpreter):
        def run_node(self, n: fx.Node):
            if n.op != "call_function" or n.name not in group_of or n.target is operator.getitem:
                return super().run_node(n)
            samples = []
            for _ in range(repeats + 1):  # the first run warms up
                sync()
                start = time.perf_counter()
                result = super().run_node(n)
                sync()
                samples.append(time.perf_counter() - start)
            times[group_of[n.name].name] += statistics.median(samples[1:])
            return result

    try:
        # Planning may run inside AOTAutograd's trace, under its fake mode: there the kernels
        # would run on fake tensors and the times would be dispatch overhead (a 20 ms
        # convolution measured 0.6 ms). Leave the fake mode, so real kernels run.
        if any(isinstance(t, FakeTensor) for t in inputs):
            raise ValueError("measure_times needs real tensors, got fake ones")
        with torch.no_grad(), unset_fake_temporarily():
            Timer(joint).run(*inputs)
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    for node in graph.nodes:
        node.time = times[node.name]
