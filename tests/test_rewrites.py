"""Graph rewrites (rkgraph.rewrites): each replaced op pattern against the ATen ops it replaces,
run on real tensors."""

from __future__ import annotations

import ast
import copy
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import rkgraph
import rkgraph.rewrites
from rkgraph import capture_joint, lean_variant
from rkgraph.profile import AllocatorEvents
from rkgraph.rewrites.cross_entropy import fuse_cross_entropy_backward
from rkgraph.rewrites.dropout import SLICE_ELEMENTS, split_dropout
from rkgraph.rewrites.dropout import scratch_bytes as dropout_scratch_bytes
from rkgraph.rewrites.gradient_layout import obeys_layout
from rkgraph.rewrites.gradient_sums import reduce_before_accumulating, stack_selected_gradients
from rkgraph.rewrites.linear_cross_entropy import fuse_linear_cross_entropy, scratch_bytes
from rockplan import Rockmate, zoo
from rockplan.memory import measure_step
from rockplan.op_count import count_step
from solvers import solve_store_all
from solvers.dtr import solve_dtr
from solvers.simulate import InfeasibleBudget

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


def _dropout_and_backward(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out, mask = aten.native_dropout.default(x, 0.3, True)
    return out, mask, aten.native_dropout_backward.default(grad, mask, 1 / 0.7)


_LARGE = {  # several slices of SLICE_ELEMENTS: by rows, and by rows within the first index
    "rows": lambda: torch.randn(4, 6, 64, 256),
    "within_rows": lambda: torch.randn(2, 700, 500, dtype=torch.float64),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS | _LARGE))
def test_mask_application_is_native_dropout_backward(layout: str) -> None:
    """Both of a graph's dropout applications (the split forward's, the backward's) become
    `rkgraph.apply_dropout_mask` where it makes ATen's bits and strides; where ATen's output is
    laid out otherwise (a transposed gradient: ATen's is contiguous) the op is left alone."""
    x, grad = _LAYOUTS.get(layout, _LARGE.get(layout))(), _LAYOUTS.get(layout, _LARGE.get(layout))()
    original, rewritten = (make_fx(_dropout_and_backward, tracing_mode="fake")(x, grad) for _ in range(2))
    split_dropout(rewritten)
    rewritten.recompile()
    applied = rewritten.graph.find_nodes(op="call_function", target=torch.ops.rkgraph.apply_dropout_mask.default)
    assert len(applied) == (1 if layout == "transposed" else 2)
    results = []
    for gm in (original, rewritten):
        torch.manual_seed(5)
        results.append(gm(x, grad))
    for a, b in zip(*results):
        assert a.stride() == b.stride()
        bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bool: torch.uint8}[a.dtype]
        assert torch.equal(a.view(bits), b.view(bits))


def test_mask_application_holds_one_slice_of_scratch() -> None:
    """ATen's CPU application makes a float copy of the whole mask (6 MiB at GPT's attention);
    ours one slice of it, the bound an estimated profile counts."""
    x = torch.randn(4, 6, 256, 256)
    mask = torch.rand_like(x) < 0.9
    gm = make_fx(lambda x, m: torch.ops.rkgraph.apply_dropout_mask(x, m, 1 / 0.9), tracing_mode="fake")(x, mask)
    ours = torch.ops.rkgraph.apply_dropout_mask.default
    node = next(n for n in gm.graph.nodes if n.target == ours)
    scratch = {}
    for name, op in (("aten", aten.native_dropout_backward.default), ("ours", ours)):
        op(x, mask, 1 / 0.9)  # warm-up
        with AllocatorEvents("cpu") as recorded:
            out = op(x, mask, 1 / 0.9)  # noqa: F841 (held: the replay's net is the output)
        peak, held = recorded.replay(0, None)
        scratch[name] = peak - held
    assert scratch["aten"] >= x.numel() * 4
    assert scratch["ours"] <= dropout_scratch_bytes(node) == SLICE_ELEMENTS * 4


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
    # Not bit for bit: ATen's kernel computes exp() its own way (1 ulp apart in some entries).
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)
    assert not got[::7].any()  # ignored rows


