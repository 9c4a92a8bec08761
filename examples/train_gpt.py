"""Train a GPT-style model a few steps under a memory budget, side by side with plain PyTorch.

    python examples/train_gpt.py                 # the default: half the step memory
    python examples/train_gpt.py --budget 0.35 --steps 5 --model resnet

Prints the measured step peak against the budget and the step time against eager PyTorch,
measured in the same process with runs interleaved (eager, rockplan, eager, ...), the first
step under the memory tracker and the others timed. The loss is
computed inside the planned module (zoo.WithLoss), so the budget covers the whole step.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch

from rkgraph.units import format_bytes
from rockplan import Rockmate, steady_cpu_heap, zoo
from rockplan.memory import measure_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=sorted(zoo.ZOO))
    parser.add_argument("--size", default="default", choices=["tiny", "default"])
    parser.add_argument("--budget", default="0.5", help="ratio of the step memory, or bytes/units like 200MB")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--solver", default="rockmate")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first measures memory, the others time")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    steady_cpu_heap()  # CPU step times that do not depend on which step ran before (see its docstring)
    budget: float | str = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget

    model, inputs, kwargs, loss_fn = zoo.make(args.model, args.size)
    # The loss goes inside the planned module, so the budget covers the whole step.
    model = zoo.WithLoss(model, loss_fn)
    eager = copy.deepcopy(model)
    start = time.perf_counter()
    rk = Rockmate(model, (inputs, kwargs), budget, solver=args.solver)
    plan_time = time.perf_counter() - start
    sched = rk.schedule
    print(f"{args.model} ({args.size}): {len(rk.graph.nodes)} nodes, planned in {plan_time:.1f} s "
          f"by {sched.solver}; budget {format_bytes(rk.budget)}, predicted peak {format_bytes(sched.predicted_peak)}")

    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (rk, eager)}
    times: dict[torch.nn.Module, list[float]] = {rk: [], eager: []}
    peaks: dict[torch.nn.Module, int] = {}

    def step(module: torch.nn.Module) -> torch.Tensor:
        loss = module(*inputs, **kwargs)
        loss.backward()
        return loss.detach()

    for i in range(args.steps):
        for module in (eager, rk):  # interleaved, so machine noise hits both alike
            if i == 0:  # the first step is the tracker's (torch.profiler slows it), not timed
                measured = measure_step(step, module)
                peaks[module], loss = measured.peak, measured.result
            else:
                start = time.perf_counter()
                loss = step(module)
                times[module].append(time.perf_counter() - start)
            opts[module].step()
            opts[module].zero_grad(set_to_none=True)
        print(f"step {i}: loss {loss.item():.4f}")

    ratio = statistics.median(times[rk]) / statistics.median(times[eager])
    print(f"measured step peak: rockplan {format_bytes(peaks[rk])} (budget {format_bytes(rk.budget)}), "
          f"eager {format_bytes(peaks[eager])}")
    print(f"step time: rockplan / eager = {ratio:.2f} (predicted overhead "
          f"{sched.predicted_time / rk.store_all_time - 1:+.1%})")


if __name__ == "__main__":
    main()
