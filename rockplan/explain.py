"""`explain`: a table a person reads in a terminal, saying what a schedule does block by block.

Per block (graph.blocks and graph.backward_blocks: the blocks the planners use, labelled by the
module path their nodes share): what the block's forward hands to the backward, how that
compares with store-all ("saved" is the activation memory the backward no longer holds), which
ops run again and the time that adds. Then totals: the plan against store-everything (fastest,
most memory) and against checkpointing every block (the classic recipe), with predicted peak
and time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

from rkgraph.blocks import block_module, block_of
from rkgraph.graph import RematGraph
from rkgraph.render import _short_op, format_time
from rkgraph.rewrites import lean_rewrites
from rkgraph.units import format_bytes
from rockplan.decisions import decide
from solvers.bounds import time_lower_bound
from solvers.checkpoint_blocks import solve_checkpoint_blocks
from solvers.schedule import Schedule
from solvers.simulate import InvalidSchedule

# A block's recomputed ops are listed by name up to this many kinds; the rest are counted.
LISTED_OPS = 3


def _table(header: Sequence[str], rows: list[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *map(line, rows)]


def _ops_summary(ops: Counter[str]) -> str:
    """"3 ops: gelu, addmm x2" for the ops a block runs again."""
    if not ops:
        return "-"
    listed = [f"{op} x{count}" if count > 1 else op for op, count in ops.most_common(LISTED_OPS)]
    rest = len(ops) - LISTED_OPS
    return ", ".join(listed) + (f", +{rest} more" if rest > 0 else "")


def _percent(value: float, reference: float) -> str:
    return f"{100 * value / reference:.0f}%" if reference else "-"


def explain(graph: RematGraph, schedule: Schedule, store_all: Schedule,
            checkpoint_blocks: Schedule | None = None, reference: tuple[int, float] | None = None,
            considered: Mapping[str, float | str] | None = None) -> str:
    """The table for `schedule` on `graph`; `store_all` is the store-everything schedule.
    `reference`: (peak, time) of autograd's graph storing everything, where `graph` is a
    variant of it (`rkgraph.rewrites.lean_variant`): overheads and ratios are against it.
    `considered`: the other graphs planned for the same budget and not run, each with its
    plan's predicted time or why it has none.

    `checkpoint_blocks` (checkpoint every block) is solved here when not given; a graph where
    it cannot run (a random op that would be recomputed) shows it as not applicable.
    """
    decisions = decide(graph, schedule, store_all)
    owner = block_of(graph)
    kept, freed = set(decisions.kept), set(decisions.freed_early)
    forward_readers: dict[str, set[str]] = {d: set() for d in graph.data}
    for node in graph.forward_nodes:
        for d in node.inputs:
            forward_readers[d].add(node.name)

    rows = []
    for i, block in enumerate(graph.blocks):
        outputs = [d for n in block for d in graph.node(n).outputs]
        kept_bytes = sum(graph.data[d].size for d in outputs if d in kept)
        saved_bytes = sum(graph.data[d].size for d in outputs if d in freed)
        again = {n: decisions.recomputations(n) for n in graph.index if owner.get(n) == i}
        again = {n: c for n, c in again.items() if c}
        ops: Counter[str] = Counter()
        for n, count in again.items():
            ops[_short_op(graph.node(n).op)] += count
        added = sum(graph.node(n).time * c for n, c in again.items())
        # Checkpointing a block keeps only what leaves it (its output to the next block, the
        # model's outputs) and runs the rest again; keeping less than store-all inside is partial.
        leaving = {d for d in outputs if d in graph.forward_outputs or forward_readers[d] - set(block)}
        if not saved_bytes and not again:
            option = "store all"
        elif all(d in leaving for d in outputs if d in kept):
            option = "checkpoint"
        else:
            option = "partial"
        cls = graph.block_classes[i] if i < len(graph.block_classes) else 0
        module = block_module(graph, block)
        rows.append([str(i), module, str(cls), option, format_bytes(kept_bytes),
                     format_bytes(saved_bytes) if saved_bytes else "-", _ops_summary(ops),
                     format_time(added) if added else "-"])
    unassigned = sum(decisions.recomputations(n) for n in graph.index if n not in owner)

    lines = [f"{graph.name or 'graph'}: {len(graph.nodes)} nodes in {len(graph.blocks)} blocks; "
             f"solver {schedule.solver or '?'}, budget "
             f"{format_bytes(schedule.budget) if schedule.budget is not None else 'none'}", ""]
    lines += _table(["block", "module", "class", "option", "kept", "saved", "recomputed", "time added"], rows,
                    right={0, 2, 4, 5, 7})
    if unassigned:
        lines.append(f"(+{unassigned} recomputations outside any block)")

    if checkpoint_blocks is None:
        try:
            checkpoint_blocks = solve_checkpoint_blocks(graph)
        except InvalidSchedule:
            checkpoint_blocks = None
    reference_peak, reference_time = reference or (store_all.predicted_peak, store_all.predicted_time)
    totals = [("store everything", store_all), ("checkpoint every block", checkpoint_blocks),
              (f"this plan ({schedule.solver or '?'})", schedule)]
    rewrites = lean_rewrites(graph)
    if rewrites:
        lines += ["", *rewrites]
        autograd = SimpleNamespace(predicted_peak=reference_peak, predicted_time=reference_time)
        totals = [("autograd's graph, store everything", autograd), *totals]
    total_rows = []
    for label, s in totals:
        if s is None:
            total_rows.append([label, "n/a", "", "n/a", "", ""])
            continue
        fits = "" if schedule.budget is None else ("yes" if s.predicted_peak <= schedule.budget else "no")
        overhead = s.predicted_time - reference_time
        total_rows.append([label, format_bytes(s.predicted_peak), _percent(s.predicted_peak, reference_peak),
                           format_time(s.predicted_time),
                           f"+{_percent(overhead, reference_time)}" if overhead > 0 else "+0%", fits])
    lines += ["", *_table(["totals", "peak", "of store-all", "time", "overhead", "fits budget"], total_rows,
                          right={1, 2, 3, 4})]
    floor, why = schedule.lower_bound, schedule.extra.get("floor_reason")
    if schedule.budget is not None and why is None:  # planned by a solver that proves no floor
        proven, why = time_lower_bound(graph, schedule.budget)
        floor = max(floor or 0.0, proven)
    if floor is not None and schedule.predicted_time > 0:
        floor = min(floor, schedule.predicted_time)
        lines.append(f"no plan within this budget runs faster than {format_time(floor)} (proven: "
                     f"{100 * (floor / reference_time - 1):+.1f}% over store-all); this plan is "
                     f"{100 * (schedule.predicted_time / floor - 1):.1f}% above that")
        if why is not None and why.startswith("at node"):  # what the budget costs, and where
            lines.append(f"the floor comes from the tightest step: {why}")
    for name, outcome in (considered or {}).items():
        lines.append(f"also planned, not run: {name}, " + (
            f"predicted {format_time(outcome)} ({100 * (outcome / reference_time - 1):+.1f}%)"
            if isinstance(outcome, float) else outcome))
    return "\n".join(lines)
