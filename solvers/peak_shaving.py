"""Heuristic: run each node once in graph order, and shave the memory peaks by recomputation.

A schedule of this family is a set of drops (d, r): value d is discarded as stage r starts
(stage r: node r, forward or backward, and the recomputations it needs), and whatever stage r
reads that is not alive is recomputed right before it, with its missing ancestors; a value
then lives until its last read (`free_at_last_use`). No drops is the store-all schedule.

From there, while some step is over the budget: at the highest step, each value alive there
and read later (not by that step) is a candidate drop at the stage of its next read; the
candidate with the least added time per byte of total excess (the sum over steps of memory
above the budget) removed is taken. Then drops that are no longer needed are undone, and each
drop in turn is ruled out and the rest repaired again, while that finds a faster schedule.
The same search also starts from DTR's schedule read as drops, and so improves on it.

Where the budget is tight at a few backward steps (most budgets above half the peak) it finds
what DTR, which evicts by a guess of future reuse, misses, at times reaching the proven
floor itself. Where it starts matters: from DTR's schedule it can stop in a local optimum
that the start from checkpointing every block, slower as it is, gets past.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from rkgraph.graph import RematGraph
from rkgraph.units import format_bytes
from solvers.dtr import solve_dtr
from solvers.schedule import Op, Schedule
from solvers.simulate import (
    InfeasibleBudget,
    Lifetimes,
    held_by_computes,
    lifetimes,
    released_inside,
    simulate,
    to_recompute,
)

NAME = "peak_shaving"

# Candidates built and measured per step of the repair once one of them helps, in the order of
# an estimate (recomputation time per byte of excess removed): on a large model a step has
# hundreds, and each build replays the whole schedule. A short list finds the same schedules as
# a long one on nearly every Checkmate graph, several times sooner.
SHORTLIST = 4
# Of the time limit, the part in which the starts are repaired to fit; the rest improves them.
REPAIR_SHARE = 0.5
# An improving start stops once this share of the time limit (at least PATIENCE_MIN seconds)
# passes without a faster schedule: its gains come in runs (each undone drop, each rule-out that
# pays), and after the last run the rest of the time limit, and the same again in each other
# backward order the portfolio tries, found nothing on the Hugging Face models at tight budgets.
PATIENCE_SHARE = 0.25
PATIENCE_MIN = 0.5  # seconds
# Of the time limit, at most, for DTR's run that seeds the search when no seeds are given (DTR
# can thrash near its floor, `solve_dtr`).
DTR_SEED_SHARE = 0.5
# Drops the undo phase tries to undo together first (`_undo_unneeded`).
UNDO_GROUP = 8
# With `perturb`, once every start has stalled: drops ruled out together in each kick (at most).
KICK_DROPS = 3
Drop = tuple[str, int]  # (data node, index of the node whose stage discards it)


def _staged_computes(graph: RematGraph, ops: Sequence[Op]) -> Iterator[tuple[int, str, int]]:
    """(position, node, stage) of each compute op: node r runs in stage r, and a recomputation
    in the stage of the next node in graph order, the one it is made for."""
    stage = 0
    for j, op in enumerate(ops):
        if op.kind == "compute":
            yield j, op.name, stage
            stage = max(stage, graph.index[op.name] + 1)


@dataclass
class _Clock:
    """When a search stops: at `deadline`, or once `patience` seconds pass without a faster
    schedule (`gained` restarts the wait)."""
    deadline: float
    patience: float = math.inf
    last_gain: float = field(init=False)

    def __post_init__(self) -> None:
        self.gained()

    def gained(self) -> None:
        self.last_gain = time.perf_counter()

    def over(self) -> bool:
        return time.perf_counter() > min(self.deadline, self.last_gain + self.patience)


@dataclass
class _Trial:
    drops: frozenset[Drop]
    lifetimes: Lifetimes
    values: list[int]  # memory at each op of the schedule (`_Family._steps`)
    excess: int  # total bytes above the budget, over all computes
    peak: int
    time: float  # seconds, the sum of its computes' times
    budget: int
    stage_starts: dict[int, int] | None = None  # stage -> its first op (`_Family.still_needed`)

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The schedule, predictions filled: written out only for the trials the search reads
        op by op (most are measured and passed over)."""
        ops, forward_length = self.lifetimes.ops()
        schedule = Schedule(ops, forward_length, solver=NAME, budget=self.budget)
        schedule.predicted_peak, schedule.predicted_time = self.peak, self.time
        return schedule


