"""The chain of blocks and the dynamic program over it: Beaumont et al., "Optimal
checkpointing for heterogeneous chains" (rotor), shared by rotor (`solvers.rotor`: one option
per block, store everything inside it) and Rockmate (`solvers.rockmate`: several options per
block, solved by the MILP).

The forward is a chain of blocks (graph.blocks; each backward node belongs to the block it
differentiates, `rkgraph.blocks.backward_blocks`). A dynamic program over sub-chains and
memory, discretised in `slots`, picks for every block one of:
  Fck  forward keeping what the block's backward reads (an "option": its forward sequence, its
       backward sequence, and the memory they need), then the rest of the chain, then B;
  Fe   forward keeping only the block's input, then Fn (forward keeping nothing but the
       output) up to a later block j, solve the chain from j on, then the chain up to j again.

The chain is a model: memory the program does not see (values read across several blocks,
gradient pieces passing through blocks, held tangents) only makes it approximate. So the plan is turned
into one compute sequence, frees are placed by `free_at_last_use` and the simulator measures
it; when the real peak overshoots, the plan is redone for a smaller memory, and the best plan
that fits is kept.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rkgraph.blocks import backward_blocks, chain_constants, derived_blocks
from rkgraph.graph import DataNode, RematGraph
from solvers.schedule import Op, Schedule
from solvers.simulate import InvalidSchedule, free_at_last_use, schedule_from_computes

log = logging.getLogger(__name__)


@dataclass
class BlockOption:
    """One way to run a block's forward (keeping some values) and later its backward."""

    forward: list[str]  # compute sequence of the forward pass
    backward: list[str]  # compute sequence of the backward pass, recomputations included
    forward_time: float
    backward_time: float
    kept: int  # bytes alive between the two: what the forward keeps, the block's output included
    forward_peak: int  # bytes above what was alive before the forward
    backward_peak: int  # bytes above the block's input and the gradients passing through it
    # (`ChainBlock.grad_through`) during the backward: `kept`, the gradients it reads last (alive
    # until that read) and those it makes included
    source: str = ""  # what produced it, for diagnostics
    # Whether the backward reads the block's input; when it does not (a loss reading only its
    # log-softmax), the input need not stay alive while the rest of the chain runs.
    reads_input: bool = True


@dataclass
class ChainBlock:
    forward: list[str]  # forward nodes in graph order: what Fe / Fn replay
    backward: list[str]  # backward nodes in graph order
    output: int  # bytes of the activations crossing the cut after this block
    grad: int  # bytes of the gradients made by later blocks' backward, alive when its backward
    # starts: those it reads last, and those passing through to earlier blocks
    grad_through: int  # of `grad`, the bytes earlier blocks read too: alive all through its backward
    held_grads: int  # bytes of backward outputs its backward makes, held to the end of the step
    plain_time: float  # Fn: the forward keeping only what leaves the block
    plain_peak: int  # and its peak above what was alive before it
    options: list[BlockOption]
    signature: str  # blocks with equal signatures are identical up to node names


@dataclass
class Chain:
    blocks: list[ChainBlock]
    offset: int  # bytes alive throughout that no block accounts for (tangents, user outputs,
    # input-independent values shared by several blocks)
    distinct: int = 0  # number of distinct block signatures, i.e. option computations made
    extra: dict[str, object] = field(default_factory=dict)


# --- the chain model ----------------------------------------------------------------------------


def chain_blocks(graph: RematGraph) -> tuple[list[list[str]], list[list[str]]]:
    """(forward blocks, backward blocks): the graph's own, derived at single-tensor cuts when absent."""
    forward = [list(b) for b in graph.blocks] or derived_blocks(graph)
    if graph.backward_blocks and len(graph.backward_blocks) == len(forward) and graph.blocks:
        return forward, [list(b) for b in graph.backward_blocks]
    return forward, backward_blocks(graph, forward)


