"""Kernels a planned step launches against eager's, counted on CPU: where a launch-bound step's extra ops come from.

    python benchmarks/op_counts.py                                     # gpt, hf_llama, hf_bert, resnet; tiny, default
    python benchmarks/op_counts.py --models gpt --sizes default --budgets 1.0
    python benchmarks/op_counts.py --out docs/benchmarks/op-counts.md  # also write the page

On a GPU a small model's step waits on the host issuing kernels, each a few microseconds
whatever its size, so a planned step dispatching more ops than eager is slower by their count
even where it recomputes nothing. This counts, for one training step (zero the gradients,
forward with the loss inside, backward) after a first one, the ATen ops that launch a kernel
(`rockplan.op_count`: not views, metadata ops or bare allocations) in eager and in the step
planned at each budget (a ratio of the store-all peak), and breaks the planned step's down:
the ATen ops our rewrites' custom ops run (by op), and the ATen ops the planned step runs more
or less often than eager outside them. Counting is deterministic: no timing. Some rewrites
apply on CPU only (dropout's split, attention's fusion in the lean variant): a CUDA step has
none of their ops.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_page import write_page  # noqa: E402  (beside this script, on its path)

from rockplan import Rockmate, codegen, zoo  # noqa: E402
from rockplan.op_count import OpCounter, count_step, kernel_ops, launches_kernel  # noqa: E402


class _ByCustomOp(OpCounter):
    """`OpCounter` that also counts the kernels run inside each of our custom ops, by op."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: str | None = None
        self.by_custom_op: Counter[str] = Counter()
        self.outside: Counter[str] = Counter()  # kernels dispatched outside our ops, by ATen op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name, inside = str(func), self.inside
        if func.namespace == "rkgraph" and inside is None:
            self.inside = func._opname
        counted = self.ops[name]
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.inside = inside
            if self.ops[name] > counted and launches_kernel(name):  # as `OpCounter` counts it
                (self.outside if inside is None else self.by_custom_op)[name if inside is None else inside] += 1


def _step(module: torch.nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202
    def run() -> None:
        for p in module.parameters():
            p.grad = None
        module(*args, **kwargs).backward()
    return run


def rows(name: str, size: str, budgets: list[float]) -> list[str]:
    """One table row per budget for zoo model `name` at `size`."""
    model, args, kwargs, loss = zoo.make(name, size)
    step = zoo.WithLoss(model, loss)
    eager = kernel_ops(count_step(_step(step, args, kwargs)))
    out = []
    for budget in budgets:
        try:
            planned = Rockmate(step, (args, kwargs), budget, profile="estimate")
        except Exception as e:  # an infeasible budget: said in its row
            out.append(f"| {name} | {size} | {budget} | {type(e).__name__} | {sum(eager.values())} | | | | |")
            print(out[-1], flush=True)
            continue
        counter = _ByCustomOp()
        count_step(_step(planned, args, kwargs), counter)
        total = sum(counter.outside.values()) + sum(counter.by_custom_op.values())
        inside = ", ".join(f"{op} {n}" for op, n in counter.by_custom_op.most_common())
        difference = {op: counter.outside[op] - eager[op] for op in set(counter.outside) | set(eager)}
        changed = ", ".join(f"{op.removeprefix('aten.')} {n:+d}" for op, n in
                            sorted(difference.items(), key=lambda item: -abs(item[1]))[:8] if n)
        graph = "lean variant" if "autograd's graph" in planned.considered else "autograd's graph"
        out.append(f"| {name} | {size} | {budget} | {graph} | {sum(eager.values())} | {total} | "
                   f"{total - sum(eager.values()):+d} | {inside or '-'} | {changed or '-'} |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,hf_llama,hf_bert,resnet")
    parser.add_argument("--sizes", default="tiny,default")
    parser.add_argument("--budgets", default="1.0,0.5")
    parser.add_argument("--out", type=Path, help="also write the table to this page")
    args = parser.parse_args()
    # Our ops through the dispatcher, so the counter sees each call and what it runs inside
    # (the planned step calls their Python definitions directly: the same ATen ops).
    codegen._python_definition = lambda op: None
    torch.set_num_threads(1)
    lines = ["Kernels (ATen ops that are not views, metadata ops or bare allocations) one training step "
             "dispatches on CPU, fp32, the loss inside (`zoo.WithLoss`), planned on estimated times. "
             "*inside our ops*: the kernels our rewrites' custom ops run, by op; *other changes*: ATen ops "
             "the planned step runs more (+) or fewer (-) times than eager outside our ops.", "",
             "| model | size | budget | graph run | eager | planned | extra | inside our ops | other changes |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines[2:]))
    budgets = [float(b) for b in args.budgets.split(",")]
    for size in args.sizes.split(","):
        for name in args.models.split(","):
            lines += rows(name, size, budgets)
    if args.out:
        write_page(args.out, "Kernels a planned step launches against eager's", "\n".join(lines))


if __name__ == "__main__":
    main()