class _Family:
    """Builds and measures the schedules of one graph's family."""

    def __init__(self, graph: RematGraph, budget: int) -> None:
        self.graph = graph
        self.budget = budget
        self.nf = len(graph.forward_nodes)
        self.tangents = graph.tangents
        excluded = {*graph.forward_outputs, *graph.user_outputs, *graph.backward_outputs, *self.tangents}
        self.droppable = {d for d, dn in graph.data.items()
                          if dn.producer is not None and d not in excluded and not dn.order_only
                          and not graph.node(dn.producer).random}
        self.built: dict[frozenset[Drop], _Trial | None] = {}
        # Looked up by name in every build, thousands per search: held in plain dicts.
        self.size = {d: dn.size for d, dn in graph.data.items()}
        self.outputs = {n.name: n.outputs for n in graph.nodes}
        self.times = {n.name: n.time for n in graph.nodes}
        self.random = frozenset(n.name for n in graph.nodes if n.random)
        self.step_bytes = {n.name: sum(self.size[d] for d in n.outputs) + n.workspace for n in graph.nodes}
        self.releasing = {n.name: n for n in graph.nodes if n.releases}
        self.tangent_bytes = sum(self.size[d] for d in self.tangents)
        self.holds_more = bool(graph.rng_states or graph.mutated_sources)  # `held_by_computes`

    def build(self, drops: frozenset[Drop]) -> _Trial | None:
        """The family's schedule for `drops`, measured; None if it would recompute a random
        node. Each drop set is built once (the repair and the undo revisit many)."""
        if drops not in self.built:
            self.built[drops] = self._build(drops)
        return self.built[drops]

    def _build(self, drops: frozenset[Drop]) -> _Trial | None:
        graph, reads, outputs = self.graph, self.graph.reads, self.outputs
        computes: list[str] = []
        available: set[str] = set()
        discarded: dict[int, list[str]] = {}
        for d, r in drops:
            discarded.setdefault(r, []).append(d)
        forward_count = 0
        for r, node in enumerate(graph.nodes):
            if r == self.nf:
                forward_count = len(computes)
                available.update(self.tangents)
            if r in discarded:
                available.difference_update(discarded[r])
            # (What `to_recompute` of all its inputs gives, asked only where one is missing.)
            missing = [d for d in reads[node.name] if d not in available]
            if missing:
                again = to_recompute(graph, missing, available)
                if not self.random.isdisjoint(again):
                    return None
                for name in again:
                    computes.append(name)
                    available.update(outputs[name])
            computes.append(node.name)
            available.update(node.outputs)
        spans = lifetimes(graph, computes, forward_count)
        values, excess = self._steps(spans)
        times = self.times
        return _Trial(drops, spans, values, excess, peak=max(values, default=0),
                      time=sum([times[name] for name in spans.computes]), budget=self.budget)

    def _steps(self, spans: Lifetimes) -> tuple[list[int], int]:
        """Memory at each op of `spans`' schedule (during a compute: its outputs and workspace
        included; after a free), as `simulate` counts it, and the total excess of the computes
        over the budget. A twin of `simulate`'s accounting, without its checks and without
        writing out the ops: a trial built through `simulate` takes markedly longer, and only
        the schedule returned needs the referee."""
        graph, size, outputs, budget, step_bytes = self.graph, self.size, self.outputs, self.budget, self.step_bytes
        computes, forward_count, frees_after = spans.computes, spans.forward_count, spans.frees_after
        # What the generated code holds beyond the data (generator states of draws made again,
        # copies of mutated buffers): without it a trial that fits here could overshoot in the
        # referee, and the search would end with nothing.
        held = None
        if self.holds_more:
            positions, forward_length = spans.positions()
            held = held_by_computes(graph, zip(positions, computes), forward_length)
        # (before, during, after) by op, for the few ops that have any: one lookup per compute.
        held_at = {} if held is None else {i: (held.before.get(i, 0), held.during.get(i, 0), held.after.get(i, 0))
                                           for i in {*held.before, *held.during, *held.after}}
        alive: set[str] = set()
        memory, values, excess = 0, [], 0
        boundary: int | None = None  # memory at the phase boundary, counted with the first backward op
        i = 0  # op index
        for p in range(len(computes) + 1):
            # (The boundary is counted with the op after it: with none, as `simulate`, not at all.)
            if p == forward_count and (p < len(computes) or spans.boundary_frees):
                if held is not None and held.copies:
                    memory += held.copies
                    excess += max(0, memory - budget)
                alive.update(self.tangents)
                memory += self.tangent_bytes
                excess += max(0, memory - budget)
                boundary = memory
                for d in spans.boundary_frees:  # never above the step before
                    alive.discard(d)
                    memory -= size[d]
                    values.append(memory if boundary is None else max(boundary, memory))
                    boundary = None
                    i += 1
            if p == len(computes):
                break
            name = computes[p]
            freed = frees_after.get(p)
            value = memory + step_bytes[name]
            node = self.releasing.get(name)
            if node is not None and freed is not None:
                value -= released_inside(graph, node, freed)
            extra = held_at.get(i) if held_at else None
            if extra is not None:
                memory += extra[0]
                value += extra[0] + extra[1]
            for d in outputs[name]:
                if d not in alive:
                    alive.add(d)
                    memory += size[d]
            if extra is not None:
                memory -= extra[2]
            if value > budget:
                excess += value - budget
            values.append(value if boundary is None else max(boundary, value))
            boundary = None
            i += 1
            if freed is not None:
                for d in freed:  # never above the step before
                    alive.discard(d)
                    memory -= size[d]
                    values.append(memory)
                i += len(freed)
        return values, excess

    def still_needed(self, trial: _Trial, drop: Drop) -> bool:
        """True when undoing `drop` surely gives no faster schedule that fits, seen without a
        build. Without it, the computes before stage r are the same and d is alive where it
        was absent, from its free to stage r's first op; what the recomputations at r read
        may be freed sooner (bounded by their total size); and if d's producer is recomputed
        at r all the same (for another output) the schedule is unchanged, no faster. Many undo
        attempts end here, each a build spared."""
        d, r = drop
        graph, ops = self.graph, trial.schedule.ops
        if trial.stage_starts is None:
            trial.stage_starts = {}
            for j, _, stage in _staged_computes(graph, ops):
                trial.stage_starts.setdefault(stage, j)
        start = trial.stage_starts.get(r)
        if start is None:
            return False
        free = next((k for k in range(start - 1, -1, -1) if ops[k].kind == "free" and ops[k].name == d), None)
        if free is None:
            return False
        read_by_recomputations: set[str] = set()
        for op in ops[start:]:
            if op.kind == "compute":
                if graph.index[op.name] >= r:
                    break  # stage r's own node
                read_by_recomputations.update(graph.reads[op.name])
        read_by_recomputations.discard(d)
        slack = sum(graph.data[x].size for x in read_by_recomputations)
        return max(trial.values[free:start]) + graph.data[d].size - slack > self.budget

    def candidates(self, schedule: Schedule, values: list[int], at: int, excluded: frozenset[Drop]) -> list[Drop]:
        """Drops that take a value alive at op `at` out of it: (d, the stage of its next read),
        not in `excluded`. When there are more than SHORTLIST, the likeliest first: least time
        to recompute d from what is alive at `at`, per byte of excess over the budget (`values`)
        where d would be absent (an estimate that orders the builds)."""
        graph = self.graph
        alive: set[str] = set(self.tangents) if at >= schedule.forward_length else set()
        for op in schedule.ops[:at]:
            if op.kind == "compute":
                alive.update(graph.node(op.name).outputs)
            else:
                alive.discard(op.name)
        op = schedule.ops[at]
        reading = set(graph.node(op.name).inputs) if op.kind == "compute" else set()
        wanted = (alive - reading) & self.droppable
        found: list[Drop] = []
        read_at: dict[Drop, int] = {}
        for j, name, stage in _staged_computes(graph, schedule.ops):
            if j > at:
                node = graph.node(name)
                for d in wanted.intersection(node.inputs):
                    found.append((d, stage))
                    read_at[d, stage] = j
                wanted -= set(node.inputs)
                wanted -= set(node.outputs)  # remade before any read: not this value's read
        found = [c for c in found if c not in excluded]
        if len(found) <= SHORTLIST:
            return found

        def recompute_time(d: str) -> float:
            needed, stack = set(), [graph.data[d].producer]
            while stack:
                name = stack.pop()
                if name in needed:
                    continue
                needed.add(name)
                stack.extend(graph.data[x].producer for x in graph.node(name).inputs
                             if x not in alive and not graph.is_source(x))
            return sum(graph.node(name).time for name in needed)

        # Where d is absent once dropped: from its last use before `at` to its next read.
        targets = {d for d, _ in found}
        last_use: dict[str, int] = {}
        for k in range(at - 1, -1, -1):
            if schedule.ops[k].kind == "compute":
                node = graph.node(schedule.ops[k].name)
                for d in targets.intersection(node.inputs) | targets.intersection(node.outputs):
                    last_use.setdefault(d, k)
        over = np.maximum(0, np.asarray(values) - self.budget)

        def removed(c: Drop) -> float:
            d = c[0]
            return float(np.minimum(over[last_use.get(d, 0) + 1:read_at[c]], graph.data[d].size).sum())

        return sorted(found, key=lambda c: recompute_time(c[0]) / max(1.0, removed(c)))


