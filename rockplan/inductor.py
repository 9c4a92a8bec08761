"""Inductor for a planned step: `Rockmate(..., backend="inductor")` compiles the generated
forward and backward with Inductor instead of running their fx code as it is."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._dynamo.backends.debugging import boxed_nop

from rkgraph.capture import is_tangent


def decompositions() -> dict:
    """Inductor's decomposition table, for tracing the step as torch.compile would."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def measured_step_peak(compiled: Callable[..., Any], tensors: list[torch.Tensor], num_params: int) -> int:
    """Bytes the planned step `compiled` (AOTAutograd's callable over parameters, buffers and
    input tensors, in that order) allocates at its peak: its forward, then its backward from
    all-ones output gradients, on real tensors (as measured profiles run), after one warm-up
    step (Inductor's first call allocates once). Nothing of the model changes: the step runs
    on detached parameters (their gradients are dropped) and on copies of the other tensors
    (buffers it updates), the user's random stream is restored, and the model's hooks do not run."""
    from rkgraph.capture import preserved_rng
    from rkgraph.hooks import hooks_muted
    from rockplan.memory import MemoryTracker

    def step() -> None:
        leaves = [t.detach().requires_grad_(t.requires_grad) if i < num_params
                  else t.detach().clone().requires_grad_(t.requires_grad) for i, t in enumerate(tensors)]
        with MemoryTracker(device) as tracker:
            outputs = [o for o in pytree.tree_leaves(compiled(*leaves))
                       if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            del outputs
        peaks.append(tracker.peak)

    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    peaks: list[int] = []
    with preserved_rng(), torch.enable_grad(), hooks_muted():
        step()
        step()
    return peaks[-1]


def seed_random_ops(joint: fx.GraphModule) -> int:
    """Rewrite `joint`'s random ops as Inductor's seeded ones, as torch.compile does to the joint
    graph before partitioning it (Inductor's joint-graph passes); returns how many were rewritten.

    Inductor lowers no `aten.rand` of its own: torch.compile replaces each by
    `inductor_random(shape, lookup_seed(seeds, i))`, with one `inductor_seeds` draw from the
    device's generator per step. Our partition step stands in for torch.compile's, so it must
    do the same, or Inductor refuses the graph. A seeded op is a function of its seed, so a
    recomputed dropout draws the same mask without any replay: only the seeds' draw (an op
    tagged random, so planned to run once) must not run twice. With `fallback_random` set,
    Inductor runs the random ops as ATen's kernels instead, and they stay as they are.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.replace_random import replace_random_passes
    from torch._inductor.virtualized import V

    if config.fallback_random:
        return 0
    values = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")]
    with V.set_fake_mode(detect_fake_mode(values)):  # the new nodes' values are made in it
        count = replace_random_passes(joint)
    if count:
        joint.graph.lint()
        joint.recompile()
    return count


def inductor_compiler(num_fwd_outputs: Callable[[], int]) -> Callable[[fx.GraphModule, Any], Any]:
    """AOTAutograd's compiler for one planned step: Inductor for real tensors; the fx code
    itself for the fake call that triggers planning, since Inductor's kernels allocate real
    buffers. `num_fwd_outputs()` says how many of the forward's outputs are its own (the rest
    are what it hands to the backward); it is asked once the partition step has planned.

    Inductor compiles the forward and the backward as two graphs and picks the layout of what
    the forward returns: with convolutions its layout optimization makes activations (and the
    weights it converts) channels-last, so what the forward hands to the backward need not
    have the strides the joint graph traced, which our backward placeholders carry. Under
    torch.compile, AOTAutograd collects the forward's output strides from the compiler
    (`TracingContext.report_output_strides`) and restrides the backward's example inputs to
    them before compiling it (`_aot_stage2b_bw_compile`); that needs a TracingContext, which
    Dynamo sets up and a bare `aot_function` does not. So this compiler does the same: the
    forward compiles first (AOTAutograd's order) and its output strides are kept; the
    backward's leading inputs (all but the tangents) are the forward's trailing outputs in
    order (codegen's convention, AOTAutograd's), and take those strides in the example inputs
    and in the placeholders' metadata. Like compile_fx's forward and backward compilers, it
    keeps eager's strides for what users see: the forward's own outputs and the gradients.
    """
    # Inductor's decompositions call into its lowerings (max-pool asks
    # torch._inductor.lowering whether to fall back), which torch.compile has imported by the
    # time it traces; a bare aot_function has not.
    from torch._inductor import config, lowering  # noqa: F401
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses import FakeTensor
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    forward_output_strides: list[tuple[int, ...] | None] = []

    def static(stride: tuple[str, ...] | None) -> tuple[int, ...] | None:
        # Inductor records strides as printed expressions: integers here (static shapes)
        try:
            return None if stride is None else tuple(int(s) for s in stride)
        except (TypeError, ValueError):
            return None

    def restride(placeholders: list[fx.Node], example_inputs: list[Any]) -> None:
        handed_over = [i for i, p in enumerate(placeholders) if not is_tangent(p)]
        if not forward_output_strides:  # none reported (as AOTAutograd without a TracingContext)
            return
        if handed_over != list(range(len(handed_over))) or len(handed_over) > len(forward_output_strides):
            raise RuntimeError("the backward's inputs do not line up with the forward's outputs")
        strides = forward_output_strides[len(forward_output_strides) - len(handed_over):]
        for i, stride in zip(handed_over, strides):
            example = example_inputs[i]
            if stride is None or not isinstance(example, torch.Tensor) or example.stride() == stride:
                continue
            example_inputs[i] = example.as_strided(example.size(), stride)
            placeholders[i].meta["val"] = example_inputs[i]
            if "tensor_meta" in placeholders[i].meta:
                placeholders[i].meta["tensor_meta"] = _extract_tensor_metadata(example_inputs[i])

    def compile(gm: fx.GraphModule, example_inputs: Any) -> Any:
        placeholders = gm.graph.find_nodes(op="placeholder")
        backward = any(is_tangent(p) for p in placeholders)
        output = gm.graph.find_nodes(op="output")[0]
        if backward:
            example_inputs = list(example_inputs)
            restride(placeholders, example_inputs)
            visible = range(len(output.args[0])) if config.bw_outputs_user_visible else range(0)
        else:  # the forward's own outputs (mutated buffers' new values, the model's outputs)
            visible = range(num_fwd_outputs()) if config.keep_output_stride else range(0)
        output.meta["user_visible_output_idxs"] = [i for i in visible if isinstance(output.args[0][i], fx.Node)]

        on_fakes = boxed_nop(copy.deepcopy(gm), example_inputs)
        # The graph's order is the schedule, whose frees the plan's peak counts on: Inductor
        # must not reorder it for its own estimate of memory.
        with config.patch(reorder_for_peak_memory=False):
            compiled = compile_fx_inner(gm, example_inputs, is_backward=backward)
        if not backward:
            forward_output_strides[:] = [static(s) for s in getattr(compiled, "output_strides", None) or []]

        def run(args: list) -> Any:
            if any(isinstance(a, FakeTensor) for a in args):
                return on_fakes(args)
            return compiled(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile
