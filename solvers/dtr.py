"""Baseline: Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021), simulated on the graph.

DTR plans nothing ahead: it runs the program (the graph's nodes in order, forward then backward)
and treats memory as a cache. When the next op's outputs do not fit under the budget it evicts
resident tensors, cheapest first by h(t) = cost(t) / (memory(t) * staleness(t)); when an op
needs an absent tensor it recomputes it, recursively, which may evict more. Replaying that
policy here gives the sequence of computations (recomputations included) a DTR runtime would
perform, and `schedule_from_computes` turns it into a Schedule.

Why the emitted order fits the budget once frees are placed by `free_at_last_use`: a value that
DTR evicts is never read again before its next computation (a read would have found it absent),
so free-at-last-use has freed it no later than the eviction; every value alive in the replayed
schedule is also resident here, and each op is admitted here only when resident memory, its
outputs and its workspace fit. The simulator checks it anyway.

Heuristics (`heuristic=`): "dtr" is the paper's h_DTR with the evicted neighbourhood e*(t):
cost(t) is the time of t's producer plus that of every absent tensor that recomputing t needs
(its evicted ancestors) and of every evicted tensor still needed whose recomputation would need
t (its evicted descendants): evicting t makes those dearer too. "lru" evicts the stalest
tensor, "size" the largest, the two simpler policies the paper compares against. "next_use" is
an offline variant a planner can afford, since it knows the program: staleness (time since the
last use, DTR's guess of how far the next use is) is replaced by the distance to the next read,
as in Belady's optimal cache eviction, weighted by the same cost and size.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import Literal

from rkgraph.graph import ComputeNode, RematGraph
from rkgraph.units import format_bytes
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, released_inside, schedule_from_computes

Heuristic = Literal["dtr", "next_use", "lru", "size"]
HEURISTICS: tuple[Heuristic, ...] = ("dtr", "next_use", "lru", "size")


class _DtrRun:
    """The state of one simulated DTR run: what is resident, what was evicted, when each tensor
    was last touched, and the computations performed so far."""

    def __init__(self, graph: RematGraph, budget: int | None, heuristic: Heuristic, keep_drawn: bool = False) -> None:
        self.graph = graph
        self.budget = budget
        self.heuristic = heuristic
        self.keep_drawn = keep_drawn
        self.resident: set[str] = set()  # non-source data in memory
        self.memory = 0
        self.evicted: set[str] = set()  # evicted by the heuristic and still needed later
        self.last_access: dict[str, int] = {}
        self.pins: Counter[str] = Counter()  # inputs of the ops in progress (never evicted)
        self.computes: list[str] = []
        self.evictions = 0
        self.position = 0  # index in graph.nodes of the program op being run
        self.backward_phase = False
        # Program positions reading each data node, in order; the last one (-1: never read).
        self.reads: dict[str, list[int]] = {d: [] for d in graph.data}
        for p, node in enumerate(graph.nodes):
            for d in dict.fromkeys(node.inputs):
                self.reads[d].append(p)
        self.last_read = {d: reads[-1] if reads else -1 for d, reads in self.reads.items()}
        self.tangents = graph.tangents
        # Held to the end of the step (by the user, by autograd, as results): never dropped.
        self.held = frozenset(graph.user_outputs) | frozenset(graph.backward_outputs) | frozenset(self.tangents)
        self.forward_outputs = frozenset(graph.forward_outputs)
        self.readers: dict[str, list[ComputeNode]] = {d: [graph.node(n) for n in users]
                                                      for d, users in graph.users.items()}

    # --- what may be dropped ------------------------------------------------------------------

    def producer(self, d: str) -> ComputeNode:
        return self.graph.node(self.graph.data[d].producer)

    def protected(self, d: str) -> bool:
        """Never evicted: held values, forward outputs until the phase boundary (the forward must
        return them), and outputs of nodes computed once (recomputing them would draw anew)."""
        return (d in self.held or (d in self.forward_outputs and not self.backward_phase)
                or self.once(self.producer(d)))

    def once(self, node: ComputeNode) -> bool:
        """Computed at most once: `random` nodes, and with `keep_drawn` the replayable `rng` ones."""
        return node.random or (self.keep_drawn and node.rng)

    def needed_later(self, d: str) -> bool:
        return self.last_read[d] > self.position

    def recomputable(self, d: str, memo: dict[str, bool]) -> bool:
        """Whether absent d can be brought back: its producer is not computed once and each of its
        inputs is a source, resident, or recomputable in turn."""
        if d not in memo:
            node = self.producer(d)
            memo[d] = not self.once(node) and all(self.available(i, memo) for i in node.inputs)
        return memo[d]

    def available(self, d: str, memo: dict[str, bool]) -> bool:
        return self.graph.is_source(d) or d in self.resident or self.recomputable(d, memo)

    def evictable(self, d: str, memo: dict[str, bool]) -> bool:
        return (not self.protected(d) and not self.pins[d] and self.graph.data[d].size > 0
                and self.recomputable(d, memo))

    # --- the heuristic ------------------------------------------------------------------------

    def evicted_ancestors(self, d: str, memo: dict[str, frozenset[str]]) -> frozenset[str]:
        """Producers of the absent tensors that recomputing d needs, d's own producer included."""
        if d not in memo:
            node = self.producer(d)
            found = {node.name}
            for i in node.inputs:
                if not self.graph.is_source(i) and i not in self.resident:
                    found |= self.evicted_ancestors(i, memo)
            memo[d] = frozenset(found)
        return memo[d]

    def evicted_descendants(self, d: str) -> set[str]:
        """Producers of the evicted tensors whose recomputation would need d."""
        found: set[str] = set()
        stack = [d]
        seen = {d}
        while stack:
            for reader in self.readers[stack.pop()]:
                for out in reader.outputs:
                    if out in self.evicted and out not in seen:
                        seen.add(out)
                        found.add(reader.name)
                        stack.append(out)
        return found

    def still_needed_from(self, d: str) -> bool:
        """Whether recomputing some evicted tensor still needed would go through d (via absent
        tensors only: a resident one on the way would serve instead)."""
        stack = [d]
        seen = {d}
        while stack:
            for reader in self.readers[stack.pop()]:
                for out in reader.outputs:
                    if out in self.evicted:
                        return True
                    if out not in self.resident and out not in seen:
                        seen.add(out)
                        stack.append(out)
        return False

    def score(self, d: str, memo: dict[str, frozenset[str]]) -> float:
        """Lower is evicted first."""
        size = self.graph.data[d].size
        staleness = len(self.computes) - self.last_access[d] + 1
        if self.heuristic == "lru":
            return 1.0 / staleness
        if self.heuristic == "size":
            return 1.0 / size
        producers = self.evicted_ancestors(d, memo) | self.evicted_descendants(d)
        cost = sum(self.graph.node(n).time for n in producers)
        if self.heuristic == "next_use":
            reads = self.reads[d]
            k = bisect.bisect_right(reads, self.position)
            distance = reads[k] - self.position if k < len(reads) else len(self.graph.nodes)
            return cost / (size * distance)
        return cost / (size * staleness)

    def make_room(self, need: int, where: str) -> None:
        """Evict until `need` more bytes fit under the budget."""
        if self.budget is None:
            return
        while self.memory + need > self.budget:
            memo: dict[str, bool] = {}
            candidates = [d for d in self.resident if self.evictable(d, memo)]
            if not candidates:
                raise InfeasibleBudget(
                    f"DTR cannot run {where} within {self.budget} bytes ({format_bytes(self.budget)}): it needs "
                    f"{self.memory + need} bytes and nothing resident can be evicted")
            ancestors: dict[str, frozenset[str]] = {}
            # Ties (free recomputations) go to the largest tensor, then to a fixed name order.
            victim = min(candidates, key=lambda d: (self.score(d, ancestors), -self.graph.data[d].size, d))
            self.resident.remove(victim)
            self.memory -= self.graph.data[victim].size
            self.evictions += 1
            if self.needed_later(victim):
                self.evicted.add(victim)

    # --- running ops --------------------------------------------------------------------------

    def run(self, node: ComputeNode, program: bool = False) -> None:
        """Compute `node`, first recomputing its absent inputs (recursively); `program`: the
        program's op at `position`, not a recomputation."""
        self.pins.update(node.inputs)
        for d in node.inputs:
            if not self.graph.is_source(d) and d not in self.resident:
                self.run(self.producer(d))
        outputs = sum(self.graph.data[d].size for d in node.outputs)
        # The simulator charges every output, even one still resident, while the op runs; less
        # what inputs read for the last time die inside it (freed right after it).
        released = released_inside(self.graph, node, self.dying(node)) if program and node.releases else 0
        self.make_room(outputs + node.workspace - released, node.name)
        step = len(self.computes)
        self.computes.append(node.name)
        for d in node.outputs:
            if d not in self.resident:
                self.resident.add(d)
                self.memory += self.graph.data[d].size
            self.evicted.discard(d)
            self.last_access[d] = step
        for d in node.inputs:
            self.last_access[d] = step
        self.pins.subtract(node.inputs)

    def dying(self, node: ComputeNode) -> set[str]:
        """Inputs of the program's op `node` that `release_dead` drops right after it, which
        `free_at_last_use` frees right after it too (the schedule reads them no more before
        computing them again)."""
        return {d for d in node.inputs if d in self.resident and not self.needed_later(d) and d not in self.held
                and not (d in self.forward_outputs and not self.backward_phase) and not self.once(self.producer(d))}

    def release_dead(self) -> None:
        """Drop what the program will never read again (DTR frees a tensor when its last
        reference goes). An output of a node computed once stays while an absent tensor still needed
        would have to be recomputed from it: it could not be brought back itself."""
        self.evicted = {d for d in self.evicted if self.needed_later(d)}
        dead = [d for d in self.resident if not (self.needed_later(d) or d in self.held
                                                  or (d in self.forward_outputs and not self.backward_phase))]
        # Random nodes' outputs last: whether one is still needed depends on which of the
        # tensors between it and an evicted one go now (in set order, a random output could be
        # released while the tensor it alone can remake is still resident, then that tensor go
        # too, and DTR would later recompute the random node).
        for d in sorted(dead, key=lambda d: self.once(self.producer(d))):
            if self.once(self.producer(d)) and self.still_needed_from(d):
                continue
            self.resident.remove(d)
            self.memory -= self.graph.data[d].size

    def enter_backward(self) -> None:
        """Tangents arrive while the forward outputs are still alive (as in the simulator)."""
        self.resident.update(self.tangents)
        self.memory += sum(self.graph.data[d].size for d in self.tangents)
        self.make_room(0, "the start of the backward phase")
        self.backward_phase = True  # from here on forward outputs are ordinary tensors
        self.release_dead()

    def run_program(self) -> int:
        """Run every node in order; return how many computations belong to the forward phase."""
        forward_count = len(self.graph.forward_nodes)
        emitted_forward = 0
        for p, node in enumerate(self.graph.nodes):
            if p == forward_count:
                emitted_forward = len(self.computes)
                self.enter_backward()
            self.position = p
            self.run(node, program=True)
            self.release_dead()
        if not self.backward_phase:  # no backward node: the boundary is the end
            emitted_forward = len(self.computes)
            self.enter_backward()
        return emitted_forward


