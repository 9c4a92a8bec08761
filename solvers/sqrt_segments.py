"""Baseline: Chen et al. 2016, "Training deep nets with sublinear memory cost".

Cut the forward chain into about sqrt(n) segments at single-tensor cuts, keep only segment
boundaries in the forward pass and recompute each segment just before its backward. Memory
O(sqrt(n)) for one extra forward pass.
"""

from __future__ import annotations

import math
import time

from rkgraph.blocks import cut_pieces
from rkgraph.graph import RematGraph
from solvers.schedule import Schedule, segment_recompute_order
from solvers.simulate import fixed_schedule


def sqrt_segments(graph: RematGraph, segments: int | None = None) -> list[list[str]]:
    """Group the pieces between single-tensor cuts (`rkgraph.blocks.cut_pieces`) into
    `segments` (default round(sqrt(n))) runs of about equal node count; a piece is never split,
    so a segment may hold more nodes than its share."""
    pieces = cut_pieces(graph)
    n = sum(len(p) for p in pieces)
    count = max(1, min(len(pieces), segments or round(math.sqrt(n))))
    result: list[list[str]] = [[]]
    done = 0
    for piece in pieces:
        # Start a new segment once the current one has reached its share of the nodes.
        if result[-1] and done >= len(result) * n / count:
            result.append([])
        result[-1].extend(piece)
        done += len(piece)
    return result


def solve_sqrt_segments(graph: RematGraph, budget: int | None = None, segments: int | None = None) -> Schedule:
    """`segments`: number of segments (default sqrt of the forward length)."""
    start = time.perf_counter()
    computes = segment_recompute_order(graph, sqrt_segments(graph, segments))
    schedule = fixed_schedule(graph, computes, len(graph.forward_nodes),
                                      solver="sqrt_segments", budget=budget)
    schedule.solve_time = time.perf_counter() - start
    return schedule