def test_cross_entropy_with_class_weights_is_left_alone() -> None:
    def step(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(F.cross_entropy(logits, target, weight=weight), logits)
        return grad

    args = (torch.randn(4, 10, requires_grad=True), torch.randint(0, 10, (4,)), torch.rand(10))
    gm = make_fx(step, tracing_mode="fake")(*args)
    assert fuse_cross_entropy_backward(gm) == 0


def _without(monkeypatch: pytest.MonkeyPatch, rewrite: str) -> None:
    """Capture without one rewrite of the table (and without those left out before)."""
    monkeypatch.setattr(rkgraph.rewrites, "REWRITES",
                        tuple(r for r in rkgraph.rewrites.REWRITES if r.name != rewrite))


def test_fused_cross_entropy_holds_one_logits_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """In GPT's step with the loss inside, the store-all peak falls by a logits-sized tensor:
    it is at the loss's backward, where the unfused ops hold three."""
    model, args, kwargs, loss_fn = zoo.make("gpt", "default")
    step = zoo.WithLoss(model, loss_fn)
    _without(monkeypatch, "linear_cross_entropy")  # it would replace the fused backward
    graph = rkgraph.capture(step, args, kwargs)
    fused = [n for n in graph.nodes if n.op == "rkgraph.log_softmax_nll_backward.default"]
    assert len(fused) == 1 and not any("nll_loss_backward" in n.op for n in graph.nodes)
    (logits_grad,) = fused[0].outputs
    assert graph.data[logits_grad].size == 4 * 255 * 8192 * 4  # the loss shifts targets by one
    _without(monkeypatch, "cross_entropy_backward")
    unfused = rkgraph.capture(step, args, kwargs)
    assert any(n.op == "aten.nll_loss_backward.default" for n in unfused.nodes)
    saved = solve_store_all(unfused).predicted_peak - solve_store_all(graph).predicted_peak
    # Nearly all of it: the peak moves to the next op (the head's matmul backward).
    assert 0.99 * graph.data[logits_grad].size <= saved <= graph.data[logits_grad].size


def _head_and_loss(reduction: str, shift: bool):
    """A language model's head and loss with its backward, as the joint graph has them: GPT's
    loss reads every position but the last (`shift`), through a slice, a copy and views."""
    def step(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = (x.view(-1, x.shape[-1]) @ w.t()).view(*x.shape[:-1], -1)
        if shift:
            logits = logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, reduction=reduction)
        return (loss, *torch.autograd.grad(loss, (x, w), torch.tensor(0.7)))
    return step


@pytest.mark.parametrize(("reduction", "shift", "dtype"), [
    ("mean", True, torch.float32), ("sum", True, torch.float64), ("mean", False, torch.float32),
])
def test_fused_linear_cross_entropy_gives_the_same_loss_and_gradients(
    reduction: str, shift: bool, dtype: torch.dtype,
) -> None:
    """Head and loss fused (the logits made a chunk of rows at a time, no logits saved): the
    same loss and gradients as the unfused ops, for rows spanning several chunks, ignored
    targets and a loss gradient other than one."""
    torch.manual_seed(0)
    batch, seq, width, vocab = 3, 200, 24, 500  # 597 or 600 rows: three chunks, the last short
    x = torch.randn(batch, seq, width, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, width, dtype=dtype) * 0.3).requires_grad_()
    target = torch.randint(0, vocab, (batch * (seq - shift),))
    target[::11] = -100
    original = make_fx(_head_and_loss(reduction, shift), tracing_mode="fake")(x, w, target)
    fused = make_fx(_head_and_loss(reduction, shift), tracing_mode="fake")(x, w, target)
    assert fuse_cross_entropy_backward(fused) == 1 and fuse_linear_cross_entropy(fused) == 1
    fused.graph.lint()
    fused.recompile()
    ops = {n.target for n in fused.graph.nodes}
    assert torch.ops.rkgraph.linear_cross_entropy.default in ops
    assert not ops & {aten.mm.default, aten._log_softmax.default, aten.nll_loss_forward.default}
    expected, got = original(x, w, target), fused(x, w, target)
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance)
    if shift:
        assert not got[1][:, -1].any()  # the last position's logits feed no loss


