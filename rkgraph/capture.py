"""Capture one training step of an nn.Module as a joint forward+backward fx graph.

We use AOTAutograd itself (the machinery under torch.compile): it traces with fake tensors,
functionalizes in-place ops and buffer mutations, and hands the joint graph to a partition
function. `training_function` builds the AOTAutograd callable with a caller-supplied
partition function (rockplan's planner plugs in there); `trace_joint` only records the graph.
This module only traces: the graph rewrites (`rkgraph.rewrites`) are applied by whoever takes
the joint graph from here.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import gc
import inspect
import logging
import math
import operator
import random
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import fx
from torch._functorch.aot_autograd import aot_function, make_boxed_compiler, make_boxed_func
from torch._subclasses import FakeTensor, FakeTensorMode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.func import functional_call
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from rkgraph.hooks import HookChain, capture_hint, hooks_as_calls, warn_of_traced_hooks

log = logging.getLogger(__name__)

PartitionFn = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


class CaptureError(RuntimeError):
    """The model cannot be captured as one graph; the message says where and what to do."""


def splits_into_graphs(error: CaptureError) -> bool:
    """Whether capture failed where Dynamo ends a graph and runs the Python itself: a value read
    from a tensor (a branch on it, `.item()`), an output whose shape depends on values
    (`nonzero`, boolean masks), a tensor's data handed to NumPy, a draw from NumPy's or Python's
    random numbers (Dynamo draws them again in every step). An error the model raises
    itself, or a bad argument, is not one: the model would fail the same way under Dynamo."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    cause = error.__cause__
    if isinstance(cause, (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode,
                          HostRandomDraw)):
        return True
    return isinstance(cause, RuntimeError) and ".numpy() is not supported for tensor subclasses" in str(cause)


class HostRandomDraw(Exception):
    """The forward drew from NumPy's or Python's global random numbers while it was traced: the
    graph would hold that one draw's values as constants (the cause of a CaptureError)."""


class _PlanningFailed(Exception):
    """Carries an error of planning or compiling through AOTAutograd, told apart from tracing errors."""


@dataclass
class JointGraph:
    """The joint graph as AOTAutograd hands it to a partitioner, plus what its inputs are."""

    module: fx.GraphModule
    num_fwd_outputs: int
    input_kinds: list[str]  # per primal placeholder: "param", "buffer" or "input"
    input_names: list[str]  # qualified parameter/buffer name, or the argument path of an input
    mutated: frozenset[str] = frozenset()  # primal placeholders the step mutates (BatchNorm stats)

    def __post_init__(self) -> None:
        refuse_unrunnable_ops(self.module)
        drop_profiler_ranges(self.module)
        float_batch_norm_statistics(self.module)
        float_norm_statistics(self.module)
        losses_in_their_buffers(self.module)


def refuse_unrunnable_ops(module: fx.GraphModule) -> None:
    """Raise `CaptureError` for a traced op whose compiled step PyTorch cannot run, or whose
    values' bytes no plan can know (sparse tensors), naming the module it comes from and what to
    do instead.

    `mkldnn_rnn_layer` (an LSTM on a CPU with oneDNN; tracing avoids it, `differentiable_lstm`,
    and this names it should a trace hold it still): its workspace output is an empty tensor in
    the trace and None when the kernel runs, so AOTAutograd's compiled forward refuses to save it
    (an assertion), and handing the backward an empty tensor instead crashes the process."""
    for node in module.graph.find_nodes(op="call_function", target=torch.ops.aten.mkldnn_rnn_layer.default):
        raise CaptureError(
            f"{_module_of(node)}: an LSTM on a CPU traces to oneDNN's mkldnn_rnn_layer, whose compiled training "
            "step PyTorch cannot run (its workspace is a tensor in the trace and None when it runs). Turn oneDNN "
            "off for planning and training, `with torch.backends.mkldnn.flags(enabled=False):`, which traces "
            "the LSTM into matrix products per time step as eager then runs it, or keep it outside the "
            "planned module."
        )
    for node in module.graph.nodes:
        values = node.meta.get("val")
        layouts = {v.layout for v in (values if isinstance(values, (tuple, list)) else [values])
                   if isinstance(v, torch.Tensor)} - {torch.strided}
        if layouts:
            raise CaptureError(
                f"{_module_of(node)}: {node.target} makes a {layouts.pop()} tensor (an nn.Embedding or "
                "nn.EmbeddingBag with sparse=True makes its weight's gradient sparse), and rockplan sizes and "
                "plans dense (strided) tensors only. Pass sparse=False (a dense gradient the size of the table), "
                "or keep the sparse module outside the planned module."
            )


def _module_of(node: fx.Node) -> str:
    """The module an fx node of the step comes from, as the trace annotated it."""
    return node.meta.get("custom", {}).get("module") or "the model"


# BatchNorm's ops whose outputs 1 and 2 are the batch's statistics (mean and inverse standard
# deviation, or their running counterparts in evaluation).
_BATCH_NORMS = frozenset({
    torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit_no_training.default,
    torch.ops.aten.native_batch_norm.default,
})
_HALF_PRECISIONS = (torch.bfloat16, torch.float16)


def float_batch_norm_statistics(module: fx.GraphModule) -> int:
    """Give BatchNorm's statistics outputs the dtype its kernels return: on a half-precision
    input ATen's CPU and CUDA kernels compute them in float32, while PyTorch's meta functions,
    which the trace records, give them the input's dtype. Node sizes come from those records:
    without this a plan counted half their bytes, and a step planned to its budget under
    autocast measured over it. Returns how many ops it corrected."""
    corrected = 0
    for node in module.graph.nodes:
        val = node.meta.get("val")
        if (node.op != "call_function" or node.target not in _BATCH_NORMS or not isinstance(val, (tuple, list))
                or not isinstance(val[0], torch.Tensor) or val[0].dtype not in _HALF_PRECISIONS):
            continue
        corrected += _give_statistics(node, torch.float32)
    return corrected


