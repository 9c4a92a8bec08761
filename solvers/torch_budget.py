"""Baseline: PyTorch's own choice, `min_cut_rematerialization_partition` under
`torch._functorch.config.activation_memory_budget`, expressed as a Schedule on our graph.

This is what `torch.compile` does for the same training step, so it is the comparison users
ask for first. The partitioner splits the joint graph into a forward module, which returns what
it saves for the backward, and a backward module, which recomputes whatever else it needs. Its
fx node names survive the split (recomputed nodes keep their joint names), so its decision reads
back as "which joint storages cross the phase boundary". We replay that decision on our compute
nodes: the forward runs every forward node in graph order; in the backward, just before the
first backward node that reads a forward value the partitioner did not save, the forward nodes
producing it (and their own unsaved inputs) are recomputed in graph order. Frees go at last use.

Our compute nodes group a head op with its pointwise successors, so where PyTorch recomputes
only the tail of a group (a GELU from a saved matmul) we recompute the whole group: the time is
then a little above what PyTorch's own backward spends.

The knob is a ratio of activation memory, estimated by PyTorch's own cost model, not a byte
budget; given bytes, `solve_torch_budget` bisects the ratio for the fastest schedule whose
simulated peak fits.
"""

from __future__ import annotations

import copy
import operator
import time
import warnings
from dataclasses import dataclass

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, schedule_from_computes, to_recompute


@dataclass
class PartitionerChoice:
    """What the partitioner decided at one ratio, in the joint graph's fx node names."""

    ratio: float
    saved: list[str]  # tensors the forward module hands to the backward module
    recomputed: list[str]  # forward fx nodes the backward module runs again


