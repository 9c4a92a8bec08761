"""The graph rewrites: what each one is, when it applies, and the scratch of the ops it adds.

A rewrite replaces a pattern of ATen ops in the joint graph by ops of our own that compute the
same values holding less memory. `REWRITES` is the one table of them, in the order they run.
Those marked "always" cost nothing and rewrite every captured graph in place
(`apply_rewrites`); those marked "lean" cost time that only tight budgets repay, so they make
a variant of the graph (`lean_variant`) that is planned beside it, and the faster plan runs.

Our ops' scratch (what a kernel allocates and frees inside one op) is known from their shapes;
`known_scratch` reads it from the table, for profiles that do not measure scratch.

Importing this package registers our ops with torch.library (`torch.ops.rkgraph.*`). The
`rkgraph` package imports it, so that importing any of its modules registers them: graphs
that hold them are run by generated code, and random ones are replayed by name
(`rockplan.rng.replay`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from rkgraph.capture import JointGraph
from rkgraph.graph import RematGraph
from rkgraph.rewrites import (
    attention,
    batch_norm,
    cross_entropy,
    dropout,
    gradient_layout,
    gradient_sums,
    linear_cross_entropy,
    mask_packing,
    mm_gelu,
)

__all__ = ["REWRITES", "Rewrite", "apply_rewrites", "known_scratch", "lean_rewrites", "lean_variant"]

_rk = torch.ops.rkgraph  # our ops, registered by the imports above


@dataclass(frozen=True)
class Rewrite:
    """One graph rewrite, as the table lists it."""

    name: str
    # "always": a rewrite of every captured graph; "lean": makes the lean variant of it.
    applies: Literal["always", "lean"]
    # Rewrites an fx graph module in place (the caller recompiles); returns how many patterns.
    rewrite: Callable[[fx.GraphModule], int]
    ops: tuple[torch._ops.OpOverload, ...]  # the ops of ours it puts into graphs
    # Bytes a node of one of those ops allocates and frees inside, from its fx node's shapes;
    # ops not listed have none beyond their outputs.
    scratch: Mapping[torch._ops.OpOverload, Callable[[fx.Node], int]]
    description: str  # one line, as `lean_rewrites` and explanations show it


# In the order they run: the head's fusion reads the fused cross-entropy backward; the attention's
# reads the dropout's split application and its mask, which mask packing then replaces.
REWRITES: tuple[Rewrite, ...] = (
    Rewrite(
        "dropout_split", "always", dropout.split_dropout,
        (_rk.dropout_mask.default, _rk.apply_dropout_mask.default),
        {_rk.apply_dropout_mask.default: dropout.scratch_bytes},
        "dropout split: the mask drawn apart, so that the output is remade from it by a multiply",
    ),
    Rewrite(
        "cross_entropy_backward", "always", cross_entropy.fuse_cross_entropy_backward,
        (_rk.log_softmax_nll_backward.default,), {},
        "cross-entropy's backward fused: one logits-sized gradient instead of two",
    ),
    Rewrite(
        "linear_cross_entropy", "always", linear_cross_entropy.fuse_linear_cross_entropy,
        (_rk.linear_cross_entropy.default,),
        {_rk.linear_cross_entropy.default: linear_cross_entropy.scratch_bytes},
        "head and loss fused: the logits made and used a chunk of rows at a time, never whole",
    ),
    Rewrite(
        "mm_gelu_backward", "always", mm_gelu.fuse_mm_gelu_backward,
        (_rk.mm_gelu_backward.default,), {},
        "GELU's backward fused: written into the product that makes its incoming gradient",
    ),
    Rewrite(
        "reduce_before_accumulating", "always", gradient_sums.reduce_before_accumulating, (), {},
        "gradients reduced before they are added up: a broadcast tensor's gradient held at its reduced size",
    ),
    Rewrite(
        "batch_norm_kernels", "always", batch_norm.eager_kernels, (), {},
        "BatchNorm run by the kernels eager runs (cuDNN's on a GPU), not ATen's own",
    ),
    Rewrite(
        "batch_norm_backward_stats", "always", batch_norm.drop_unread_running_stats, (), {},
        "BatchNorm's backward given no running statistics, which in training it does not read",
    ),
    Rewrite(
        "stack_selected_gradients", "always", gradient_sums.stack_selected_gradients, (), {},
        "the gradients of a tensor's slices stacked, not added up as zero-filled copies of the whole",
    ),
    Rewrite(
        "gradients_in_input_layout", "always", gradient_layout.gradients_in_input_layout, (), {},
        "gradients made in their parameter's layout, which autograd would otherwise copy them into after the step",
    ),
    Rewrite(
        "attention", "lean", attention.fuse_attention,
        (_rk.attention.default, _rk.attention_backward.default),
        {_rk.attention.default: attention.scratch_bytes, _rk.attention_backward.default: attention.scratch_bytes},
        "attention fused: its probabilities are made again in the backward, a few heads at a time",
    ),
    Rewrite(
        "mask_packing", "lean", mask_packing.pack_saved_masks,
        (_rk.pack_mask.default, _rk.unpack_mask.default),
        {_rk.pack_mask.default: mask_packing.packing_scratch_bytes,
         _rk.unpack_mask.default: mask_packing.packing_scratch_bytes},
        "masks packed: the dropout masks the backward reads are kept eight to a byte",
    ),
)


def _run(module: fx.GraphModule, applies: str) -> int:
    """Run the table's rewrites marked `applies` on `module`, each of them, in order; recompile
    when any rewrote something. Returns how many patterns were rewritten."""
    count = sum([r.rewrite(module) for r in REWRITES if r.applies == applies])
    if count:
        module.graph.lint()
        module.recompile()
    return count


def apply_rewrites(joint: JointGraph) -> JointGraph:
    """Rewrite `joint`'s graph in place with the rewrites that always apply; returns `joint`."""
    _run(joint.module, "always")
    return joint


def lean_variant(joint: JointGraph) -> JointGraph | None:
    """A copy of `joint` (rewritten by `apply_rewrites`) rewritten by the lean rewrites, which
    make it hold less for a recomputation or two; None when none applies. A copy, not a
    rewrite of `joint`: the variant costs time that only tight budgets repay."""
    graph = fx.Graph()
    # The (primals, tangents) signature. Shared, not copied: code generation only reads it, and
    # deep-copying its pytree specs makes torch warn (FutureWarning on LeafSpec) in users' logs.
    graph._codegen = joint.module.graph._codegen
    graph.output(graph.graph_copy(joint.module.graph, {}))  # nodes' meta is shared, not copied
    # Lazy: its Python code is generated only if it is run (planning and code generation read
    # its graph), not once here and again after the rewrites.
    module = _LazyGraphModule(joint.module, graph)
    if not _run(module, "lean"):
        return None
    return dataclasses.replace(joint, module=module)


def lean_rewrites(graph: RematGraph) -> list[str]:
    """The descriptions of the lean rewrites `graph` holds (none for autograd's graph): those
    whose ops some node of it runs. Reads op names only, so it works on graphs loaded from files."""
    held = {node.op for node in graph.nodes}
    return [r.description for r in REWRITES if r.applies == "lean" and any(str(op) in held for op in r.ops)]


def known_scratch(node: fx.Node) -> int:
    """The scratch an fx node of one of our ops allocates and frees inside, as the table knows it
    from the node's shapes; 0 for any other node."""
    for r in REWRITES:
        bytes_of = r.scratch.get(node.target)
        if bytes_of is not None:
            return bytes_of(node)
    return 0
