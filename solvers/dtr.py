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
import heapq
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Literal

import numpy as np

from rkgraph.graph import ComputeNode, RematGraph
from rkgraph.units import format_bytes
from solvers.schedule import Schedule
from solvers.simulate import InfeasibleBudget, released_inside, schedule_from_computes

Heuristic = Literal["dtr", "next_use", "lru", "size"]
HEURISTICS: tuple[Heuristic, ...] = ("dtr", "next_use", "lru", "size")
DEADLINE_EVERY = 64  # computations between looks at the clock


class _Reach:
    """For each tensor x, the producers of the tensors reachable from x along `edges` through
    tensors that are `open` (absent, or evicted): the heuristic's evicted neighbourhood, one
    direction of it, as a bit set of node indices (unions of long absent chains are then a few
    machine words each). Cached, and an entry is forgotten only when a tensor it looked at opens
    or closes, or an entry it was built from is forgotten: C(x) is the union, over x's open
    neighbours y, of y's producer and C(y), which does not depend on whether x itself is open.
    So an eviction or a computation costs only the entries it changes."""

    def __init__(self, edges: dict[str, tuple[str, ...]], producer_bit: dict[str, int],
                 is_open: Callable[[str], bool]) -> None:
        self.edges = edges
        self.producer_bit = producer_bit
        self.is_open = is_open
        self.entries: dict[str, int] = {}
        self.looked: dict[str, set[str]] = defaultdict(set)  # y -> entries that read whether y is open
        self.used: dict[str, set[str]] = defaultdict(set)  # y -> entries built from y's

    def get(self, x: str) -> int:
        entries = self.entries
        if x in entries:
            return entries[x]
        stack = [x]
        while stack:  # post-order, without recursion: absent chains can be long
            top = stack[-1]
            if top in entries:
                stack.pop()
                continue
            open_neighbours = [y for y in self.edges[top] if self.is_open(y)]
            missing = [y for y in open_neighbours if y not in entries]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            found = 0
            for y in self.edges[top]:
                self.looked[y].add(top)
            for y in open_neighbours:
                self.used[y].add(top)
                found |= self.producer_bit[y] | entries[y]
            entries[top] = found
        return entries[x]

    def changed(self, y: str) -> list[str]:
        """y opened or closed; returns the tensors whose entries are forgotten."""
        forgotten = []
        stack = list(self.looked.pop(y, ()))
        while stack:
            x = stack.pop()
            if self.entries.pop(x, None) is not None:
                forgotten.append(x)
                stack.extend(self.used.pop(x, ()))
        return forgotten


