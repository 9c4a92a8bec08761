"""Baseline: wrap each block in `torch.utils.checkpoint`.

In the forward pass a checkpointed block keeps only what leaves it (its inputs are the previous
block's outputs); everything produced inside is dropped after its last forward use. In the
backward pass, the first backward node that reads something dropped in block j triggers the
recomputation of block j's forward, whose results then live until the block's backward is done.
Random nodes are never recomputed (torch replays their RNG state; our model keeps their output).
"""

from __future__ import annotations

import time

from rkgraph.blocks import derived_blocks
from rkgraph.graph import RematGraph
from solvers.schedule import Schedule, segment_recompute_order
from solvers.simulate import fixed_schedule


def solve_checkpoint_blocks(graph: RematGraph, budget: int | None = None) -> Schedule:
    """Checkpoint each block of `graph.blocks` (derived when empty)."""
    start = time.perf_counter()
    blocks = [list(b) for b in graph.blocks] or derived_blocks(graph)
    schedule = fixed_schedule(graph, segment_recompute_order(graph, blocks),
                                      len(graph.forward_nodes), solver="checkpoint_blocks",
                                      budget=budget)
    schedule.solve_time = time.perf_counter() - start
    return schedule
