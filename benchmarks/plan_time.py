"""Planning time: everything `Rockmate(model, sample, budget)` does, by stage and by solver.

    python benchmarks/plan_time.py                      # every model below, at 0.7 of the peak
    python benchmarks/plan_time.py --models resnet50,gpt2-l12 --ratio 0.5

Each model is planned in a fresh interpreter (`--one NAME` is that child's entry point), so
that the peak memory it reports is the planner's and imports and caches do not carry over.
Per model: graph nodes (autograd's graph, after the rewrites), and seconds spent
- capture: tracing the step with AOTAutograd on fake tensors, rewrites, and generating the
  code of the plan (everything but the two stages below);
- profile: building the RematGraph of each graph planned, costing it (measured by replaying the
  step, or estimated: `--profile`) and cutting it into blocks;
- solve: the portfolio, split by its stages (the proven floors, DTR's variants, saved values,
  peak shaving, greedy checkpoints, the chain of blocks, the flat MILP), and the referee;
and the process's peak resident memory (ru_maxrss) with how much planning raised it; then, in
another fresh interpreter, the same plan again as a script run again makes it, read from the
plan cache the first one wrote (`rockplan.plan_cache`).
Where the budget is below what the model can run in (a large model's parameters and gradients
alone can be over 0.7 of its peak), the row says so, with how long the refusal took, and its
figures are those of a plan at the smallest budget known to be feasible
(`solvers.min_feasible_budget`), planned in a fresh process too: every model gets a planning time.
The GPT-2 depth series (`gpt2-l12`, `-l24`, `-l48`) plans on estimated costs whatever
`--profile` says: it shows how planning grows with depth, not how long measuring takes.
The page, docs/benchmarks/plan-time.md (`--out`), has the table and a plot of planning time
against nodes beside it (`.png`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import resource
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_page import PAGES, child_row, write_page  # noqa: E402  (beside this script, on its path)

MODELS = ("mlp", "resnet", "gpt", "unet", "resnet50", "hf-gpt2", "t5-small", "bert", "llama", "roberta", "vit",
          "swin-t", "efficientnet-b0", "hf-resnet50", "gpt2-l12", "gpt2-l24", "gpt2-l48")
DEPTH_SERIES = {"gpt2-l12": 12, "gpt2-l24": 24, "gpt2-l48": 48}
# The solve stage's parts, by the names `solvers.portfolio` and `rockplan.planner` call them:
# (module, function) -> column. The planner proves floors outside the portfolio's call (autograd's
# graph's, which can settle the plan before that graph is solved, and the lean variant's);
# everything else here runs inside it.
SOLVE_PARTS = {
    ("solvers.portfolio", "check_budget"): "memory bounds",
    ("solvers.portfolio", "time_lower_bound"): "time floor",
    ("rockplan.planner", "time_lower_bound"): "time floor (planner)",
    ("solvers.portfolio", "solve_dtr"): "DTR",
    ("solvers.portfolio", "saved_values_attempts"): "saved values",
    ("solvers.portfolio", "solve_peak_shaving"): "peak shaving",
    ("solvers.portfolio", "solve_greedy_checkpoints"): "greedy ckpt",
    ("solvers.portfolio", "chain_schedules"): "chain",
    ("solvers.portfolio", "solve_milp"): "flat MILP",
    ("rockplan.planner", "simulate"): "referee",
}
OUTSIDE_PORTFOLIO = "time floor (planner)"
# The part of capture that is PyTorch's: AOTAutograd's metadata pass over the forward and its
# trace of the joint graph (our planning runs after both, in its partition step).
TRACE_PARTS = {("torch._functorch.aot_autograd", "create_aot_state"): "trace",
               ("torch._functorch.aot_autograd", "aot_stage1_graph_capture"): "trace"}


# --- the models ------------------------------------------------------------------------------


def _resnet50() -> tuple:
    """ResNet-50's layout (bottleneck blocks 3, 4, 6, 3; torchvision's widths) on 64x64 images."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Bottleneck(nn.Module):
        def __init__(self, channels_in: int, width: int, stride: int) -> None:
            super().__init__()
            out = 4 * width
            self.body = nn.Sequential(
                nn.Conv2d(channels_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
                nn.ReLU(inplace=True), nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
            self.skip = (nn.Identity() if stride == 1 and channels_in == out else
                         nn.Sequential(nn.Conv2d(channels_in, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.body(x) + self.skip(x))

    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1)]
    channels = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for b in range(blocks):
            layers.append(Bottleneck(channels, width, 2 if b == 0 and stage > 0 else 1))
            channels = 4 * width
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 1000))
    x = torch.randn(8, 3, 64, 64)
    labels = torch.randint(0, 1000, (8,))
    return model, (x,), lambda logits, *_: F.cross_entropy(logits, labels)


