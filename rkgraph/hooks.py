"""Module hooks in a captured step: run in every step, with real tensors, not while planning.

A hook the user registered on a module (`register_forward_pre_hook`, `register_forward_hook`,
with or without `with_kwargs`, the global `register_module_forward_pre_hook` and
`register_module_forward_hook`, and full backward hooks and pre-hooks) runs in Python when the
module is called. AOTAutograd calls it while it traces the step on fake tensors, twice, and
never again: the planned step runs the traced graph, not the modules. What it computes into
tensors is in the graph; its Python side effects (a counter, a list of recorded activations,
a print, a logged statistic) would happen only while planning.

So a hook whose code returns nothing is not called while tracing. In its place the trace
records `rockplan::call_hook(id, tensors, after)`: an op with a side effect, kept through
dead-code elimination, flagged to run once (never recomputed, as collectives are:
`rkgraph.build`), that calls the hook in every step with the real tensors rebuilt into the
structure the hook was given (the pytree spec recorded while tracing). Each call takes the
token the previous call returned, so hooks run in eager's order whatever order the schedule
gives the rest of the step; a call runs in the forward (the backward, for a backward hook)
where its tensors are alive, and holds nothing the schedule does not already hold.

What a hook sees: the values eager's hook sees, without autograd history (the planned
forward runs under no_grad, as every AOTAutograd forward does): `requires_grad` is False,
`grad_fn` None, and `register_hook` on them fails. A transformers key/value cache among its
arguments is None, as in the planned step's outputs. What a hook keeps stays alive, as in
eager, and what it keeps or allocates is not in the plan's budget.

A hook whose code returns a value (`return out * 2`) changes the step's tensors: it is traced
as before, its tensor effect applies in every step, gradients included, and its Python side
effects happen only while tracing (planning warns, naming it). Hooks of installed libraries
may store what the forward reads (torch's pruning, weight and spectral normalization and FSDP
set the weight; transformers' and timm's collect the hidden states their forwards return):
they are traced too (`runs_in_steps`). A forward that reads what a user's hook run in steps
stores fails to capture (the value is not there, or is a stale one: `capture_hint` says to
make the hook return its output, which traces it).

Which kind a hook is, is read from its code (`returns_value`), never by calling it on fake
tensors: planning runs no hook and changes no hook's state. What its code cannot tell (a
lambda whose body is a call, a builtin) is taken for a side effect and checked in each step:
a hook run as a side effect that returns a value, changes its tensors in place, or replaces a
tensor its module's traced forward reads (a pre-hook), raises an error that names it, never
a silent difference from eager.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import itertools
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.modules.module as module_globals
import torch.utils._pytree as pytree
from torch import fx, nn


class HookError(RuntimeError):
    """A hook run in a planned step did what rockplan cannot run as planned; the message says what to do."""


@dataclass(eq=False)
class HookCall:
    """One call of a hook as traced (a module called twice calls its hooks twice), made in
    each step by `rockplan::call_hook`."""

    id: int
    hook: Callable
    module: nn.Module | None  # the module hooked; None for a tensor's hook (called without one)
    kind: str  # "forward_pre", "forward", "backward_pre", "backward" or "tensor"
    name: str  # for messages: where it is registered and what it is
    # How the hook's arguments after the module are flattened: their spec, and the non-tensor
    # leaves as traced (tensor positions hold None); recorded at the trace.
    spec: pytree.TreeSpec | None = None
    leaves: list[Any] = field(default_factory=list)
    tensor_positions: list[int] = field(default_factory=list)
    # A pre-hook's module's plain tensor attributes when traced: its forward may read them.
    read_by_forward: tuple[str, ...] = ()

    def record(self, hook_args: tuple) -> list[torch.Tensor]:
        """Remember the structure of `hook_args`; their tensors, in order."""
        from rkgraph.capture import _register_dataclasses

        if self.kind == "forward_pre":
            self.read_by_forward = tuple(n for n, v in vars(self.module).items() if isinstance(v, torch.Tensor))

        _register_dataclasses(hook_args)
        leaves, self.spec = pytree.tree_flatten(hook_args)
        self.tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.leaves = [None if isinstance(x, torch.Tensor) else _usable(x) for x in leaves]
        return [leaves[i] for i in self.tensor_positions]

    def run(self, tensors: list[torch.Tensor]) -> None:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_positions, tensors, strict=True):
            leaves[i] = t
        hook_args = pytree.tree_unflatten(leaves, self.spec)
        versions = [t._version for t in tensors]
        state = self._module_tensors() if self.kind == "forward_pre" else None
        result = self.hook(*hook_args) if self.module is None else self.hook(self.module, *hook_args)
        if result is not None:
            raise HookError(
                f"{self.name} returned a value in a planned step. Its code did not show that it does (a lambda "
                "whose body is a call, or a builtin), so rockplan runs it as a side effect on the step's values, "
                "and what it returns cannot reach the step. Write it as a def that returns the value by name "
                "(out = ...; return out): it is then traced into the step, and what it returns applies.")
        if any(t._version != v for t, v in zip(tensors, versions)):
            raise HookError(
                f"{self.name} changed a tensor it was given in place in a planned step. Its code returns "
                "nothing, so rockplan runs it as a side effect on the step's values; the change would not "
                "reach the step. Return the changed value instead (return out * 2, not out.mul_(2)): it is "
                "then traced into the step.")
        if state is not None and self._module_tensors() != state:
            raise HookError(
                f"{self.name} set a tensor on its module before the module ran, in a planned step. Its code "
                "returns nothing, so rockplan runs it as a side effect after tracing the module without it. "
                "Use torch.nn.utils.parametrize for a computed weight, or return the new inputs from the hook.")

    def _module_tensors(self) -> list[tuple[str, int]]:
        """The identity of the tensors a pre-hook could hand the module's traced forward: its
        parameters and buffers, and the tensor attributes it had when traced (a new attribute,
        as a hook recording its inputs sets, is no input of the traced forward)."""
        module = self.module
        named = itertools.chain(module._parameters.items(), module._buffers.items(),
                                ((n, getattr(module, n, None)) for n in self.read_by_forward))
        return [(n, id(v)) for n, v in named]


# Calls by id, held by the chain of the captured step (`FlatCall.hooks`): a step dropped
# takes its calls with it.
_CALLS: weakref.WeakValueDictionary[int, HookCall] = weakref.WeakValueDictionary()
_ids = itertools.count()
_muted = 0  # > 0 while planning replays the step on real tensors (profiling, measuring)


@contextlib.contextmanager
def hooks_muted() -> Iterator[None]:
    """Run no hook while the step is replayed to be measured, not to train."""
    global _muted
    _muted += 1
    try:
        yield
    finally:
        _muted -= 1


def _token(like: list[torch.Tensor], after: torch.Tensor | None) -> torch.Tensor:
    device = like[0].device if like else after.device if after is not None else torch.device("cpu")
    return torch.empty(0, device=device)


@torch.library.custom_op("rockplan::call_hook", mutates_args=())
def call_hook(hook: int, tensors: list[torch.Tensor], after: torch.Tensor | None) -> torch.Tensor:
    """Call hook `hook` with `tensors`, after the call that returned `after`; returns the token
    the next call takes (no data: its order is all it carries)."""
    if not _muted:
        call = _CALLS.get(hook)
        if call is None:  # a graph run without the step that recorded it (rkgraph.capture_joint's)
            raise HookError(f"hook call {hook} belongs to a captured step no longer held: run the graph "
                            "inside hooks_muted(), or run the step of the Rockmate module that captured it")
        call.run(tensors)
    return _token(tensors, after)


@call_hook.register_fake
def _(hook: int, tensors: list[torch.Tensor], after: torch.Tensor | None) -> torch.Tensor:
    return _token(tensors, after)


CALL_HOOK = torch.ops.rockplan.call_hook.default
fx.node.has_side_effect(CALL_HOOK)


def is_hook_call(node: fx.Node) -> bool:
    """Whether the node calls a user's hook: it runs once, in its place (see the module docstring)."""
    return node.op == "call_function" and node.target is CALL_HOOK