@pytest.mark.parametrize("case", ["class_weights", "bfloat16", "no_reduction", "wider_than_its_rows"])
def test_linear_cross_entropy_outside_its_cases_is_left_alone(case: str) -> None:
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32

    def step(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = (x @ w.t()).float() if case == "bfloat16" else x @ w.t()
        loss = F.cross_entropy(logits, target, weight=torch.ones(10) if case == "class_weights" else None,
                               reduction="none" if case == "no_reduction" else "mean")
        return (loss, *torch.autograd.grad(loss.sum(), (x, w)))

    rows, width = (6, 7) if case == "wider_than_its_rows" else (6, 4)
    args = (torch.randn(rows, width, dtype=dtype, requires_grad=True),
            torch.randn(10, width, dtype=dtype, requires_grad=True), torch.randint(0, 10, (rows,)))
    gm = make_fx(step, tracing_mode="fake")(*args)
    fuse_cross_entropy_backward(gm)
    assert fuse_linear_cross_entropy(gm) == 0


def test_fused_linear_cross_entropy_keeps_no_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT's store-all step with the loss inside holds no logits-sized tensor once the head and
    its loss are fused: its peak falls by more than one of them (32 MiB)."""
    model, args, kwargs, loss_fn = zoo.make("gpt", "default")
    step = zoo.WithLoss(model, loss_fn)
    graph = rkgraph.capture(step, args, kwargs)
    assert [n.op for n in graph.nodes if "cross_entropy" in n.op or "nll" in n.op] == [
        "rkgraph.linear_cross_entropy.default"]
    logits_bytes = 4 * 256 * 8192 * 4
    assert max(d.size for d in graph.data.values()) < logits_bytes / 2
    # The head weight's unit gradient is scaled where the tied embedding's gradient joins it,
    # at the backward's end, not at its start where the step peaks with both [V, E] alive.
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    scaling = next(n for n in graph.nodes if n.op == "aten.mul.Tensor" and graph.data[n.outputs[0]].size
                   == 4 * 8192 * 384)
    assert order[scaling.name] > len(graph.nodes) - 10
    _without(monkeypatch, "linear_cross_entropy")
    unfused = rkgraph.capture(step, args, kwargs)
    saved = solve_store_all(unfused).predicted_peak - solve_store_all(graph).predicted_peak
    assert saved > logits_bytes


@pytest.mark.parametrize("rows", ["all", "shifted"])
def test_linear_cross_entropy_scratch_bound_is_what_the_allocator_sees(rows: str) -> None:
    """The fused head's scratch (a chunk of logits and per-row vectors, freed inside the op),
    which an estimated profile counts in the node's workspace: at least what the CPU allocator
    records, and within 3% of it."""
    batch, seq, width, vocab = 4, 256, 64, 8192
    x, wt = torch.randn(batch * seq, width), torch.randn(width, vocab) * 0.1
    index = torch.arange(batch * seq).view(batch, seq)[:, :-1].reshape(-1) if rows == "shifted" else None
    target = torch.randint(0, vocab, (batch * (seq - 1) if index is not None else batch * seq,))
    op = torch.ops.rkgraph.linear_cross_entropy.default
    args = (x, wt, index, target, 1, -100, 256)  # 1: mean
    gm = make_fx(lambda x, wt, index, target: op(x, wt, index, target, 1, -100, 256), tracing_mode="fake")(*args[:4])
    node = next(n for n in gm.graph.nodes if n.target == op)
    op(*args)  # warm-up
    with AllocatorEvents("cpu") as recorded:
        outputs = op(*args)  # noqa: F841 (held: the replay's net is the outputs, the rest scratch)
    peak, held = recorded.replay(0, None)
    assert peak - held <= scratch_bytes(node) <= 1.03 * (peak - held)


class _Attention(torch.nn.Module):
    """The attentions SDPA's math path traces on CPU: causal, with an additive mask, or neither."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, 70, 4, 4).transpose(1, 2) for t in self.proj(x).split(16, dim=2))
        mask = torch.linspace(-1, 0, 70 * 70).view(1, 1, 70, 70) if self.case == "additive_mask" else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.case == "causal",
                                           dropout_p=0.2 if self.training else 0.0)
        return y.transpose(1, 2).reshape(2, 70, 16).sum()


def _joint_outputs(joint: object, model: torch.nn.Module, args: tuple) -> list[torch.Tensor]:
    from rkgraph.capture import flat_tensors, flatten_call
    real = flat_tensors(model, flatten_call(model, args, {}), args, {})
    torch.manual_seed(3)
    out = joint.module(list(real), rkgraph.random_tangents(joint.module))
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


