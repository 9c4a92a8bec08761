"""rockplan with PyTorch's data-parallel engines, on CPU: two processes over gloo.

Each rank trains the zoo GPT (with its loss, `WithLoss`) on its own batch, planned from the same
weights and sample on estimated node times (`profile="estimate"`, a function of the graph
alone), so both ranks solve the same problem. Their schedules are not compared: a solver
stopping at its wall-clock limit can settle differently on a loaded machine, which the engines
tolerate. The supported orders, `DDP(Rockmate(model))` and `fully_shard(Rockmate(model))`, are
compared with eager DDP and FSDP2 on the same weights, batches and seed; each rank measures its
step's peak (`measure_step`, the CPU allocator's events) against the budget. The orders that
wrap an engine inside Rockmate are refused at construction, with the order that works.

All distributed scenarios run in one spawn (starting two processes and planning is most of a
test's time); each test reads its part of the ranks' results.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rkgraph.build import is_collective
from rkgraph.capture import is_tangent
from rockplan import Rockmate, zoo
from rockplan.distributed import ShardedBlocks, fsdp_buffer_bytes
from rockplan.memory import measure_step

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD = 2
BUDGET = 0.6  # of the step's store-all memory: tight enough that the plan recomputes
TIGHT = 0.6  # the same, for the stacks of tanh layers below (feasible from about half)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpt_with_loss() -> tuple[nn.Module, torch.Tensor]:
    """The zoo GPT with its loss (seed 0: the same weights on every rank) and its sample."""
    entry = zoo.make("gpt", "tiny")
    return zoo.WithLoss(entry.model, entry.loss_fn), entry.args[0]


def _batch(sample: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s batch: different on each rank, so that averaging the gradients matters."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, int(sample.max()) + 1, sample.shape, generator=generator)


def _step(module: nn.Module, batch: torch.Tensor) -> None:
    torch.manual_seed(1)  # dropout draws the same masks in eager and planned steps
    module(batch).backward()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients (whole) by the parameter's name in the user's model, under any wrappers."""
    def inner(name: str) -> str:
        while name.startswith(("module.", "model.")):
            name = name.split(".", 1)[1]
        return name
    return {inner(name): _full(p.grad).detach().cpu().clone() for name, p in module.named_parameters()}