# --- which hooks run in steps ---------------------------------------------------------------------

def _code(hook: Callable) -> tuple[types.CodeType | None, str]:
    """The code object a hook runs, and the module that defines it."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    if isinstance(hook, types.MethodType):
        hook = hook.__func__
    if not isinstance(hook, (types.FunctionType, types.BuiltinFunctionType)):
        call = inspect.getattr_static(type(hook), "__call__", None)  # a callable object's, if Python
        if isinstance(call, types.FunctionType):
            hook = call
    code = getattr(hook, "__code__", None)
    return (code if isinstance(code, types.CodeType) else None), getattr(hook, "__module__", None) or ""


def returns_value(hook: Callable) -> bool | None:
    """Whether the hook's code returns a value: False when every return returns None; True
    when one returns something else; None when its code cannot tell (a lambda whose body is a
    call, as `lambda m, args, out: seen.append(out)`, or a callable without Python code)."""
    code, _ = _code(hook)
    if code is None:
        return None
    instructions = list(dis.get_instructions(code))
    sites = []  # per return: None (returns None), "call" (a call's result) or "value"
    for before, ins in zip([None, *instructions], instructions):
        if ins.opname == "RETURN_CONST":
            sites.append(None if ins.argval is None else "value")
        elif ins.opname == "RETURN_VALUE":
            if before is not None and before.opname == "LOAD_CONST" and before.argval is None:
                sites.append(None)
            elif before is not None and before.opname.startswith(("CALL", "PRECALL")) \
                    and not before.opname.startswith("CALL_INTRINSIC"):  # (*args,) is no call
                sites.append("call")
            else:
                sites.append("value")
    if "value" in sites:
        return True
    if "call" in sites:
        return True if code.co_name != "<lambda>" else None
    return False


# Packages whose hooks compute what their models' forwards read (pruning and weight norm set
# the weight, FSDP gathers it; transformers' and timm's hooks collect the hidden states and
# features their forwards return): traced, as part of the model, without a warning.
_MODEL_PACKAGES = ("torch", "transformers", "timm")


def _origin(hook: Callable) -> str:
    """"model" for a hook of `_MODEL_PACKAGES`, "library" for another installed package's,
    "user" for the user's own code."""
    code, module = _code(hook)
    if module.split(".")[0] in _MODEL_PACKAGES:
        return "model"
    if code is not None and any(part in code.co_filename for part in ("/site-packages/", "/dist-packages/")):
        return "library"
    return "user"