def solve_dtr(graph: RematGraph, budget: int | None = None, heuristic: Heuristic = "dtr",
              keep_drawn: bool = False) -> Schedule:
    """The computations a DTR runtime would perform under `budget` bytes, as a Schedule.

    `heuristic`: "dtr" (cost with evicted neighbourhood / (memory * staleness)), "next_use",
    "lru" or "size". `keep_drawn`: never evict what a random op drew (dropout masks), as
    PyTorch's partitioner never recomputes one: the heuristic, blind to what a small tensor's
    absence costs later, evicts a language model's masks and pays a redraw for each, which can
    cost more than keeping them. Raises InfeasibleBudget when an op cannot fit even after
    evicting everything evictable (DTR has no lower bound to report: the floor is where it
    fails).
    """
    if heuristic not in HEURISTICS:
        raise ValueError(f"unknown DTR heuristic {heuristic!r}; choose one of {HEURISTICS}")
    start = time.perf_counter()
    dtr = _DtrRun(graph, budget, heuristic, keep_drawn)
    forward_count = dtr.run_program()
    schedule = schedule_from_computes(graph, dtr.computes, forward_count, solver="dtr", budget=budget,
                                      extra={"heuristic": heuristic, "keep_drawn": keep_drawn,
                                             "evictions": dtr.evictions})
    schedule.solve_time = time.perf_counter() - start
    return schedule