def _repair(family: _Family, trial: _Trial, clock: _Clock,
            ruled_out: frozenset[Drop] = frozenset()) -> _Trial | None:
    """Add drops to `trial`'s, greedily, until the schedule fits; None if it cannot or time
    runs out. Each step measures candidates one by one, then takes the cheapest together with
    the next cheapest while their separate reductions of the excess add up to less than the
    excess: one build instead of one step each (large models need many small drops)."""
    while trial.excess > 0:
        if clock.over():
            return None
        at = max(range(len(trial.values)), key=trial.values.__getitem__)
        measured: list[tuple[float, Drop, int]] = []  # (time per byte of excess removed, drop, bytes)
        lowering: list[tuple[int, float, _Trial]] = []  # (excess, time, trial): lower peaks only
        for tried, drop in enumerate(family.candidates(trial.schedule, trial.values, at, trial.drops | ruled_out)):
            if clock.over():
                return None
            if tried >= SHORTLIST and measured:
                break  # the likeliest were built and one helps
            other = family.build(trial.drops | {drop})
            if other is None:
                continue
            if other.excess >= trial.excess:
                if other.peak < trial.peak:
                    lowering.append((other.excess, other.time, other))
                continue
            removed = trial.excess - other.excess
            measured.append(((other.time - trial.time) / removed, drop, removed))
        if not measured:
            if not lowering:
                return None
            # A local minimum of the excess (each drop adds more elsewhere, at the step where
            # its value comes back): lower the peak anyway, adding the least excess. Drops
            # only accumulate, so this ends.
            trial = min(lowering, key=lambda entry: entry[:2])[2]
            continue
        measured.sort()
        chosen, total = [], 0
        for _, drop, removed in measured:
            if total + removed > trial.excess and chosen:
                break
            chosen.append(drop)
            total += removed
        together = family.build(trial.drops | set(chosen)) if len(chosen) > 1 else None
        if together is None or together.excess >= trial.excess:
            together = family.build(trial.drops | {measured[0][1]})
        trial = together
    return trial


