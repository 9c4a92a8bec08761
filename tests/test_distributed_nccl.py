"""rockplan with PyTorch's data-parallel engines on CUDA: two processes over NCCL, one GPU each.

The CUDA variant of `test_distributed.py`'s supported orders, `DDP(Rockmate(model))` and
`fully_shard(Rockmate(model))`, in fp32 and under bf16 autocast (the way people train on GPUs).
Each rank plans from the same weights and sample on estimated node times. The ranks' schedules
are not compared: solvers stop at wall-clock limits, so two ranks may settle on different
schedules, which DDP and FSDP2 tolerate (their collectives run outside the planned step).
Gradients are compared with eager DDP / FSDP2 in the same set-up, and each rank's peak is the
CUDA caching allocator's (expandable segments, as `tests/conftest.py` sets them). Skipped
without two CUDA devices and NCCL.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist

from rockplan import Rockmate
from rockplan.memory import measure_step
from tests.test_distributed import BUDGET, WORLD, _batch, _gpt_with_loss, _gradients, run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
                            and dist.is_available() and dist.is_nccl_available()),
                       reason=f"needs {WORLD} CUDA devices and NCCL"),
]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _precision(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _step(module: torch.nn.Module, batch: torch.Tensor, dtype: torch.dtype | None) -> None:
    torch.manual_seed(1)  # dropout draws the same masks in eager and planned steps
    with _precision(dtype):
        loss = module(batch)
    loss.backward()


def _scenario(rank: int, engine: str, dtype: torch.dtype | None) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", rank)
    model, sample = _gpt_with_loss()
    model, sample = model.to(device), sample.to(device)
    batch = _batch(sample.cpu(), rank).to(device)
    wrap = {"ddp": lambda m: DDP(m, device_ids=[rank]), "fsdp": fully_shard}[engine]
    unsharded = measure_step(_step, copy.deepcopy(model), batch, dtype).peak
    eager = wrap(copy.deepcopy(model))
    eager_peak = measure_step(_step, eager, batch, dtype).peak
    with _precision(dtype):  # planned in the set-up it trains in: autocast selects the plan
        rk = Rockmate(copy.deepcopy(model), sample, BUDGET, profile="estimate")
    planned = wrap(rk)
    measured = measure_step(_step, planned, batch, dtype)
    torch.cuda.synchronize(device)
    return {"eager": {k: v.cpu() for k, v in _gradients(eager).items()},
            "planned": {k: v.cpu() for k, v in _gradients(planned).items()},
            "peak": measured.peak, "budget": rk.budget, "engine_adds": max(0, eager_peak - unsharded)}


SCENARIOS = {f"{engine} {precision}": functools.partial(_scenario, engine=engine, dtype=dtype)
             for engine in ("ddp", "fsdp") for precision, dtype in PRECISIONS.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("nccl_ranks"), "nccl", SCENARIOS)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_engine_of_rockmate_on_nccl_matches_eager_within_budget(ranks: list[dict], engine: str,
                                                                 precision: str) -> None:
    results = []
    for rank, by_scenario in enumerate(ranks):
        r = by_scenario[f"{engine} {precision}"]
        if "error" in r:
            pytest.fail(f"rank {rank}, {engine} {precision}:\n{r['error']}")
        results.append(r)
    for rank, r in enumerate(results):
        for name, eager in r["eager"].items():
            # bf16: the same casts in the same order; cuBLAS may still pick kernels per call.
            tolerance = {} if precision == "fp32" else {"rtol": 1.6e-2, "atol": 1e-3}
            torch.testing.assert_close(r["planned"][name], eager, **tolerance,
                                       msg=lambda m, k=rank, n=name: f"rank {k}, {n}: {m}")
        # The engine's own buffers (DDP's buckets, FSDP2's gathered parameters and reduce-scatter
        # copies) come on top of the step, as on top of eager's.
        assert r["peak"] <= r["budget"] + r["engine_adds"], (
            f"rank {rank}: peak {r['peak']} > budget {r['budget']} + what {engine} adds {r['engine_adds']}")