def _give_statistics(node: fx.Node, dtype: torch.dtype) -> bool:
    """Record a norm's outputs 1 and 2 (its statistics), and the getitems taking them, as
    `dtype` where the trace recorded half precision; returns whether any changed."""
    val = node.meta["val"]
    fixed = [torch.empty_like(v, dtype=dtype) if i in (1, 2) and isinstance(v, torch.Tensor)
             and v.dtype in _HALF_PRECISIONS and v.dtype != dtype else v for i, v in enumerate(val)]
    if all(a is b for a, b in zip(fixed, val)):
        return False
    node.meta["val"] = type(val)(fixed)
    for user in node.users:
        if user.target is operator.getitem and user.args[1] in (1, 2):
            user.meta["val"] = fixed[user.args[1]]
    return True


@dataclass(frozen=True)
class _NormCall:
    """Where a norm op's call holds what decides its statistics' dtype, and how to call it on a
    probe: `tensors` picks the input, weight and bias from the call's arguments, `width` the
    elements one row normalizes over (layer norm's normalized size, group norm's channels), and
    `probe` calls the op on one row of that width (weight and bias None where absent)."""

    tensors: Callable[[tuple], tuple]
    width: Callable[[tuple], int]
    probe: Callable[..., tuple]


# LayerNorm's and GroupNorm's ops, whose outputs 1 and 2 are the statistics the backward reads.
_NORMS_WITH_STATISTICS = {
    torch.ops.aten.native_layer_norm.default: _NormCall(
        tensors=lambda args: (args[0], args[2], args[3]), width=lambda args: math.prod(args[1]),
        probe=lambda x, w, b, width: torch.ops.aten.native_layer_norm.default(x, [width], w, b, 1e-5)),
    torch.ops.aten.native_group_norm.default: _NormCall(
        tensors=lambda args: (args[0], args[1], args[2]), width=lambda args: args[4],
        probe=lambda x, w, b, width: torch.ops.aten.native_group_norm.default(x, w, b, 1, width, 1, 1, 1e-5)),
}


@functools.cache
def _statistics_dtype(op: torch._ops.OpOverload, device: torch.device, dtypes: tuple[torch.dtype | None, ...],
                      width: int) -> torch.dtype | None:
    """The dtype of the statistics `op`'s kernel on `device` returns for an input, weight and bias
    of `dtypes` (None: no tensor), over `width` elements of a row: probed once on a one-row
    input. None where the kernel refuses."""
    with unset_fake_temporarily():
        x, w, b = (None if d is None else torch.rand(1, width, device=device, dtype=d) for d in dtypes)
        try:
            out = _NORMS_WITH_STATISTICS[op].probe(x, None if w is None else w[0], None if b is None else b[0], width)
        except (RuntimeError, NotImplementedError):
            return None
    return out[1].dtype


def float_norm_statistics(module: fx.GraphModule) -> int:
    """Give LayerNorm's and GroupNorm's statistics outputs the dtype their kernels return. On a
    CPU, with a half-precision input and float32 weights (what autocast makes of a convolution or
    linear layer's output feeding a norm whose parameters stay float32), the kernels compute and
    return the statistics in float32, while PyTorch's meta functions, which the trace records,
    give them the input's dtype, so a plan counted half their bytes and the step measured over
    its budget. Probed per device and dtypes, as kernels differ.
    Returns how many ops it corrected."""
    corrected = 0
    for node in module.graph.nodes:
        val = node.meta.get("val")
        if (node.op != "call_function" or node.target not in _NORMS_WITH_STATISTICS
                or not isinstance(val, (tuple, list)) or not all(isinstance(v, torch.Tensor) for v in val)
                or val[1].dtype not in _HALF_PRECISIONS):
            continue
        call = _NORMS_WITH_STATISTICS[node.target]
        dtypes = tuple(a.meta["val"].dtype if isinstance(a, fx.Node) else None for a in call.tensors(node.args))
        dtype = _statistics_dtype(node.target, val[0].device, dtypes, call.width(node.args))
        if dtype is not None:
            corrected += _give_statistics(node, dtype)
    return corrected


# Losses whose kernels may reduce into their unreduced buffer and return the reduced value as a
# view of it (on CPU, torch 2.13: a 0-dim tensor over all of the input's elements), where the
# meta function, which the trace records, returns a tensor of its own.
_LOSSES = frozenset({
    torch.ops.aten.mse_loss.default,
    torch.ops.aten.smooth_l1_loss.default,
    torch.ops.aten.binary_cross_entropy.default,
    torch.ops.aten.soft_margin_loss.default,
})


_A_TENSOR = object()  # in `_reduces_in_its_buffer`'s arguments, where the call passes a tensor


@functools.cache
def _reduces_in_its_buffer(op: torch._ops.OpOverload, arguments: tuple, device: torch.device,
                           dtype: torch.dtype) -> bool:
    """Whether `op`'s kernel on `device`, called with `arguments` (`_A_TENSOR` for each tensor),
    returns a reduced loss whose storage is its input's size: probed once on a small input."""
    with unset_fake_temporarily():
        small = [torch.rand(2, 3, device=device, dtype=dtype) if a is _A_TENSOR else a for a in arguments]
        try:
            out = op(*small)
        except (RuntimeError, NotImplementedError):  # no kernel for this dtype or device: the step fails there
            return False
    return out.untyped_storage().nbytes() > out.numel() * out.element_size()


def losses_in_their_buffers(module: fx.GraphModule) -> int:
    """Give each reduced loss of `_LOSSES` whose kernel returns it inside its unreduced buffer
    the storage the kernel makes: node sizes come from the trace's records, and such a loss
    output, kept for the whole step, would be counted at a few bytes and hold its input's size
    (a diffusion U-Net's step measured over its budget by its MSE loss). Returns how many."""
    corrected = 0
    for node in module.graph.nodes:
        val = node.meta.get("val")
        first = node.args[0] if node.args else None
        if (node.op != "call_function" or node.target not in _LOSSES or not isinstance(val, torch.Tensor)
                or val.dim() != 0 or not isinstance(first, fx.Node) or node.kwargs):
            continue
        if any(isinstance(a, fx.Node) and not isinstance(a.meta.get("val"), torch.Tensor) for a in node.args):
            continue
        arguments = tuple(_A_TENSOR if isinstance(a, fx.Node) else a for a in node.args)
        if _reduces_in_its_buffer(node.target, arguments, val.device, val.dtype):
            node.meta["val"] = val.new_empty(first.meta["val"].shape).as_strided((), ())
            corrected += 1
    return corrected