# Vision models users bring, as Hugging Face builds them from its default configs (ViT-base,
# Swin-T, EfficientNet-B0, ResNet-50): (config class, model class), by name. They
# train on IMAGES images of 224x224: at the text models' batch of 2 their parameters and
# gradients alone are most of the step's peak.
IMAGES = 8
VISION = {"vit": ("ViTConfig", "ViTForImageClassification"),
          "swin-t": ("SwinConfig", "SwinForImageClassification"),
          "efficientnet-b0": ("EfficientNetConfig", "EfficientNetForImageClassification"),
          "hf-resnet50": ("ResNetConfig", "ResNetForImageClassification")}


def _hf(kind: str) -> tuple:
    """Hugging Face models from configs (random weights, nothing downloaded), loss included:
    batch 2 of 128 tokens, or IMAGES images."""
    import torch
    from torch import nn

    batch, seq = 2, 128
    options = {"use_cache": False}
    ids = torch.randint(0, 1000, (batch, seq))
    if kind == "t5-small":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                          decoder_start_token_id=0, pad_token_id=0)
        model: nn.Module = T5ForConditionalGeneration(config)
        call = {"input_ids": ids, "labels": ids}
    elif kind == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        model = BertForSequenceClassification(BertConfig())  # BERT-base's shape
        call = {"input_ids": ids, "labels": torch.zeros(batch, dtype=torch.long)}
        options = {}
    elif kind == "roberta":
        from transformers import RobertaConfig, RobertaForSequenceClassification

        model = RobertaForSequenceClassification(RobertaConfig(vocab_size=1000))  # RoBERTa-base's layers
        call = {"input_ids": ids, "labels": torch.zeros(batch, dtype=torch.long)}
        options = {}
    elif kind in VISION:
        import transformers

        config_class, model_class = VISION[kind]
        model = getattr(transformers, model_class)(getattr(transformers, config_class)())
        call = {"pixel_values": torch.randn(IMAGES, 3, 224, 224), "labels": torch.zeros(IMAGES, dtype=torch.long)}
        options = {}
    else:  # a Llama-style decoder, small
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq)
        model = LlamaForCausalLM(config)
        call = {"input_ids": ids, "labels": ids}

    class Step(nn.Module):
        """The model's own loss, returned as a tensor: the module planned."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, **kwargs: torch.Tensor) -> torch.Tensor:
            return self.model(**kwargs, **options, return_dict=False)[0]

    return Step(), ((), call), None


def build(name: str) -> tuple:
    """(module to plan, sample) for model `name`: the loss is inside the planned module."""
    from rockplan import zoo

    if name == "resnet50":
        model, sample, loss = _resnet50()
    elif name in ("t5-small", "bert", "llama", "roberta", *VISION):
        model, sample, loss = _hf(name)
    elif name == "hf-gpt2" or name in DEPTH_SERIES:
        model, sample, _, loss = zoo.make("hf_gpt2", "gpt2", n_layer=DEPTH_SERIES.get(name))
    else:
        model, sample, _, loss = zoo.make(name, "default")
    return (zoo.WithLoss(model, loss) if loss is not None else model), sample


# --- one plan, timed (the child process) -----------------------------------------------------


@contextlib.contextmanager
def timed(module: object, name: str, into: dict[str, float], label: str) -> Iterator[None]:
    """Add the seconds spent in `module.name` to `into[label]` while the block runs (a
    generator function is timed until exhausted)."""
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
            return list(result) if name == "saved_values_attempts" else result
        finally:
            into[label] += time.perf_counter() - start

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, original)


def _peak_rss() -> int:
    """The process's peak resident memory so far, in bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plan_one(name: str, budget: float | int, profile: str, cache: str | None = None,
             restart: bool = False) -> dict[str, object]:
    """Plan model `name` at `budget` (a ratio of its peak, or bytes), timed by stage, keeping
    plans in `cache` (a directory; None: none). When the budget is refused, the graph's size and
    the smallest budget known to fit are still reported (`min_feasible`, bytes), from the plan
    that stores everything. `restart`: the same plan again, as a script run again does (its
    plan read from `cache`): only its total is wanted, no replan."""
    import importlib

    import torch

    from rockplan import Rockmate
    from solvers import InfeasibleBudget, min_feasible_budget

    torch.manual_seed(0)
    model, sample = build(name)
    profile = "estimate" if name in DEPTH_SERIES else profile
    seconds: dict[str, float] = defaultdict(float)
    stack = contextlib.ExitStack()
    planner = importlib.import_module("rockplan.planner")
    stack.enter_context(timed(planner, "costed_graph", seconds, "profile"))
    stack.enter_context(timed(planner, "replayed_times", seconds, "profile"))  # measured once the budget is checked
    for (module_name, attr), label in {**SOLVE_PARTS, **TRACE_PARTS}.items():
        stack.enter_context(timed(importlib.import_module(module_name), attr, seconds, label))
    stack.enter_context(timed(planner, "_solve", seconds, "portfolio"))
    peak_before = _peak_rss()  # the model and its inputs built: about what the process holds
    start = time.perf_counter()
    min_feasible = None
    with stack:
        try:
            rk = Rockmate(model, sample, budget, profile=profile, plan_cache=cache or False)
            plan = rk.plan
            outcome = f"{plan.schedule.extra.get('schedule_from', plan.schedule.solver)}"
        except InfeasibleBudget:
            outcome = "infeasible"
    total = time.perf_counter() - start
    peak = _peak_rss()
    replan = reuse = None
    if outcome == "infeasible":  # after the figures: this plan is not the one timed
        plan = Rockmate(model, sample, 1.0, solver="store_all", profile=profile).plan
        min_feasible = min_feasible_budget(plan.graph)
    elif name not in DEPTH_SERIES and not restart:  # (those plan on fake tensors: they run no step)
        replan = _replan_seconds(rk, _other_batch(sample))
        smaller = _other_batch(_other_batch(sample))
        if replan is not None and _shapes(smaller) != _shapes(sample):  # (a batch of 2: back to the sample's)
            reuse = _reuse_seconds(rk, smaller)
    return {"model": name, "profile": profile, "nodes": len(plan.times),  # autograd's graph, after the rewrites
            "total": total, "outcome": outcome, "seconds": dict(seconds), "peak_rss": peak,
            "planning_rss": max(0, peak - peak_before), "min_feasible": min_feasible,
            "store_all_peak": plan.reference.predicted_peak, "replan": replan, "reuse": reuse}