def block_subgraph(graph: RematGraph, forward: Sequence[str], backward: Sequence[str],
                   unaccounted: set[str], incoming: frozenset[str] = frozenset()) -> RematGraph:
    """The block as a graph of its own. What it reads from outside becomes a source, weighing
    nothing (the chain model counts the input and the gradients passing through), except the
    `incoming` gradients, which its backward reads last: they keep their size, and the block's
    backward peak counts them until their last read (`_phase_memory`; solvers ignore sources).
    Values in `unaccounted` weigh nothing (they are in the chain's offset); what others read,
    or the graph requires, is a required output."""
    names = [*forward, *backward]
    inside = set(names)
    forward_set = set(forward)
    produced = list(dict.fromkeys(d for n in names for d in graph.node(n).outputs))
    data: dict[str, DataNode] = {}
    for n in names:
        for d in graph.node(n).inputs:
            if graph.data[d].producer not in inside:
                data[d] = DataNode(d, graph.data[d].size if d in incoming else 0, "input",
                                   order_only=graph.data[d].order_only)
    for d in produced:
        dn = graph.data[d]
        data[d] = DataNode(d, 0 if d in unaccounted else dn.size, dn.kind, dn.producer, order_only=dn.order_only)

    def needed_outside(d: str, required: tuple[str, ...]) -> bool:
        return d in required or any(u not in inside for u in graph.users[d])

    forward_outputs = tuple(d for d in produced if graph.data[d].producer in forward_set
                            and needed_outside(d, graph.forward_outputs))
    backward_outputs = tuple(d for d in produced if graph.data[d].producer not in forward_set
                             and needed_outside(d, graph.backward_outputs))
    return RematGraph([graph.node(n) for n in names], data, forward_outputs, backward_outputs,
                      name=f"{graph.name}:{forward[0] if forward else backward[0]}")


