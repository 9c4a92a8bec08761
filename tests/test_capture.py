"""Capture: the joint graph is complete, sized exactly, annotated, and capture changes nothing."""

from __future__ import annotations

import contextlib
import copy
import gc
import operator
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import rkgraph
import solvers
from rkgraph.capture import CaptureError
from rockplan import Rockmate


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(torch.relu(self.bn(self.inp(x)))))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_graph_structure(net: Net) -> None:
    graph = rkgraph.capture(net, torch.randn(32, 8))
    graph.validate()
    assert graph.forward_nodes and graph.backward_nodes
    kinds = {d.kind for d in graph.data.values()}
    assert {"param", "buffer", "input", "activation", "tangent"} <= kinds
    # every parameter gets a gradient; BatchNorm's buffers are forward outputs (mutations)
    assert len(graph.backward_outputs) == len(list(net.parameters()))
    assert any(n.rng for n in graph.forward_nodes)  # dropout is flagged, and replayable
    assert not any(n.rng or n.random for n in graph.backward_nodes)
    once = rkgraph.build_graph(graph.joint, replay_rng=False)  # for runtimes that cannot replay
    assert [n.name for n in once.nodes if n.random] == [n.name for n in graph.nodes if n.rng]
    modules = {n.module for n in graph.nodes}
    assert {"inp", "bn", "blocks.0.fc", "blocks.3.norm", "out"} <= modules
    assert all(n.time > 0 for n in graph.nodes if n.op.startswith(("aten.mm", "aten.addmm")))
    # views are not scheduled: every compute node allocates something
    assert all(n.outputs or n.workspace for n in graph.nodes)


def test_sizes_match_real_tensors(net: Net) -> None:
    graph = rkgraph.capture(net, torch.randn(32, 8))
    joint = graph.joint.module
    real = [*net.parameters(), *net.buffers(), torch.randn(32, 8), *rkgraph.random_tangents(joint)]
    values: dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node):
            out = super().run_node(n)
            if n.name in graph.data and isinstance(out, torch.Tensor):
                values[n.name] = out
            return out

    Recorder(joint, garbage_collect_values=False).run(*real)
    checked = 0
    for name, data in graph.data.items():
        if data.kind == "activation" and not data.order_only:  # an order value holds no tensor
            assert values[name].untyped_storage().nbytes() == data.size, name
            checked += 1
    assert checked > 20


def test_capture_changes_nothing(net: Net) -> None:
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(32, 8)
    rng = torch.get_rng_state()
    rkgraph.capture(net, x, profile="measure")
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in net.state_dict().items():
        assert torch.equal(before[k], v), k
    assert all(p.grad is None for p in net.parameters())


def test_capture_draws_nothing_from_the_users_generator() -> None:
    """Noise made from a shape alone runs for real when AOTAutograd runs the traced forward
    on fake inputs: the generator is put back afterwards."""
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + torch.randn(4, 8)

    model, x = Noisy(), torch.randn(4, 8)
    rng = torch.get_rng_state()
    rkgraph.capture(model, x)
    assert torch.equal(rng, torch.get_rng_state())


_REAL_CALLS: list[int] = []  # the sizes `rktest::counted_ones` was called with for real


@torch.library.custom_op("rktest::counted_ones", mutates_args=())
def _counted_ones(n: int) -> torch.Tensor:
    _REAL_CALLS.append(n)
    return torch.ones(n)


@_counted_ones.register_fake
def _(n: int) -> torch.Tensor:
    return torch.empty(n)