def _faster_without(family: _Family, trial: _Trial, undone: set[Drop]) -> _Trial | None:
    """`trial` with the drops `undone` undone, where that fits and is faster; else None."""
    other = family.build(trial.drops - undone)
    return other if other is not None and other.excess == 0 and other.time < trial.time else None


def _undo_unneeded(family: _Family, trial: _Trial, clock: _Clock) -> _Trial:
    improved = True
    while improved:
        improved = False
        # The drops whose undoing brings the fewest bytes back first: the likeliest to fit. On
        # a large model of ops of nearly equal cost (a GPU step bound by kernel launches) the
        # time runs out before every drop is tried, and DTR's seeds drop tiny values (scalars, index
        # ranges) whose recomputation costs as much as a matrix product's. So UNDO_GROUP of
        # them are first undone together, in one build: where that fits and is faster, each
        # is spared its own.
        order = sorted(trial.drops, key=lambda drop: (family.graph.data[drop[0]].size, drop))
        for g in range(0, len(order), UNDO_GROUP):
            if clock.over():
                return trial
            grouped = trial  # (`still_needed` is asked again only of a trial that has changed)
            group = [drop for drop in order[g:g + UNDO_GROUP] if not family.still_needed(trial, drop)]
            if len(group) > 1 and (other := _faster_without(family, trial, set(group))) is not None:
                trial, improved = other, True
                clock.gained()
                continue
            for drop in group:
                if clock.over():
                    return trial
                if trial is not grouped and family.still_needed(trial, drop):
                    continue
                if (other := _faster_without(family, trial, {drop})) is not None:
                    trial, improved = other, True
                    clock.gained()
    return trial


