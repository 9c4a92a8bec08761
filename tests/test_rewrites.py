"""Graph rewrites applied at capture (rkgraph.dropout, rkgraph.cross_entropy): each replaced
op pattern against the ATen ops it replaces, run on real tensors."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import rkgraph
from rkgraph.cross_entropy import fuse_cross_entropy_backward
from rkgraph.dropout import split_dropout
from rockplan import zoo
from solvers import solve_store_all

aten = torch.ops.aten
_LAYOUTS = {
    "contiguous": lambda: torch.randn(64, 33),
    "transposed": lambda: torch.randn(33, 64).t(),
    "channels_last": lambda: torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last),
    "sliced": lambda: torch.randn(8, 5, 2)[:, ::2],
    "expanded": lambda: torch.randn(8, 1).expand(8, 6),
    "float64": lambda: torch.randn(3, 4, dtype=torch.float64),
}


def _dropout(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return aten.native_dropout.default(x, 0.3, True)


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_split_dropout_draws_what_native_dropout_draws(layout: str) -> None:
    """The split graph draws the same mask, makes the same output (values and strides) and
    leaves the generator where `native_dropout` leaves it."""
    x = _LAYOUTS[layout]()
    original, split = (make_fx(_dropout, tracing_mode="fake")(x) for _ in range(2))
    assert split_dropout(split) == 1
    split.recompile()
    assert not split.graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout.default)
    results = []
    for gm in (original, split):
        torch.manual_seed(5)
        results.append((*gm(x), torch.get_rng_state()))
    (out, mask, state), (split_out, split_mask, split_state) = results
    assert torch.equal(split_mask, mask) and torch.equal(split_out, out) and torch.equal(split_state, state)
    assert split_out.stride() == out.stride() and split_mask.stride() == mask.stride()
    assert not mask.all() and mask.any()  # a real draw


def test_reduced_precision_dropout_is_not_split() -> None:
    assert split_dropout(make_fx(_dropout, tracing_mode="fake")(torch.randn(8, 8, dtype=torch.bfloat16))) == 0


def _cross_entropy_backward(reduction: str):
    def step(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits, target, reduction=reduction, ignore_index=-100)
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        return grad
    return step


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_cross_entropy_backward_gives_the_same_gradient(reduction: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 1000, requires_grad=True)
    target = torch.randint(0, 1000, (64,))
    target[::7] = -100  # ignored rows
    original = make_fx(_cross_entropy_backward(reduction), tracing_mode="fake")(logits, target)
    fused = make_fx(_cross_entropy_backward(reduction), tracing_mode="fake")(logits, target)
    assert fuse_cross_entropy_backward(fused) == 1
    fused.recompile()
    ops = {n.target for n in fused.graph.nodes}
    assert aten.nll_loss_backward.default not in ops and aten._log_softmax_backward_data.default not in ops
    expected, got = original(logits, target), fused(logits, target)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    # Not bit for bit: ATen's kernel computes exp() its own way (1 ulp apart in 7% of entries).
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)
    assert not got[::7].any()  # ignored rows


def test_cross_entropy_with_class_weights_is_left_alone() -> None:
    def step(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(F.cross_entropy(logits, target, weight=weight), logits)
        return grad

    args = (torch.randn(4, 10, requires_grad=True), torch.randint(0, 10, (4,)), torch.rand(10))
    gm = make_fx(step, tracing_mode="fake")(*args)
    assert fuse_cross_entropy_backward(gm) == 0


def test_fused_cross_entropy_holds_one_logits_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """In GPT's step with the loss inside, the store-all peak falls by a logits-sized tensor:
    it is at the loss's backward, where the unfused ops hold three."""
    model, args, kwargs, loss_fn = zoo.make("gpt", "default")
    step = zoo.WithLoss(model, loss_fn)
    graph = rkgraph.capture(step, args, kwargs)
    fused = [n for n in graph.nodes if n.op == "rkgraph.log_softmax_nll_backward.default"]
    assert len(fused) == 1 and not any("nll_loss_backward" in n.op for n in graph.nodes)
    (logits_grad,) = fused[0].outputs
    assert graph.data[logits_grad].size == 4 * 255 * 8192 * 4  # the loss shifts targets by one
    # sys.modules: the package's `capture` function hides its `capture` module.
    monkeypatch.setattr(sys.modules["rkgraph.capture"], "fuse_cross_entropy_backward", lambda gm: 0)
    unfused = rkgraph.capture(step, args, kwargs)
    assert any(n.op == "aten.nll_loss_backward.default" for n in unfused.nodes)
    saved = solve_store_all(unfused).predicted_peak - solve_store_all(graph).predicted_peak
    # Nearly all of it: the peak moves to the next op (the head's matmul backward).
    assert 0.99 * graph.data[logits_grad].size <= saved <= graph.data[logits_grad].size