def test_planning_runs_nothing_for_real() -> None:
    """An op with no tensor input runs for real whenever the compiled step runs, fakes or not:
    planning compiles the step without running it, and the user's step runs it once."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * torch.ops.rktest.counted_ones(8)

    model, x = Scaled(), torch.randn(4, 8)
    _REAL_CALLS.clear()
    rk = Rockmate(model, x, 1.0, profile="estimate")
    assert _REAL_CALLS == []
    loss = rk(x).sum()
    loss.backward()
    assert _REAL_CALLS == [8]
    eager = model(x).sum()
    assert torch.equal(loss, eager)


def test_planning_leaves_the_collectors_settings_as_they_were(net: Net) -> None:
    """Planning collects garbage less often and leaves older objects out (`_collections_spared`):
    the thresholds and what is frozen are the caller's again afterwards, a caller's freeze included."""
    threshold = gc.get_threshold()
    Rockmate(net, torch.randn(32, 8), 1.0, profile="estimate")
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        Rockmate(net, torch.randn(32, 8), 1.0, profile="estimate")
        # Still frozen, nothing added (frozen objects that die leave the count).
        assert gc.get_threshold() == threshold and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_identical_blocks_share_a_class(net: Net) -> None:
    graph = rkgraph.capture(net, torch.randn(32, 8))
    block_of = {name: i for i, block in enumerate(graph.blocks) for name in block}
    layer_blocks = {block_of[n.name] for n in graph.forward_nodes if n.module.startswith("blocks.")}
    assert len(layer_blocks) >= 4
    classes = [graph.block_classes[b] for b in sorted(layer_blocks)]
    assert len(set(classes[1:])) == 1  # layers 1..3 look alike (layer 0 follows BatchNorm+ReLU)


def test_repr_is_one_line_of_counts(net: Net) -> None:
    """A graph's repr summarises it in a line instead of listing every node."""
    graph = rkgraph.capture(net, torch.randn(32, 8))
    forward = len(graph.forward_nodes)
    assert repr(graph) == (f"RematGraph('Net', {len(graph.nodes)} compute nodes ({forward} forward), "
                           f"{len(graph.data)} data nodes, {len(graph.blocks)} blocks in "
                           f"{len(set(graph.block_classes))} classes)")
    assert "\n" not in repr(graph) and len(graph.blocks) > 1


def test_views_share_storage() -> None:
    class Viewy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return (h.view(4, 2, 8).transpose(0, 1).reshape(-1, 8) * 2).sum()

    graph = rkgraph.capture(Viewy(), torch.randn(8, 8))
    views = [n for n in graph.joint.module.graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem and rkgraph.build.is_view(n)]
    assert views
    assert all(v.name not in graph.data for v in views)


def test_data_dependent_control_flow_names_the_line() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fc(x).sum() > 0:  # depends on values: not capturable
                return x * 2
            return x

    with pytest.raises(CaptureError, match=r"test_capture.py:\d+: if self.fc\(x\).sum\(\) > 0"):
        rkgraph.capture(Branchy(), torch.randn(2, 4))


def test_sample_not_matching_forward(net: Net) -> None:
    with pytest.raises(TypeError, match="does not match Net.forward"):
        rkgraph.capture(net, (torch.randn(4, 8), torch.randn(4, 8)))


def test_nothing_requires_grad(net: Net) -> None:
    net.requires_grad_(False)
    with pytest.raises(ValueError, match="nothing in Net or its inputs requires grad"):
        rkgraph.capture(net, torch.randn(4, 8))


_INTERPOLATIONS = [("nearest", 1, {}), ("nearest", 2, {}), ("nearest", 3, {}), ("nearest-exact", 2, {}),
                   ("linear", 1, {}), ("bilinear", 2, {}), ("bilinear", 2, {"align_corners": True}),
                   ("trilinear", 3, {}), ("bicubic", 2, {}), ("bilinear", 2, {"antialias": True}),
                   ("bicubic", 2, {"antialias": True})]