# `torch.profiler.record_function` (DDP's forward opens one) traces as an op returning a handle
# that its exit op takes. The handle is no tensor: it has no storage to plan, and a range opened
# in the forward and closed after a recomputation moved into the backward would mean nothing.
_PROFILER_RANGE_OPS = frozenset({
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
})


def drop_profiler_ranges(module: fx.GraphModule) -> None:
    """Remove `record_function` ranges from a traced step: they annotate a profile and compute
    nothing, so the planned step runs without them (exits first, then the enters they read)."""
    ranges = [n for n in module.graph.nodes if n.op == "call_function" and n.target in _PROFILER_RANGE_OPS]
    if not ranges:
        return
    for node in reversed(ranges):
        module.graph.erase_node(node)
    module.recompile()


@dataclass
class FlatCall:
    """How a model call is flattened into the positional tensors AOTAutograd sees."""

    param_names: list[str]
    buffer_names: list[str]
    input_names: list[str]
    spec: pytree.TreeSpec
    leaves: list[Any]  # non-tensor leaves as given; tensor positions hold None
    tensor_positions: list[int] = field(default_factory=list)
    mutated: set[int] = field(default_factory=set)  # flat indices mutated by the step, seen in tracing
    # AOTAutograd hands a flat tuple of outputs back as a list (PytreeThunk's shortcut for
    # "simple" specs); the caller restores the tuple the model returned.
    returns_tuple: bool = False
    # Tensors the forward assigns to module attributes (an auxiliary loss kept as
    # `self.aux_loss`, read after the forward): per attribute, the module's path, the name, and
    # the value's pytree spec with its non-tensor leaves. The step returns their tensors after
    # the model's output, and `result` sets them on the modules, as eager's forward would.
    attached: list[tuple[str, str, pytree.TreeSpec, list[Any]]] = field(default_factory=list)
    dropped_cache: bool = False  # a key/value cache the model returned is None in the step's outputs
    hooks: HookChain = field(default_factory=HookChain)  # the model's hooks run in each step (rkgraph.hooks)

    def tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        leaves, _ = pytree.tree_flatten((args, kwargs))
        return [leaves[i] for i in self.tensor_positions]

    def unflatten(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        return pytree.tree_unflatten(_with_tensors(self.leaves, self.tensor_positions, tensors), self.spec)

    def result(self, model: torch.nn.Module, out: Any) -> Any:
        """The model's output from what the traced step returned; attached tensors set on `model`."""
        if self.attached:
            out, tensors = out
            tensors = iter(tensors)
            for path, name, spec, leaves in self.attached:
                positions = [i for i, leaf in enumerate(leaves) if leaf is _TENSOR]
                value = _with_tensors(leaves, positions, [next(tensors) for _ in positions])
                setattr(model.get_submodule(path), name, pytree.tree_unflatten(value, spec))
        return tuple(out) if self.returns_tuple else out


_TENSOR = object()  # where an attached value's leaf is a tensor the step returns


def _with_tensors(leaves: list[Any], positions: list[int], tensors: Iterable[torch.Tensor]) -> list[Any]:
    """`leaves` with `tensors` put at `positions`."""
    leaves = list(leaves)
    for pos, t in zip(positions, tensors):
        leaves[pos] = t
    return leaves


def is_tangent(node: fx.Node) -> bool:
    """A placeholder for the gradient of a forward output. AOTAutograd names a joint graph's
    inputs primals_i and tangents_i, and the backward graphs split from it keep the tangents'
    names: the name is the only mark they carry."""
    return node.op == "placeholder" and node.name.startswith("tangents")


def flatten_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> FlatCall:
    _check_signature(model, args, kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return FlatCall(
        param_names=[n for n, _ in model.named_parameters()],
        buffer_names=[n for n, _ in model.named_buffers()],
        input_names=[_argument_label(paths[i]) for i in positions],
        spec=spec,
        leaves=[None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
        tensor_positions=positions,
    )


def _argument_label(path: str) -> str:
    # pytree paths of (args, kwargs) look like "[0][1]" or "[1]['mask']"
    if path.startswith("[0]"):
        return "args" + path[3:]
    return "kwargs" + path[3:]


def _check_signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"the sample does not match {type(model).__name__}.forward: {e}") from None


def training_function(
    model: torch.nn.Module,
    flat: FlatCall,
    partition_fn: PartitionFn,
    compiler: Callable | None = None,
    decompositions: dict | None = None,
) -> Callable[..., Any]:
    """An AOTAutograd callable over (params, buffers, input tensors) running `model`.

    Traced on its first call; `partition_fn(joint_module, joint_inputs, num_fwd_outputs=...)`
    decides what the forward keeps and what the backward recomputes; `compiler` turns the
    forward and backward modules into callables (default: run the fx code as it is).
    """
    n_params, n_buffers = len(flat.param_names), len(flat.buffer_names)
    names = flat.param_names + flat.buffer_names

    def flat_fn(*tensors: torch.Tensor) -> Any:
        flat.hooks.restart()
        args, kwargs = flat.unflatten(tensors[n_params + n_buffers:])
        before = _attributes(model)
        state = _module_state(model)
        try:
            out = functional_call(model, dict(zip(names, tensors[: n_params + n_buffers])), args, kwargs)
        finally:
            _restore_module_state(state)
            attached = _take_attached(model, before)
        out, dropped = _without_caches(out)
        flat.dropped_cache |= dropped
        _register_dataclasses(out)
        flat.returns_tuple = type(out) is tuple
        # AOTAutograd functionalizes the call: a mutated input shows as a pending data mutation.
        flat.mutated.update(i for i, t in enumerate(tensors) if _has_data_mutation(t))
        flat.attached = []
        returned: list[torch.Tensor] = []
        for (path, name), value in attached.items():
            leaves, spec = pytree.tree_flatten(value)
            # Tensors from before the step (not traced) stay the objects they are.
            flat.attached.append((path, name, spec, [_TENSOR if _traced(x) else x for x in leaves]))
            returned += [x for x in leaves if _traced(x)]
        return (out, returned) if attached else out

    compiler = _planning_step(compiler or make_boxed_compiler(lambda gm, _inputs: gm))
    return aot_function(
        flat_fn,
        fw_compiler=_not_run_by_trace(compiler),
        bw_compiler=compiler,
        partition_fn=_planning_step(partition_fn),
        decompositions=decompositions,
        num_params_buffers=n_params + n_buffers,
        # Its logs print every graph (joint, forward, backward) as Python source, whether or
        # not a logger shows them: planning's business is the graphs' structure.
        enable_log=False,
    )


class _Traced(Exception):
    """Raised by a compiled forward called inside `trace`: the step is traced, planned and
    compiled, and AOTAutograd holds the compiled step; what is left is running it on fakes.
    Or by a partition function that wants the joint graph only (`trace_joint`)."""


_IN_TRACE: contextvars.ContextVar[bool] = contextvars.ContextVar("rkgraph_in_trace", default=False)


def _not_run_by_trace(compiler: Callable) -> Callable:
    """`compiler` for the forward, whose compiled callable refuses to run inside `trace`.

    AOTAutograd's callable traces and compiles on its first call and then runs the compiled
    step on that call's inputs. Run on `trace`'s fake tensors that computes nothing anyone
    reads, and the ops with no tensor input (dropout's mask draw) run for real; stopping
    there leaves the compiled step cached for the real calls.
    """

    def compile_forward(module: fx.GraphModule, inputs: Any) -> Callable:
        compiled = compiler(module, inputs)
        boxed = compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)

        def run(args: list) -> Any:
            if _IN_TRACE.get():
                raise _Traced()
            return boxed(args)

        run._boxed_call = True  # AOTAutograd's mark of a callable taking one list of inputs
        return run

    return compile_forward


_MODULE_STATE = frozenset(vars(torch.nn.Module()))  # what nn.Module keeps in every instance


def _module_state(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict, dict]]:
    """Each module's parameters and buffers, as `_restore_module_state` puts them back."""
    return [(module, dict(module._parameters), dict(module._buffers)) for module in model.modules()]