def partitioner_choice(graph: RematGraph, ratio: float) -> PartitionerChoice:
    """Run PyTorch's min-cut partitioner on a copy of `graph.joint` at `activation_memory_budget=ratio`."""
    import torch
    from torch._functorch import config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from rkgraph.capture import is_tangent

    joint = graph.joint
    # The partitioner rewrites the graph it is given; graph.joint must stay as captured.
    # Outside any fake mode (the runtime plans inside AOTAutograd's trace): under one, copying a
    # real constant of the module (ResNet's) fails to set a meta tensor's storage to a CPU one.
    with warnings.catch_warnings(), unset_fake_temporarily():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation, from deepcopy
        module = copy.deepcopy(joint.module)
    # The partitioner knows random ops by a list of ATen's: it would recompute our dropout
    # mask draws (rkgraph.rewrites.dropout), and its CSE would merge those of one shape (no tensor
    # inputs, equal arguments). Marked as values to save, and CSE off. What CSE would merge
    # besides is small: on GPT, each layer's copy of the causal mask (ones, tril, where).
    # Our fused head (rkgraph.rewrites.linear_cross_entropy) is the head's forward and backward products
    # in one op: unmarked, the partitioner remakes it in the backward to spare its [V, E]
    # output (all three of the head's products again, a large share of a language model's
    # step), a trade the unfused graph never offered it. Saved too, so that it plans the graph
    # it would have planned.
    from torch.utils.checkpoint import CheckpointPolicy

    for target in (torch.ops.rkgraph.dropout_mask.default, torch.ops.rkgraph.linear_cross_entropy.default):
        for node in module.graph.find_nodes(op="call_function", target=target):
            for marked in (node, *(u for u in node.users if u.target is operator.getitem)):
                marked.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    with config.patch(activation_memory_budget=ratio, cse=False):
        _, backward = min_cut_rematerialization_partition(module, None, num_fwd_outputs=joint.num_fwd_outputs)
    joint_nodes = {n.name: n for n in joint.module.graph.nodes}
    saved = []
    for p in backward.graph.find_nodes(op="placeholder"):
        if is_tangent(p) or not isinstance(p.meta.get("val"), torch.Tensor):
            continue  # tangents are not saved; symbolic sizes hold no memory
        if p.name not in joint_nodes:
            raise ValueError(f"the partitioner saves {p.name}, which is no node of the joint graph")
        saved.append(p.name)
    forward_names = {n.name for n in joint.module.graph.nodes
                     if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward"}
    recomputed = [n.name for n in backward.graph.nodes if n.op == "call_function" and n.name in forward_names]
    return PartitionerChoice(ratio, saved, recomputed)


def computes_for_choice(graph: RematGraph, choice: PartitionerChoice) -> tuple[list[str], dict[str, object]]:
    """The compute order that keeps what the partitioner saves and recomputes the rest, plus
    diagnostics: how many nodes are recomputed and which unsaved outputs of random nodes had to
    be kept (those could not be recomputed without drawing a new mask)."""
    from rkgraph.build import storage_map

    storage_of = storage_map(graph.joint.module).storage_of
    saved = {storage_of[name] for name in choice.saved if name in storage_of}
    handed = saved | set(graph.user_outputs) | set(graph.tangents)
    # Random draws are never made again (nor does the partitioner remake them): those the
    # backward needs and the partitioner did not save are kept from the forward.
    drawn = {d for n in graph.forward_nodes if n.random for d in n.outputs}
    available = handed | drawn
    computes = [n.name for n in graph.forward_nodes]
    recomputed: set[str] = set()
    kept_random: dict[str, None] = {}
    for node in graph.backward_nodes:
        again = sorted(to_recompute(graph, node.inputs, available), key=graph.index.__getitem__)
        for name in (*again, node.name):
            kept_random.update((d, None) for d in graph.node(name).inputs if d in drawn and d not in handed)
            computes.append(name)
            available.update(graph.node(name).outputs)
        recomputed.update(again)
    return computes, {"saved": len(saved), "recomputed_nodes": len(recomputed), "kept_random": list(kept_random)}


def _schedule_at(graph: RematGraph, ratio: float, budget: int | None) -> Schedule:
    choice = partitioner_choice(graph, ratio)
    computes, extra = computes_for_choice(graph, choice)
    return schedule_from_computes(graph, computes, len(graph.forward_nodes), solver="torch_budget",
                                  budget=budget, extra={"ratio": ratio, **extra})


def solve_torch_budget(graph: RematGraph, budget: int | None = None, ratio: float | None = None,
                       grid_points: int = 9, bisection_steps: int = 3) -> Schedule:
    """PyTorch's partitioner's schedule for `graph` (captured: `graph.joint` is needed).

    `ratio` set: use that `activation_memory_budget` (a budget, if given, is only checked).
    Else, with a byte `budget`, search the ratio (see `_search_ratio`); the chosen one is in
    `schedule.extra["ratio"]`, every ratio tried and its peak in `extra["probes"]`. Without
    either, ratio 1 (PyTorch's default).
    Raises ValueError for graphs without a joint fx graph (imported ones), InfeasibleBudget when
    no ratio tried fits.
    """
    if graph.joint is None:
        raise ValueError(f"graph {graph.name!r} has no joint fx graph (imported graphs have none): "
                         "PyTorch's partitioner works on captured graphs only")
    start = time.perf_counter()
    if ratio is not None or budget is None:
        schedule = _schedule_at(graph, 1.0 if ratio is None else ratio, budget)
    else:
        schedule = _search_ratio(graph, budget, grid_points, bisection_steps)
    schedule.solve_time = time.perf_counter() - start
    return schedule


def _search_ratio(graph: RematGraph, budget: int, grid_points: int, bisection_steps: int) -> Schedule:
    """The fastest schedule that fits among the ratios tried.

    Plain bisection on the ratio does not work: the simulated peak is not monotone in it. The
    partitioner bounds what crosses the phase boundary, not the backward's peak; at low ratios
    it saves almost nothing and the backward recomputes most of the forward at once, which
    brings the peak back up to store-all's at ratio 0. So: ratio 1 if it fits; else a grid of
    `grid_points` ratios over [0, 1], then bisection between the fastest fitting grid ratio
    and the next grid ratio up (larger ratios save more, so they tend to recompute less).
    """
    probes: dict[float, Schedule] = {}

    def fits(ratio: float) -> bool:
        if ratio not in probes:
            probes[ratio] = _schedule_at(graph, ratio, None)
        return probes[ratio].predicted_peak <= budget

    if not fits(1.0):
        step = 1 / (grid_points - 1)
        fitting = [r for r in (i * step for i in range(grid_points)) if fits(r)]
        if not fitting:
            lowest = min(probes.values(), key=lambda s: s.predicted_peak)
            raise InfeasibleBudget(
                f"PyTorch's partitioner cannot fit {budget} bytes ({format_bytes(budget)}): its lowest peak, at "
                f"activation_memory_budget={lowest.extra['ratio']:.3f}, is {lowest.predicted_peak} bytes "
                f"({format_bytes(lowest.predicted_peak)})")
        low = min(fitting, key=lambda r: probes[r].predicted_time)
        high = low + step
        for _ in range(bisection_steps):
            middle = (low + high) / 2
            if fits(middle):
                low = middle
            else:
                high = middle
    best = min((s for s in probes.values() if s.predicted_peak <= budget), key=lambda s: s.predicted_time)
    best.budget = budget
    best.extra["probes"] = {r: s.predicted_peak for r, s in sorted(probes.items())}
    return best
