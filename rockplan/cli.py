"""The `rockplan` command line: plan a model, explain a plan file, run the benchmarks.

    rockplan plan zoo:gpt --budget 0.5 --out plans/gpt
    rockplan plan mypkg.models:make_model --shape 8x128 --dtype long --budget 1.5GiB
    rockplan plan path/to/model.py:factory --shape 32x3x224x224 --budget 0.4 --solver ilp
    rockplan explain plans/gpt/plan.json
    rockplan bench [benchmark options]

A factory is called without arguments and returns an `nn.Module` (the sample is then drawn
from `--shape` and `--dtype`) or a zoo-style tuple `(model, args[, kwargs, loss_fn])` whose
sample is used unless `--shape` is given. `--with-loss` plans `loss_fn(model(*args), *args)`
as one module (the loss's memory then counts against the budget, as in the benchmarks).
Mistakes in what the user typed are one line on stderr and exit code 2; progress goes
through `logging` (INFO on a terminal, warnings only otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rockplan.planner import DEFAULT_SOLVER

log = logging.getLogger("rockplan")

BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
DTYPES = {"float": torch.float32, "float32": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "float64": torch.float64, "long": torch.long, "int64": torch.long,
          "int": torch.int32, "int32": torch.int32}


class UsageError(Exception):
    """Something the user typed is wrong: reported as one line, exit code 2."""


def parse_shape(text: str) -> tuple[int, ...]:
    """"8x128" -> (8, 128)."""
    if not re.fullmatch(r"\s*[1-9][0-9]*(\s*[x,]\s*[1-9][0-9]*)*\s*", text):
        raise UsageError(f"bad shape {text!r}: write positive sizes joined by 'x', e.g. 8x128 or 32x3x224x224")
    return tuple(int(n) for n in re.split(r"[x,]", text.replace(" ", "")))


def parse_budget_arg(text: str) -> int | float | str:
    """"0.5" is a ratio, "123456" bytes, anything else a size with units (checked now, so a typo
    fails before minutes of capture)."""
    from rockplan.budget import parse_budget

    budget: int | float | str
    if re.fullmatch(r"[0-9]+", text.strip()):
        budget = int(text)
    elif re.fullmatch(r"[0-9]*\.[0-9]+|[0-9]+\.", text.strip()):
        budget = float(text)
    else:
        budget = text
    try:
        parse_budget(budget, reference=1)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    return budget


def load_factory(spec: str) -> Any:
    """The callable named by `package.module:factory`, `path/to/file.py:factory` or `zoo:NAME`."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(f"bad model {spec!r}: write package.module:factory, path/to/file.py:factory or zoo:NAME")
    if where == "zoo":
        from rockplan import zoo

        if name not in zoo.ZOO:
            raise UsageError(f"no zoo model {name!r}; the zoo has {', '.join(zoo.ZOO)}")
        return lambda size: zoo.make(name, size)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"no file {where}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None  # a .py file always has both
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))  # so the file can import its neighbours
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise UsageError(f"cannot import {where}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"{where} has no factory {name!r}")
    return factory


def _random_sample(model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    # Integer inputs are usually token ids: drawn below the smallest embedding table, so every
    # lookup is in range (position embeddings included); 0 or 1 without embeddings.
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return torch.randint(0, min(tables, default=2), shape, dtype=dtype)


def build_model(spec: str, shape: str | None, dtype: str, size: str,
                with_loss: bool = False) -> tuple[nn.Module, tuple, dict]:
    # Everything typed is checked before the factory runs: building a model can take a while.
    dims = parse_shape(shape) if shape is not None else None
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    factory = load_factory(spec)
    made = factory(size) if spec.startswith("zoo:") else factory()
    if with_loss:
        if not (isinstance(made, tuple) and len(made) > 3 and callable(made[3])):
            raise UsageError(f"{spec} returns no loss: --with-loss needs a factory returning "
                             "(model, args, kwargs, loss_fn)")
        from rockplan.zoo import WithLoss

        made = (WithLoss(made[0], made[3]), *made[1:3])
    if isinstance(made, nn.Module):
        if dims is None:
            raise UsageError(f"{spec} returns a bare module: give the sample's shape with --shape, e.g. 8x128")
        return made, (_random_sample(made, dims, DTYPES[dtype]),), {}
    if isinstance(made, tuple) and made and isinstance(made[0], nn.Module):
        model = made[0]
        if dims is not None:
            return model, (_random_sample(model, dims, DTYPES[dtype]),), {}
        if len(made) < 2:
            raise UsageError(f"{spec} returns no sample: give its shape with --shape")
        args = made[1] if isinstance(made[1], tuple) else (made[1],)
        kwargs = made[2] if len(made) > 2 and isinstance(made[2], dict) else {}
        return model, args, kwargs
    raise UsageError(f"{spec} returned {type(made).__name__}: a factory returns an nn.Module or (model, args, ...)")


def _plan(args: argparse.Namespace) -> int:
    from rockplan import Rockmate
    from solvers import RUNTIME_SOLVERS

    if args.solver not in RUNTIME_SOLVERS:
        raise UsageError(f"unknown solver {args.solver!r}; choose one of {', '.join(sorted(RUNTIME_SOLVERS))}")
    if args.polish and args.solver != DEFAULT_SOLVER:
        raise UsageError(f"--polish is an option of the default solver {DEFAULT_SOLVER!r}, not of {args.solver!r}")
    budget = parse_budget_arg(args.budget)
    model, sample_args, sample_kwargs = build_model(args.model, args.shape, args.dtype, args.size, args.with_loss)
    log.info("capturing %s and solving with %s (budget %s)...", type(model).__name__, args.solver, args.budget)
    rk = Rockmate(model, (sample_args, sample_kwargs), budget, solver=args.solver, profile=args.profile,
                  plan_file=args.plan_file, solver_options={"polish_time": args.polish} if args.polish else None)
    out = Path(args.out)
    log.info("writing %s", rk.export(out / "plan.json"))
    log.info("writing %s", rk.render(out / "graph.pdf"))
    try:
        log.info("writing %s", rk.plot_memory(out / "memory.png"))
    except ImportError as e:  # the plan and the graph are the main results: do not lose them
        log.warning("no memory plot: %s", e)
    print(rk.explain())
    return 0


def _explain(args: argparse.Namespace) -> int:
    from rockplan.explain import explain
    from rockplan.plan_file import read_plan
    from solvers import solve_store_all

    if not Path(args.plan).is_file():
        raise UsageError(f"no plan file {args.plan}")
    try:
        plan = read_plan(args.plan)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(explain(plan.graph, plan.schedule, solve_store_all(plan.graph), reference=plan.store_all,
                  considered=plan.considered))
    return 0


def _bench(rest: Sequence[str]) -> int:
    if not BENCH_SCRIPT.is_file():
        print(f"rockplan: the benchmarks are not installed here ({BENCH_SCRIPT} is missing; they are run "
              "from a source checkout)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(BENCH_SCRIPT), *rest])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rockplan", description="Train PyTorch models in less memory: plan, "
                                "inspect and benchmark rematerialization schedules.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="plan a model: writes plan.json, graph.pdf, memory.png and prints the table")
    plan.add_argument("model", help="package.module:factory, path/to/file.py:factory or zoo:NAME")
    plan.add_argument("--shape", help="sample shape, e.g. 8x128 (needed when the factory returns a bare module)")
    plan.add_argument("--dtype", default="float", help="sample dtype: float, half, bfloat16, long, ... "
                      "(integers are drawn below the smallest nn.Embedding's size)")
    plan.add_argument("--budget", default="1.0", help="ratio of the store-everything peak (0.5), bytes, or a "
                      "size with units (800MB, 1.5GiB)")
    plan.add_argument("--solver", default=DEFAULT_SOLVER, help=f"planner (default {DEFAULT_SOLVER})")
    plan.add_argument("--profile", choices=("measure", "estimate"), default="measure",
                      help="op times measured on the sample, or estimated from FLOPs (kernels' scratch is "
                           "measured op by op either way)")
    plan.add_argument("--size", choices=("tiny", "default"), default="default", help="size of a zoo model")
    plan.add_argument("--with-loss", action="store_true", help="plan the model with its loss inside, as the "
                      "benchmarks do (zoo models, or factories returning (model, args, kwargs, loss_fn))")
    plan.add_argument("--plan-file", help="reuse this plan file instead of solving (checked against the model)")
    plan.add_argument("--polish", type=float, default=0.0, metavar="SECONDS",
                      help="where the plan stays above its proven floor, search on from it for up to this long "
                           "(the default solver's polish_time): a plan file is made once and trained on long")
    plan.add_argument("--out", default=".", help="directory for the outputs (default: current)")
    plan.set_defaults(run=_plan)

    explain = sub.add_parser("explain", help="print the table of a plan file")
    explain.add_argument("plan", help="a plan.json written by rockplan plan or rk.export")
    explain.set_defaults(run=_explain)

    # Listed for the help only: main() hands everything after `bench` to the script untouched
    # (argparse would take the script's own options, --help included, for rockplan's).
    sub.add_parser("bench", help="run the benchmarks (benchmarks/bench.py of a source checkout); "
                   "options go to the script")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = parser().parse_args(argv)
    # Progress on a terminal; in tests and pipes only what needs attention.
    quiet = args.quiet or not sys.stderr.isatty()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
                        format="%(message)s")
    from rockplan.plan_file import PlanMismatch
    from solvers import InfeasibleBudget

    try:
        return args.run(args)
    except UsageError as e:
        print(f"rockplan: error: {e}", file=sys.stderr)
        return 2
    except (PlanMismatch, InfeasibleBudget) as e:  # answers about the model, not bugs: no traceback
        print(f"rockplan: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