def subgraph_signature(sub: RematGraph) -> str:
    """Structure of a block graph (ops, sizes, wiring by position), independent of names and of
    times: measured times differ a little between identical layers, which must still be
    solved once (keyed on times, a measured profile would make most layers distinct blocks,
    each solved on its own)."""
    position = {n.name: i for i, n in enumerate(sub.nodes)}
    parts = []
    for node in sub.nodes:
        ins = []
        for d in node.inputs:
            producer = sub.data[d].producer
            if producer:
                ins.append(f"{position[producer]}.{sub.node(producer).outputs.index(d)}")
            elif not sub.data[d].order_only:
                ins.append(f"ext:{sub.data[d].kind}:{sub.data[d].size}")
        # A value that orders random draws (held once made, `DataNode.order_only`) is read from
        # the layer before, except by the first layer's draw, and read after, except the last's:
        # the layers are still identical.
        outs = [(sub.data[d].size, not sub.data[d].order_only and (d in sub.forward_outputs
                                                                   or d in sub.backward_outputs))
                for d in node.outputs]
        parts.append(f"{node.op}|{node.backward}|{ins}|{outs}|{node.workspace}|{node.random}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def measure(sub: RematGraph, computes: Sequence[str], forward_count: int, source: str) -> BlockOption:
    """Run a block schedule (frees at last use) and read its times and phase memory."""
    ops, forward_length = free_at_last_use(sub, computes, forward_count)
    forward_peak, backward_peak, kept = _phase_memory(sub, ops, forward_length)
    forward = [op.name for op in ops[:forward_length] if op.kind == "compute"]
    backward = [op.name for op in ops[forward_length:] if op.kind == "compute"]
    return BlockOption(forward, backward, sum(sub.node(n).time for n in forward),
                       sum(sub.node(n).time for n in backward), kept, forward_peak, backward_peak, source)


def _phase_memory(sub: RematGraph, ops: list[Op], forward_length: int) -> tuple[int, int, int]:
    """(forward peak, backward peak, memory at the phase boundary), transients included; the
    backward's also counts the incoming gradients (sources with a size) until their last read."""
    incoming = {d: dn.size for d, dn in sub.data.items() if sub.is_source(d) and dn.size}
    last_read = {d: i for i, op in enumerate(ops) if op.kind == "compute" and i >= forward_length
                 for d in sub.node(op.name).inputs if d in incoming}
    alive: set[str] = set()
    memory, kept = 0, 0
    peaks = [0, 0]
    for i, op in enumerate(ops):
        if i == forward_length:
            kept = memory
            memory += sum(incoming.values())
        if op.kind == "compute":
            node = sub.node(op.name)
            outputs = set(node.outputs)
            phase = int(i >= forward_length)
            peaks[phase] = max(peaks[phase], memory + sum(sub.data[d].size for d in outputs) + node.workspace)
            memory += sum(sub.data[d].size for d in outputs - alive)
            alive |= outputs
            memory -= sum(size for d, size in incoming.items() if last_read.get(d) == i)
        else:
            alive.discard(op.name)
            memory -= sub.data[op.name].size
    if forward_length == len(ops):
        kept = memory
    return peaks[0], max(peaks[1], kept + sum(incoming.values())), kept


def store_all_option(sub: RematGraph) -> BlockOption:
    """Rotor's Fck: run the block's forward keeping everything its backward reads."""
    return measure(sub, [n.name for n in sub.nodes], len(sub.forward_nodes), "store_all")


OptionMaker = Callable[[RematGraph], list[BlockOption]]


def undominated(options: Sequence[BlockOption]) -> list[BlockOption]:
    """Options no other beats or equals on time, kept, forward peak and backward peak at once."""
    def key(o: BlockOption) -> tuple[float, int, int, int]:
        return (o.forward_time + o.backward_time, o.kept, o.forward_peak, o.backward_peak)

    unique = list({key(o): o for o in options}.values())
    return [o for o in unique
            if not any(p is not o and all(a <= b for a, b in zip(key(p), key(o))) for p in unique)]


def _cut(sub: RematGraph, computes: list[str], forward_count: int, rename: dict[str, str],
         source: str) -> BlockOption | None:
    """The part of a whole-graph compute sequence (its first `forward_count` in the forward)
    that runs one block's nodes (the keys of `rename`), as an option of the identical block
    `sub` (their names there); None when that part is not a schedule of the block on its own
    (it relied on values another block's part recomputed)."""
    forward = [rename[n] for n in computes[:forward_count] if n in rename]
    backward = [rename[n] for n in computes[forward_count:] if n in rename]
    try:
        schedule_from_computes(sub, [*forward, *backward], len(forward), solver="cut")  # the referee
    except InvalidSchedule:
        return None
    return measure(sub, [*forward, *backward], len(forward), source)


def _renamed(graph: RematGraph, option: BlockOption, rename: dict[str, str], entering: set[str]) -> BlockOption:
    """`option` of an identical block, for this block: its nodes, their own times (the memory
    figures are structural), and whether its backward reads what enters the block."""
    forward = [rename[n] for n in option.forward]
    backward = [rename[n] for n in option.backward]
    return BlockOption(forward, backward, sum(graph.node(n).time for n in forward),
                       sum(graph.node(n).time for n in backward), option.kept, option.forward_peak,
                       option.backward_peak, option.source,
                       any(d in entering for n in backward for d in graph.node(n).inputs))


def build_chain(graph: RematGraph, make_options: OptionMaker = lambda sub: [store_all_option(sub)],
                schedules: Sequence[Schedule] = ()) -> Chain:
    """Measure every block; `make_options` runs once per distinct block (identical blocks
    reuse the options of the first one, renamed). The part each of `schedules` (whole-graph
    schedules, e.g. DTR's) runs in each block is one more option for all blocks identical to
    it: a heuristic treats identical layers differently, and the program may combine the
    treatments into a plan faster than both the heuristic's schedule and the MILP's options."""
    forward_blocks, backward_of = chain_blocks(graph)
    position = {name: j for j, block in enumerate(forward_blocks) for name in block}
    position.update({name: j for j, block in enumerate(backward_of) for name in block})
    constant = chain_constants(graph)
    # Chain constants read by other blocks are made once and read all along (an attention
    # mask): like the held outputs and tangents, they are a constant of the chain.
    shared = {d for d in constant if any(position.get(u) != position.get(graph.data[d].producer)
                                         for u in graph.users[d])}
    unaccounted = shared | set(graph.user_outputs)
    offset = sum(graph.data[d].size for d in unaccounted | set(graph.tangents))

    count = len(forward_blocks)
    output = [0] * count
    grad = [0] * count
    incoming: list[set[str]] = [set() for _ in range(count)]  # gradients each block reads last
    held = [0] * count
    backward_outputs = set(graph.backward_outputs)
    for d, dn in graph.data.items():
        if dn.producer is None or d in unaccounted:
            continue
        made = position[dn.producer]
        readers = [position[u] for u in graph.users[d]]
        if not graph.node(dn.producer).backward:
            forward_readers = [position[u] for u in graph.users[d] if not graph.node(u).backward]
            for j in range(made, max(forward_readers, default=made)):
                output[j] += dn.size
        elif d in backward_outputs:
            held[made] += dn.size
        else:
            for j in range(min(readers, default=made), made):
                grad[j] += dn.size
            if readers and min(readers) < made:
                incoming[min(readers)].add(d)

    subs = [block_subgraph(graph, forward, backward, unaccounted, frozenset(incoming[j]))
            for j, (forward, backward) in enumerate(zip(forward_blocks, backward_of))]
    signatures = [subgraph_signature(sub) for sub in subs]
    first: dict[str, RematGraph] = {}
    for sub, signature in zip(subs, signatures):
        first.setdefault(signature, sub)
    renames = [(signature, {n.name: f.name for n, f in zip(sub.nodes, first[signature].nodes)})
               for sub, signature in zip(subs, signatures) if sub.backward_nodes]  # (else: store-all only)
    cuts: dict[str, list[BlockOption]] = {signature: [] for signature in first}
    for schedule in schedules:
        computes, forward_count = schedule.computes(), schedule.forward_count
        for signature, rename in renames:
            cut = _cut(first[signature], computes, forward_count, rename, f"cut from {schedule.solver}")
            if cut is not None:
                cuts[signature].append(cut)
    blocks: list[ChainBlock] = []
    solved: dict[str, tuple[list[str], list[BlockOption]]] = {}
    for j, (forward, backward) in enumerate(zip(forward_blocks, backward_of)):
        sub, signature = subs[j], signatures[j]
        names = [n.name for n in sub.nodes]
        if signature not in solved:
            made = make_options(sub) if backward else [store_all_option(sub)]
            solved[signature] = (names, undominated([*made, *cuts[signature]]) if cuts[signature] else made)
        first_names, options = solved[signature]
        rename = dict(zip(first_names, names))
        entering = {d for name in forward for d in graph.node(name).inputs
                    if (producer := graph.data[d].producer) is not None and position[producer] < j}
        options = [_renamed(graph, o, rename, entering) for o in options]
        plain = measure(sub, forward, len(forward), "plain")
        through = grad[j] - sum(graph.data[d].size for d in incoming[j])
        blocks.append(ChainBlock(list(forward), list(backward), output[j], grad[j], through, held[j],
                                 plain.forward_time, plain.forward_peak, options, signature))
    return Chain(blocks, offset, len(solved))


# --- the dynamic program ------------------------------------------------------------------------


@dataclass
class ChainTables:
    unit: int  # bytes per slot
    cost: dict[tuple[int, int], np.ndarray]  # (i, k) -> best time of the sub-chain per memory
    how: dict[tuple[int, int], np.ndarray]  # its choice: option o, or len(options) + j for Fe at j
    size: dict[str, list[int]]  # per block, in slots: input, grad, held_grads prefix sums


def solve_chain(chain: Chain, memory: int, slots: int) -> ChainTables:
    """Tables for every sub-chain [i, k] and every memory 0..slots * unit (unit = memory / slots).

    cost[i, k][m]: time to run the backward of blocks i..k, starting with block i's input and
    block k's incoming gradient alive, ending with block i's outgoing gradient, peaking at most
    m slots above what the caller holds (the input counted throughout: it is the caller's
    checkpoint). Sizes round up, so a plan fits the model whenever the table says so.
    """
    unit = max(1, math.ceil(memory / slots))
    blocks = chain.blocks
    count = len(blocks)

    def up(b: float) -> int:
        return math.ceil(b / unit)

    inp = [0] + [up(b.output) for b in blocks[:-1]]  # input of block i = output of block i - 1
    out = [up(b.output) for b in blocks]
    grad = [up(b.grad) for b in blocks]
    through = [up(b.grad_through) for b in blocks]
    held_prefix = np.concatenate([[0], np.cumsum([b.held_grads for b in blocks])])

    def held(i: int, k: int) -> int:  # gradients made by the backward of blocks i..k
        return up(held_prefix[k + 1] - held_prefix[i]) if k >= i else 0

    ms = np.arange(slots + 1)
    inf = np.full(slots + 1, np.inf)

    def shifted(values: np.ndarray, by: int) -> np.ndarray:
        result = inf.copy()
        if by <= slots:
            result[by:] = values[: slots + 1 - by]
        return result

    cost: dict[tuple[int, int], np.ndarray] = {}
    how: dict[tuple[int, int], np.ndarray] = {}
    for span in range(count):
        for i in range(count - span):
            k = i + span
            best, choice = inf.copy(), np.full(slots + 1, -1)

            def offer(candidate: np.ndarray, code: int, best: np.ndarray = best, choice: np.ndarray = choice) -> None:
                better = candidate < best
                best[better] = candidate[better]
                choice[better] = code

            for o, option in enumerate(blocks[i].options):
                held_input = inp[i] if option.reads_input else 0
                forward_need = inp[i] + grad[k] + up(option.forward_peak)
                backward_need = held_input + through[i] + held(i + 1, k) + up(option.backward_peak)
                total = option.forward_time + option.backward_time
                if span == 0:
                    candidate = np.where(ms >= max(forward_need, backward_need), total, np.inf)
                else:
                    keep = held_input + max(0, up(option.kept) - out[i])
                    candidate = total + shifted(cost[i + 1, k], keep)
                    candidate[ms < max(forward_need, backward_need)] = np.inf
                offer(candidate, o)
            forward_time, forward_need = 0.0, 0
            for j in range(i + 1, k + 1):  # Fe at i, Fn up to j - 1, then [j, k] and [i, j - 1]
                last = j - 1
                forward_time += blocks[last].plain_time
                forward_need = max(forward_need, inp[i] + grad[k] + (inp[last] if last > i else 0)
                                   + up(blocks[last].plain_peak))
                candidate = forward_time + shifted(cost[j, k], inp[i]) + shifted(cost[i, last], held(j, k))
                candidate[ms < forward_need] = np.inf
                offer(candidate, len(blocks[i].options) + j)
            cost[i, k], how[i, k] = best, choice
    return ChainTables(unit, cost, how, {"input": inp, "grad": grad})


def chain_plan(chain: Chain, tables: ChainTables, m: int) -> list[tuple[str, int, int]]:
    """The actions of the best plan in m slots: ("F", block, option), ("B", block, option) or
    ("Fn", block, -1), in execution order."""
    blocks = chain.blocks
    inp = tables.size["input"]
    out_slots = [math.ceil(b.output / tables.unit) for b in blocks]
    held_prefix = np.concatenate([[0], np.cumsum([b.held_grads for b in blocks])])
    actions: list[tuple[str, int, int]] = []

    def walk(i: int, k: int, m: int) -> None:
        code = int(tables.how[i, k][m])
        if code < 0:
            raise AssertionError(f"no plan for blocks {i}..{k} in {m} slots")
        options = blocks[i].options
        if code < len(options):
            actions.append(("F", i, code))
            if k > i:
                held_input = inp[i] if options[code].reads_input else 0
                keep = held_input + max(0, math.ceil(options[code].kept / tables.unit) - out_slots[i])
                walk(i + 1, k, m - keep)
            actions.append(("B", i, code))
            return
        j = code - len(options)
        actions.extend(("Fn", block, -1) for block in range(i, j))
        walk(j, k, m - inp[i])
        walk(i, j - 1, m - math.ceil((held_prefix[k + 1] - held_prefix[j]) / tables.unit))

    walk(0, len(blocks) - 1, m)
    return actions


def plan_computes(graph: RematGraph, chain: Chain, actions: list[tuple[str, int, int]]) -> tuple[list[str], int]:
    """The compute sequence of a plan and its forward count (everything before the first B).
    A node that draws unreplayable random numbers runs once: later passes reuse its output."""
    computes: list[str] = []
    forward_count: int | None = None
    ran_random: set[str] = set()
    for kind, j, o in actions:
        block = chain.blocks[j]
        if kind == "B" and forward_count is None:
            forward_count = len(computes)
        names = (block.forward if kind == "Fn" else block.options[o].forward if kind == "F"
                 else block.options[o].backward)
        for name in names:
            if graph.node(name).random:
                if name in ran_random:
                    continue
                ran_random.add(name)
            computes.append(name)
    return computes, len(computes) if forward_count is None else forward_count


def chain_fits_model(chain: Chain, budget: int, slots: int) -> bool:
    """Whether the program finds a plan of `chain` in `budget` at some memory `schedule_chain`
    tries (none above the budget): where it does not, `schedule_chain` returns None. The
    program's needs grow with each option's peaks, what it keeps and whether it reads its input,
    so options that need no more than any real one make a chain that fits whenever one does."""
    if budget - chain.offset <= 0:
        return False
    return bool(np.isfinite(solve_chain(chain, budget, slots).cost[0, len(chain.blocks) - 1][slots]))


def schedule_chain(graph: RematGraph, chain: Chain, budget: int, slots: int, solver: str,
                   attempts: int = 8) -> Schedule | None:
    """The fastest plan of the chain that fits `budget` in the simulator, or None.

    The program plans for the budget less the chain's offset; the simulator then says how far
    the model was off, and the memory given to the program moves by that much (down when it
    overshoots, up by half the slack when it fits), keeping the best schedule that fits."""
    free = budget - chain.offset
    if free <= 0:
        return None
    tables = solve_chain(chain, budget, slots)
    total = tables.cost[0, len(chain.blocks) - 1]
    m = min(slots, free // tables.unit)
    if not np.isfinite(total[m]):  # the model is conservative: a plan it deems too big may fit
        feasible = np.flatnonzero(np.isfinite(total[m:]))
        m += int(feasible[0]) if len(feasible) else 0
    best: Schedule | None = None
    tried: set[int] = set()
    for _ in range(attempts):
        if m < 0 or m in tried or not np.isfinite(total[m]):
            break
        tried.add(m)
        computes, forward_count = plan_computes(graph, chain, chain_plan(chain, tables, m))
        try:
            schedule = schedule_from_computes(graph, computes, forward_count, solver=solver)
        except InvalidSchedule as error:  # a bug in the chain model; never hand it on
            log.error("%s plan rejected by the simulator: %s", solver, error)
            return best
        over = schedule.predicted_peak - budget
        if over <= 0:
            if best is None or schedule.predicted_time < best.predicted_time:
                best = schedule
            step = (-over // tables.unit) // 2
            if step == 0 or m >= slots:
                break
            m = min(slots, m + step)
        else:
            m -= max(1, math.ceil(over / tables.unit))
    if best is not None:
        best.budget = budget
        best.extra.update({"memory_unit": tables.unit, "blocks": len(chain.blocks),
                           "distinct_blocks": chain.distinct, "plans_tried": len(tried)})
    return best
