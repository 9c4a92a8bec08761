"""Baseline: wrap each block in `torch.utils.checkpoint`.

In the forward pass a checkpointed block keeps only what leaves it (its inputs are the previous
block's outputs); everything produced inside is dropped after its last forward use. In the
backward pass, the first backward node that reads something dropped in block j triggers the
recomputation of block j's forward, whose results then live until the block's backward is done.
Random nodes are never recomputed (torch replays their RNG state; our model keeps their output).
"""

from __future__ import annotations

import time

from rkgraph.blocks import cut_pieces
from rkgraph.graph import RematGraph
from solvers.schedule import Schedule
from solvers.simulate import fixed_schedule


def _prefix(graph: RematGraph, name: str) -> str:
    """Grouping key: the top-level module, or for imported graphs the name's first word
    (Keras names layers block1_conv1, block1_pool, ...)."""
    module = graph.node(name).module
    return module.split(".")[0] if module else name.split("_")[0]


def derived_blocks(graph: RematGraph) -> list[list[str]]:
    """Blocks for graphs that come without: the pieces between single-tensor cuts
    (`rkgraph.blocks.cut_pieces`), merged while consecutive pieces belong to the same
    top-level module (or name prefix)."""
    blocks: list[list[str]] = []
    for piece in cut_pieces(graph):
        if blocks and _prefix(graph, blocks[-1][0]) == _prefix(graph, piece[0]):
            blocks[-1].extend(piece)
        else:
            blocks.append(list(piece))
    return blocks


def segment_recompute_order(graph: RematGraph, segments: list[list[str]]) -> list[str]:
    """Compute order of 'checkpoint each segment': the forward once, then before each backward
    node the recomputation of every segment holding a dropped value it reads."""
    segment_of = {name: j for j, seg in enumerate(segments) for name in seg}
    forward_readers: dict[str, set[int]] = {}
    for node in graph.forward_nodes:
        for d in node.inputs:
            forward_readers.setdefault(d, set()).add(segment_of.get(node.name, -1))
    # A value is dropped by its segment unless it leaves the segment (read by another segment
    # or by an unsegmented node, or returned), or comes from a random node.
    dropped: dict[str, int] = {}
    for name, j in segment_of.items():
        node = graph.node(name)
        if node.random:
            continue
        for d in node.outputs:
            if d not in graph.forward_outputs and forward_readers.get(d, set()) <= {j}:
                dropped[d] = j
    computes = [n.name for n in graph.forward_nodes]
    recomputed: set[int] = set()
    for node in graph.backward_nodes:
        for j in sorted({dropped[d] for d in node.inputs if d in dropped} - recomputed):
            computes.extend(name for name in segments[j] if not graph.node(name).random)
            recomputed.add(j)
        computes.append(node.name)
    return computes


def solve_checkpoint_blocks(graph: RematGraph, budget: int | None = None) -> Schedule:
    """Checkpoint each block of `graph.blocks` (derived when empty)."""
    start = time.perf_counter()
    blocks = [list(b) for b in graph.blocks] or derived_blocks(graph)
    schedule = fixed_schedule(graph, segment_recompute_order(graph, blocks),
                                      len(graph.forward_nodes), solver="checkpoint_blocks",
                                      budget=budget)
    schedule.solve_time = time.perf_counter() - start
    return schedule
