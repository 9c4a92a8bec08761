"""Module and tensor hooks in planned steps run as in eager: once per step, in eager's order,
with eager's values, and never while planning (`rkgraph.hooks`).

A hook whose code returns nothing runs in each step on the step's values; a hook that returns
a value is traced into the step, so what it returns applies (gradients included), and planning
warns that its Python side effects do not happen per step.
"""

from __future__ import annotations

import copy
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from rkgraph import CaptureError
from rkgraph.hooks import HookError, returns_value
from rockplan import Rockmate, zoo
from rockplan.memory import measure_step
from solvers import min_feasible_budget


def _step(model: nn.Module, args: tuple, kwargs: dict, seed: int = 3) -> Any:
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward(torch.ones_like(loss))
    return out


def _assert_same_gradients(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)), \
        torch.randn(5, 8)


class _Recorder:
    """Hooks that record what they see, by name: eager's and the planned step's are compared."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[torch.Tensor]]] = []

    def _keep(self, name: str, *values: Any) -> None:
        tensors = [t.detach().clone() for t in torch.utils._pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
        self.seen.append((name, tensors))

    def attach(self, model: nn.Module, modules: list[str]) -> list[Any]:
        handles = []
        for path in modules:
            module = model.get_submodule(path)

            def pre(_m: nn.Module, args: tuple, path: str = path) -> None:
                self._keep(f"pre {path}", args)

            def post(_m: nn.Module, args: tuple, out: Any, path: str = path) -> None:
                self._keep(f"post {path}", args, out)

            def post_kwargs(_m: nn.Module, args: tuple, kwargs: dict, out: Any, path: str = path) -> None:
                self._keep(f"kwargs {path} {sorted(kwargs)}", args, kwargs, out)

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
            handles.append(module.register_forward_hook(post_kwargs, with_kwargs=True))
        return handles


def _assert_recorded_alike(planned: _Recorder, eager: _Recorder) -> None:
    assert [name for name, _ in planned.seen] == [name for name, _ in eager.seen]  # eager's order
    for (name, got), (_, expected) in zip(planned.seen, eager.seen):
        assert len(got) == len(expected), name
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("name", "modules"), [
    ("gpt", ["transformer.h.0", "transformer.h.1.mlp", ""]),  # dropout
    ("resnet", ["stages.0.0.bn1", "stages.0.0.relu", "stages.1.0"]),  # BatchNorm, in-place ReLU and residual
])
def test_recording_hooks_see_eagers_values_in_eagers_order_every_step(name: str, modules: list[str]) -> None:
    """At the smallest budget a schedule is known for, so blocks are recomputed: the hooks still
    run once per step, in the forward, on eager's values (dropout replayed)."""
    model, args, kwargs, _ = zoo.make(name, "tiny")
    reference = copy.deepcopy(model)
    planned, eager = _Recorder(), _Recorder()
    planned.attach(model, modules)
    eager.attach(reference, modules)
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all", profile="estimate")
    rk = Rockmate(model, (args, kwargs), min_feasible_budget(probe.graph), profile="estimate")
    assert planned.seen == []  # planning ran no hook
    assert any(op.kind == "compute" and not rk.graph.node(op.name).backward for op in rk.schedule.backward_ops), \
        "nothing is recomputed"
    for seed in (1, 2):
        planned.seen.clear(), eager.seen.clear()
        _step(rk, args, kwargs, seed)
        _step(reference, args, kwargs, seed)
        _assert_recorded_alike(planned, eager)
        assert len(planned.seen) >= 3 * len(modules)  # a module called twice (ReLU) calls its hooks twice
    _assert_same_gradients(model, reference)


def test_counters_read_the_number_of_steps_within_the_budget() -> None:
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    reference = copy.deepcopy(model)
    counts: list[dict[str, int]] = [{}, {}]  # planned, eager
    for count, m in zip(counts, (model, reference)):
        for path, module in m.named_modules():
            module.register_forward_pre_hook(
                lambda _m, _a, path=path, count=count: count.__setitem__(path, count.get(path, 0) + 1))
    probe = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all", profile="estimate")
    rk = Rockmate(model, (args, kwargs), min_feasible_budget(probe.graph))
    assert counts[0] == {}  # planning, its profile's replays of the step included, ran no hook
    for _ in range(3):
        planned = measure_step(_step, rk, args, kwargs)
        assert planned.peak <= rk.budget, f"measured {planned.peak} B over budget {rk.budget} B"
        _step(reference, args, kwargs)
    assert counts[0] == counts[1] and set(counts[0].values()) == {3}