def _other_batch(sample: tuple) -> tuple:
    """`sample` with one example fewer (one more where it has one): a new input signature of the
    same step, every tensor whose first dimension is the batch cut or repeated along it."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_map

    batch = next(t.shape[0] for t in tree_leaves(sample) if isinstance(t, torch.Tensor) and t.dim())

    def resized(t: object) -> object:
        if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[0] != batch:
            return t
        return t[:batch - 1] if batch > 1 else torch.cat([t, t])

    return tree_map(resized, sample)


def _replan_seconds(rk: object, sample: tuple) -> float | None:
    """Seconds a training step at `sample`, a new input signature, spends planning again for it
    (as `rk.on_new_input` says: "replan" by default): the time inside the module's planning call."""
    import warnings

    from rockplan.module import Rockmate, _split_sample

    args, kwargs = _split_sample(sample)
    seconds: dict[str, float] = defaultdict(float)
    with warnings.catch_warnings(), timed(Rockmate, "_plan", seconds, "replan"):
        warnings.simplefilter("ignore")  # the warning that a new input is planned: this is that plan
        try:
            rk(*args, **kwargs).backward()
        except ValueError as e:  # the zoo's losses hold targets for the sample's batch only
            print(f"no re-planning figure: the step at another batch fails ({e})", file=sys.stderr)
            return None
    return seconds["replan"]


