"""Train a GPT-style model a few steps under a memory budget, side by side with plain PyTorch.

    python examples/train_gpt.py                 # the default: half the step memory
    python examples/train_gpt.py --budget 0.35 --steps 5 --model resnet

Prints the measured step peak against the budget and the step time against eager PyTorch,
measured in the same process with runs interleaved (eager, rockplan, eager, ...). The loss is
computed inside the planned module (zoo.WithLoss), so the budget covers the whole step.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch

from rockplan import Rockmate, zoo
from rockplan.budget import format_bytes
from rockplan.memory import measure_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=sorted(zoo.ZOO))
    parser.add_argument("--size", default="default", choices=["tiny", "default"])
    parser.add_argument("--budget", default="0.5", help="ratio of the step memory, or bytes/units like 200MB")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--solver", default="rockmate")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
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
            start = time.perf_counter()
            measured = measure_step(step, module)
            times[module].append(time.perf_counter() - start)
            peaks[module] = max(peaks.get(module, 0), measured.peak)
            opts[module].step()
            opts[module].zero_grad(set_to_none=True)
        print(f"step {i}: loss {measured.result.item():.4f}")

    ratio = statistics.median(times[rk]) / statistics.median(times[eager])
    print(f"measured step peak: rockplan {format_bytes(peaks[rk])} (budget {format_bytes(rk.budget)}), "
          f"eager {format_bytes(peaks[eager])}")
    print(f"step time: rockplan / eager = {ratio:.2f} (predicted overhead "
          f"{sched.predicted_time / rk.store_all_time - 1:+.1%})")


if __name__ == "__main__":
    main()