def _dearest_first(family: _Family, trial: _Trial) -> list[Drop]:
    """`trial`'s drops, those whose undoing saves most time first (the undo phase has built
    each schedule without one drop already): ruling them out is likeliest to pay."""
    def saved(drop: Drop) -> float:
        other = family.build(trial.drops - {drop})
        return 0.0 if other is None else trial.time - other.time

    return sorted(trial.drops, key=lambda drop: (-saved(drop), drop))


def _drops_of(family: _Family, schedule: Schedule) -> frozenset[Drop]:
    """The drops under which the family replays `schedule`'s recomputations: each output of a
    node recomputed in stage r, discarded as r starts. Exact when `schedule` runs each node in
    graph order with recomputations before the node they serve (DTR's schedules, usually);
    otherwise a start that the repair completes."""
    graph = family.graph
    drops: set[Drop] = set()
    computed: set[str] = set()
    for _, name, stage in _staged_computes(graph, schedule.ops):
        if name in computed and graph.index[name] < stage:
            drops.update((d, stage) for d in graph.node(name).outputs if d in family.droppable)
        computed.add(name)
    return frozenset(drops)


def _improve(family: _Family, best: _Trial, clock: _Clock, good_enough: float) -> _Trial:
    """Ruin and recreate: rule out one drop, dearest first, repair, undo; keep what is faster."""
    best = _undo_unneeded(family, best, clock)
    improved = True
    while improved and best.time > good_enough and not clock.over():
        improved = False
        for drop in _dearest_first(family, best):
            repaired = _repair(family, family.build(best.drops - {drop}), clock, ruled_out=frozenset({drop}))
            if repaired is None:
                continue
            other = _undo_unneeded(family, repaired, clock)
            if other.time < best.time:
                best, improved = other, True
                clock.gained()
                break
    return best


def _kicked(family: _Family, best: _Trial, deadline: float, patience: float, good_enough: float) -> _Trial:
    """Iterated local search until `deadline`: `best` less a few of its drops at random, repaired
    with those ruled out, improved; kept where faster."""
    chosen = random.Random(0)
    while best.drops and best.time > good_enough and time.perf_counter() < deadline:
        kick = frozenset(chosen.sample(sorted(best.drops), min(KICK_DROPS, len(best.drops))))
        clock = _Clock(deadline, patience)
        repaired = _repair(family, family.build(best.drops - kick), clock, ruled_out=kick)
        if repaired is None:
            continue
        other = _improve(family, repaired, clock, good_enough)
        if other.time < best.time:
            best = other
    return best


