"""What a schedule decided for each node, compared with what plain autograd (store-all) does.

One definition shared by the plan file, `explain` and the pictures, so they never disagree:

- a compute node is "recomputed" when the schedule runs it more than once;
- a forward activation is "kept" when it crosses the phase boundary (the forward hands it to
  the backward), and "freed early" when store-all would hand it over but this schedule frees it
  in the forward (the backward gets it back by recomputation).

Activations store-all does not hand over either (temporaries of the forward) get no decision.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rkgraph.graph import RematGraph
from solvers.schedule import Schedule


@dataclass
class Decisions:
    computed: Counter[str]  # compute node -> number of times the schedule runs it
    kept: list[str]  # data handed from forward to backward, in order of computation
    freed_early: list[str]  # data store-all hands over and this schedule does not

    def recomputations(self, name: str) -> int:
        return max(self.computed[name] - 1, 0)

    def labels(self) -> dict[str, str]:
        """`{name: "kept" | "recomputed" | "freed early"}`, as `rkgraph.render` draws them.

        Compute and data nodes share one namespace there, and an op's first output usually has
        the op's name; "recomputed" wins such clashes, since a freed-early tensor whose producer
        runs again is recomputed, and that is the decision worth seeing on the op.
        """
        labels = dict.fromkeys(self.kept, "kept")
        labels.update(dict.fromkeys(self.freed_early, "freed early"))
        labels.update({name: "recomputed" for name, count in self.computed.items() if count > 1})
        return labels


def decide(graph: RematGraph, schedule: Schedule, store_all: Schedule) -> Decisions:
    kept = schedule.alive_at_boundary(graph)
    kept_set = set(kept)
    freed = [d for d in store_all.alive_at_boundary(graph) if d not in kept_set]
    return Decisions(Counter(schedule.computes()), kept, freed)