@pytest.mark.parametrize(("mode", "dims", "options"), _INTERPOLATIONS)
def test_interpolation_keeps_its_aten_kernels_and_eagers_bits(mode: str, dims: int, options: dict) -> None:
    """Every mode of `F.interpolate` is captured as eager runs it (the kernel and its native
    backward), not through the Python decomposition torch._decomp registers for it (gathers
    forward, a scatter with accumulation backward): the planned step's gradients are eager's bits."""
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    scale = 0.5 if options.get("antialias") else 2  # antialiasing applies when downsampling

    class Resized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = conv(3, 4, 3, padding=1), conv(4, 2, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(F.interpolate(self.a(x), scale_factor=scale, mode=mode, **options)).square().mean()

    torch.manual_seed(0)
    eager, x = Resized(), torch.randn(2, 3, *[8] * dims)
    planned = Rockmate(copy.deepcopy(eager), x, 1.0, solver="store_all", profile="estimate")
    ops = {n.op for n in planned.graph.nodes}
    assert not any("index" in op for op in ops)
    assert sum("upsample" in op for op in ops) == 2  # the kernel and its backward
    eager(x).backward()
    planned(x).backward()
    for p, q in zip(eager.parameters(), planned.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_decompositions_hidden_while_capturing_are_registered_again() -> None:
    """The Python decompositions capture hides or wraps are registered again afterwards, also
    when capture fails."""
    aten = torch.ops.aten
    registered = {op: dict(op.py_kernels)
                  for op in (aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default, aten.lstm.input)}
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2, mode="bilinear"))
    rkgraph.capture(model, torch.randn(2, 3, 8, 8))
    assert {op: dict(op.py_kernels) for op in registered} == registered

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.up(x)
            return y * 2 if y.sum() > 0 else y  # depends on values: not capturable

    with pytest.raises(CaptureError):
        rkgraph.capture(Branchy(), torch.randn(2, 3, 8, 8))
    assert {op: dict(op.py_kernels) for op in registered} == registered


def test_dropout_output_is_recomputed_without_a_draw(net: Net) -> None:
    """Captured on CPU, each dropout is a mask draw (no tensor inputs, replayed as random) and
    the mask's application, a node that draws nothing and reads the dropout's input and mask.
    Each draw reads the previous one's order value, so schedules draw in eager's order."""
    graph = rkgraph.capture(net, torch.randn(32, 8))
    ops = [n.op for n in graph.nodes]
    assert "aten.native_dropout.default" not in ops
    masks = [n for n in graph.nodes if n.op == "rkgraph.dropout_mask.default"]
    assert len(masks) == 4 and all(n.rng for n in masks)
    order = [tuple(d for d in n.outputs if graph.data[d].order_only) for n in masks]
    assert all(len(o) == 1 for o in order)
    assert [n.inputs for n in masks] == [(), *order[:-1]]
    for mask in masks:
        (mask_data,) = (d for d in mask.outputs if not graph.data[d].order_only)
        assert graph.data[mask_data].size == 32 * 16  # bool: a quarter of the output's bytes
        readers = [n for n in graph.nodes if mask_data in n.inputs]
        applied = [n for n in readers if not n.backward]
        assert len(applied) == 1 and not applied[0].rng and len(applied[0].inputs) == 2
        assert any(n.backward for n in readers)  # the dropout's backward reads the same mask


def test_pointwise_op_on_a_saved_tensor_is_its_own_node(net: Net) -> None:
    """fc's output is kept for GELU's backward; GELU on it is a node of its own, so a planner
    that drops GELU's output remakes it with the GELU alone, not with the matmul too. ReLU after
    BatchNorm reads what nothing else reads: it stays in BatchNorm's node."""
    graph = rkgraph.capture(net, torch.randn(32, 8))
    gelus = [n for n in graph.forward_nodes if n.op == "aten.gelu.default"]
    assert len(gelus) == 4
    for gelu in gelus:
        (x,) = [d for d in gelu.inputs if not graph.is_source(d)]
        assert graph.node(graph.data[x].producer).op == "aten.addmm.default"
        assert any(x in n.inputs for n in graph.backward_nodes)
    (bn,) = [n for n in graph.forward_nodes if n.op.startswith("aten._native_batch_norm")]
    assert "relu" in bn.fx_nodes