def _restore_module_state(state: list[tuple[torch.nn.Module, dict, dict]]) -> None:
    """Put back the parameters and buffers `functional_call` swapped. It leaves the traced
    tensors in a module reached by two attribute paths (a block shared across stages), and the
    user's model would then hold tensors of the trace."""
    for module, parameters, buffers in state:
        module._parameters.update(parameters)
        module._buffers.update(buffers)


def _attributes(model: torch.nn.Module) -> dict[tuple[str, str], tuple[Any, Any]]:
    """Every module's own attributes, by (module path, name): the value, and a shallow copy of
    a list or dict (to see tensors added to it in place)."""
    return {(path, name): (value, copy.copy(value) if isinstance(value, (list, dict)) else None)
            for path, module in model.named_modules() for name, value in vars(module).items()
            if name not in _MODULE_STATE}


def _take_attached(model: torch.nn.Module, before: dict[tuple[str, str], tuple[Any, Any]],
                   ) -> dict[tuple[str, str], Any]:
    """The values holding tensors that the traced forward assigned to module attributes, by
    (module path, name); the attributes are put back as they were, since the traced tensors
    are unusable outside the trace and planning leaves the model as it was. A tensor added in
    place to a list or dict attribute cannot be returned that way: CaptureError, saying so."""
    attached, refused = {}, []
    for (path, name), (value, _) in _attributes(model).items():
        old, contents = before.get((path, name), (None, None))
        if not any(map(_traced, pytree.tree_leaves(value))):
            continue
        module = model.get_submodule(path)
        if value is not old:
            attached[path, name] = value
            if (path, name) in before:
                setattr(module, name, old)
            else:
                delattr(module, name)
        elif contents is not None and not _same_items(value, contents):
            if isinstance(value, list):
                value[:] = contents
            else:
                value.clear()
                value.update(contents)
            refused.append((f"{path}.{name}" if path else name, name, type(value).__name__))
    if refused:
        where, name, kind = refused[0]
        raise CaptureError(
            f"the forward of {type(model).__name__} adds tensors to {where} (a {kind}) in place: rockplan "
            f"returns the tensors a forward assigns to a module attribute (self.{name} = tensor), not those it "
            f"adds to a container. Return the tensor from forward, or assign it (self.{name} = tensor).")
    return attached


def _traced(x: Any) -> bool:
    """A tensor the traced forward made (a fake or functional one, unusable after the trace)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(x, (FakeTensor, FunctionalTensor))


def _same_items(a: list | dict, b: list | dict) -> bool:
    """The same objects in the same places (`==` would compare tensors element by element)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _planning_step(fn: Callable) -> Callable:
    """Mark errors of our own steps inside AOTAutograd so they are not taken for tracing errors."""

    def run(*a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except _Traced:  # not an error: the step stops there (`trace_joint`)
            raise
        except Exception as e:
            raise _PlanningFailed() from e

    return run


def _without_caches(out: Any) -> tuple[Any, bool]:
    """The model's outputs with every transformers key/value cache replaced by None.

    transformers' language models return a `Cache` (their config's `use_cache` is on by
    default, for generation). A training step gives None in its place, as transformers' own
    gradient checkpointing gives no filled cache: the cache serves generation, not the loss,
    and returning it would keep every layer's keys and values alive after the forward, which
    a plan under a budget cannot afford. The cache is an object pytree cannot flatten, so
    AOTAutograd could not return it anyway. Warned (Python shows a warning once per process), since `out.cache` then
    differs from eager's; passing `use_cache=False` says the caller expects no cache.
    """
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return out, False
    leaves, spec = pytree.tree_flatten(out)
    caches = [isinstance(leaf, cache_utils.Cache) for leaf in leaves]
    if not any(caches):
        return out, False
    return pytree.tree_unflatten([None if cache else leaf for leaf, cache in zip(leaves, caches)], spec), True


def _register_dataclasses(out: Any) -> None:
    """Let AOTAutograd flatten dataclass outputs: tensor fields are leaves, the rest constants."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        cls = type(out)
        if cls not in pytree.SUPPORTED_NODES:
            def flatten(obj: Any) -> tuple[list[Any], Any]:
                fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
                data = [k for k, v in fields.items() if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v))]
                constants = tuple((k, v) for k, v in fields.items() if k not in data)
                return [fields[k] for k in data], (tuple(data), constants)

            def unflatten(children: Any, context: Any) -> Any:
                data, constants = context
                return cls(**dict(zip(data, children)), **dict(constants))

            pytree.register_pytree_node(cls, flatten, unflatten)
        for f in dataclasses.fields(out):
            _register_dataclasses(getattr(out, f.name))
    elif isinstance(out, (list, tuple)):
        for item in out:
            _register_dataclasses(item)
    elif isinstance(out, dict):
        for item in out.values():
            _register_dataclasses(item)


def _has_data_mutation(t: torch.Tensor) -> bool:
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, FunctionalTensor) and torch._functionalize_has_data_mutation(t.elem)


def preserved_rng() -> contextlib.AbstractContextManager[object]:
    """Restore the default generators on exit: CPU's, and every CUDA device's once CUDA is
    initialised (reading them earlier would create a context on every device)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else [])