def runs_in_steps(hook: Callable) -> bool:
    """Whether the hook runs in each step as a side effect, else it is traced: a hook of the
    user's own code whose code returns nothing. A library's hook may store what its forward reads
    (a dict of features the forward returns), which only tracing it keeps: traced."""
    return _origin(hook) == "user" and not returns_value(hook)


_KIND_LABELS = {"forward_pre": "forward pre-hook", "forward": "forward hook", "backward_pre": "backward pre-hook",
                "backward": "backward hook", "tensor": "gradient hook"}


def describe(hook: Callable, where: str, kind: str) -> str:
    """'the forward hook `record` (file.py:12) of layers.0'"""
    code, _ = _code(hook)
    name = (getattr(hook, "__qualname__", None) or type(hook).__qualname__).rsplit("<locals>.", 1)[-1]
    at = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code is not None else ""
    return f"the {_KIND_LABELS[kind]} `{name}`{at} of {where}"


def _usable(leaf: Any) -> Any:
    """A non-tensor argument as the hook gets it in each step: a transformers key/value cache
    holds the trace's tensors, unusable after it, and a planned step returns none (None)."""
    import sys

    cache_utils = sys.modules.get("transformers.cache_utils")
    return None if cache_utils is not None and isinstance(leaf, cache_utils.Cache) else leaf


# --- capture: hooks replaced by calls while tracing ------------------------------------------------

# (module attribute, global dict, kind). `hook_ids` reads the module attributes by name, in this
# order (each step's guards call it): a kind added here is added there too.
_KINDS = (
    ("_forward_pre_hooks", "_global_forward_pre_hooks", "forward_pre"),
    ("_forward_hooks", "_global_forward_hooks", "forward"),
    ("_backward_pre_hooks", "_global_backward_pre_hooks", "backward_pre"),
    ("_backward_hooks", "_global_backward_hooks", "backward"),
)


def hook_ids(modules: Iterable[nn.Module]) -> tuple:
    """The handles of every module hook `modules` (a model's `modules()`) and the global
    registries hold: a plan was traced with these hooks, and runs those only."""
    # Each step's guards read these: the attributes by name, not through nested generators
    # over _KINDS (twice the time on a small model, whose GPU step waits on the host).
    local = tuple([(tuple(m._forward_pre_hooks), tuple(m._forward_hooks), tuple(m._backward_pre_hooks),
                    tuple(m._backward_hooks)) for m in modules])
    return local, tuple(tuple(getattr(module_globals, attr)) for _, attr, _ in _KINDS)