class _T5Step(torch.nn.Module):
    """transformers' T5 (random weights) with its loss: its attention's key gradient is viewed
    through a transpose and a slice (the relative position bias), as laid out by the products
    the fused backward replaces."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration
        self.model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                         num_heads=2, decoder_start_token_id=0))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


@pytest.mark.parametrize("case", ["causal", "additive_mask", "no_mask", "bfloat16", "gpt", "t5"])
def test_fused_attention_makes_the_same_bits(case: str) -> None:
    """Attention fused (its probabilities made a few heads at a time, again in the backward):
    the same loss and gradients, bit for bit, as the math path's ops, which it replaces whole.
    In bfloat16 the math path computes in float32 on CPU, and so does the fused op."""
    if case == "gpt":
        model, args, kwargs, loss_fn = zoo.make("gpt", "tiny")
        model, count = zoo.WithLoss(model, loss_fn), 2
    elif case == "t5":
        pytest.importorskip("transformers")
        torch.manual_seed(0)
        model, args, count = _T5Step(), (torch.randint(1, 64, (2, 24)), torch.randint(1, 64, (2, 8))), 1
    elif case == "bfloat16":
        model, args, count = _Attention("causal").to(torch.bfloat16), (torch.randn(2, 70, 16, dtype=torch.bfloat16),), 1
    else:
        model, args, count = _Attention(case), (torch.randn(2, 70, 16),), 1
    joint = capture_joint(model, args)
    fused = lean_variant(joint)
    targets = [n.target for n in fused.module.graph.nodes]
    assert targets.count(torch.ops.rkgraph.attention.default) == count
    assert targets.count(torch.ops.rkgraph.attention_backward.default) == count
    if case != "t5":  # not all of T5's attentions are fused
        assert not {aten._safe_softmax.default, aten._softmax_backward_data.default, aten.bmm.default} & set(targets)
    expected, got = _joint_outputs(joint, model, args), _joint_outputs(fused, model, args)
    assert len(got) == len(expected) > count
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_attention_without_dropout_is_left_alone() -> None:
    model = _Attention("causal").eval()  # no dropout: PyTorch's own flash kernel holds no scores
    assert lean_variant(capture_joint(model, (torch.randn(2, 70, 16),))) is None


def test_fused_attention_scratch_bound_is_what_the_allocator_sees() -> None:
    """The scratch an estimated profile counts for the fused ops bounds what the allocator sees
    inside them, and is below one of the math path's [B, H, T, S] tensors (6 MiB here)."""
    from rkgraph.rewrites.attention import scratch_bytes as attention_scratch_bytes
    batch, heads, t, d = 4, 6, 256, 64
    q, v, grad = (torch.randn(batch * heads, t, d) for _ in range(3))
    kt = torch.randn(batch * heads, d, t)
    bias = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    mask = torch.rand(batch, heads, t, t) < 0.9
    forward = (q, kt, v, bias, mask, 1 / 0.9, heads, True)
    ops = torch.ops.rkgraph
    gm = make_fx(lambda g, *a: (ops.attention(*a), ops.attention_backward(g, *a)), tracing_mode="fake")(grad, *forward)
    nodes = {n.target: n for n in gm.graph.nodes}
    for op, args in ((ops.attention.default, forward), (ops.attention_backward.default, (grad, *forward))):
        op(*args)  # warm-up
        with AllocatorEvents("cpu") as recorded:
            out = op(*args)  # noqa: F841 (held: the replay's net is the output)
        peak, held = recorded.replay(0, None)
        assert 0 < peak - held <= attention_scratch_bytes(nodes[op]) < batch * heads * t * t * 4


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "one_word"])
def test_packed_masks_unpack_to_the_same_mask(layout: str) -> None:
    """A mask packed eight to a byte unpacks to the same values in the same layout."""
    from rkgraph.rewrites.mask_packing import CHUNK_WORDS, pack_mask, unpack_mask
    torch.manual_seed(0)
    if layout == "contiguous":  # more words than a chunk, and not a whole number of chunks
        mask = torch.rand(3, CHUNK_WORDS + 5, 8) < 0.9
    elif layout == "permuted":  # dense, not contiguous: packed in memory order
        mask = (torch.rand(4, 6, 16, 8) < 0.5).permute(0, 2, 1, 3)
    else:
        mask = torch.tensor([True, False, False, True, True, True, False, True])
    packed = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == mask.numel() // 8
    unpacked = unpack_mask(packed, list(mask.shape), list(mask.stride()))
    assert unpacked.stride() == mask.stride() and torch.equal(unpacked, mask)
    assert unpacked.view(torch.uint8).max() <= 1  # a bool's byte is 0 or 1
    if layout == "one_word":
        assert packed.tolist() == [0b10111001]  # element i is bit i


def test_lean_variant_keeps_the_backwards_masks_packed() -> None:
    """In GPT's lean variant every mask the backward reads reaches it unpacked from its packed
    copy, and the loss and gradients are those of autograd's graph, bit for bit."""
    model, args, kwargs, loss_fn = zoo.make("gpt", "tiny")
    model = zoo.WithLoss(model, loss_fn)
    joint = capture_joint(model, args)
    lean = lean_variant(joint)
    ops = torch.ops.rkgraph
    masks = list(lean.module.graph.find_nodes(op="call_function", target=ops.dropout_mask.default))
    assert len(masks) == 7  # embedding, and per layer attention and two residual branches
    for mask in masks:
        assert all(not rkgraph.build.is_backward(u) for u in mask.users)
        (packed,) = [u for u in mask.users if u.target is ops.pack_mask.default]
        (unpacked,) = packed.users
        assert unpacked.target is ops.unpack_mask.default and rkgraph.build.is_backward(unpacked)
    expected, got = _joint_outputs(joint, model, args), _joint_outputs(lean, model, args)
    assert len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(g, e)
    # What the variant holds: each stored mask an eighth of its bytes.
    graph = rkgraph.build_graph(lean)
    for mask in masks:
        packed = next(u for u in mask.users if u.target is ops.pack_mask.default)
        assert graph.data[packed.name].size * 8 == graph.data[mask.name].size