def solve_peak_shaving(graph: RematGraph, budget: int, time_limit: float = 2.0, good_enough: float = 0.0,
                       seeds: Sequence[Schedule] | None = None, perturb: bool = False) -> Schedule:
    """The fastest schedule of the family found within `time_limit` seconds, or the first found
    whose time is at most `good_enough` (a proven floor plus a gap: searching on cannot pay).

    The search starts from each of `seeds` (schedules to improve on; by default DTR's), read as
    drops, and from no drops where no seed can be repaired to fit: from DTR's schedule it is a
    local search that only keeps what is faster, and it can end faster than the search from no
    drops. A start whose improvement stalls (no faster schedule in PATIENCE_SHARE of the time
    limit) is done, so the search can end well before the limit. With `perturb`, the rest of
    the time limit goes to an iterated local search from the best: rule out up to KICK_DROPS
    of its drops at random (a fixed seed: the same kicks each run), repair, improve, keep what
    is faster; the single rule-outs of `_improve` leave it in a local optimum, which a larger
    change can leave. Raises InfeasibleBudget when no start can be repaired to fit (the greedy
    repair meets a dead end, or time runs out)."""
    start = time.perf_counter()
    deadline = start + time_limit
    family = _Family(graph, budget)
    if seeds is None:
        try:
            seeds = [solve_dtr(graph, budget, time_limit=DTR_SEED_SHARE * time_limit)]
        except InfeasibleBudget:
            seeds = []
    built = [family.build(drops)
             for drops in dict.fromkeys((frozenset(), *(_drops_of(family, seed) for seed in seeds)))]
    starts = []
    # Every start is repaired before any is improved (`_improve` undoes unneeded drops first):
    # undoing one start's drops takes a build per drop, hundreds on a large model, and left the
    # other starts no time to be repaired at all.
    # The nearest to fitting first, each in the whole time until one fits (a seed a little over
    # the budget is repaired in a few builds, often within a hair of the floor); the farther
    # ones then only in the repairs' part of the time limit. The start from no drops, far over
    # the budget, only where no seed could be repaired: it takes thousands of builds, and
    # where a seed fitted it ended slower than the seeds or not at all (the Hugging Face models
    # on launch-bound costs, Swin-T, the zoo's ResNet and GPT), leaving them half the time.
    repairs_end = start + REPAIR_SHARE * time_limit
    one_fits = False
    for trial in sorted((t for t in built if t is not None), key=lambda t: t.excess):
        if one_fits and not trial.drops:
            continue
        repaired = _repair(family, trial, _Clock(repairs_end if one_fits else deadline))
        if repaired is not None:
            starts.append(repaired)
            one_fits = True
    if not starts:
        raise InfeasibleBudget(f"peak shaving found no schedule within {budget} bytes ({format_bytes(budget)})")
    pending = sorted({trial.drops: trial for trial in starts}.values(), key=lambda trial: trial.time)
    best = pending[0]
    # The starts fastest first, each improved until it stalls or the time runs out, not in
    # equal shares of the time: on a large model with ops of nearly equal cost a share is
    # shorter than one undo pass over a start's drops (a build per drop), and none improves.
    # Each start its own patience: a slower start can end faster than the first one stalled
    # (hf_llama on launch-bound costs at 0.35).
    patience = max(PATIENCE_MIN, PATIENCE_SHARE * time_limit)
    for trial in pending:
        if best.time <= good_enough or time.perf_counter() >= deadline:
            break
        improved = _improve(family, trial, _Clock(deadline, patience), good_enough)
        if improved.time < best.time:
            best = improved
    if perturb:
        best = _kicked(family, best, deadline, patience, good_enough)
    schedule = best.schedule
    simulate(graph, schedule, budget)  # the referee, on the one schedule returned
    schedule.extra = {"drops": len(best.drops)}
    schedule.solve_time = time.perf_counter() - start
    return schedule