def _ddp(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, sample = _gpt_with_loss()
    batch = _batch(sample, rank)
    eager = DDP(copy.deepcopy(model))
    _step(eager, batch)
    rk = Rockmate(copy.deepcopy(model), sample, BUDGET, profile="estimate")
    planned = DDP(rk)
    measured = measure_step(_step, planned, batch)
    return {"eager": _gradients(eager), "planned": _gradients(planned), "peak": measured.peak,
            "budget": rk.budget,
            "recomputes": _recomputes(rk)}


def _fsdp(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model, sample = _gpt_with_loss()
    batch = _batch(sample, rank)
    # FSDP2's own buffers (the gathered parameters, the gradients copied for their
    # reduce-scatter) are allocated in the step, around what runs inside: what it adds to eager's
    # step, it may add to the planned step's.
    unsharded = measure_step(_step, copy.deepcopy(model), batch).peak
    eager = fully_shard(copy.deepcopy(model))
    sharded = measure_step(_step, eager, batch).peak
    rk = Rockmate(copy.deepcopy(model), sample, BUDGET, profile="estimate")
    planned = fully_shard(rk)
    measured = measure_step(_step, planned, batch)
    return {"eager": _gradients(eager), "planned": _gradients(planned), "peak": measured.peak,
            "fsdp_adds": sharded - unsharded, "eager_peak": sharded, "budget": rk.budget,
            "parameter_bytes": sum(_full(p).nbytes for p in planned.parameters())}


def _shard_blocks(model: nn.Module) -> nn.Module:
    """FSDP2 as torchtitan and accelerate apply it: each transformer block, then the model."""
    from torch.distributed.fsdp import fully_shard

    for block in model.model.transformer.h:
        fully_shard(block)
    return fully_shard(model)


def _shard_root(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def _fsdp_then_rockmate(rank: int, device: str = "cpu") -> dict:
    """Per sharding: FSDP2 applied first, then Rockmate, against eager FSDP2 sharded the same way."""
    from torch.distributed.tensor import DTensor

    results = {}
    for name, shard in {"blocks": _shard_blocks, "root": _shard_root}.items():
        model, sample = _gpt_with_loss()
        model, sample = model.to(device), sample.to(device)
        batch = _batch(sample, rank).to(device)
        eager = shard(copy.deepcopy(model))
        eager_peak = measure_step(_step, eager, batch).peak
        sharded = shard(copy.deepcopy(model))
        hooks = _forward_hooks(sharded)
        # Planning's own peak is read on CUDA only. On a CPU planning measures kernels' scratch
        # with torch.profiler, so the allocator's events cannot be read around it
        # (`AllocatorEvents`); and under the storage count's dispatch mode the trace runs the
        # model's forward on real tensors, so that count is not planning's.
        if device == "cpu":
            rk, planning_peak = Rockmate(sharded, sample, BUDGET, profile="estimate"), None
        else:
            planning = measure_step(Rockmate, sharded, sample, BUDGET, profile="estimate")
            rk, planning_peak = planning.result, planning.peak
        # Planning leaves the model as FSDP2 made it: sharded, its hooks and forward its own.
        untouched = (all(isinstance(p, DTensor) for p in sharded.parameters()) and "forward" not in vars(sharded)
                     and hooks == _forward_hooks(sharded))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            measured = measure_step(_step, rk, batch)
        results[name] = {"eager": _gradients(eager), "planned": _gradients(rk), "peak": measured.peak,
                         "replanned": [str(w.message) for w in caught if "planned for" in str(w.message)],
                         "eager_peak": eager_peak, "budget": rk.budget, "untouched": untouched,
                         "fsdp_buffers": fsdp_buffer_bytes(rk), "planning_peak": planning_peak,
                         "sharded_after_step": all(isinstance(p, DTensor) for p in sharded.parameters()),
                         "schedule": [tuple(op) for op in rk.schedule.ops], "recomputes": _recomputes(rk),
                         "recomputed_reading_blocks": _recomputed_reading(rk, "model.transformer.h.")}
        # A shorter input is planned inside its step, within the root's forward.
        for module in (eager, rk):
            module.zero_grad()
        with pytest.warns(UserWarning, match="planned for a new input"):
            _step(rk, batch[:, : batch.shape[1] // 2])
        _step(eager, batch[:, : batch.shape[1] // 2])
        results[name + ", shorter input"] = {"eager": _gradients(eager), "planned": _gradients(rk)}
    return results


def _fsdp_measured_replan(rank: int) -> dict:
    """Per-block FSDP2, then Rockmate on its default measured profile: the first plan gathers
    every sharded group whole to replay the step; a shorter input is then planned inside its
    step on the first plan's times rescaled, which replays nothing, so the groups are gathered
    one at a time for the trace, never whole (a model sharded because it does not fit whole)."""
    model, sample = _gpt_with_loss()
    batch = _batch(sample, rank)
    eager = _shard_blocks(copy.deepcopy(model))
    sharded = _shard_blocks(copy.deepcopy(model))
    gathered_whole: list[bool] = []
    planning = ShardedBlocks.planning

    def recorded(self: ShardedBlocks, values: bool) -> object:
        gathered_whole.append(values)
        return planning(self, values)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShardedBlocks, "planning", recorded)
        rk = Rockmate(sharded, sample, BUDGET)
        shorter = batch[:, : batch.shape[1] // 2]
        with pytest.warns(UserWarning, match="planned for a new input"):
            _step(rk, shorter)
    _step(eager, shorter)
    return {"eager": _gradients(eager), "planned": _gradients(rk), "gathered_whole": gathered_whole}


def _fsdp_ranks_agree(rank: int) -> dict:
    """Per-block FSDP2 with each rank planning by another solver: the ranks must still run one
    schedule, since the generated code gathers a block where its plan first reads it."""
    model, sample = _gpt_with_loss()
    batch = _batch(sample, rank)
    eager = _shard_blocks(copy.deepcopy(model))
    _step(eager, batch)
    solver = "rockmate" if rank == 0 else "dtr"
    rk = Rockmate(_shard_blocks(copy.deepcopy(model)), sample, BUDGET, profile="estimate", solver=solver)
    _step(rk, batch)
    alone = Rockmate(copy.deepcopy(model), sample, BUDGET, profile="estimate", solver=solver)  # unsharded
    return {"eager": _gradients(eager), "planned": _gradients(rk), "schedule": [tuple(op) for op in rk.schedule.ops],
            "alone": [tuple(op) for op in alone.schedule.ops]}


def _fsdp_mixed_precision(rank: int) -> dict:
    """Per-block FSDP2 with torchtitan's mixed-precision policy (bf16 parameters, fp32 gradient
    reduction), then Rockmate: FSDP2 gathers bf16 parameters in every step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def shard(model: nn.Module) -> nn.Module:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.model.transformer.h:
            fully_shard(block, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)

    model, sample = _gpt_with_loss()
    batch = _batch(sample, rank)
    eager = shard(copy.deepcopy(model))
    _step(eager, batch)
    rk = Rockmate(shard(copy.deepcopy(model)), sample, BUDGET, profile="estimate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measured = measure_step(_step, rk, batch)
    planned = _gradients(rk)
    rk.zero_grad(set_to_none=True)  # the same step again, its storages counted
    storages = measure_step(_step, rk, batch, method="storages")
    return {"eager": _gradients(eager), "planned": planned, "peak": measured.peak, "budget": rk.budget,
            "storages_peak": storages.peak, "fsdp_buffers": fsdp_buffer_bytes(rk),
            "replanned": [str(w.message) for w in caught if "planned for" in str(w.message)]}


class _GainBlock(nn.Module):
    """A residual block that also reads a parameter of the model it is in (`gain`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh())

    def forward(self, h: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return h + gain * self.net(h)


class _TiedBlocks(nn.Module):
    """A tiny language model as FSDP2 users shard it: an embedding tied to the head (GPT-2's and
    Llama's tie_word_embeddings), blocks, and a root parameter every block reads. `value_branch`
    adds a branch on a tensor's value, where Dynamo would break the graph."""

    VOCAB, DIM, LAYERS = 64, 64, 4

    def __init__(self, value_branch: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.blocks = nn.ModuleList(_GainBlock(self.DIM) for _ in range(self.LAYERS))
        self.gain = nn.Parameter(torch.full((self.DIM,), 0.5))
        self.head = nn.Linear(self.DIM, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.value_branch = value_branch

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, self.gain)
        if self.value_branch and h.sum() > 0:
            h = 2 * h
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def _tied_blocks(value_branch: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    sample = torch.randint(0, _TiedBlocks.VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
    return _TiedBlocks(value_branch), sample


def _shard_each_block(model: nn.Module, keep: tuple[bool, ...] = ()) -> nn.Module:
    """`fully_shard` per block then the root; block i kept gathered after its forward where
    `keep[i]` (`reshard_after_forward=False`)."""
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.blocks):
        fully_shard(block, reshard_after_forward=not (i < len(keep) and keep[i]))
    return fully_shard(model)


def _shard_grouped(model: nn.Module) -> nn.Module:
    """Groups of several modules: the tied embedding and head as one (as FSDP2 asks for tied
    parameters), and the blocks two by two."""
    from torch.distributed.fsdp import fully_shard

    fully_shard([model.embed, model.head])
    for i in range(0, len(model.blocks), 2):
        fully_shard(list(model.blocks[i:i + 2]))
    return fully_shard(model)


KEEP = (True, False, True, False)  # blocks kept gathered from forward to backward


def _fsdp_setups(rank: int) -> dict:
    """FSDP2 set-ups beyond one group per block, each then Rockmate, against eager FSDP2 sharded
    the same way: grouped modules, blocks kept gathered after their forward, gradient
    accumulation without gradient sync, and a forward with a graph break."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from rockplan.distributed import _reshard_after_forward

    results: dict = {}
    model, sample = _tied_blocks()
    batches = [_batch(sample, rank + WORLD * i) for i in range(3)]
    for name, shard in {"grouped": _shard_grouped, "kept": lambda m: _shard_each_block(m, KEEP)}.items():
        eager = shard(copy.deepcopy(model))
        rk = Rockmate(shard(copy.deepcopy(model)), sample, BUDGET, profile="estimate")
        gathered_after_forward = []
        for module, fsdp in ((eager, eager), (rk, rk.model)):  # the blocks held between forward and backward
            loss = module(batches[0])
            gathered_after_forward.append([not isinstance(b.net[0].weight, DTensor) for b in fsdp.blocks])
            loss.backward()
        for module in (eager, rk):
            module.zero_grad()
        measured = measure_step(_step, rk, batches[0])
        _step(eager, batches[0])
        results[name] = {"eager": _gradients(eager), "planned": _gradients(rk), "peak": measured.peak,
                         "budget": rk.budget, "fsdp_buffers": fsdp_buffer_bytes(rk), "recomputes": _recomputes(rk),
                         "gathered_after_forward": gathered_after_forward,
                         "reshard_after_forward": [_reshard_after_forward([b]) for b in rk.model.blocks]}
        # A shorter input is planned inside its step (its traced forward gathers the blocks).
        for module in (eager, rk):
            module.zero_grad()
        with pytest.warns(UserWarning, match="planned for a new input"):
            _step(rk, batches[1][:, :32])
        _step(eager, batches[1][:, :32])
        results[name + ", shorter input"] = {"eager": _gradients(eager), "planned": _gradients(rk)}
        # Gradient accumulation: no gradient sync (no reduce-scatter) on the first micro-steps.
        reduced_after_first = []
        for module, fsdp in ((eager, eager), (rk, rk.model)):
            module.zero_grad()
            for i, batch in enumerate(batches):
                fsdp.set_requires_gradient_sync(i == len(batches) - 1)
                _step(module, batch)
                if i == 0:
                    reduced_after_first.append([p.grad is not None for p in fsdp.parameters()])
        results[name + ", accumulated"] = {"eager": _gradients(eager), "planned": _gradients(rk),
                                           "reduced_after_first": reduced_after_first}

    # A graph break: refused, saying what to do; the order it names works.
    branching, _ = _tied_blocks(value_branch=True)
    try:
        Rockmate(_shard_each_block(copy.deepcopy(branching)), sample, BUDGET, profile="estimate")
        refusal = None
    except Exception as e:  # noqa: BLE001  # the test reads what was raised
        refusal = f"{type(e).__name__}: {e}"
    eager = fully_shard(copy.deepcopy(branching))
    _step(eager, batches[0])
    planned = fully_shard(Rockmate(copy.deepcopy(branching), sample, BUDGET, profile="estimate"))
    _step(planned, batches[0])
    results["graph break"] = {"eager": _gradients(eager), "planned": _gradients(planned), "refusal": refusal}
    return results


def _recomputed_reading(rk: Rockmate, prefix: str) -> list[str]:
    """Nodes the plan computes more than once that read a parameter whose name starts with `prefix`."""
    primals = [n.name for n in rk.plan.joint.module.graph.find_nodes(op="placeholder") if not is_tangent(n)]
    names = dict(zip(primals, rk.plan.joint.input_names))
    computed = [op.name for op in rk.schedule.ops if op.kind == "compute"]
    return sorted({n for n in computed if computed.count(n) > 1
                   and any(names.get(d, "").startswith(prefix) for d in rk.graph.node(n).inputs)})


def _forward_hooks(model: nn.Module) -> dict[str, tuple[dict, dict]]:
    return {path: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for path, m in model.named_modules()}


def _refusals(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    messages = {}
    wrapped = {
        "Rockmate(DDP(model))": lambda m: DDP(m),
        "fully_shard on the blocks only, then Rockmate": lambda m: [fully_shard(b) for b in m.model.transformer.h]
        and m,
    }
    for order, wrap in wrapped.items():
        model, sample = _gpt_with_loss()
        try:
            Rockmate(wrap(model), sample, BUDGET, profile="estimate")
            messages[order] = None
        except ValueError as e:
            messages[order] = str(e)
    return messages


def _tanh_stack(layers: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(64, 64), nn.Tanh())])


class _Gathered(nn.Module):
    """Tensor-parallel style: each rank's activations are all-gathered inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.before, self.after, self.head = _tanh_stack(3), _tanh_stack(3), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        # Renamed in torch 2.10; the old name warns there.
        all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        h = all_gather(self.before(x), 0, dist.group.WORLD)
        return self.head(self.after(h)).square().mean()


def _collective_in_forward(rank: int) -> dict:
    torch.manual_seed(0)
    model = _Gathered()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(rank))
    eager = copy.deepcopy(model)
    eager(x).backward()
    rk = Rockmate(copy.deepcopy(model), x, TIGHT, profile="estimate")
    # Counted by storages: gloo's worker thread holds the all-gather's input until the collective
    # completes and, when its reference is the last, frees it on that thread, which the CPU
    # profiler does not follow (the block would count as alive to the end of the step).
    measured = measure_step(lambda: rk(x).backward(), method="storages")
    computed = [op.name for op in rk.schedule.ops if op.kind == "compute"]
    collectives = [n.name for n in rk.graph.nodes
                   if any(is_collective(f) for f in rk.plan.joint.module.graph.nodes if f.name in n.fx_nodes)]
    return {"eager": _gradients(eager), "planned": _gradients(rk), "peak": measured.peak, "budget": rk.budget,
            "collectives": collectives, "run_once": all(rk.graph.node(c).random for c in collectives),
            "computed": {c: computed.count(c) for c in collectives}, "recomputes": _recomputes(rk)}


def _recomputes(rk: Rockmate) -> int:
    computed = [op.name for op in rk.schedule.ops if op.kind == "compute"]
    return len(computed) - len(set(computed))


COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # the slowest scenario takes under one
SCENARIOS = {"ddp": _ddp, "fsdp": _fsdp, "fsdp_first": _fsdp_then_rockmate, "fsdp_agree": _fsdp_ranks_agree,
             "fsdp_mixed": _fsdp_mixed_precision, "fsdp_setups": _fsdp_setups,
             "fsdp_measured": _fsdp_measured_replan, "refusals": _refusals,
             "collective": _collective_in_forward}


def _worker(rank: int, port: int, out: str, backend: str = "gloo", scenarios: dict | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A scenario that raises on one rank between collectives leaves the other waiting: with the
    # default half hour, the test module hangs instead of failing with the raising rank's error.
    dist.init_process_group(backend, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    torch.set_num_threads(1)  # two ranks share the machine's cores
    results = {}
    try:
        for name, scenario in (scenarios or SCENARIOS).items():
            try:
                results[name] = scenario(rank)
            except Exception:  # reported by the scenario's test, the others still run
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def run_ranks(out: Path, backend: str = "gloo", scenarios: dict | None = None) -> list[dict]:
    """Each rank's results of `scenarios` (by default `SCENARIOS`), run in WORLD spawned processes."""
    mp.spawn(_worker, args=(_free_port(), str(out), backend, scenarios), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("ranks"))


def _scenario(ranks: list[dict], name: str) -> list[dict]:
    for rank, results in enumerate(ranks):
        if "error" in results[name]:
            pytest.fail(f"rank {rank}, {name}:\n{results[name]['error']}")
    return [results[name] for results in ranks]


def _assert_same_gradients(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["eager"].keys() == r["planned"].keys()
        for name, eager in r["eager"].items():
            torch.testing.assert_close(r["planned"][name], eager, msg=lambda m, k=rank, n=name: f"rank {k}, {n}: {m}")
    # Averaged across ranks, from different batches: every rank holds the same gradients.
    for name, grad in results[0]["planned"].items():
        assert torch.equal(results[1]["planned"][name], grad), name


def test_ddp_of_rockmate_matches_eager_ddp_within_budget(ranks: list[dict]) -> None:
    results = _scenario(ranks, "ddp")
    _assert_same_gradients(results)
    assert results[0]["recomputes"] > 0  # the budget is tight enough to make the plan recompute
    for rank, r in enumerate(results):
        assert r["peak"] <= r["budget"], f"rank {rank}: peak {r['peak']} > budget {r['budget']}"
        print(f"rank {rank}: DDP peak {r['peak']}, budget {r['budget']}")


def test_fully_shard_of_rockmate_matches_eager_fsdp2_within_budget(ranks: list[dict]) -> None:
    results = _scenario(ranks, "fsdp")
    _assert_same_gradients(results)
    for rank, r in enumerate(results):
        assert r["peak"] <= r["budget"] + r["fsdp_adds"], (
            f"rank {rank}: peak {r['peak']} > budget {r['budget']} + what FSDP2 adds to eager's step {r['fsdp_adds']}")
        print(f"rank {rank}: FSDP2", {k: v for k, v in r.items() if k not in ("eager", "planned")})


def test_engines_inside_rockmate_are_refused_with_the_order_that_works(ranks: list[dict]) -> None:
    messages = _scenario(ranks, "refusals")[0]
    assert "DDP(Rockmate(model" in messages["Rockmate(DDP(model))"]
    assert "fully_shard(model); Rockmate(model" in messages["fully_shard on the blocks only, then Rockmate"]


@pytest.mark.parametrize("sharding", ["blocks", "root"])
def test_rockmate_of_fsdp2_matches_eager_fsdp2_within_budget(ranks: list[dict], sharding: str) -> None:
    """`fully_shard` on each block and then on the model (torchtitan's order), or on the model
    alone, then Rockmate: eager FSDP2's gradients, and the step within the budget plus FSDP2's
    gathered parameters and buffers (`fsdp_buffer_bytes`, README)."""
    results = [r[sharding] for r in _scenario(ranks, "fsdp_first")]
    _assert_same_gradients(results)
    assert results[0]["schedule"] == results[1]["schedule"]
    for rank, r in enumerate(results):
        # Recomputed in the backward from a block's parameters: after the block is gathered again.
        assert r["recomputed_reading_blocks"], "the budget is tight enough to make the plan recompute in a block"
        assert r["untouched"] and r["sharded_after_step"]
        assert not r["replanned"], "the step runs the plan made at construction"
        assert r["peak"] <= r["budget"] + r["fsdp_buffers"], (
            f"rank {rank}: peak {r['peak']} > budget {r['budget']} + FSDP2's buffers {r['fsdp_buffers']}")
        print(f"rank {rank}: FSDP2 ({sharding}) then Rockmate",
              {k: v for k, v in r.items() if k not in ("eager", "planned", "schedule")})


@pytest.mark.parametrize("sharding", ["blocks", "root"])
def test_rockmate_of_fsdp2_plans_a_new_input_inside_the_step(ranks: list[dict], sharding: str) -> None:
    _assert_same_gradients([r[sharding + ", shorter input"] for r in _scenario(ranks, "fsdp_first")])


def test_rockmate_of_fsdp2_plans_a_new_input_on_measured_times_without_gathering_whole(ranks: list[dict]) -> None:
    results = _scenario(ranks, "fsdp_measured")
    for r in results:
        assert r["gathered_whole"] == [True, False]  # the first plan replays the step; the new input does not
    _assert_same_gradients(results)


def test_ranks_run_rank_0s_plan_under_per_block_fsdp2(ranks: list[dict]) -> None:
    results = _scenario(ranks, "fsdp_agree")
    # Rank 1's solver alone plans otherwise; sharded, it runs the plan rank 0 made.
    assert results[1]["alone"] != results[0]["schedule"]
    assert results[0]["schedule"] == results[1]["schedule"]
    _assert_same_gradients(results)


def test_rockmate_of_fsdp2_with_a_mixed_precision_policy_matches_eager(ranks: list[dict]) -> None:
    """The plan made at construction applies in the step (the plan key reads the parameters as
    the model declares them, not FSDP2's bf16 gathered ones); gradients equal eager FSDP2's up to
    bf16 rounding; and the step is within the budget plus FSDP2's buffers, counted both ways:
    by the allocator's events, which see the bf16 matmuls' scratch (the estimated profile counts
    it, op by op) but hold a block gloo's thread frees to the end, and by storages, which see
    no scratch but every free (`rockplan.memory`)."""
    results = _scenario(ranks, "fsdp_mixed")
    for rank, r in enumerate(results):
        assert not r["replanned"], f"rank {rank}: {r['replanned']}"
        for name, eager in r["eager"].items():
            torch.testing.assert_close(r["planned"][name], eager, rtol=1.6e-2, atol=1e-3,
                                       msg=lambda m, k=rank, n=name: f"rank {k}, {n}: {m}")
        within = r["budget"] + r["fsdp_buffers"]
        for how in ("peak", "storages_peak"):
            assert r[how] <= within, (f"rank {rank}: {how} {r[how]} > budget {r['budget']} + FSDP2's buffers "
                                      f"{r['fsdp_buffers']}")


@pytest.mark.parametrize("setup", ["grouped", "kept"])
def test_rockmate_of_fsdp2_setups_match_eager_fsdp2_within_budget(ranks: list[dict], setup: str) -> None:
    """Grouped modules (`fully_shard([embed, head])`, the tied embedding and head, and blocks two
    by two) and blocks sharded with `reshard_after_forward=False`, under a root whose parameter
    every block reads: eager FSDP2's gradients, the step within the budget plus FSDP2's buffers."""
    results = [r[setup] for r in _scenario(ranks, "fsdp_setups")]
    _assert_same_gradients(results)
    for rank, r in enumerate(results):
        assert r["recomputes"] > 0
        assert r["peak"] <= r["budget"] + r["fsdp_buffers"], (
            f"rank {rank}: peak {r['peak']} > budget {r['budget']} + FSDP2's buffers {r['fsdp_buffers']}")
        print(f"rank {rank}: FSDP2 ({setup}) then Rockmate",
              {k: v for k, v in r.items() if k not in ("eager", "planned")})


@pytest.mark.parametrize("setup", ["grouped", "kept"])
def test_rockmate_of_fsdp2_setups_plan_a_new_input_inside_the_step(ranks: list[dict], setup: str) -> None:
    _assert_same_gradients([r[setup + ", shorter input"] for r in _scenario(ranks, "fsdp_setups")])


def test_rockmate_of_fsdp2_keeps_blocks_gathered_after_forward_as_eager(ranks: list[dict]) -> None:
    """A block sharded with `reshard_after_forward=False` stays gathered from the forward to the
    backward in the planned step, as in eager FSDP2; the others are resharded."""
    for r in (r["kept"] for r in _scenario(ranks, "fsdp_setups")):
        eager, planned = r["gathered_after_forward"]
        assert eager == list(KEEP)
        assert planned == eager
        assert r["reshard_after_forward"] == [not keep for keep in KEEP]


@pytest.mark.parametrize("setup", ["grouped", "kept"])
def test_rockmate_of_fsdp2_accumulates_without_gradient_sync_as_eager(ranks: list[dict], setup: str) -> None:
    """`set_requires_gradient_sync(False)` on the first micro-steps: no reduce-scatter there (no
    sharded gradient yet), then eager FSDP2's accumulated gradients after the last."""
    results = [r[setup + ", accumulated"] for r in _scenario(ranks, "fsdp_setups")]
    for r in results:
        eager, planned = r["reduced_after_first"]
        assert not any(eager) and planned == eager
    _assert_same_gradients(results)


def test_rockmate_of_fsdp2_with_a_graph_break_says_what_to_do(ranks: list[dict]) -> None:
    results = [r["graph break"] for r in _scenario(ranks, "fsdp_setups")]
    for r in results:
        assert r["refusal"] is not None and r["refusal"].startswith("CaptureError"), r["refusal"]
        assert "sharded by FSDP2" in r["refusal"] and "fully_shard(Rockmate(model" in r["refusal"]
    _assert_same_gradients(results)  # the order the error names gives eager FSDP2's gradients


def test_fsdp2_private_details_rockplan_reads_are_there() -> None:
    """What `rockplan.distributed` reads of FSDP2 beyond its public API (listed there): fails
    here, by name, when a torch release changes one."""
    import inspect

    from torch.autograd.graph import _MultiHandle
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert callable(FSDPModule._get_fsdp_state)
    init = inspect.getsource(FSDPState.init)
    assert "self._pre_forward_hook_handle =" in init and "self._post_forward_hook_handle =" in init
    assert "handles" in _MultiHandle.__annotations__
    assert "self._fsdp_param_groups" in inspect.getsource(FSDPState.__init__)
    group_init = inspect.getsource(FSDPParamGroup.__init__)
    assert "self.post_forward_mesh_info =" in group_init and "self.mesh_info =" in group_init
    # The root's final callback runs the post-backward of groups whose backward hook did not fire.
    final = inspect.getsource(FSDPState._root_post_backward_final_callback)
    assert "_training_state != TrainingState.POST_BACKWARD" in final and ".post_backward()" in final
    queues = inspect.getsource(FSDPState._register_root_post_backward_final_callback)
    assert "queue_callback" in queues and "self._root_post_backward_final_callback" in queues


def test_collectives_in_the_forward_run_once(ranks: list[dict]) -> None:
    results = _scenario(ranks, "collective")
    for r in results:
        assert r["collectives"], "the all-gather is a node of the planned graph"
        assert r["run_once"] and set(r["computed"].values()) == {1}, r["computed"]
        assert r["recomputes"] > 0  # the plan recomputes, but not the collective


def test_collectives_in_the_forward_give_eager_gradients_within_the_budget(ranks: list[dict]) -> None:
    for rank, r in enumerate(_scenario(ranks, "collective")):
        for name, eager in r["eager"].items():
            torch.testing.assert_close(r["planned"][name], eager, msg=lambda m, k=rank, n=name: f"rank {k}, {n}: {m}")
        assert r["peak"] <= r["budget"]


class _Ranged(nn.Module):
    """A forward with a profiler range, as DDP's and many training codebases' forwards open."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.head = _tanh_stack(6), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("ranged.forward"):
            return self.head(self.net(x)).square().mean()


def test_record_function_in_forward_is_planned_and_matches_eager() -> None:
    torch.manual_seed(0)
    model, x = _Ranged(), torch.randn(1024, 64)
    eager = copy.deepcopy(model)
    eager(x).backward()
    rk = Rockmate(model, x, TIGHT, profile="estimate")
    measured = measure_step(lambda: rk(x).backward())
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert _recomputes(rk) > 0
    assert measured.peak <= rk.budget


def _fsdp_then_rockmate_on_cuda(rank: int) -> dict:
    return _fsdp_then_rockmate(rank, f"cuda:{rank}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD
                    or not dist.is_nccl_available(), reason="needs two CUDA devices and NCCL")
@pytest.mark.parametrize("sharding", ["blocks", "root"])
def test_rockmate_of_fsdp2_on_nccl_matches_eager_fsdp2_within_budget(tmp_path: Path, sharding: str) -> None:
    """The same as on gloo, one GPU per rank over NCCL, peaks read from the CUDA allocator."""
    ranks = run_ranks(tmp_path, "nccl", {"fsdp_first": _fsdp_then_rockmate_on_cuda})
    results = [r[sharding] for r in _scenario(ranks, "fsdp_first")]
    _assert_same_gradients(results)
    for rank, r in enumerate(results):
        # Planning traces on the whole shapes with one group gathered at a time, within the budget.
        assert r["planning_peak"] <= r["budget"], (
            f"rank {rank}: planning peaked at {r['planning_peak']}, budget {r['budget']}, eager {r['eager_peak']}")
        assert r["peak"] <= r["budget"] + r["fsdp_buffers"], (
            f"rank {rank}: peak {r['peak']} > budget {r['budget']} + FSDP2's buffers {r['fsdp_buffers']}")