@dataclass
class ModuleTree:
    """`model.modules()`, `model.parameters()` and `model.buffers()`, in their order."""

    modules: list[torch.nn.Module]
    parameters: list[torch.nn.Parameter]
    buffers: list[torch.Tensor]


_WALKERS = ("modules", "named_modules", "parameters", "named_parameters", "buffers", "named_buffers",
            "_named_members")


def module_tree(model: torch.nn.Module) -> ModuleTree:
    """The modules, parameters and buffers of `model` as nn.Module's methods list them (each
    once, in their order), in one walk of the tree.

    Every planned step reads all three (its guards and its flat inputs) before any op runs;
    the methods walk the tree once each through nested generators, and on a GPU, where the
    step waits on the host, five such walks were a visible share of a small model's step. A
    model whose class lists them its own way is asked through its methods."""
    if any(getattr(type(model), name) is not getattr(torch.nn.Module, name) for name in _WALKERS):
        return ModuleTree(list(model.modules()), list(model.parameters()), list(model.buffers()))
    modules: list[torch.nn.Module] = []
    parameters: list[torch.nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    seen_modules: set[int] = set()
    seen_parameters: set[int] = set()
    seen_buffers: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        modules.append(module)
        # Written out, loop by loop: a generic loop over (found, seen, members) and a generator
        # for the children took half again as long, in every step.
        for tensor in module._parameters.values():
            if tensor is not None and id(tensor) not in seen_parameters:
                seen_parameters.add(id(tensor))
                parameters.append(tensor)
        for tensor in module._buffers.values():
            if tensor is not None and id(tensor) not in seen_buffers:
                seen_buffers.add(id(tensor))
                buffers.append(tensor)
        if module._modules:
            stack += reversed([child for child in module._modules.values() if child is not None])
    return ModuleTree(modules, parameters, buffers)


def flat_tensors(model: torch.nn.Module | ModuleTree, flat: FlatCall, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The step's positional tensors: parameters, buffers, then the call's input tensors."""
    tree = model if isinstance(model, ModuleTree) else module_tree(model)
    return [*tree.parameters, *tree.buffers, *flat.tensors(args, kwargs)]


def trace(
    model: torch.nn.Module,
    flat: FlatCall,
    compiled: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    native_kernels: bool = True,
) -> None:
    """Trigger tracing (and the partition function) on fake copies of the real tensors.

    Nothing real is computed and nothing in the model changes: the fake forward mutates fake
    buffers, and fake random ops draw no real random numbers. `native_kernels=False` traces
    through torch._decomp's Python kernels as torch.compile does: Inductor wants those ops
    decomposed and refuses to fall back on their ATen kernels.
    """
    tensors = flat_tensors(model, flat, args, kwargs)
    if not any(t.requires_grad for t in tensors):
        raise ValueError(
            f"nothing in {type(model).__name__} or its inputs requires grad: there is no backward "
            "to plan. Check that parameters are not all frozen (requires_grad=False)."
        )
    # Ops with no tensor inputs (arange) make real constants when the fake forward runs.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t) for t in tensors]
    with (
        _host_draws_watched() as host_draws,
        _collections_spared(),
        preserved_rng(),  # ops with no tensor inputs run for real in the fake forward, draws included
        traced_kernels(native_kernels),
        tensor_checks_as_assertions(),
        _side_effects_kept(),
        hooks_as_calls(model, flat.hooks),  # before the annotations' own hooks are added
        _module_path_annotations(model),
        fx_traceback.preserve_node_meta(),
        torch.enable_grad(),
        traced_as_compiling(),
        # The joint graph's Python code is generated when it is first run, not at each
        # recompile: tracing, the rewrites and planning only read its graph (as under torch.compile).
        _use_lazy_graph_module(True),
    ):
        in_trace = _IN_TRACE.set(True)
        try:
            compiled(*fakes)
        except _Traced:
            pass
        except _PlanningFailed as e:
            raise e.__cause__ from None
        except (CaptureError, ValueError, TypeError):
            raise
        except Exception as e:  # tracing failures: name the op and the user's line
            raise CaptureError(_explain_trace_failure(model, e) + capture_hint(flat.hooks)) from e
        finally:
            _IN_TRACE.reset(in_trace)
    if host_draws:
        raise CaptureError(
            f"{type(model).__name__} draws random numbers from {' and '.join(host_draws)} in its forward: traced "
            "once as one graph, every step would reuse this draw's values (a SpecAugment mask drawn with NumPy, "
            "say). Dynamo runs that code in Python at each step, between graphs. To plan the step as one graph, "
            "draw with torch (torch.rand, torch.bernoulli), whose draws the graph makes at each step."
        ) from HostRandomDraw()
    warn_of_traced_hooks(model, flat.hooks, _user_stacklevel() + 1)
    if flat.dropped_cache:
        warnings.warn(
            f"{type(model).__name__} returns a key/value cache (use_cache is on in its config): a planned "
            "training step returns None in its place, as gradient checkpointing does. The cache serves "
            "generation; pass use_cache=False in the model's arguments to say none is expected.",
            stacklevel=_user_stacklevel(),
        )


@contextlib.contextmanager
def _host_draws_watched() -> Iterator[list[str]]:
    """Yield a list that, on exit, names the generators outside torch the block drew from:
    NumPy's global one (`np.random`) and Python's (`random`); both are restored on exit, so
    tracing moves neither. A generator object the model keeps (`np.random.default_rng()`) is
    not seen."""
    numpy = sys.modules.get("numpy")  # a model that never imported NumPy draws nothing from it
    python_state = random.getstate()
    numpy_state = numpy.random.get_state(legacy=False) if numpy is not None else None
    drew: list[str] = []
    try:
        yield drew
    finally:
        if random.getstate() != python_state:
            drew.append("Python's random module")
        random.setstate(python_state)
        if numpy is not None:
            now = numpy.random.get_state(legacy=False)
            # MT19937's state: its key, the position in it, and a normal drawn in a pair kept for the next call.
            if (now["state"]["pos"], now["has_gauss"], now["gauss"]) != (
                    numpy_state["state"]["pos"], numpy_state["has_gauss"], numpy_state["gauss"]) \
                    or not numpy.array_equal(now["state"]["key"], numpy_state["state"]["key"]):
                drew.append("NumPy's global generator (np.random)")
            numpy.random.set_state(numpy_state)


# Allocations between collections of the youngest generation while tracing (Python's default: 700).
TRACE_GC_THRESHOLD = 20_000


@contextlib.contextmanager
def _collections_spared() -> Iterator[None]:
    """Fewer garbage collections while the step is traced and planned; restored on exit.

    Tracing allocates millions of short-lived objects (fake tensors, fx nodes, pytree specs),
    so the collector runs hundreds of times, and each older collection walks everything
    alive, the user's model and every imported library included: a sizeable share of the
    trace. Objects that exist before tracing are frozen (left out of collections) and the
    youngest generation collected less often; cycles made while tracing are still collected.
    A caller that froze objects itself keeps its own freeze (it is not undone here).
    """
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(threshold[0], TRACE_GC_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


def _user_stacklevel() -> int:
    """`warnings.warn`'s stacklevel that names the user's line: the innermost frame outside
    torch and rockplan's packages (3.12's `skip_file_prefixes` does this; we support 3.11)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def trace_joint(model: torch.nn.Module, args: Any, kwargs: dict | None = None) -> JointGraph:
    """Trace one training step of `model` on `args`/`kwargs` and return the joint graph as
    AOTAutograd makes it, not rewritten (`rkgraph.capture_joint` rewrites it)."""
    args = args if isinstance(args, tuple) else (args,)
    kwargs = kwargs or {}
    flat = flatten_call(model, args, kwargs)
    recorded: list[JointGraph] = []

    def record(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any):
        recorded.append(joint_graph(flat, joint, num_fwd_outputs))
        raise _Traced()  # the joint graph is all that is wanted: not partitioned, nor compiled

    trace(model, flat, training_function(model, flat, record), args, kwargs)
    return recorded[0]


def joint_graph(flat: FlatCall, joint: fx.GraphModule, num_fwd_outputs: int) -> JointGraph:
    """Wrap AOTAutograd's joint graph with what its primal inputs are; the graph is not changed."""
    _refuse_constants_with_history(joint, flat)
    kinds = ["param"] * len(flat.param_names) + ["buffer"] * len(flat.buffer_names)
    kinds += ["input"] * len(flat.input_names)
    names = flat.param_names + flat.buffer_names + flat.input_names
    primals = [p.name for p in joint.graph.find_nodes(op="placeholder") if not is_tangent(p)]
    mutated = frozenset(primals[i] for i in flat.mutated)
    return JointGraph(joint, num_fwd_outputs, kinds, names, mutated)


def _refuse_constants_with_history(joint: fx.GraphModule, flat: FlatCall) -> None:
    """A tensor the forward read that is neither a parameter, a buffer nor an input is a
    constant of the step; one made by autograd outside the step (a value kept from an earlier
    call, as a hook that stores activations keeps it) would be a stale value whose gradient
    the step drops: CaptureError, naming what to do."""
    for node in joint.graph.find_nodes(op="get_attr"):
        value = getattr(joint, node.target, None)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            raise CaptureError(
                f"the forward reads a tensor computed outside the step, with autograd history "
                f"({type(value.grad_fn).__name__}, shape {tuple(value.shape)}): a value kept from an earlier call. "
                "The planned step would read it as a constant and drop its gradient. Compute it in the forward, "
                "or pass it as an input." + capture_hint(flat.hooks))


# Ops that act without an output, which fx does not count as side effects: dead-code
# elimination drops them from the traced graph (`torch._assert_async(cond)` without a message).
_UNMARKED_SIDE_EFFECTS = (torch.ops.aten._assert_async.default,)


def has_side_effect(node: fx.Node) -> bool:
    """An op that must run although nothing reads its result: an assertion, or any op fx keeps
    through dead-code elimination (a mutation, a draw from a generator)."""
    return node.op == "call_function" and (node.target in _UNMARKED_SIDE_EFFECTS or node.is_impure())


@contextlib.contextmanager
def _side_effects_kept():
    """Count `_UNMARKED_SIDE_EFFECTS` as side effects while tracing, so that AOTAutograd keeps
    them as eager runs them; fx's table is restored on exit."""
    added = [op for op in _UNMARKED_SIDE_EFFECTS if op not in fx.node._side_effectful_functions]
    fx.node._side_effectful_functions.update(added)
    try:
        yield
    finally:
        fx.node._side_effectful_functions.difference_update(added)


# Ops whose Python decomposition torch._decomp registers for the Autograd and
# CompositeImplicitAutograd keys (py_impl), which AOTAutograd's tracing takes in place of the
# ATen kernel: every interpolation `F.interpolate` makes. Eager runs the kernel: one output in
# the forward, its own backward kernel in the backward. The decompositions gather from index
# tensors, and their backward scatters with accumulation (`_unsafe_index_put`), several times
# slower than the upsampling kernels' backward; bilinear keeps four full-size corner images on
# both sides (UNet); linear, trilinear and bicubic gradients round differently from eager's.
# Tracing without them keeps the graph's ops, memory, times and bits those of eager; an
# explicit decomposition table (inductor's) still applies below autograd. Each `.vec` overload
# goes through its C++ composite to the `.default` kernel.
_KEEP_NATIVE = tuple(
    overload
    for name in (
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
        "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
        "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    )
    for overload in (getattr(torch.ops.aten, name).default, getattr(torch.ops.aten, name).vec)
)
_DECOMPOSING_KEYS = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.CompositeImplicitAutograd)


_Kernels = Mapping[tuple[torch._ops.OpOverload, torch._C.DispatchKey], Callable | None]


@contextlib.contextmanager
def _python_kernels_set(kernels: _Kernels) -> Iterator[None]:
    """While the block runs, the Python kernel of each (op, dispatch key) in `kernels` is the one
    given there, or none where that is None (the op's C++ kernel then runs); restored on exit,
    also on an error. The same save/override/restore of `py_kernels` as torch.export's
    `_override_composite_implicit_decomp`."""

    def put(table: _Kernels) -> None:
        for (op, key), kernel in table.items():
            if kernel is None:
                op.py_kernels.pop(key, None)
            else:
                op.py_kernels[key] = kernel
            op._dispatch_cache.clear()  # the Python dispatcher caches the kernel resolved per key

    saved = {(op, key): op.py_kernels.get(key) for op, key in kernels}
    put(kernels)
    try:
        yield
    finally:
        put(saved)


def _python_kernels_replaced(ops: Iterable[torch._ops.OpOverload], replacement: Callable[[Callable], Callable | None]
                             ) -> contextlib.AbstractContextManager[None]:
    """While the block runs, each Python kernel torch._decomp registers for `ops` at the Autograd
    and CompositeImplicitAutograd keys is `replacement(kernel)`, or is removed where that is None
    (the op's C++ kernel then runs); restored on exit, also on an error."""
    return _python_kernels_set({(op, key): replacement(op.py_kernels[key])
                                for op in ops for key in _DECOMPOSING_KEYS if key in op.py_kernels})


def _native_kernels() -> contextlib.AbstractContextManager[None]:
    """Hide the Python decompositions of `_KEEP_NATIVE` while tracing. The `.vec` overload then
    goes through its C++ composite, which calls the `.default` kernel and records its native
    backward."""
    return _python_kernels_replaced(_KEEP_NATIVE, lambda _kernel: None)


# The LSTM decompositions: on a CPU with oneDNN they choose `mkldnn_rnn_layer` whenever the
# LSTM's input does not require grad, even where its parameters do. That op's workspace is an
# empty tensor in the trace and None when the kernel runs, which AOTAutograd's compiled step
# cannot save for the backward (PyTorch's fix, #185902, gates that path on every tensor).
_LSTMS = (torch.ops.aten.lstm.input, torch.ops.aten.lstm.data)


def differentiable_lstm() -> contextlib.AbstractContextManager[None]:
    """While tracing, an LSTM is decomposed into its differentiable per-time-step ops, never
    into `mkldnn_rnn_layer` (`_LSTMS`): oneDNN is off inside the decomposition, where it only
    chooses the path (the ops it records run later with the flag as the user set it)."""

    def without_onednn(decomposition: Callable) -> Callable:
        def traced(*args: Any, **kwargs: Any) -> Any:
            with torch.backends.mkldnn.flags(enabled=False):
                return decomposition(*args, **kwargs)
        return traced

    return _python_kernels_replaced(_LSTMS, without_onednn)


def _mask_write(target: Any, index: Any, value: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For `target[index] = value` (`index_put_` with one index) where `index` is a boolean mask
    over `target`'s leading dimensions and `value` is the same for every position it selects:
    the mask shaped to broadcast over `target` and the value shaped to broadcast over the rest,
    which `torch.where` writes with no value-dependent shape. None for any other write (an index
    per dimension, `x[:, mask]`'s included), left as it is.

    `index_put_` broadcasts the value to (positions selected, *rest) after dropping its leading
    dimensions of size one; a value that keeps a leading dimension then has one entry per
    selected position, a shape only the mask's values give."""
    if not (isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor)
            and isinstance(index, torch.Tensor) and index.dtype == torch.bool):
        return None
    leading = index.ndim
    if not (0 < leading <= target.ndim and index.shape == target.shape[:leading]
            and index.device == target.device and value.dtype == target.dtype):
        return None  # eager indexes, or refuses (dtypes differ), as the trace then does
    rest = tuple(target.shape[leading:])
    shape = list(value.shape)
    while len(shape) > len(rest) and shape[0] == 1:
        shape.pop(0)
    if len(shape) > len(rest):
        return None
    try:
        if torch.broadcast_shapes(tuple(shape), rest) != rest:
            return None
    except RuntimeError:
        return None
    return index.reshape(*index.shape, *(1,) * len(rest)), value.reshape(shape)


def _index_put_as_where(op: torch._ops.OpOverload, in_place: bool) -> Callable:
    """`op` (`index_put_` or `index_put`) at the Autograd key: a write `_mask_write` takes is
    `torch.where`'s (copied into `self` in place), any other the op's own kernel."""

    def kernel(self: torch.Tensor, indices: list, values: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
        write = None if accumulate or len(indices) != 1 else _mask_write(self, indices[0], values)
        if write is None:
            with torch._C._DisablePythonDispatcher():  # past this kernel, to the op's own
                return op(self, indices, values, accumulate)
        mask, value = write
        written = torch.where(mask, value, self)
        return self.copy_(written) if in_place else written

    return kernel


_INDEX_PUTS = {torch.ops.aten.index_put_.default: True, torch.ops.aten.index_put.default: False}


def mask_writes_as_where() -> contextlib.AbstractContextManager[None]:
    """While tracing, `x[mask] = v` with one boolean mask over `x`'s leading dimensions and a
    `v` the same at every position it selects (`_mask_write`; SpecAugment's learned mask
    embedding in wav2vec 2.0 and HuBERT) is written as `x.copy_(torch.where(mask, v, x))`.

    The same values and gradients, up to the order the gradient of `v` is summed in. Traced as
    written, the write is `index_put_` on the mask's positions, and its backward gathers the
    gradient of `v` at them (`nonzero`), a tensor whose shape only the mask's values give: no
    plan can size it before the step runs. The write stays in place, as eager's: a view of `x`
    sees it, and autograd refuses it where eager does (a leaf, or a value saved for the backward).

    A Python kernel of `index_put_` at the Autograd key, which AOTAutograd's trace takes in place
    of the ATen kernel (as torch._decomp's for dropout): only the writes pass through it, and
    the rest of the model's calls run as they do without it."""
    autograd = torch._C.DispatchKey.Autograd
    return _python_kernels_set({(op, autograd): _index_put_as_where(op, in_place)
                                for op, in_place in _INDEX_PUTS.items() if autograd not in op.py_kernels})


@contextlib.contextmanager
def traced_kernels(native_kernels: bool = True) -> Iterator[None]:
    """The kernels a training step's trace takes in place of what it would record as written, for
    `trace` and for the graphs Dynamo captures alike: the ATen kernels of `_KEEP_NATIVE` (unless
    `native_kernels` is False, as Inductor wants), the differentiable LSTM, and one value written
    at a boolean mask's positions as `torch.where`."""
    with _native_kernels() if native_kernels else contextlib.nullcontext(), differentiable_lstm(), \
            mask_writes_as_where():
        yield


@contextlib.contextmanager
def tensor_checks_as_assertions() -> Iterator[None]:
    """While tracing, `torch._check_tensor_all(cond)` (and `_check_tensor_all_with`) is an
    assertion in the graph, `torch._assert_async`, checked at each step where it runs.

    As written it reads whether `cond` holds in Python (`.item()`), which a trace on fake tensors
    cannot: the model would not be one graph. Libraries call it to check values in a way
    compilers can keep (transformers' `torch_compilable_check` calls it while compiling: a
    multimodal model checking that its image tokens match its image features). An assertion
    that fails raises RuntimeError, not the check's own type or message (`message` may format
    the tensor's values, which the trace does not have); on a GPU it is a device-side assertion,
    which ends the process's CUDA context, as torch.export's runtime assertions do. A cond that
    is not a boolean tensor is refused as the check itself refuses it."""
    checks = torch._check_tensor_all_with

    def asserted(error_type: type[Exception], cond: Any, message: Any = None) -> None:
        if not (isinstance(cond, torch.Tensor) and cond.dtype == torch.bool):
            checks(error_type, cond, message)  # its TypeError
            return
        torch._assert_async(cond.all(), f"a check of the model failed in the planned step ({error_type.__name__}: "
                                        "torch._check_tensor_all, traced as an assertion)")

    torch._check_tensor_all_with = asserted
    try:
        yield
    finally:
        torch._check_tensor_all_with = checks


@contextlib.contextmanager
def _module_path_annotations(model: torch.nn.Module):
    """Tag every traced node with the path of the submodule that produced it.

    AOTAutograd copies a forward node's metadata to the backward nodes it produces, so
    backward nodes get the path too. The hooks are removed when tracing ends.
    """
    stack: list[str] = []

    def enter(name: str, _module: torch.nn.Module, _args: Any) -> None:
        stack.append(name)
        fx_traceback.current_meta["custom"] = {"module": name}

    def leave(_name: str, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()
        fx_traceback.current_meta["custom"] = {"module": stack[-1] if stack else ""}

    handles = []
    for name, sub in model.named_modules():
        handles.append(sub.register_forward_pre_hook(functools.partial(enter, name)))
        handles.append(sub.register_forward_hook(functools.partial(leave, name), always_call=True))
    saved = fx_traceback.current_meta.get("custom")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if saved is None:
            fx_traceback.current_meta.pop("custom", None)
        else:
            fx_traceback.current_meta["custom"] = saved


@contextlib.contextmanager
def traced_as_compiling():
    """Make `torch.compiler.is_compiling()` true while the step is traced, as torch.compile
    makes it while AOTAutograd traces a graph Dynamo captured.

    Library code asks `torch.compiler.is_compiling()` (the public question; transformers'
    `is_tracing` and `is_torchdynamo_compiling` ask it) to skip what cannot be traced: reads
    of tensor values in Python that pick a faster path in eager, such as transformers dropping
    an all-ones padding mask or detecting packed sequences. Our trace is AOTAutograd's, the
    stage torch.compile runs with that flag set, so the library's traceable path is the right
    one. torch sets the flag only through private context managers (Dynamo's compile session,
    torch.export's); we use Dynamo's, which sets `is_compiling` alone (not `is_exporting`:
    this is not an export, and the graph stays one of training).
    """
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    saved = torch.compiler._is_compiling_flag  # torch before 2.10 keeps the bare flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = saved


_ROOT = Path(__file__).parent.parent
_INTERNAL_DIRS = tuple(str(p) + "/" for p in
                       (Path(torch.__file__).parent, _ROOT / "rkgraph", _ROOT / "rockplan", _ROOT / "solvers"))


# torch.utils.checkpoint's reentrant variant: (file, function) of its backward.
_REENTRANT_CHECKPOINT = ("torch/utils/checkpoint.py", "backward")


def _explain_trace_failure(model: torch.nn.Module, error: Exception) -> str:
    """Name the op and the innermost line of user code where tracing failed."""
    frames = traceback.extract_tb(error.__traceback__)
    if any(f.filename.endswith(_REENTRANT_CHECKPOINT[0]) and f.name == _REENTRANT_CHECKPOINT[1] for f in frames):
        # Its backward runs a backward of its own, which the trace refuses; torch's message says
        # "set use_reentrant=False" and nothing of where, and the hint below would mislead.
        return (f"cannot capture {type(model).__name__}: it runs torch.utils.checkpoint with use_reentrant=True, "
                "whose backward runs a backward of its own and cannot be traced. rockplan chooses what to "
                "recompute itself: turn the model's checkpointing off (Hugging Face: "
                "model.gradient_checkpointing_disable(); timm: model.set_grad_checkpointing(False)), or pass "
                "use_reentrant=False, which is traced as if the checkpoint were not there.")
    user = [f for f in frames if "/transformers/" in f.filename
            or not (f.filename.startswith(_INTERNAL_DIRS) or "/site-packages/" in f.filename)]
    where = f"{user[-1].filename}:{user[-1].lineno}: {user[-1].line}" if user else "unknown location"
    what = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    hint = (
        "rockplan captures the whole training step as one graph, so the forward must not "
        "branch on tensor values or call ops without a fake-tensor implementation. Make the "
        "branch depend on shapes or Python values, or move the code outside the planned module."
    )
    return f"cannot capture {type(model).__name__}: {type(error).__name__}: {what}\n  at {where}\n{hint}"
