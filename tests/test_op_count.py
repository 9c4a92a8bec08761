"""A planned step launches few kernels beyond eager's: counted ops, not times.

On a GPU a small model's step waits on the host issuing kernels, so every op the planned step
runs beyond eager's costs time even where nothing is recomputed. `rockplan.op_count` counts
the ATen ops that launch a kernel in one step, on CPU, deterministically.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rockplan import Rockmate, zoo
from rockplan.op_count import count_step, kernel_ops


def _kernels(module: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    def step() -> None:
        for p in module.parameters():
            p.grad = None
        module(*args, **kwargs).backward()
    return sum(kernel_ops(count_step(step)).values())


# Kernels the step planned at budget 1.0 may launch beyond eager's, per tiny zoo model, with a
# little slack. gpt: its fused head and loss (two chunks of a dozen kernels, against the
# unfused head's ten) and, on CPU only, dropout split into its mask and a sliced application;
# hf_llama: its fused head (one chunk); resnet: the fused cross-entropy backward. Before the
# head's chunks were written with fewer ops and BatchNorm's buffers updated in place, these
# were 52, 17 and 26.
@pytest.mark.parametrize(("name", "extra"), [("gpt", 40), ("hf_llama", 13), ("resnet", 8)])
def test_a_step_that_recomputes_nothing_launches_few_kernels_beyond_eager(name: str, extra: int) -> None:
    if name not in zoo.ZOO:
        pytest.skip("needs transformers")
    model, args, kwargs, loss = zoo.make(name)
    step = zoo.WithLoss(model, loss)
    eager = _kernels(step, args, kwargs)
    planned = _kernels(Rockmate(step, (args, kwargs), 1.0), args, kwargs)
    assert planned - eager <= extra, f"eager {eager} kernels, planned {planned}"


def _chunk_rows(rk: Rockmate) -> list[int]:
    op = torch.ops.rkgraph.linear_cross_entropy.default
    return [n.args[6] for n in rk.plan.joint.module.graph.find_nodes(op="call_function", target=op)]


def test_the_fused_head_takes_larger_chunks_where_the_budget_leaves_room() -> None:
    """At the ratio 1.0 the fused head's chunks are what the store-all peak was measured with;
    with room to spare (a budget in bytes above it) the head runs in one chunk, a dozen kernels
    fewer, still within the budget and computing the same loss and gradients."""
    model, args, kwargs, loss = zoo.make("gpt")
    step = zoo.WithLoss(model, loss)
    at_ratio = Rockmate(step, (args, kwargs), 1.0)
    roomy = Rockmate(step, (args, kwargs), 2 * at_ratio.store_all_peak)
    rows = 8 * 64  # every row of the head: the loss reads all but each sequence's last
    assert _chunk_rows(at_ratio) == [256] and _chunk_rows(roomy) == [rows]
    assert roomy.schedule.predicted_peak <= roomy.budget
    assert _kernels(roomy, args, kwargs) <= _kernels(at_ratio, args, kwargs) - 10
    results = []
    for module in (at_ratio, roomy):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks
        value = module(*args, **kwargs)
        value.backward()
        results.append((value.detach(), [p.grad.clone() for p in step.parameters()]))
    torch.testing.assert_close(results[0], results[1])


def test_batch_norm_buffers_are_updated_in_place_as_eager_updates_them() -> None:
    """The planned step that recomputes nothing updates BatchNorm's running statistics and batch
    count in its forward, in place, to eager's bits; no copy into them follows."""
    model, args, kwargs, loss = zoo.make("resnet")
    eager, planned_model = zoo.WithLoss(model, loss), zoo.WithLoss(copy.deepcopy(model), loss)
    planned = Rockmate(planned_model, (args, kwargs), 1.0)
    counted = {}
    for name, module in (("eager", eager), ("planned", planned)):
        counted[name] = count_step(lambda module=module: module(*args, **kwargs).backward())  # two steps
    ops = counted["planned"]
    assert ops["aten._native_batch_norm_legit.default"] == 6
    assert ops["aten._native_batch_norm_legit_functional.default"] == 0
    assert ops["aten.copy_.default"] == counted["eager"]["aten.copy_.default"]
    for (name, a), (_, b) in zip(eager.named_buffers(), planned_model.named_buffers(), strict=True):
        assert torch.equal(a, b), name
