"""Train a ResNet-style CNN under a memory budget, the way a training script would use rockplan.

    python examples/train_resnet.py                  # budget: 60% of the step memory
    python examples/train_resnet.py --budget 40MB --steps 10

The model is planned once on a sample batch; the training loop is unchanged: the loss is
computed outside the planned module (a cross-entropy over 100 classes is tiny next to the
activations), the optimizer gets `rk.parameters()`, the same Parameter objects as the model's.
Each step's peak is measured by the allocator (CPU: its events, recorded by torch.profiler;
CUDA: its statistics) and printed against the budget, beside plain PyTorch's.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from rkgraph.units import format_bytes
from rockplan import Rockmate
from rockplan.memory import measure_step
from rockplan.zoo import ResNet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.6", help="ratio of the step memory, or bytes/units like 40MB")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    budget: float | str = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    device = "cuda" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    model = ResNet(widths=(32, 64, 128, 256), blocks_per_stage=2, num_classes=100).to(device)
    images = torch.randn(args.batch, 3, 64, 64, device=device)  # stands in for a data loader
    labels = torch.randint(0, 100, (args.batch,), device=device)

    start = time.perf_counter()
    rk = Rockmate(model, images, budget)
    print(f"planned in {time.perf_counter() - start:.1f} s: budget {format_bytes(rk.budget)}, "
          f"predicted peak {format_bytes(rk.schedule.predicted_peak)}, predicted overhead "
          f"{rk.schedule.predicted_time / rk.store_all_time - 1:+.1%}")
    opt = torch.optim.SGD(rk.parameters(), lr=0.05, momentum=0.9)

    def step() -> float:
        loss = F.cross_entropy(rk(images), labels)
        loss.backward()
        return loss.item()

    for i in range(args.steps):
        start = time.perf_counter()
        measured = measure_step(step, device=device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {i}: loss {measured.result:.4f}, peak {format_bytes(measured.peak)} "
              f"(budget {format_bytes(rk.budget)}), {time.perf_counter() - start:.2f} s")

    def eager_step() -> None:
        F.cross_entropy(model(images), labels).backward()

    eager = measure_step(eager_step, device=device).peak
    model.zero_grad(set_to_none=True)
    print(f"plain PyTorch, same step: peak {format_bytes(eager)}")


if __name__ == "__main__":
    main()