def test_global_hooks_run_once_per_module_call() -> None:
    model, x = _mlp()
    seen: list[str] = []
    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: seen.append(f"pre {type(m).__name__}")),
        torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(f"post {type(m).__name__}")),
    ]
    try:
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
        assert seen == []
        _step(rk, (x,), {})
        planned = list(seen)
        seen.clear()
        _step(model, (x,), {})
    finally:
        for h in handles:
            h.remove()
    # The Rockmate module is a module too: global hooks see it called around the model.
    wrapper = type(rk).__name__  # Rockmate[Sequential]
    assert planned == [f"pre {wrapper}", *seen, f"post {wrapper}"] and len(seen) == 2 * len(list(model.modules()))


def test_hooks_that_return_values_apply_in_every_step_with_eagers_gradients() -> None:
    model, x = _mlp()
    model[1].register_forward_pre_hook(lambda _m, args: (args[0] * 0.5,))
    model[2].register_forward_hook(lambda _m, _args, out: out * 3.0)
    model[3].register_forward_pre_hook(lambda _m, args, kwargs: ((args[0] + 1.0,), kwargs), with_kwargs=True)
    model[3].register_full_backward_hook(lambda _m, grad_in, _grad_out: (grad_in[0] * 3.0,))
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"return a value.*forward pre-hook `<lambda>`.* of 1.*only while planning") \
            as caught:
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
    assert caught[0].filename == __file__  # the warning names the user's line
    for seed in (1, 2):  # every step, not only the first
        model.zero_grad(), reference.zero_grad()
        torch.testing.assert_close(_step(rk, (x,), {}, seed), _step(reference, (x,), {}, seed))
        _assert_same_gradients(model, reference)
    plain = copy.deepcopy(reference)
    for m in plain.modules():  # the hooks do change the step: without them it differs
        m._forward_hooks.clear(), m._forward_pre_hooks.clear(), m._backward_hooks.clear()
    assert not torch.allclose(plain(x), reference(x))


def test_a_side_effect_hook_after_a_replacing_hook_sees_the_replaced_output() -> None:
    model, x = _mlp()
    seen: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda _m, _args, out: out * 3.0)
    model[2].register_forward_hook(lambda _m, _args, out: seen.append(out.detach().clone()))
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="return a value"):
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
    _step(rk, (x,), {})
    _step(reference, (x,), {})
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], seen[1])


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")
def test_backward_hooks_run_in_each_backward_as_in_eager() -> None:
    model, x = _mlp()
    reference = copy.deepcopy(model)
    logs: list[list[tuple[str, list[torch.Tensor]]]] = [[], []]
    for log, m in zip(logs, (model, reference)):
        m[2].register_full_backward_hook(
            lambda _m, gin, gout, log=log: log.append(("backward", [gin[0].clone(), gout[0].clone()])))
        m[3].register_full_backward_pre_hook(lambda _m, gout, log=log: log.append(("backward pre", [gout[0].clone()])))
        m[1].register_forward_hook(lambda _m, _a, out, log=log: log.append(("forward", [out.clone()])))
        # not full: called on the grad_fn of the module's output, as in eager
        m[4].register_backward_hook(lambda _m, gin, gout, log=log: log.append(
            ("not full", [g.clone() for g in (*gin, *gout) if g is not None])))
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    assert logs[0] == []
    for _ in range(2):
        _step(rk, (x,), {})
        _step(reference, (x,), {})
    assert [n for n, _ in logs[0]] == [n for n, _ in logs[1]] == ["forward", "not full", "backward pre", "backward"] * 2
    for (name, got), (_, expected) in zip(*logs):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, msg=name)
    _assert_same_gradients(model, reference)


class _TensorHooked(nn.Module):
    """A forward that registers a gradient hook on an intermediate tensor."""

    def __init__(self, seen: list[torch.Tensor]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).tanh()
        if h.requires_grad:
            h.register_hook(lambda grad: self.seen.append(grad.clone()))
        return self.b(h)


def test_a_tensor_hook_registered_in_the_forward_runs_in_each_backward() -> None:
    torch.manual_seed(0)
    planned_seen, eager_seen = [], []
    model, x = _TensorHooked(planned_seen), torch.randn(5, 8)
    reference = copy.deepcopy(model)
    reference.seen = eager_seen
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    assert planned_seen == []
    for _ in range(2):
        _step(rk, (x,), {})
        _step(reference, (x,), {})
    assert len(planned_seen) == len(eager_seen) == 2
    for a, b in zip(planned_seen, eager_seen):
        torch.testing.assert_close(a, b)