def test_mask_packing_scratch_bound_is_what_the_allocator_sees() -> None:
    from rkgraph.rewrites.mask_packing import packing_scratch_bytes
    mask = torch.rand(4, 6, 256, 256) < 0.9
    ops = torch.ops.rkgraph
    gm = make_fx(lambda m: ops.unpack_mask(ops.pack_mask(m), list(m.shape), list(m.stride())),
                 tracing_mode="fake")(mask)
    pack, unpack = (n for n in gm.graph.nodes if n.op == "call_function")
    packed = ops.pack_mask(mask)
    for op, args, node in ((ops.pack_mask.default, (mask,), pack),
                           (ops.unpack_mask.default, (packed, list(mask.shape), list(mask.stride())), unpack)):
        op(*args)  # warm-up
        with AllocatorEvents("cpu") as recorded:
            out = op(*args)  # noqa: F841 (held: the replay's net is the output)
        peak, held = recorded.replay(0, None)
        assert 0 < peak - held <= packing_scratch_bytes(node) < mask.numel()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_written_into_its_product_makes_the_same_bits(
    approximate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A linear layer and GELU on 3-D input (the product seen through reshapes): the captured
    graph's `gelu_backward` and the product before it become one `mm_gelu_backward`, with the
    same loss and gradients, bit for bit, as the graph without the rewrite."""
    import rkgraph.rewrites.mm_gelu
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(approximate=approximate),
                                torch.nn.Linear(64, 16))
    args = (torch.randn(4, 10, 16),)
    joint = capture_joint(model, args)
    targets = [n.target for n in joint.module.graph.nodes]
    assert targets.count(torch.ops.rkgraph.mm_gelu_backward.default) == 1
    assert aten.gelu_backward.default not in targets
    with monkeypatch.context() as patched:
        patched.setattr(rkgraph.rewrites, "REWRITES",
                        tuple(r for r in rkgraph.rewrites.REWRITES if r.name != "mm_gelu_backward"))
        plain = capture_joint(model, args)
    assert aten.gelu_backward.default in [n.target for n in plain.module.graph.nodes]
    expected, got = _joint_outputs(plain, model, args), _joint_outputs(joint, model, args)
    assert len(got) == len(expected) == 5  # the output and the four parameters' gradients
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(g, e)
    assert rkgraph.rewrites.mm_gelu.fuse_mm_gelu_backward(joint.module) == 0  # nothing left to fuse

def _shared_bias_step(bias: torch.Tensor, *scores: torch.Tensor) -> list[torch.Tensor]:
    """A bias expanded over the batch once and added to each layer's scores (as MPNet's relative
    position bias), and the gradients of a loss over them."""
    full = bias.expand(scores[0].shape).contiguous()
    loss = sum((s + full).softmax(-1).square().sum() for s in scores)
    return list(torch.autograd.grad(loss, [bias, *scores]))


def _all_backward(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """make_fx marks no node as the backward's: here every op is a gradient's."""
    for node in gm.graph.nodes:
        node.meta["partitioner_tag"] = "is_backward"
    return gm


def _full_size_adds(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is aten.add.Tensor and n.meta["val"].shape == (4, 2, 8, 8)]


def test_gradients_reduced_before_they_are_added_give_the_same_gradients() -> None:
    args = (torch.randn(1, 2, 8, 8, requires_grad=True),
            *(torch.randn(4, 2, 8, 8, requires_grad=True) for _ in range(3)))
    gm = _all_backward(make_fx(_shared_bias_step, tracing_mode="fake")(*args))
    adds = len(_full_size_adds(gm))  # the scores plus the bias, and the bias's three gradients added up
    expected = gm(*args)
    assert reduce_before_accumulating(gm) == 1
    gm.graph.lint()
    gm.recompile()
    assert len(_full_size_adds(gm)) == adds - 2
    sums = list(gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList))
    assert len(sums) == 3 and all(s.prev is s.args[0] for s in sums)  # each reduced as soon as it is made
    for got, want in zip(gm(*args), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_sums_that_reduce_nothing_or_read_a_total_read_elsewhere_are_left_alone() -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = a + b
        return (a * 2 + b).sum([0], keepdim=True), total.sum([1]) + total.exp().sum()

    gm = _all_backward(make_fx(step, tracing_mode="fake")(torch.randn(1, 5), torch.randn(1, 5)))
    assert reduce_before_accumulating(gm) == 0

def _packed_projection_step(x: torch.Tensor, weight: torch.Tensor, take: int) -> list[torch.Tensor]:
    """Queries, keys and values projected as one tensor and selected, as nn.MultiheadAttention
    does; `take` of the three read."""
    packed = (x @ weight).unflatten(-1, (3, -1)).movedim(-2, 0)
    loss = sum((packed[i] * (i + 1)).tanh().sum() for i in range(take))
    return list(torch.autograd.grad(loss, [x, weight]))


@pytest.mark.parametrize("take", [3, 2])
def test_gradients_of_every_slice_are_stacked_not_added_as_zero_filled_copies(take: int) -> None:
    args = (torch.randn(4, 5, 8, requires_grad=True), torch.randn(8, 24, requires_grad=True))
    gm = _all_backward(make_fx(functools.partial(_packed_projection_step, take=take), tracing_mode="fake")(*args))
    expected = gm(*args)

    def selects() -> int:
        return len(gm.graph.find_nodes(op="call_function", target=aten.select_backward.default))

    assert selects() == take
    # With a slice unread its zeros must be written somewhere: left alone.
    assert stack_selected_gradients(gm) == (take == 3)
    gm.graph.lint()
    gm.recompile()
    assert selects() == (0 if take == 3 else take)
    for got, want in zip(gm(*args), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_multihead_attentions_projection_gradient_is_one_tensor_and_the_step_is_eagers() -> None:
    """nn.MultiheadAttention's packed projection: its backward held three zero-filled copies of
    the projection's size at once; stacked, the step's floor is lower and its gradients are eager's."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True)
            self.head = torch.nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, weights = self.attention(x, x, x, need_weights=True)
            return self.head(out).square().mean() + weights.square().mean()

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(4, 64, 64)
    eager = copy.deepcopy(model)
    rk = Rockmate(model, (x,), 1.0, profile="estimate")
    assert not [n for n in rk.graph.nodes if n.op == "aten.select_backward.default"]

    def step(m: torch.nn.Module) -> None:
        torch.manual_seed(3)
        m(x).backward()

    planned = measure_step(step, rk)
    step(eager)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert planned.peak == rk.schedule.predicted_peak <= rk.budget


