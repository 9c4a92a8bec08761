"""One step's budget split across the graphs Dynamo captured, once every graph of the step is known.

A step runs graphs in a sequence (the same graph may run more than once) and their backwards
in reverse. While the graph at position p runs, every run before it holds what its plan keeps
for its backward and the gradient of its outputs, and the gradients of the parameters that
runs after p use are alive (made by their backwards, before p's). So the step's memory at
position p is

    peak of p's plan + sum over runs q < p of (held of q's plan + q's output gradients)
                     + gradients of the parameters of runs after p                  (`step_peaks`)

and a split is one plan per graph such that this is within the budget at every position of
every sequence seen, and such that every run but a sequence's last leaves a graph not seen yet
(a branch taken later) a share of the room (`room_rows`). Among a few plans per graph
(`GraphOption`: its simulated peak, what it holds, its time), `choose` finds the split of least
total time by a small MILP on HiGHS: one binary per (graph, option), one or two rows per
position. The graphs form a chain, as the blocks of
one graph do, but `solvers.chain`'s program does not fit: its second move (run a block keeping
only its output, and again in the backward) would re-run a whole graph, and the Python Dynamo
runs between graphs cannot be replayed; what remains is a choice of one option per graph, and
with the same graph at several positions (a sequence with a loop, or branches taken in
different steps) a program over positions would give one graph several plans.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from solvers.ilp_model import MilpBuilder

GraphSequence = tuple[int, ...]  # graph indices in the order a step runs them


@dataclass(frozen=True)
class GraphOption:
    """One plan of a graph, as the step sees it: all from `solvers.simulate` of its schedule."""

    peak: int  # bytes above what was alive before the graph's forward, through its backward
    held: int  # bytes it leaves alive from its forward's end to its backward: held into the
    # backward, and the gradients of its outputs (made by later graphs, read by its backward)
    time: float  # predicted seconds of its forward and backward


def step_peaks(sequence: GraphSequence, chosen: Mapping[int, GraphOption], reserves: Sequence[int]) -> list[int]:
    """The step's predicted memory at each position of `sequence`, each graph running `chosen`
    (`reserves`: per position, the gradients of the parameters that later runs use)."""
    peaks, before = [], 0
    for graph, reserve in zip(sequence, reserves, strict=True):
        peaks.append(chosen[graph].peak + before + reserve)
        before += chosen[graph].held
    return peaks


def room_rows(sequence: GraphSequence, chosen: Mapping[int, GraphOption], reserves: Sequence[int],
              budget: int, share: float) -> list[float]:
    """Per position of `sequence` but the last, how far the run there holds more than `share`
    of the room the runs before it left (the budget less their held bytes and the reserve):
    positive where it does. A graph not seen yet may follow any position (a branch first taken
    later), and this is the room it would find."""
    rows, before = [], 0
    for graph, reserve in zip(sequence[:-1], reserves[:-1], strict=False):
        rows.append(chosen[graph].held - share * (budget - reserve - before))
        before += chosen[graph].held
    return rows


def choose(options: Mapping[int, Sequence[GraphOption]], sequences: Mapping[GraphSequence, Sequence[int]],
           budget: int, *, share: float = 1.0, current: Mapping[int, GraphOption] | None = None,
           time_limit: float = 10.0) -> dict[int, int] | None:
    """Per graph, the index of its option in the fastest split whose every step peak
    (`step_peaks`, for each sequence with its reserves) is within `budget`, and where every run
    but a sequence's last holds at most `share` of the room left to it (`room_rows`; where the
    `current` plans hold more, as much as they do); None when no split is. Time counts each
    run: a graph that runs twice in a step, twice. Memory is in bytes over the budget
    (coefficients at most about one), and the result is checked again in integers."""
    b = MilpBuilder()
    runs = {g: sum(s.count(g) for s in sequences) for g in options}
    column = {(g, o): b.var(0, 1, runs[g] * option.time, True)
              for g, graph_options in options.items() for o, option in enumerate(graph_options)}
    for g, graph_options in options.items():
        b.row([column[g, o] for o in range(len(graph_options))], [1.0] * len(graph_options), 1, 1)
    for sequence, reserves in sequences.items():
        for p, (graph, reserve) in enumerate(zip(sequence, reserves, strict=True)):
            weight: dict[int, float] = {}
            for o, option in enumerate(options[graph]):
                weight[column[graph, o]] = option.peak / budget
            for earlier in sequence[:p]:
                for o, option in enumerate(options[earlier]):
                    weight[column[earlier, o]] = weight.get(column[earlier, o], 0.0) + option.held / budget
            b.row(list(weight), list(weight.values()), -math.inf, 1 - reserve / budget)
        # held[p] + share * sum of held[q < p] <= share * (budget - reserve[p]), or the current plans' value
        slack = [0.0] * len(sequence) if current is None else room_rows(sequence, current, reserves, budget, share)
        for p, reserve in enumerate(reserves[:-1]):
            weight = {}
            for q, earlier in enumerate(sequence[:p + 1]):
                for o, option in enumerate(options[earlier]):
                    factor = 1.0 if q == p else share
                    weight[column[earlier, o]] = weight.get(column[earlier, o], 0.0) + factor * option.held / budget
            b.row(list(weight), list(weight.values()), -math.inf,
                  (share * (budget - reserve) + max(0.0, slack[p])) / budget)
    h = b.highs()
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.run()
    if h.getInfo().primal_solution_status != 2:  # no feasible solution
        return None
    values = h.getSolution().col_value
    chosen = {g: max(range(len(graph_options)), key=lambda o: values[column[g, o]])
              for g, graph_options in options.items()}
    picked = {g: options[g][o] for g, o in chosen.items()}
    if any(max(step_peaks(s, picked, r)) > budget for s, r in sequences.items()):
        return None  # within HiGHS's tolerance but not in bytes
    if current is not None and any(
            new > max(0.0, old) + 1 for s, r in sequences.items()
            for new, old in zip(room_rows(s, picked, r, budget, share), room_rows(s, current, r, budget, share))):
        return None
    return chosen