@dataclass
class HookChain:
    """The calls recorded for a model's hooks, and the token of the last one (the next call
    takes it, so calls keep eager's order)."""

    calls: list[HookCall] = field(default_factory=list)
    traced: list[tuple[str, str, Callable]] = field(default_factory=list)  # (where, kind, hook) left traced
    last: torch.Tensor | None = None

    def restart(self) -> None:
        """AOTAutograd traces the forward more than once, the last trace making the graph:
        each trace starts a new chain."""
        self.calls.clear()
        self.last = None

    def emit(self, hook: Callable, module: nn.Module | None, kind: str, name: str, hook_args: tuple) -> None:
        """Record a call of `hook` with `hook_args` in the graph (one per call: a module called
        twice calls its hooks twice, maybe on arguments of another structure)."""
        call = HookCall(next(_ids), hook, module, kind, name)
        tensors = call.record(hook_args)
        self.calls.append(call)  # the registry holds it only while the chain does
        _CALLS[call.id] = call
        with torch.no_grad():  # the call has no gradient: it only reads
            self.last = CALL_HOOK(call.id, tensors, self.last)


@contextlib.contextmanager
def hooks_as_calls(model: nn.Module, chain: HookChain) -> Iterator[None]:
    """While tracing `model`, replace each hook that `runs_in_steps` by a stand-in recording
    its call in the graph; the hooks are put back on exit, the model as it was."""
    replaced: list[tuple[dict, int, Callable]] = []

    def replace(hooks: dict, where: str | None, kind: str, module: nn.Module | None) -> None:
        for hook_id, hook in list(hooks.items()):
            if not runs_in_steps(hook):
                chain.traced.append((where or "every module", kind, hook))
                continue

            def stand_in(module: nn.Module, *hook_args: Any, hook: Callable = hook) -> None:
                chain.emit(hook, module, kind, describe(hook, where or type(module).__name__, kind), hook_args)

            hooks[hook_id] = stand_in
            replaced.append((hooks, hook_id, hook))

    for module_attr, global_attr, kind in _KINDS:
        for name, sub in model.named_modules():
            replace(getattr(sub, module_attr), name or type(model).__name__, kind, sub)
        replace(getattr(module_globals, global_attr), None, kind, None)  # global: named by the module it sees
    register_hook = torch.Tensor.register_hook
    stand_ins: set[Callable] = set()

    def register_tensor_hook(tensor: torch.Tensor, hook: Callable) -> Any:
        """A gradient hook the forward registers on a tensor, called by the traced backward."""
        where = f"a tensor in {type(model).__name__}'s forward"
        if hook in stand_ins or not runs_in_steps(hook):  # a tensor subclass's register_hook comes back here
            if hook not in stand_ins:
                chain.traced.append((where, "tensor", hook))
            return register_hook(tensor, hook)

        def stand_in(grad: torch.Tensor) -> None:
            chain.emit(hook, None, "tensor", describe(hook, where, "tensor"), (grad,))

        stand_ins.add(stand_in)
        return register_hook(tensor, stand_in)

    # Patched on the class for the trace's duration (tensors the forward makes are traced ones,
    # made inside it), as `_module_path_annotations` hooks every module for it.
    torch.Tensor.register_hook = register_tensor_hook
    try:
        yield
    finally:
        torch.Tensor.register_hook = register_hook
        for hooks, hook_id, hook in replaced:
            hooks[hook_id] = hook


def warn_of_traced_hooks(model: nn.Module, chain: HookChain, stacklevel: int) -> None:
    """Name the hooks left traced, whose Python side effects run only while planning (not
    those of `_MODEL_PACKAGES`: they compute the model)."""
    shown = [describe(hook, where, kind) for where, kind, hook in chain.traced if _origin(hook) != "model"]
    if not shown:
        return
    listed = "; ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
    warnings.warn(
        f"{type(model).__name__}: hooks that return a value, and hooks of installed libraries (which may store "
        f"what the forward reads), are traced into the planned step: {listed}. What they return or store applies "
        "in every step, gradients included, but their Python side effects (counters, recorded tensors, prints) "
        "happen only while planning, on traced tensors, not in each step. A hook of your own code that returns "
        "nothing runs in each step on the step's values: keep side effects in such hooks.",
        stacklevel=stacklevel,
    )


def capture_hint(chain: HookChain) -> str:
    """What to add to a capture failure when hooks were not called while tracing: the forward
    may have read what one of them stores (a dict of features filled by forward hooks)."""
    if not chain.calls:
        return ""
    names = "; ".join(dict.fromkeys(call.name for call in chain.calls[:3]))
    return (f"\nHooks that return nothing are not called while tracing, only in each step ({names}). If the "
            "forward reads what a hook stores, make the hook return its output (return out, or return args for "
            "a pre-hook): it is then traced into the step, and what it stores is there when the forward reads it.")