class _DtrRun:
    """The state of one simulated DTR run: what is resident, what was evicted, when each tensor
    was last touched, and the computations performed so far.

    Choosing a victim asks, for every resident tensor, whether it can be brought back and what
    evicting it would cost; both are walks through the graph (absent ancestors, evicted
    descendants). They are cached and a cache entry is dropped only where a change of state can
    alter it, so that each eviction costs about one pass over the resident tensors:
    - whether a tensor can be recomputed depends on which tensors are available (a source,
      resident, or recomputable in turn). Evicting changes no availability (only recomputable
      tensors are evicted), and a tensor made for the first time is no ancestor of anything
      asked about; the cache is cleared only when a recomputation makes available, or a release
      makes unavailable, a tensor that was not, or no longer is, recomputable.
    - the cost walks d's absent ancestors and its evicted descendants: `_Reach` keeps both,
      told by each change of residency or of evictedness which entries it makes stale.
    """

    def __init__(self, graph: RematGraph, budget: int | None, heuristic: Heuristic, keep_drawn: bool = False,
                 deadline: float = math.inf) -> None:
        self.graph = graph
        self.budget = budget
        self.deadline = deadline  # time.perf_counter() at which the run gives up
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
        # What `release_dead` looks at after the program op at p: the tensors p reads for the last
        # time, those computed since the last release, and the outputs of once-computed nodes it
        # kept. A tensor not among them did not change from alive to dead (see `release_dead`).
        self.last_read_at: dict[int, list[str]] = defaultdict(list)
        for d, p in self.last_read.items():
            self.last_read_at[p].append(d)
        self.released_upto = 0  # computes[:released_upto] were looked at by a release
        self.kept_once: set[str] = set()
        self.data_index = {d: i for i, d in enumerate(graph.data)}
        self.tangents = graph.tangents
        # Held to the end of the step (by the user, by autograd, as results): never dropped.
        self.held = (frozenset(graph.user_outputs) | frozenset(graph.backward_outputs) | frozenset(self.tangents)
                     | graph.order_values)
        self.forward_outputs = frozenset(graph.forward_outputs)
        self.readers: dict[str, list[ComputeNode]] = {d: [graph.node(n) for n in users]
                                                      for d, users in graph.users.items()}
        self.sources = frozenset(d for d in graph.data if graph.is_source(d))
        self.size = {d: dn.size for d, dn in graph.data.items()}
        self.producers: dict[str, ComputeNode] = {d: graph.node(dn.producer) for d, dn in graph.data.items()
                                                  if dn.producer is not None}
        self.recomputable_memo: dict[str, bool] = {}
        # Never evicted: held values, empty ones, and outputs of nodes computed once (recomputing
        # them would draw anew); nor, until the phase boundary, forward outputs (the forward must
        # return them), nor the inputs of the ops in progress (`pins`), nor what cannot be
        # brought back.
        self.never_evicted = frozenset(d for d in graph.data if d in self.held or self.size[d] == 0
                                       or (d in self.producers and self.once(self.producers[d])))
        self.times = np.array([node.time for node in graph.nodes])
        self.producer_bit = {d: 1 << graph.index[node.name] for d, node in self.producers.items()}
        self.costs: dict[int, float] = {}  # set of nodes (bits) -> their total time
        # Tensor -> its eviction cost, until a change of state forgets either of its neighbourhoods
        # (`_forgotten`): every resident tensor is scored at every shortfall, and on a graph of
        # thousands of nodes joining and hashing its neighbourhoods' bit sets was most of the run.
        self.cost_of: dict[str, float] = {}
        self.bytes = (len(graph.nodes) + 7) // 8
        # Absent ancestors: through the non-source inputs of each producer; evicted descendants:
        # through the outputs of each reader. Kept only for the heuristics that read them.
        self.costed = heuristic in ("dtr", "next_use")
        self.ancestors = _Reach({d: tuple(i for i in node.inputs if i not in self.sources)
                                 for d, node in self.producers.items()},
                                self.producer_bit, lambda d: d not in self.resident)
        self.descendants = _Reach({d: tuple(out for reader in readers for out in reader.outputs)
                                   for d, readers in self.readers.items()},
                                  self.producer_bit, self.evicted.__contains__)

    # --- what may be dropped ------------------------------------------------------------------

    def producer(self, d: str) -> ComputeNode:
        return self.producers[d]

    def once(self, node: ComputeNode) -> bool:
        """Computed at most once: `random` nodes, and with `keep_drawn` the replayable `rng` ones."""
        return node.random or (self.keep_drawn and node.rng)

    def needed_later(self, d: str) -> bool:
        return self.last_read[d] > self.position

    def recomputable(self, d: str) -> bool:
        """Whether absent d can be brought back: its producer is not computed once and each of its
        inputs is a source, resident, or recomputable in turn."""
        memo = self.recomputable_memo
        stack = [d]
        while stack:  # post-order, without recursion: absent chains can be long
            x = stack[-1]
            if x in memo:
                stack.pop()
                continue
            node = self.producer(x)
            if self.once(node):
                memo[x] = False
                stack.pop()
                continue
            # As `all` would: the inputs in order, up to the first one not available.
            answer = True
            for i in node.inputs:
                if i in self.sources or i in self.resident:
                    continue
                if i not in memo:
                    stack.append(i)
                    break
                if not memo[i]:
                    answer = False
                    break
            else:
                memo[x] = answer
                stack.pop()
                continue
            if not answer:
                memo[x] = False
                stack.pop()
        return memo[d]

    # --- the heuristic ------------------------------------------------------------------------

    def eviction_cost(self, d: str) -> float:
        """Time of the producers of the absent tensors that recomputing d needs (d's own producer
        included) and of the evicted tensors still needed whose recomputation would need d:
        evicting d makes those dearer too."""
        cost = self.cost_of.get(d)
        if cost is not None:
            return cost
        nodes = self.producer_bit[d] | self.ancestors.get(d) | self.descendants.get(d)
        if nodes not in self.costs:
            # Summed in node order: equal sets cost the same whatever the order they were found in.
            members = np.unpackbits(np.frombuffer(nodes.to_bytes(self.bytes, "little"), dtype=np.uint8),
                                    bitorder="little", count=len(self.times)).astype(bool)
            self.costs[nodes] = float(self.times[members].sum())
        cost = self.cost_of[d] = self.costs[nodes]
        return cost

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

    def score(self, d: str) -> float:
        """Lower is evicted first."""
        size = self.size[d]
        staleness = len(self.computes) - self.last_access[d] + 1
        if self.heuristic == "lru":
            return 1.0 / staleness
        if self.heuristic == "size":
            return 1.0 / size
        cost = self.eviction_cost(d)
        if self.heuristic == "next_use":
            reads = self.reads[d]
            k = bisect.bisect_right(reads, self.position)
            distance = reads[k] - self.position if k < len(reads) else len(self.graph.nodes)
            return cost / (size * distance)
        return cost / (size * staleness)

    def make_room(self, need: int, where: str) -> None:
        """Evict until `need` more bytes fit under the budget.

        Evicting changes what no other tensor's eviction depends on (pins, protection, whether
        it can be brought back), so the candidates are found once and the run fails at once
        when evicting all of them would not be enough."""
        if self.budget is None or self.memory + need <= self.budget:
            return
        # Here as well as every DEADLINE_EVERY computations: on a graph of thousands of nodes
        # each shortfall scores every resident tensor, and those computations take long.
        self.check_deadline()
        # What may be evicted (see `never_evicted`): asked of every resident tensor at every shortfall.
        pins, memo, forward_outputs = self.pins, self.recomputable_memo, self.forward_outputs
        candidates = {d for d in self.resident - self.never_evicted
                      if not pins.get(d) and (self.backward_phase or d not in forward_outputs)
                      and (memo[d] if d in memo else self.recomputable(d))}
        if self.memory + need - sum(self.size[d] for d in candidates) > self.budget:
            raise InfeasibleBudget(
                f"DTR cannot run {where} within {self.budget} bytes ({format_bytes(self.budget)}): it needs "
                f"{self.memory + need - sum(self.size[d] for d in candidates)} bytes and nothing resident "
                f"can be evicted")
        # The least key first; ties (free recomputations) go to the largest tensor, then to a fixed
        # name order. Within one call only costs change (staleness and distances wait for the
        # next computation), and only those of the tensors whose cached neighbourhood an eviction
        # made stale: they are scored again, and the heap's older entries for them skipped.
        score, size = self.score, self.size
        keys = {d: (score(d), -size[d], d) for d in candidates}
        heap = list(keys.values())
        heapq.heapify(heap)
        while self.memory + need > self.budget:
            key = heapq.heappop(heap)
            victim = key[2]
            if keys.get(victim) != key:
                continue
            del keys[victim]
            stale = self.drop(victim)
            self.evictions += 1
            if self.needed_later(victim):
                self.evicted.add(victim)
                stale += self.evicted_changed(victim)
            for d in stale:
                if d in keys:
                    keys[d] = (self.score(d), -self.size[d], d)
                    heapq.heappush(heap, keys[d])

    # --- keeping the caches -------------------------------------------------------------------

    def drop(self, d: str) -> list[str]:
        """d leaves memory; returns the tensors whose cached cost it made stale."""
        self.resident.remove(d)
        self.memory -= self.size[d]
        return self._forgotten(self.ancestors, d)

    def evicted_changed(self, d: str) -> list[str]:
        """d was evicted, or is no longer; returns the tensors whose cached cost it made stale."""
        return self._forgotten(self.descendants, d)

    def _forgotten(self, reach: _Reach, d: str) -> list[str]:
        """`reach` told that d opened or closed: the tensors whose neighbourhood it forgot,
        whose costs are forgotten with it."""
        if not self.costed:
            return []
        forgotten = reach.changed(d)
        for x in forgotten:
            self.cost_of.pop(x, None)
        return forgotten

    # --- running ops --------------------------------------------------------------------------

    def run(self, node: ComputeNode, program: bool = False) -> None:
        """Compute `node`, first recomputing its absent inputs (recursively); `program`: the
        program's op at `position`, not a recomputation."""
        self.pins.update(node.inputs)
        for d in node.inputs:
            if d not in self.sources and d not in self.resident:
                self.run(self.producer(d))
        outputs = sum(self.size[d] for d in node.outputs)
        # The simulator charges every output, even one still resident, while the op runs; less
        # what inputs read for the last time die inside it (freed right after it).
        released = released_inside(self.graph, node, self.dying(node)) if program and node.releases else 0
        self.make_room(outputs + node.workspace - released, node.name)
        step = len(self.computes)
        if step % DEADLINE_EVERY == 0:
            self.check_deadline()
        self.computes.append(node.name)
        for d in node.outputs:
            if d not in self.resident:
                if self.recomputable_memo.get(d) is False:  # made available: the answers may change
                    self.recomputable_memo.clear()
                self._forgotten(self.ancestors, d)
                self.resident.add(d)
                self.memory += self.size[d]
            if d in self.evicted:
                self.evicted.discard(d)
                self.evicted_changed(d)
            self.last_access[d] = step
        for d in node.inputs:
            self.last_access[d] = step
        self.pins.subtract(node.inputs)

    def check_deadline(self) -> None:
        """InfeasibleBudget once the run's time is up."""
        if time.perf_counter() > self.deadline:
            raise InfeasibleBudget(
                f"DTR stopped at its time limit after {len(self.computes)} computations, {self.position} of the "
                f"graph's {len(self.graph.nodes)} ops run: it keeps evicting what it must recompute soon (thrashing)")

    def dying(self, node: ComputeNode) -> set[str]:
        """Inputs of the program's op `node` that `release_dead` drops right after it, which
        `free_at_last_use` frees right after it too (the schedule reads them no more before
        computing them again)."""
        return {d for d in node.inputs if d in self.resident and not self.needed_later(d) and d not in self.held
                and not (d in self.forward_outputs and not self.backward_phase) and not self.once(self.producer(d))}

    def release_dead(self, everything: bool = False) -> None:
        """Drop what the program will never read again (DTR frees a tensor when its last
        reference goes). An output of a node computed once stays while an absent tensor still needed
        would have to be recomputed from it: it could not be brought back itself.

        Only the tensors whose answer can have changed since the last release are looked at (a
        scan of everything resident at every op made DTR quadratic in the graph's size): a
        tensor dies when the position passes its last read (`last_read_at`), when it is computed
        after that (an ancestor recomputed for a recomputation), or, for the forward outputs, at
        the phase boundary, where `everything` looks at all of them. An evicted tensor was needed
        later when evicted, and stops being so at its last read, too."""
        fresh = self.computes[self.released_upto:]
        self.released_upto = len(self.computes)
        if everything:
            candidates = set(self.resident) | self.evicted
        else:
            candidates = set(self.last_read_at.get(self.position, ())) | self.kept_once
            candidates.update(out for name in fresh for out in self.graph.node(name).outputs)
        for d in [d for d in candidates if d in self.evicted and not self.needed_later(d)]:
            self.evicted.remove(d)
            self.evicted_changed(d)
        dead = [d for d in candidates if d in self.resident
                and not (self.needed_later(d) or d in self.held
                         or (d in self.forward_outputs and not self.backward_phase))]
        # Random nodes' outputs last, in the graph's order: whether one is still needed depends on
        # which of the tensors between it and an evicted one go now (released first, a random
        # output could go while the tensor it alone can remake is still resident, then that tensor
        # go too, and DTR would later recompute the random node).
        self.kept_once.clear()
        for d in sorted(dead, key=lambda d: (self.once(self.producer(d)), self.data_index[d])):
            if self.once(self.producer(d)) and self.still_needed_from(d):
                self.kept_once.add(d)
                continue
            self.drop(d)
            if not self.recomputable(d):  # no longer available: the answers may change
                self.recomputable_memo.clear()

    def enter_backward(self) -> None:
        """Tangents arrive while the forward outputs are still alive (as in the simulator)."""
        self.resident.update(self.tangents)
        self.memory += sum(self.size[d] for d in self.tangents)
        self.make_room(0, "the start of the backward phase")
        self.backward_phase = True  # from here on forward outputs are ordinary tensors
        self.release_dead(everything=True)

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
              keep_drawn: bool = False, time_limit: float | None = None) -> Schedule:
    """The computations a DTR runtime would perform under `budget` bytes, as a Schedule.

    `heuristic`: "dtr" (cost with evicted neighbourhood / (memory * staleness)), "next_use",
    "lru" or "size". `keep_drawn`: never evict what a random op drew (dropout masks), as
    PyTorch's partitioner never recomputes one: the heuristic, blind to what a small tensor's
    absence costs later, evicts a language model's masks and pays a redraw for each, which can
    cost more than keeping them. Raises InfeasibleBudget when an op cannot fit even after
    evicting everything evictable (DTR has no lower bound to report: the floor is where it
    fails). `time_limit`: seconds after which the run gives up, with InfeasibleBudget too (None:
    never). Near its floor DTR can thrash, evicting what it must recompute soon and recomputing
    it by evicting the next: on timm's NASNet-A Large (2,707 nodes) at 0.7 of its peak, the
    "size" heuristic had made 168,000 computations for 2,000 of the graph's ops after 3 minutes.
    """
    if heuristic not in HEURISTICS:
        raise ValueError(f"unknown DTR heuristic {heuristic!r}; choose one of {HEURISTICS}")
    start = time.perf_counter()
    dtr = _DtrRun(graph, budget, heuristic, keep_drawn,
                  deadline=math.inf if time_limit is None else start + time_limit)
    forward_count = dtr.run_program()
    schedule = schedule_from_computes(graph, dtr.computes, forward_count, solver="dtr", budget=budget,
                                      extra={"heuristic": heuristic, "keep_drawn": keep_drawn,
                                             "evictions": dtr.evictions})
    schedule.solve_time = time.perf_counter() - start
    return schedule