def test_mpnets_shared_bias_gradient_is_held_reduced_and_plans_at_a_tighter_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MPNet expands its relative position bias over the batch once and adds it to every layer's
    scores: autograd adds the bias's gradients up at the scores' size, held from the last layer's
    backward to the first's, then sums the total over the batch. Reduced before they are added
    up, they are held at a quarter of that size (batch 4), and a step fits 0.6 of its peak where
    DTR's schedule of the graph without the rewrite does not."""
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = t.MPNetConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=80)
    model = t.MPNetForMaskedLM(config).train()
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 128, (4, 64))
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[1, 32:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}

    rk = Rockmate(model, ((), batch), 0.6, profile="estimate", solver_options={"time_limit": 5})
    scores_size = 4 * 4 * 64 * 64 * 4
    assert not [n for n in rk.graph.nodes if n.op == "aten.add.Tensor" and n.backward
                and [rk.graph.data[d].size for d in n.outputs] == [scores_size]]
    _without(monkeypatch, "reduce_before_accumulating")
    unrewritten = rkgraph.capture(model, (), batch)
    assert solve_store_all(unrewritten).predicted_peak == rk.store_all_peak  # that peak is the forward's
    with pytest.raises(InfeasibleBudget):
        solve_dtr(unrewritten, rk.budget, heuristic="next_use")
    solve_dtr(rk.graph, rk.budget, heuristic="next_use")

    def step(m: torch.nn.Module) -> object:
        torch.manual_seed(7)
        out = m(**batch)
        out.loss.backward()
        return out

    planned = measure_step(step, rk)
    expected = step(eager)
    torch.testing.assert_close(planned.result.loss, expected.loss)
    for (label, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {label}")
    assert planned.peak <= rk.budget

class _Downsampling(torch.nn.Module):
    """ConvNeXt's downsampling: a LayerNorm over channels (channels last) and a 2x2 stride-2
    convolution, whose weight's gradient comes out channels-last for a contiguous weight."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.conv = torch.nn.LayerNorm(16), torch.nn.Conv2d(16, 32, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)).square().mean()


class _SpectralLayer(torch.nn.Module):
    """A Fourier neural operator's layer: complex weights applied to the low modes by an einsum,
    whose weight gradient comes out in the einsum's order; that weight is the step's largest tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64, 17, dtype=torch.cfloat) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modes = torch.fft.rfft(x)
        out = torch.zeros_like(modes)
        out[..., :17] = torch.einsum("bik,iok->bok", modes[..., :17], self.weight)
        return F.gelu(torch.fft.irfft(out, n=x.shape[-1])).square().mean()


