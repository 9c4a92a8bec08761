"""`plot_memory`: memory over one training step, the chosen schedule against store-everything.

The curves are the simulator's (memory after each op); the x axis counts compute ops, so a
schedule that recomputes is longer, and frees show as drops. The simulator's peak also counts
an op's outputs and workspace while it runs, which the after-op curve cannot show, so each
schedule's peak is drawn as a dotted level of its colour. matplotlib is an optional extra.
"""

from __future__ import annotations

from pathlib import Path

from rkgraph.graph import RematGraph
from rkgraph.units import byte_unit
from solvers.schedule import Schedule
from solvers.simulate import simulate


def _steps(graph: RematGraph, schedule: Schedule) -> tuple[list[int], list[float], int]:
    """x (compute ops run so far) and y (bytes) per compute op, and the x of the phase boundary.

    y is the highest memory between a compute op and the next one: right after the op, before
    the frees that follow it (drawing every free as its own point makes a comb of spikes).
    """
    curve = simulate(graph, schedule).curve
    xs, ys = [0], [0.0]
    for op, memory in zip(schedule.ops, curve):
        if op.kind == "compute":
            xs.append(xs[-1] + 1)
            ys.append(float(memory))
        else:
            ys[-1] = max(ys[-1], float(memory))
    boundary = schedule.forward_count
    return xs, ys, boundary


def plot_memory(graph: RematGraph, schedule: Schedule, path: str | Path, budget: int | None,
                store_all: Schedule) -> Path:
    """Draw the memory of `schedule` and of `store_all` over the step, and the budget, to `path`
    (the format its suffix names: .png, .pdf, .svg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window, work without a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_memory needs matplotlib: pip install 'rockplan[plot]'") from None

    highest = max(schedule.predicted_peak, store_all.predicted_peak, budget or 0)
    unit, scale = byte_unit(highest)
    fig, ax = plt.subplots(figsize=(10, 4.8), layout="constrained")
    series = [(f"store everything ({store_all.solver or 'store_all'})", store_all, "#7f7f7f", 1.2),
              (f"this plan ({schedule.solver or '?'})", schedule, "#1f77b4", 1.8)]
    for label, s, color, width in series:
        xs, ys, boundary = _steps(graph, s)
        ax.step(xs, [y / scale for y in ys], where="post", color=color, linewidth=width, label=label)
        ax.axhline(s.predicted_peak / scale, color=color, linestyle=":", linewidth=1)
        ax.axvline(boundary, color=color, linestyle="--", linewidth=1)
        ax.annotate("backward →", (boundary, 0), xytext=(4, 4), textcoords="offset points", color=color,
                    fontsize=8)
    if budget is not None:
        ax.axhline(budget / scale, color="#d62728", linewidth=1.5, label=f"budget {budget / scale:.2f} {unit}")
    ax.set_xlabel("compute ops run (dashed: end of the forward; dotted: peak, transient allocations included)")
    ax.set_ylabel(f"activation memory ({unit})")
    ax.set_title(f"{graph.name or 'graph'}: memory over one training step")
    ax.set_ylim(bottom=0, top=highest / scale * 1.12)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