def test_hooks_see_values_without_autograd_history() -> None:
    """What the README promises: eager's values, detached (the planned forward runs without grad)."""
    model, x = _mlp()
    seen: list[bool] = []
    model[2].register_forward_hook(lambda _m, _args, out: seen.append(out.requires_grad))
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    _step(rk, (x,), {})
    _step(model, (x,), {})
    assert seen == [False, True]  # planned, eager


def test_a_hook_run_as_a_side_effect_that_mutates_or_returns_raises_naming_it() -> None:
    model, x = _mlp()

    def scale_in_place(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        out.mul_(2.0)

    model[2].register_forward_hook(scale_in_place)
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    with pytest.raises(HookError, match=r"`.*scale_in_place`.*of 2.*in place.*Return the changed value"):
        _step(rk, (x,), {})

    model, x = _mlp()
    model[2].register_forward_hook(lambda _m, _args, out: torch.relu(out))  # its code cannot tell
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    with pytest.raises(HookError, match=r"`.*<lambda>`.*returned a value.*Write it as a def"):
        _step(rk, (x,), {})


class _Shared(nn.Module):
    """One module called twice, on arguments of different structure."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.inner(x).tanh() * 2)


def test_a_module_called_twice_calls_its_hooks_twice_on_each_calls_values() -> None:
    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    planned, eager = _Recorder(), _Recorder()
    planned.attach(model, ["inner"])
    eager.attach(reference, ["inner"])
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    _step(rk, (x,), {})
    _step(reference, (x,), {})
    assert len(planned.seen) == 6
    _assert_recorded_alike(planned, eager)


def test_pruning_hooks_from_torch_stay_traced_and_keep_eagers_gradients() -> None:
    model, x = _mlp()
    reference = copy.deepcopy(model)
    for m in (model, reference):  # L1 pruning is deterministic
        prune.l1_unstructured(m[2], "weight", amount=0.5)  # a pre-hook setting weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own hooks are not the user's side effects
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
    torch.testing.assert_close(_step(rk, (x,), {}), _step(reference, (x,), {}))
    _assert_same_gradients(model, reference)


def test_a_pre_hook_may_record_onto_its_module_but_not_replace_its_weight() -> None:
    model, x = _mlp()

    def remember_input(m: nn.Module, args: tuple) -> None:
        m.last_input = args[0].detach()

    model[2].register_forward_pre_hook(remember_input)
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    for _ in range(2):
        _step(rk, (x,), {})
    assert torch.equal(model[2].last_input, model[1](model[0](x)).detach())

    model, x = _mlp()

    def scaled_weight(m: nn.Module, _args: tuple) -> None:
        m.weight = nn.Parameter(m.weight.detach() * 2)

    model[2].register_forward_pre_hook(scaled_weight)
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    with pytest.raises(HookError, match=r"`.*scaled_weight`.*of 2 set a tensor on its module.*parametrize"):
        _step(rk, (x,), {})


def test_hooks_run_in_inductors_compiled_step_and_not_while_it_is_measured() -> None:
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    reference = copy.deepcopy(model)
    planned, eager = _Recorder(), _Recorder()
    modules = [name for name, _ in model.named_modules()]
    planned.attach(model, modules)
    eager.attach(reference, modules)
    rk = Rockmate(model, (args, kwargs), 1.0, backend="inductor")  # its compiled step is run to be measured
    assert planned.seen == []
    for seed in (1, 2):
        planned.seen.clear(), eager.seen.clear()
        _step(rk, args, kwargs, seed)
        _step(reference, args, kwargs, seed)
        _assert_recorded_alike(planned, eager)


_features: dict[str, torch.Tensor] = {}


class _ReadsWhatAHookStores(nn.Module):
    """A forward that reads what a forward hook stored (features for a perceptual loss)."""

    def __init__(self, hook: Callable) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.body[1].register_forward_hook(hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).sum() + _features["tanh"].square().sum()


def _store(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
    _features["tanh"] = out


def _store_and_return(_m: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    _features["tanh"] = out
    return out


def test_a_forward_reading_what_a_hook_stores_is_refused_with_the_remedy_that_works() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    _features.clear()
    with pytest.raises(CaptureError, match=r"KeyError(.|\n)*forward hook `_store`.*make the hook return its output"):
        Rockmate(_ReadsWhatAHookStores(_store), (x,), 1.0, solver="store_all")
    model = _ReadsWhatAHookStores(_store)
    model(x)  # an eager call leaves a stale value behind: read as a constant, its gradient would be lost
    with pytest.raises(CaptureError, match=r"computed outside the step(.|\n)*forward hook `_store`"):
        Rockmate(model, (x,), 1.0, solver="store_all")
    _features.clear()
    model = _ReadsWhatAHookStores(_store_and_return)  # the remedy: traced
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="_store_and_return"):
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
    torch.testing.assert_close(_step(rk, (x,), {}), _step(reference, (x,), {}))
    _assert_same_gradients(model, reference)


def test_a_librarys_hook_is_traced_and_named() -> None:
    """An installed library's hook may store what its forward reads: traced, as before, and named."""
    model, x = _mlp()
    calls: list[int] = []

    def count(_m: nn.Module, _args: tuple, _out: torch.Tensor) -> None:
        calls.append(1)

    as_installed = types.FunctionType(count.__code__.replace(co_filename="/venv/site-packages/lib/hooks.py"),
                                      count.__globals__, "count", None, count.__closure__)
    model[2].register_forward_hook(as_installed)
    with pytest.warns(UserWarning, match=r"installed libraries.*`count` \(hooks.py"):
        rk = Rockmate(model, (x,), 1.0, solver="store_all")
    traced = len(calls)
    assert traced > 0  # called while tracing, as a traced hook is
    _step(rk, (x,), {})
    assert len(calls) == traced


def test_hooks_added_after_planning_are_planned_for() -> None:
    model, x = _mlp()
    rk = Rockmate(model, (x,), 1.0, solver="store_all")
    seen: list[int] = []
    handle = model[2].register_forward_hook(lambda _m, _a, _o: seen.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new plan is announced
        _step(rk, (x,), {})
    assert seen == [1]
    handle.remove()
    _step(rk, (x,), {})
    assert seen == [1]


def test_hooks_run_in_a_held_plan_reused_for_a_smaller_input() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4))
    x = torch.randn(256, 8)
    seen: list[tuple[int, ...]] = []
    model[2].register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape)))
    # (A budget that storing everything at the smaller input exceeds: else that is planned.)
    rk = Rockmate(model, (x,), 0.8, on_new_input="reuse", profile="estimate")
    _step(rk, (x[:224],), {})
    assert rk.schedule.extra.get("reused") and seen == [(224, 64)]