def _returned_gradients(joint: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(primal, its gradient) fake values of a joint graph, for the primals that get one."""
    graph = joint.module.graph
    outputs = graph.find_nodes(op="output")[0].args[0]
    primals = [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    return [(p.meta["val"], g.meta["val"]) for p, g in zip(primals, outputs[len(outputs) - len(primals):])
            if g is not None]


@pytest.mark.parametrize("case", ["downsampling", "spectral"])
def test_gradients_are_returned_in_their_parameters_layout_and_the_step_fits_its_plan(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Autograd copies a gradient whose strides are not its parameter's into the parameter's
    layout after the backward, with every gradient alive, where no plan sees it: the copy is
    made in the graph, and the step measures what its plan predicts."""
    torch.manual_seed(0)
    model, x = ((_Downsampling(), torch.randn(2, 16, 16, 16)) if case == "downsampling"
                else (_SpectralLayer(), torch.randn(4, 64, 64)))
    eager = copy.deepcopy(model)
    rk = Rockmate(model, (x,), 1.0, profile="estimate")
    assert all(obeys_layout(g, p) for p, g in _returned_gradients(rk.plan.joint))
    _without(monkeypatch, "gradients_in_input_layout")
    assert not all(obeys_layout(g, p) for p, g in _returned_gradients(capture_joint(model, (x,))))

    planned = measure_step(lambda m: m(x).backward(), rk)
    eager(x).backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad.stride() == p.stride()
        torch.testing.assert_close(p.grad, q.grad)
    assert planned.peak == rk.schedule.predicted_peak <= rk.budget


# --- the table, and the imports ------------------------------------------------------------

# Our ops by the names graphs and plan files hold.
_OUR_OPS = ["rkgraph.dropout_mask.default", "rkgraph.apply_dropout_mask.default",
            "rkgraph.log_softmax_nll_backward.default", "rkgraph.linear_cross_entropy.default",
            "rkgraph.mm_gelu_backward.default", "rkgraph.attention.default", "rkgraph.attention_backward.default",
            "rkgraph.pack_mask.default", "rkgraph.unpack_mask.default"]


def test_table_names_each_rewrite_once_with_its_ops() -> None:
    table = rkgraph.rewrites.REWRITES
    assert len({r.name for r in table}) == len(table)
    assert sorted(str(op) for r in table for op in r.ops) == sorted(_OUR_OPS)
    assert {r.applies for r in table} == {"always", "lean"}
    for r in table:  # only BatchNorm's rewrites (to other ATen ops, or arguments) put no op of ours in graphs
        assert (r.ops or r.applies == "always") and set(r.scratch) <= set(r.ops)
        assert r.description and "\n" not in r.description
    # The lean ones run after the ones they read (the attention reads the dropout's split).
    kinds = [r.applies for r in table]
    assert kinds == sorted(kinds)  # "always" < "lean"


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports when it is imported: the statements run at
    import time, not those inside functions or under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if sub in modules else node.module)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(path.read_text()).body)
    return found & modules


def test_rkgraph_modules_import_each_other_without_a_circle() -> None:
    """No module of rkgraph imports, at import time and through others, itself (a package's
    submodules reading the package they are in is Python's import order, not a circle)."""
    root = Path(rkgraph.__file__).parent.parent
    paths = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / "rkgraph").rglob("*.py")}
    edges = {m: _module_imports(p, set(paths)) - {m} for m, p in paths.items()}
    assert "rkgraph.capture" in paths and not edges["rkgraph.capture"] & {"rkgraph.rewrites", "rkgraph.profile"}

    def circle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for nxt in edges[module]:
                if nxt == start:
                    return [*path, start]
                if nxt not in path:
                    stack.append((nxt, [*path, nxt]))
        return None

    circles = [c for m in paths if (c := circle_from(m)) is not None]
    assert not circles, " -> ".join(circles[0])