def _shapes(sample: tuple) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    return [tuple(t.shape) for t in tree_leaves(sample) if isinstance(t, torch.Tensor)]


def _reuse_seconds(rk: object, sample: tuple) -> tuple[float, bool] | None:
    """(`_replan_seconds`, whether the held plan ran) of a training step at `sample`, another new
    input signature, with on_new_input="reuse" from then on: its planning call runs the latest
    held plan where the simulator fits it, or else plans."""
    rk.on_new_input = "reuse"
    seconds = _replan_seconds(rk, sample)
    return None if seconds is None else (seconds, bool(rk.plan.schedule.extra.get("reused")))


# --- the page (the parent process) -----------------------------------------------------------


def markdown(rows: list[dict[str, object]], ratio: float) -> str:
    stages = [label for label in SOLVE_PARTS.values() if any(label in r["seconds"] for r in rows)]
    lines = [
        f"Budget: {ratio} of the step's peak without rematerialization. Seconds per stage; "
        "capture = total - profile - solve (tracing, rewrites, code generation), of which trace: AOTAutograd's "
        "metadata pass and joint trace, PyTorch's part. The columns after "
        "solve split it by part (solve also counts what is not listed: the referee's replays inside "
        "the solvers, the baselines); the lean variant's solve counts in the same columns. Peak RSS: "
        "the planning process's, and how much planning raised it above the peak reached building the "
        "model and its inputs. "
        "Plan from: the portfolio's member whose schedule was kept; where the budget is infeasible, how "
        "long the refusal took, and the row's figures are those of a plan at the smallest feasible budget. "
        "Replan s: planning again for a new input signature (one example fewer in the batch, one more "
        "where it has one), inside the first training step at it; not for the depth series (planned on "
        "fake tensors), the refusals, nor the zoo models whose loss holds targets for the sample's batch only. "
        "Reuse s: then a step one example fewer again with on_new_input=\"reuse\" (the budget the latest plan's "
        "bytes): its planning call, which runs the held plan where the simulator fits it, or else plans "
        "(\"planned\"); not where the batch is 2 (one fewer again is the sample's). Restart s: the same "
        "plan in a new process, as a script run again makes it: its plan read from the plan cache "
        "(`rockplan.plan_cache`, on by default), so the step is traced but neither replayed nor solved.",
        "",
        "| model | profile | nodes | total s | capture s | of which trace s | profile s | solve s | "
        f"{' | '.join(stages)} | "
        "peak RSS | planning added | replan s | reuse s | restart s | plan from |",
        f"|---|---|---|---|---|---|---|---|{'---|' * len(stages)}---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["seconds"]
        solve = s.get("portfolio", 0.0) + s.get(OUTSIDE_PORTFOLIO, 0.0)
        capture = r["total"] - s.get("profile", 0.0) - solve
        cells = [f"{s.get(k, 0.0):.2f}" for k in stages]
        lines.append(f"| {r['model']} | {r['profile']} | {r['nodes']} | {r['total']:.1f} | {capture:.1f} | "
                     f"{s.get('trace', 0.0):.1f} | "
                     f"{s.get('profile', 0.0):.1f} | {solve:.1f} | {' | '.join(cells)} | "
                     f"{r['peak_rss'] / 2**20:.0f} MiB | {r['planning_rss'] / 2**20:.0f} MiB | "
                     f"{'' if r.get('replan') is None else format(r['replan'], '.1f')} | {_reuse_cell(r)} | "
                     f"{'' if r.get('restart') is None else format(r['restart'], '.1f')} | "
                     f"{r['outcome']} |")
    return "\n".join(lines)


def _reuse_cell(row: dict[str, object]) -> str:
    if row.get("reuse") is None:
        return ""
    seconds, ran = row["reuse"]
    return f"{seconds:.1f}" + ("" if ran else " (planned)")


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        solve = r["seconds"].get("portfolio", 0.0) + r["seconds"].get(OUTSIDE_PORTFOLIO, 0.0)
        ax.scatter(r["nodes"], r["total"], color="tab:blue")
        ax.scatter(r["nodes"], solve, color="tab:orange", marker="x")
        ax.annotate(r["model"], (r["nodes"], r["total"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.scatter([], [], color="tab:blue", label="total (capture + profile + solve)")
    ax.scatter([], [], color="tab:orange", marker="x", label="solve")
    ax.set_xlabel("graph nodes")
    ax.set_ylabel("seconds")
    ax.set_title("Planning time against graph size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _child(name: str, budget: list[str], profile: str, cache: str, restart: bool = False) -> dict[str, object] | None:
    """`plan_one`'s row, from a fresh interpreter (None, said on stderr, when it failed)."""
    return child_row(__file__, "--one", name, *budget, "--profile", profile, "--cache", cache,
                     *(["--restart"] if restart else []), label=name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ratio", type=float, default=0.7)
    parser.add_argument("--profile", choices=("measure", "estimate"), default="measure")
    parser.add_argument("--out", type=Path, default=PAGES / "plan-time.md", help="the generated page")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: plan this model, print JSON
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)  # the child's budget, instead of --ratio
    parser.add_argument("--cache", help=argparse.SUPPRESS)  # the child's plan cache
    parser.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)  # the child plans again
    args = parser.parse_args()
    if args.one:
        print(json.dumps(plan_one(args.one, args.ratio if args.bytes is None else args.bytes, args.profile,
                                  args.cache, args.restart)))
        return
    rows = []
    for name in args.models.split(","):
        # The plan cache is on by default: each model's own, empty at its first plan.
        with tempfile.TemporaryDirectory(prefix="rockplan-plans-") as cache:
            budget = ["--ratio", str(args.ratio)]
            row = _child(name, budget, args.profile, cache)
            if row is not None and row["outcome"] == "infeasible":
                # Refused: the row's figures become those of a plan at the smallest feasible budget.
                refused = row
                budget = ["--bytes", str(refused["min_feasible"])]
                row = _child(name, budget, args.profile, cache)
                if row is not None:
                    share = refused["min_feasible"] / refused["store_all_peak"]
                    row["outcome"] = (f"{args.ratio} infeasible (refused in {refused['total']:.1f} s); at the "
                                      f"smallest feasible budget, {share:.2f} of the peak: {row['outcome']}")
            again = None if row is None else _child(name, budget, args.profile, cache, restart=True)
        if row is None:
            continue
        row["restart"] = None if again is None else again["total"]
        rows.append(row)
        print(f"{name}: {row['nodes']} nodes, {row['total']:.1f} s, {row['outcome']}", flush=True)
        write_page(args.out, "Planning time by stage", markdown(rows, args.ratio))
        plot(rows, args.out.with_suffix(".png"))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
