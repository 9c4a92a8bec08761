"""rkgraph: capture a training step as a RematGraph (knows nothing of solvers or codegen)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from rkgraph.blocks import split_into_blocks
from rkgraph.build import build_graph
from rkgraph.capture import CaptureError, JointGraph, trace_joint
from rkgraph.graph import ComputeNode, DataNode, RematGraph, node_keys
from rkgraph.profile import (
    AllocatorEvents,
    RescaledTimes,
    estimate_times,
    estimated_times,
    joint_device,
    measure_op_scratch,
    measure_scratch,
    measure_times,
    random_tangents,
    share_profile,
    synthetic_times,
)
from rkgraph.rewrites import REWRITES, apply_rewrites, lean_rewrites, lean_variant

log = logging.getLogger(__name__)

__all__ = [
    "REWRITES", "AllocatorEvents", "CaptureError", "ComputeNode", "DataNode", "JointGraph", "RematGraph",
    "RescaledTimes", "apply_rewrites", "build_graph", "capture", "capture_joint", "estimate_times",
    "estimated_times", "lean_rewrites", "lean_variant", "measure_op_scratch", "measure_scratch", "measure_times",
    "node_keys", "profile_graph", "random_tangents", "replayed_times", "share_profile", "split_into_blocks",
    "synthetic_times",
]


def capture_joint(model: torch.nn.Module, args: Any, kwargs: dict | None = None) -> JointGraph:
    """Trace one training step of `model` on `args`/`kwargs` and return the joint graph, with the
    rewrites that always apply applied (`rkgraph.rewrites`)."""
    return apply_rewrites(trace_joint(model, args, kwargs))


def profile_graph(
    graph: RematGraph, joint: JointGraph, real_inputs: list[torch.Tensor] | None,
    mode: Literal["measure", "estimate"] | Mapping[str, float] | RescaledTimes = "measure",
    reference: RematGraph | None = None,
) -> None:
    """Set node costs. Times: measured on `real_inputs` (primals) when possible, else
    estimated; or, when `mode` maps node names to seconds (another plan's graph of the same
    model and sample), taken from it, so that plans compared are planned on the same costs; or
    a held plan's times at other input shapes, rescaled to these (`RescaledTimes`).
    Kernels' scratch memory is added to node workspaces, in every mode, from each op called
    alone on synthetic inputs (`measure_op_scratch`): no real inputs and no replay of the step
    are needed, so it holds for estimated profiles, on fake tensors and on every rank alike, and
    needs no more memory than one op's. It agrees with what a store-everything replay of the
    step reads from the allocator's events (`measure_scratch`), node by node.

    With `reference`, the costed graph `graph` is a variant of (`lean_variant`), nodes made of
    the same fx nodes take its costs (`share_profile`), so that plans of both compare on the
    same costs, and only the variant's own nodes are costed here. Unless `mode` is "estimate",
    they are timed op by op on synthetic inputs (`synthetic_times`; no replay of the variant,
    which would cost as many steps as the reference's profile again) and put on the
    reference's clock: scaled by the reference's time for the ops they replace over those ops'
    own times on synthetic inputs, the same work in the same step (an op timed alone, warm,
    runs faster than in a step). Priced instead as the reference's ops they replace, they come
    out too cheap: fused attentions and the packing and unpacking of masks take longer than the
    ops they stand for. An own node that cannot run on synthetic inputs takes its estimate on
    the reference's clock. Their scratch is measured op by op (`measure_op_scratch`)."""
    # The device traced on, not the real inputs': a sharded or fake-tensor plan has none, and
    # the variant must be estimated at the same speeds as its reference.
    device = joint_device(joint.module).type
    if reference is not None:
        _profile_variant(graph, joint, mode != "estimate", reference, device)
        return
    measured = False
    if isinstance(mode, RescaledTimes):
        rescaled = mode.rescaled(graph, joint.module, device)
        if rescaled is None:
            log.info("the held plan's times cover too little of %s's graph: profiled anew (%s)", graph.name,
                     mode.otherwise)
            mode = mode.otherwise
        else:
            mode = rescaled
    if isinstance(mode, Mapping):
        names = [node.name for node in graph.nodes]
        missing, extra = [n for n in names if n not in mode], sorted(set(mode) - set(names))
        if missing or extra:
            raise ValueError(f"the given profile is for another graph (another model or input shape): it has no "
                             f"time for {len(missing)} of this graph's {len(names)} nodes"
                             f"{f' (first: {missing[0]!r})' if missing else ''} and {len(extra)} nodes this graph "
                             f"lacks{f' (first: {extra[0]!r})' if extra else ''}")
        for node in graph.nodes:
            node.time = float(mode[node.name])
    elif mode == "measure" and real_inputs is not None:
        measured = replayed_times(graph, joint, real_inputs)
    if not measured and not isinstance(mode, Mapping):
        estimate_times(graph, joint.module, device)
    measure_op_scratch(graph, joint.module)


def replayed_times(graph: RematGraph, joint: JointGraph, real_inputs: list[torch.Tensor]) -> bool:
    """Set `graph`'s node times to those measured in replays of the step on `real_inputs` (the
    primals; tangents drawn) (`measure_times`): `profile_graph`'s measured times, for a graph
    costed already (a planner that needs them only once the budget is known to be worth
    planning). False, the times left as they were, when the store-everything replay does not fit."""
    device = joint_device(joint.module).type
    # The runtime plans inside AOTAutograd's trace, under its fake mode: tangents drawn there,
    # and kernels run there, would be fake (times of dispatch, not of compute).
    with unset_fake_temporarily():
        try:
            measure_times(graph, joint.module, [*real_inputs, *random_tangents(joint.module, device)])
            return True
        except torch.OutOfMemoryError:  # the store-everything replays do not fit
            log.warning("node times estimated: the store-everything replay does not fit")
            return False


def _profile_variant(graph: RematGraph, joint: JointGraph, measure: bool, reference: RematGraph,
                     device: str) -> None:
    """`profile_graph` for a variant of `reference`'s graph (see there), traced on `device`."""
    estimate_times(graph, joint.module, device)
    estimates = {node.name: node.time for node in graph.nodes}
    own = set(share_profile(graph, reference))
    measure_op_scratch(graph, joint.module, own)
    if not measure or not own:
        return
    timed = synthetic_times(graph, joint.module, own)
    # The reference's ops the variant's own ones replace: the same work in the same step,
    # timed alone as the own ops are, give the clock from alone to in the step.
    same = {node.name: node.fx_nodes for node in graph.nodes}
    replaced = {node.name: node.time for node in reference.nodes if same.get(node.name) != node.fx_nodes}
    alone = synthetic_times(reference, reference.joint.module, replaced)
    clock = _ratio(sum(replaced[name] for name in alone), sum(alone.values()))
    shared = [node for node in graph.nodes if node.name not in own]
    estimated_clock = _ratio(sum(node.time for node in shared), sum(estimates[node.name] for node in shared))
    for node in graph.nodes:
        if node.name in own:  # an op that cannot run on synthetic inputs: its estimate, on the reference's clock
            node.time = timed[node.name] * clock if node.name in timed else estimates[node.name] * estimated_clock


def _ratio(seconds: float, per: float) -> float:
    """`seconds` over `per`: how many seconds of one clock one of another is worth (1 with no
    second of the other to compare)."""
    return seconds / per if per > 0 else 1.0


def capture(
    model: torch.nn.Module, args: Any, kwargs: dict | None = None, *,
    profile: Literal["measure", "estimate"] = "estimate",
) -> RematGraph:
    """The RematGraph of one training step of `model` on the sample, with times and blocks.

    `args` is a tensor or a tuple of positional arguments. The joint fx graph is attached as
    `graph.joint`. Nothing in the model (parameters, buffers, RNG state) is changed.
    """
    from rkgraph.capture import flat_tensors, flatten_call

    joint = capture_joint(model, args, kwargs)
    graph = build_graph(joint, name=type(model).__name__)
    graph.joint = joint
    args_t = args if isinstance(args, tuple) else (args,)
    real = flat_tensors(model, flatten_call(model, args_t, kwargs or {}), args_t, kwargs or {})
    profile_graph(graph, joint, real, profile)
    split_into_blocks(graph)
    return graph