@pytest.mark.parametrize("entry", ["rkgraph.graph", "solvers", "rockplan.rng"])
def test_our_ops_are_registered_by_any_import(entry: str) -> None:
    """Plan files and generated code name our ops (`rkgraph.dropout_mask.default`); whichever of
    the project's modules a fresh interpreter imports first, they resolve, and a recorded draw
    replays through the op they name."""
    code = f"""
import importlib, torch
importlib.import_module({entry!r})
for name in {_OUR_OPS!r}:
    namespace, packet, overload = name.split(".")
    getattr(getattr(getattr(torch.ops, namespace), packet), overload)
from rockplan.rng import replay
state = torch.get_rng_state()
first = torch.ops.rkgraph.dropout_mask([64], [1], 0.5, torch.device("cpu"))
again = replay(state, torch.device("cpu"), torch.ops.rkgraph.dropout_mask.default, [64], [1], 0.5, torch.device("cpu"))
assert torch.equal(first, again)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(rkgraph.__file__).parent.parent)
    assert done.returncode == 0, done.stderr


def _batch_norm_ops(rk) -> set[str]:
    return {n.op for n in rk.graph.nodes if "batch_norm" in (n.op or "")}


def test_batch_norm_is_left_as_traced_where_eager_runs_atens_own_kernels() -> None:
    """On a CPU eager runs ATen's BatchNorm kernels, as the traced graph does: nothing changes."""
    model, args, kwargs, loss = zoo.make("resnet")
    rk = Rockmate(zoo.WithLoss(model, loss), (args, kwargs), 1.0, solver="store_all")
    assert _batch_norm_ops(rk) == {"aten._native_batch_norm_legit_functional.default",
                                   "aten.native_batch_norm_backward.default"}


def test_batch_norm_where_eager_runs_a_vendors_kernels_runs_what_eager_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where eager would choose a vendor's BatchNorm (cuDNN's on CUDA; here MIOpen's choice is
    forced, which keeps no reserve), the graph runs the ATen ops that make that choice as eager
    does, and hand the forward's reserve to the backward. On a CPU they run ATen's kernels: a
    plan below the step's peak makes the bits of the traced graph's plan, updates the running
    statistics in place where it runs BatchNorm once, and stays within its budget."""
    model, args, kwargs, loss = zoo.make("resnet")
    traced_model, vendor_model = zoo.WithLoss(model, loss), zoo.WithLoss(copy.deepcopy(model), loss)
    traced = Rockmate(traced_model, (args, kwargs), 0.75, profile="estimate")
    monkeypatch.setattr(torch._C, "_select_batch_norm_backend", lambda *_: torch._C._BatchNormBackend.Miopen)
    vendor = Rockmate(vendor_model, (args, kwargs), 0.75, profile="estimate")
    monkeypatch.undo()
    assert _batch_norm_ops(vendor) == {"aten._batch_norm_with_update_functional.default",
                                       "aten.batch_norm_backward.default"}
    results = []
    for module in (traced, vendor):
        measured = measure_step(lambda module=module: module(*args, **kwargs).backward())
        assert measured.peak <= module.budget
        results.append(([p.grad for p in module.parameters()], list(module.buffers())))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    ops = count_step(lambda: vendor(*args, **kwargs).backward())
    # Six BatchNorms: those run once write the buffers in place, a recomputed one is functional.
    assert ops["aten._batch_norm_with_update.default"] >= 1
    assert ops["aten._batch_norm_with_update.default"] + ops["aten._batch_norm_with_update_functional.default"] >= 6
    assert ops["aten.batch_norm_backward.default"] == 6
    assert not any("native_batch_norm" in op for op in ops)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.backends.cudnn.is_available()), reason="needs cuDNN")
def test_batch_norm_on_a_gpu_runs_cudnns_kernels_as_eager_does() -> None:
    """On CUDA eager runs cuDNN's BatchNorm; the planned step runs the same kernels (counted by
    torch.profiler), with eager's loss and gradients."""
    from torch.profiler import ProfilerActivity, profile

    model, args, kwargs, loss = zoo.make("resnet")
    eager = zoo.WithLoss(model, loss).cuda()
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    planned = Rockmate(copy.deepcopy(eager), (args, kwargs), 1.0, solver="store_all")
    assert _batch_norm_ops(planned) == {"aten._batch_norm_with_update_functional.default",
                                        "aten.batch_norm_backward.default"}
    counts = []
    for module in (eager, planned):
        module(*args, **kwargs).backward()  # warm-up
        module.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as run:
            module(*args, **kwargs).backward()
        counts.append({e.key: e.count for e in run.key_averages() if "batch_norm" in e.key})
    assert counts[0]["aten::cudnn_batch_norm"] == counts[1]["aten::cudnn_batch_norm"] == 6
    assert counts[0]["aten::cudnn_batch_norm_backward"] == counts[1]["aten::cudnn_batch_norm_backward"] == 6
    for p, q in zip(eager.parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
