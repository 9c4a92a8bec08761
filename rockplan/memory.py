"""Measure the memory one training step allocates.

"Step memory" (as in the design notes) is what a step allocates beyond what was alive before it:
parameters, optimizer state and inputs that exist at entry are not counted, only tensors created
inside the step (activations, gradients, temporaries).

API
---
``MemoryTracker(device=None, method="auto")`` is a context manager::

    with MemoryTracker() as tracker:
        loss = loss_fn(model(x), y)
        loss.backward()
    tracker.peak, tracker.current     # peak of the step, bytes it created still alive at exit

``measure_step(fn, *args, device=None, method="auto", **kwargs) -> StepMemory`` runs
``fn(*args, **kwargs)`` under a tracker and returns ``StepMemory(peak, end, result)``; ``end``
includes whatever the returned ``result`` keeps alive.

Three ways of counting, chosen by ``method``:

- ``"allocator"`` (default on CUDA): the caching allocator's own statistics
  (``torch.cuda.max_memory_allocated`` / ``memory_allocated``) relative to the allocation at entry.
  Resets the device's peak statistics on entry, so two allocator trackers must not be nested.
  Includes what kernels allocate internally (cuBLAS workspaces, reduction scratch) and the
  allocator's rounding of every block to a multiple of 512 bytes.
- ``"profiler"`` (default on CPU): the CPU allocator's own allocation and free events, recorded
  by ``torch.profiler`` with ``profile_memory=True``. Like the CUDA allocator it sees every
  allocation, kernels' scratch buffers (on CPU, much of a convolutional network's step peak) and
  Inductor's generated code included, and it does not change how the code runs (under a
  dispatch mode ``torch.compile`` falls back to eager). Figures exist only once the block has
  exited; a free of memory allocated before the block is not counted. Exact requested bytes.
  It follows the threads PyTorch runs the step on (autograd's included), not threads a library
  owns: a block freed there (gloo's worker releasing a collective's input) counts as alive to
  the end of the block, an overstatement; count storages for such steps.
- ``"storages"`` (default elsewhere; live figures): a ``TorchDispatchMode`` that sees every ATen
  op, registers each storage an op returns once (views share their base's storage so they add
  nothing) and subtracts it when a weak reference on the storage reports its death. It sees
  ops inside autograd's backward (the engine propagates dispatch modes to the threads it runs
  on), inside ``torch.autograd.Function`` and fx GraphModules. It does not see buffers a kernel
  allocates and frees internally, nor code that allocates without going through the
  dispatcher (Inductor's generated code), so it is a lower bound there. The counted bytes are
  exact ``nbytes`` with no allocator rounding. Under its dispatch mode ``torch.compile`` runs
  the model eagerly: a compiled model, or a ``Rockmate`` whose model has graph breaks (run by
  Dynamo), is measured as eager runs it, not as planned; measure those with the allocator or
  the profiler.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rkgraph.profile import AllocatorEvents

__all__ = ["MemoryTracker", "Method", "StepMemory", "cuda_blocks_fit_requests", "measure_step", "steady_cpu_heap"]

Method = Literal["auto", "allocator", "storages", "profiler"]
R = TypeVar("R")

# ``torch.tensor(...)`` builds its tensor outside the dispatcher, then passes it through this op:
# its storage is new even though it arrives as an argument.
_LIFT_FRESH = torch.ops.aten.lift_fresh.default


@dataclass(frozen=True)
class StepMemory(Generic[R]):
    """What one call of :func:`measure_step` allocated, in bytes, and what it returned."""

    peak: int  # highest allocation of the step beyond what was alive at entry
    end: int  # bytes created by the step and still alive when it returned (result included)
    result: R


def _storage_of(value: object) -> torch.UntypedStorage | None:
    """The storage behind a tensor (or storage) argument, None where there is no real memory."""
    if isinstance(value, torch.UntypedStorage):
        storage = value
    elif isinstance(value, torch.Tensor) and value.layout is torch.strided:
        storage = value.untyped_storage()
    else:  # sparse and nested tensors, scalars, dtypes and other non-tensor arguments
        return None
    # Meta storages (meta tensors, FakeTensors) have a size but no memory behind them.
    return None if storage.device.type == "meta" else storage


def _storages(values: Iterable[object]) -> dict[int, torch.UntypedStorage]:
    """Distinct storages among values, keyed by their StorageImpl address (unique while alive)."""
    found: dict[int, torch.UntypedStorage] = {}
    for value in values:
        storage = _storage_of(value)
        if storage is not None:
            found[storage._cdata] = storage
    return found


class _LiveStorages(TorchDispatchMode):
    """Counts bytes of storages created (or grown) by ops while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        # Reentrant: a weak-reference callback may fire inside our own bookkeeping when that
        # bookkeeping drops the last reference to a tensor (or triggers a GC pass).
        self._lock = threading.RLock()
        # StorageImpl address -> (weak reference whose callback uncounts it, bytes counted).
        self._counted: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        inputs = _storages(tree_leaves((args, kwargs)))
        # In-place and out= ops may resize an argument's storage (``resize_``, or a kernel
        # resizing its ``out`` tensor internally, below the dispatcher); compare sizes around
        # the call. Only mutable schemas can do that, which keeps the common path cheap.
        sizes_before = {key: s.nbytes() for key, s in inputs.items()} if func._schema.is_mutable else {}
        out = func(*args, **kwargs)
        fresh = func is _LIFT_FRESH
        for key, storage in _storages(tree_leaves(out)).items():
            # An output sharing an input's storage (a view, an in-place result) is not new.
            if fresh or key not in inputs:
                self._count_new(key, storage)
        for key, before in sizes_before.items():
            grown = inputs[key].nbytes() - before
            if grown > 0:
                self._count_growth(key, inputs[key], grown)
        return out

    def _count_new(self, key: int, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        # Empty storages cost nothing; if one is resized later, _count_growth registers it.
        if nbytes == 0:
            return
        with self._lock:
            if key not in self._counted:
                self._register(key, storage, nbytes)

    def _count_growth(self, key: int, storage: torch.UntypedStorage, grown: int) -> None:
        with self._lock:
            entry = self._counted.get(key)
            if entry is None:
                # A storage alive before the step that grew inside it: only the growth is new.
                self._register(key, storage, grown)
            else:
                self._counted[key] = (entry[0], entry[1] + grown)
                self._add(grown)

    def _register(self, key: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        # The storage's Python object lives exactly as long as its StorageImpl (PyTorch keeps
        # it alive while C++ holds the storage), so the callback fires when the memory is freed,
        # even if only autograd's saved tensors held it.
        ref = weakref.ref(storage, functools.partial(self._forget, key))
        self._counted[key] = (ref, nbytes)
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _forget(self, key: int, _ref: weakref.ref[torch.UntypedStorage]) -> None:
        # Storages may die on any thread (autograd worker threads), hence the lock.
        with self._lock:
            entry = self._counted.pop(key, None)
            if entry is not None:
                self.current -= entry[1]

    def stop(self) -> None:
        """Drop the weak references so later deaths no longer change the figures."""
        with self._lock:
            self._counted.clear()


class _AllocatorStatistics:
    """CUDA caching-allocator figures relative to the allocation at start."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._base = 0

    def start(self) -> None:
        self._base = torch.cuda.memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self._device) - self._base

    @property
    def current(self) -> int:
        return torch.cuda.memory_allocated(self._device) - self._base


class _ProfiledAllocations:
    """The CPU allocator's events over the block, replayed once it has exited."""

    def __init__(self) -> None:
        self._events = AllocatorEvents("cpu")
        self.peak = self.current = 0

    def start(self) -> None:
        self._events.__enter__()

    def stop(self, read: bool = True) -> None:
        """`read`: replay the events (not while the block's own exception propagates, which
        an unrecorded session's error would hide)."""
        self._events.__exit__(None, None, None)
        if read:
            self.peak, self.current = self._events.replay()


class MemoryTracker:
    """Context manager measuring the memory allocated inside its block (see module docstring).

    ``peak`` and ``current`` are frozen at exit; with the allocator and storage methods they
    can also be read while the block runs. A tracker can be entered again, which starts a new
    measurement.
    """

    def __init__(self, device: torch.device | str | None = None, method: Method = "auto") -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if method == "auto":
            method = {"cuda": "allocator", "cpu": "profiler"}.get(self.device.type, "storages")
        if method == "allocator" and self.device.type != "cuda":
            raise ValueError(f"method='allocator' needs a CUDA device, got {self.device}")
        if method == "profiler" and self.device.type != "cpu":
            raise ValueError(f"method='profiler' measures the CPU allocator, got {self.device}")
        self.method: Literal["allocator", "storages", "profiler"] = method
        self._counter: _LiveStorages | _AllocatorStatistics | _ProfiledAllocations | None = None
        self._final: tuple[int, int] | None = None  # (peak, current) at exit

    def __enter__(self) -> Self:
        self._final = None
        if self.method == "allocator":
            counter = _AllocatorStatistics(self.device)
            counter.start()
        elif self.method == "profiler":
            counter = _ProfiledAllocations()
            counter.start()
        else:
            counter = _LiveStorages()
            counter.__enter__()
        self._counter = counter
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        counter = self._counter
        assert counter is not None, "__exit__ without __enter__"
        if isinstance(counter, _LiveStorages):
            counter.__exit__(exc_type, exc, traceback)
            counter.stop()  # leaves peak and current as they are
        elif isinstance(counter, _ProfiledAllocations):
            counter.stop(read=exc_type is None)
        self._final = (counter.peak, counter.current)
        self._counter = None

    @property
    def peak(self) -> int:
        """Highest number of bytes allocated inside the block beyond what was alive at entry."""
        return self._figures()[0]

    @property
    def current(self) -> int:
        """Bytes allocated inside the block and alive now (at exit, once the block is over)."""
        return self._figures()[1]

    def _figures(self) -> tuple[int, int]:
        if self._final is not None:
            return self._final
        if self._counter is None:
            raise RuntimeError("MemoryTracker has not been entered")
        if isinstance(self._counter, _ProfiledAllocations):
            raise RuntimeError("method='profiler' has figures only once the tracker has exited")
        return self._counter.peak, self._counter.current


def _infer_device(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The first non-CPU device among the tensors of the call and the module's parameters."""
    tensors: list[torch.Tensor] = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        tensors.extend(fn.parameters())
        tensors.extend(fn.buffers())
    for tensor in tensors:
        if tensor.device.type != "cpu":
            return tensor.device
    return torch.device("cpu")


def cuda_blocks_fit_requests() -> bool:
    """Whether this process's CUDA caching allocator gives each request a block of its own size.

    Without expandable segments (PyTorch's default) the allocator may serve a request from a
    larger cached block and, when what would be left is under 1 MiB, hand over the whole block
    without splitting it: its statistics then count more than the tensors' bytes, by an amount
    that depends on what earlier steps left in the cache, which no plan can predict. With
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (read when CUDA is first used) blocks
    are cut to the request, and the measured peak is the plan's, in 512-byte blocks.
    """
    settings = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in settings.replace(" ", "").lower()


def measure_step(
    fn: Callable[..., R],
    *args: Any,
    device: torch.device | str | None = None,
    method: Method = "auto",
    **kwargs: Any,
) -> StepMemory[R]:
    """Run ``fn(*args, **kwargs)`` and report the memory it allocated.

    ``device`` defaults to the first non-CPU device among the arguments' tensors (and ``fn``'s
    parameters when it is a module), else CPU; ``method`` is the tracker's (by default the CUDA
    allocator's statistics, the CPU allocator's events, elsewhere a count of storages).
    """
    if device is None:
        device = _infer_device(fn, args, kwargs)
    with MemoryTracker(device, method) as tracker:
        result = fn(*args, **kwargs)
    return StepMemory(peak=tracker.peak, end=tracker.current, result=result)


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def steady_cpu_heap() -> bool:
    """Fix glibc's malloc thresholds for this process, so CPU steps reuse the heap rather than
    page in memory that an earlier step gave back; returns whether it could (glibc only).

    For timing CPU steps side by side. PyTorch's CPU allocator is glibc's malloc (no caching
    allocator on CPU). By default glibc returns the top of its heap to the system once more than
    twice its adaptive mmap threshold lies free there, and maps large blocks afresh, so a step
    that follows one with a larger peak pays page faults for what it allocates: a step's time
    then depends on what ran before it, as much as the differences being timed (two copies of
    one step, or the same schedule at two places of a round robin, disagree). With the
    thresholds fixed, copies of a step run alike wherever they come. The cost: the process
    keeps its heap's high-water mark. What the allocator's events count, hence measured peaks,
    does not change.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    # Blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, never trimmed.
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