class _Branches(nn.Module):
    """A branch on a tensor's value: a graph break, so Dynamo captures the graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).tanh()
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def test_hooks_run_per_step_in_a_model_with_graph_breaks() -> None:
    torch.manual_seed(0)
    model, x = _Branches(), torch.randn(5, 8)
    counts = [0]
    model.a.register_forward_hook(lambda _m, _a, _o: counts.__setitem__(0, counts[0] + 1))
    rk = Rockmate(model, (x,), "1MB")
    for _ in range(3):
        _step(rk, (x,), {})
    assert rk.graph_plans and counts == [3]


def test_no_hook_no_warning() -> None:
    model, x = _mlp()
    model[2].register_forward_hook(lambda _m, _a, _o: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Rockmate(model, (x,), 1.0, solver="store_all")


def _returns_none(m: nn.Module, args: tuple) -> None:
    if args:
        return
    print(m)


def _returns_scaled(m: nn.Module, args: tuple) -> tuple:
    if not args:
        return None
    return (args[0] * 2,)


@pytest.mark.parametrize(("hook", "expected"), [
    (_returns_none, False),
    (_returns_scaled, True),
    (lambda m, args: None, False),
    (lambda m, args: args[0] * 2, True),
    (lambda m, args: print(m), None),  # a call's result: only the step can tell
    (print, None),
])
def test_what_a_hooks_code_says_it_returns(hook: Callable, expected: bool | None) -> None:
    assert returns_value(hook) is expected


transformers = pytest.importorskip("transformers")


def test_hf_llama_hooks_with_kwargs_see_eagers_values() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # padded: eager builds the mask tensor the traced step builds (all ones, eager drops it)
    # transformers collects hidden states with forward hooks of its own: they stay traced
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids, "output_hidden_states": True}
    reference = copy.deepcopy(model)
    planned, eager = _Recorder(), _Recorder()
    modules = ["model.layers.0", "model.layers.1.mlp", "lm_head"]
    planned.attach(model, modules)
    eager.attach(reference, modules)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*key/value cache")
        probe = Rockmate(copy.deepcopy(model), ((), batch), 1.0, solver="store_all", profile="estimate")
        rk = Rockmate(model, ((), batch), min_feasible_budget(probe.graph), profile="estimate")
    assert planned.seen == []
    out, expected = _step(rk, (), batch), _step(reference, (), batch)
    _assert_recorded_alike(planned, eager)
    _assert_same_gradients(model, reference)
    assert len(out.hidden_states) == len(expected.hidden_states) == 3
    for got, want in zip(out.hidden_states, expected.hidden_states):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