def test_weight_gradient_runs_before_the_input_gradient_when_that_frees_its_input(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Autograd makes a linear layer's input gradient, then its weight gradient, which reads
    the layer's input last: both alive at once. Hoisted, weight gradients of `net`'s linear
    layers run as soon as their inputs exist, the layer's input is freed before the input
    gradient is made, and the store-all peak does not rise. A bias
    gradient (`sum` of the output gradient, which the input gradient still reads) stays."""
    x = torch.randn(256, 8)
    hoisted = rkgraph.capture(net, x)
    monkeypatch.setattr(rkgraph.build, "hoist_gradients", lambda nodes, *_: nodes)
    autograd = rkgraph.capture(net, x)
    new, old = ([n.name for n in graph.backward_nodes] for graph in (hoisted, autograd))
    assert sorted(new) == sorted(old) and new != old
    gradients = set(hoisted.backward_outputs)
    moved = [n for n in hoisted.backward_nodes if new.index(n.name) < old.index(n.name) and set(n.outputs) <= gradients]
    assert moved and all(n.op == "aten.mm.default" for n in moved)
    assert not any(n.op == "aten.sum.dim_IntList" for n in moved)
    for weight_gradient in moved:
        # Before the move an input gradient read the same output gradient after it; now it
        # runs first, and is the last reader of the activation it reads.
        (activation,) = [d for d in weight_gradient.inputs if hoisted.data[d].producer and
                         not hoisted.node(hoisted.data[d].producer).backward]
        readers = [new.index(r) for r in hoisted.users[activation] if hoisted.node(r).backward]
        assert max(readers) == new.index(weight_gradient.name)
    peaks = [solvers.simulate(g, solvers.solve_store_all(g)).peak for g in (hoisted, autograd)]
    assert peaks[0] <= peaks[1]


@pytest.mark.parametrize(
    ("op", "draws"),
    [
        (torch.ops.aten.native_dropout.default, True),
        (torch.ops.aten._scaled_dot_product_efficient_attention.default, True),
        (torch.ops.aten._scaled_dot_product_cudnn_attention.default, True),
        # CUDA attention's backward ops are tagged as seeded but take the forward's philox seed
        # and offset: they replay its draws and draw nothing (planning GPT on CUDA failed on them).
        (torch.ops.aten._scaled_dot_product_efficient_attention_backward.default, False),
        (torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default, False),
        (torch.ops.aten.mm.default, False),
    ],
)
def test_ops_given_their_random_state_draw_nothing(op: torch._ops.OpOverload, draws: bool) -> None:
    from rkgraph.build import is_random

    graph = fx.Graph()
    node = graph.call_function(op, ())
    assert is_random(node) is draws


def test_cuda_storages_are_counted_in_the_allocators_blocks() -> None:
    """The CUDA caching allocator's statistics (which measure a CUDA step) count whole 512-byte
    blocks; a CPU storage is its bytes. Fake CUDA tensors need no GPU."""
    from torch._subclasses import FakeTensorMode

    from rkgraph.build import storage_bytes

    with FakeTensorMode():
        sizes = [torch.empty(n, device="cuda") for n in (0, 3, 128, 129)]
        cpu = torch.empty(3)
    assert [storage_bytes(t) for t in sizes] == [0, 512, 512, 1024]
    assert storage_bytes(cpu) == 12


def test_a_language_models_layers_are_blocks_of_their_own() -> None:
    """The attention mask (made from the padding mask) and the values that order random draws
    are read by every layer: they must not keep the layers from being cut apart, or the chain
    sees the whole model as one block (no MILP options, nothing reused across layers)."""
    pytest.importorskip("transformers")
    from rockplan import zoo

    model, args, kwargs, loss_fn = zoo.make("hf_llama", "tiny")
    graph = Rockmate(zoo.WithLoss(model, loss_fn), (args, kwargs), 1.0, solver="store_all",
                     profile="estimate").graph

    def layer(name: str) -> str | None:
        parts = graph.node(name).module.split(".")
        return parts[3] if parts[:3] == ["model", "model", "layers"] and len(parts) > 3 else None

    layers_of = [{layer(name) for name in block} - {None} for block in graph.blocks]
    assert all(len(layers) <= 1 for layers in layers_of)  # no block spans two layers
    # Each layer's last block (its MLP) looks like the other layer's.
    last = {next(iter(layers)): graph.block_classes[j] for j, layers in enumerate(layers_of) if layers}
    assert len(last) == 2 and len(set(last.values())) == 1


def test_module_tree_lists_what_nn_modules_methods_list() -> None:
    """One walk gives what `modules()`, `parameters()` and `buffers()` give, in their order,
    with a module reached twice, a tied parameter, a tensor that is a parameter in one module
    and a buffer in another, and None entries."""
    from rkgraph.capture import module_tree

    shared = nn.Linear(4, 4)
    net = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared, nn.Linear(4, 4)), nn.BatchNorm1d(4))
    net[2][1].weight = shared.weight
    net[1].register_buffer("same_as_a_bias", shared.bias)
    net[1].register_buffer("absent", None)
    net[3].register_parameter("absent", None)
    net.add_module("nothing", None)
    tree = module_tree(net)
    assert tree.modules == list(net.modules())
    assert tree.parameters == list(net.parameters())
    assert [id(b) for b in tree.buffers] == [id(b) for b in net.buffers()]
    assert any(b is shared.bias for b in tree.buffers)


@pytest.mark.parametrize("name", ["hf_llama", "hf_bert"])
def test_module_tree_of_hugging_face_models(name: str) -> None:
    from rkgraph.capture import module_tree
    from rockplan import zoo

    if name not in zoo.ZOO:
        pytest.skip("transformers is not installed")
    model = zoo.make(name, "tiny")[0]
    tree = module_tree(model)
    assert tree.modules == list(model.modules())
    assert tree.parameters == list(model.parameters())
    assert [id(b) for b in tree.buffers] == [id(b) for b in model.buffers()]


def test_an_lstm_on_its_models_input_plans_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """An LSTM reading the model's input (which requires no grad) is traced into its
    differentiable per-time-step ops, not oneDNN's `mkldnn_rnn_layer`, whose compiled step
    PyTorch cannot run: the planned step makes eager's gradients (its bits with oneDNN off, where
    eager runs the same ops). A trace that still held that op is refused, naming the module."""

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(16, 16, batch_first=True, num_layers=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0].square().mean()

    torch.manual_seed(0)
    model, x = Tagger(), torch.randn(4, 8, 16)
    for onednn in (True, False):
        eager = copy.deepcopy(model)
        with torch.backends.mkldnn.flags(enabled=onednn):
            planned = Rockmate(copy.deepcopy(model), x, 0.95, profile="estimate")
            assert not any("mkldnn" in n.op for n in planned.graph.nodes)
            eager(x).backward()
            planned(x).backward()
        for p, q in zip(eager.parameters(), planned.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **({} if onednn else {"rtol": 0, "atol": 0}))
    if torch.backends.mkldnn.is_available():
        monkeypatch.setattr(sys.modules["rkgraph.capture"], "differentiable_lstm", contextlib.nullcontext)
        with pytest.raises(CaptureError, match=r"rnn: an LSTM on a CPU .*mkldnn.flags\(enabled=False\)"):
            Rockmate(copy.deepcopy(model), x, 1.0)


class _MaskedEmbedding(nn.Module):
    """SpecAugment's write as wav2vec 2.0 makes it: a learned vector written at the masked time
    steps, here into a view of the activation (the write must reach the tensor it views)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.masked_embed = nn.Parameter(torch.randn(1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        steps = h.view(2, 3, 8)
        steps[torch.rand(2, 3) < 0.5] = self.masked_embed
        return self.b(h).square().mean()


def test_a_boolean_mask_write_of_one_value_is_one_graph_matching_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """`x[mask] = v` with `v` the same at every masked position is traced as `torch.where`: one
    graph with no value-dependent shape, eager's losses and gradients at every step (the mask
    drawn again in each), up to the order `v`'s gradient is summed in. Traced as written, its
    backward gathers at the mask's positions (nonzero) and the step cannot be planned."""
    torch.manual_seed(0)
    model, x = _MaskedEmbedding(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    planned = Rockmate(model, x, 1.0, profile="estimate")
    assert planned.graph_plans == []  # one graph
    ops = {node.target for node in planned.plan.joint.module.graph.nodes}
    assert torch.ops.aten.where.self in ops
    assert not ops & {torch.ops.aten.nonzero.default, torch.ops.aten.index_put.default}
    for seed in (1, 2):
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            module(x).backward() if module is eager else planned(x).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(sys.modules["rkgraph.capture"], "mask_writes_as_where", contextlib.nullcontext)
    with pytest.raises(CaptureError, match="shape depends on the values of its input"):
        Rockmate(copy.deepcopy(eager), x, 1.0, profile="estimate")(x)


class _HostAugmented(nn.Module):
    """A forward that draws from NumPy's or Python's global random numbers."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.a, self.source = nn.Linear(8, 8), source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.source == "numpy":
            h = h * torch.from_numpy(np.random.rand(x.shape[0]) < 0.5).to(h.dtype)[:, None]
        else:
            h = h * random.uniform(0.5, 1.5)
        return h.square().mean()


@pytest.mark.parametrize("source", ["numpy", "python"])
def test_random_numbers_drawn_outside_torch_are_drawn_again_each_step(source: str) -> None:
    """One graph traced once would hold a NumPy or Python draw as a constant, the same in every
    step. Such a forward is run by Dynamo, which draws again in each step from the same
    generator eager draws from (NumPy's own, not torch's as its default would): the losses of
    eager at every seed. Planning moves neither generator."""
    torch.manual_seed(0)
    model, x = _HostAugmented(source), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    np.random.seed(0)
    random.seed(0)
    planned = Rockmate(model, x, 1.0, profile="estimate")
    assert np.random.rand() == np.random.RandomState(0).rand() and random.random() == random.Random(0).random()
    assert planned._graph_breaks is not None
    assert ("NumPy's global generator" if source == "numpy" else "Python's random module") in str(
        planned._graph_breaks.why)
    losses = []
    for seed in (1, 2, 3):
        for module in (planned, eager):
            np.random.seed(seed)
            random.seed(seed)
            losses.append(module(x).item())
    assert losses[0::2] == losses[1::2]
    assert len(set(losses[0::2])) == 3


def test_planning_leaves_the_parameters_of_a_module_reached_by_two_paths() -> None:
    """torch.func.functional_call leaves the traced tensors in a module the model reaches by
    two attribute paths (timm's CoaT shares its relative position encoding across blocks):
    capture puts every parameter and buffer back, so the model is as it was and its step runs."""
    import copy as _copy

    from rockplan import Rockmate

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = torch.nn.Linear(8, 8)
            self.blocks = torch.nn.Sequential(self.shared, torch.nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.blocks(x) + self.shared(x)).square().mean()

    torch.manual_seed(0)
    model, x = Shared(), torch.randn(4, 8)
    eager = _copy.deepcopy(model)
    before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    rk = Rockmate(model, (x,), 1.0)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[n] is p and type(p) is torch.nn.Parameter for n, p in before.items())
    rk(x).backward()
    eager(x).backward()
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


class _Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check_tensor_all(x.abs() < 100, lambda: "inputs out of range")
        return self.a(x).square().mean()


def test_a_check_on_tensor_values_is_an_assertion_in_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch._check_tensor_all` (transformers' `torch_compilable_check` while compiling) reads
    its condition in Python, which a trace cannot: it is traced as an assertion, so the model
    stays one graph, and the planned step raises where the condition fails. Traced as written,
    the model is not one graph."""
    x = torch.randn(4, 8)
    planned = Rockmate(_Checked(), x, 1.0, profile="estimate")
    assert planned.graph_plans == []
    ops = {node.target for node in planned.plan.joint.module.graph.nodes}
    assert ops & {torch.ops.aten._assert_async.msg, torch.ops.aten._functional_assert_async.msg}
    planned(x).backward()
    with pytest.raises(RuntimeError, match="a check of the model failed"):
        planned(1000 * x)
    monkeypatch.setattr(sys.modules["rkgraph.capture"], "tensor_checks_as_assertions", contextlib.nullcontext)
    assert Rockmate(_Checked(), x, 1.0, profile="estimate")._graph_breaks is not None
