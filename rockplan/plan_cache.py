"""Plans kept on disk between runs: a training script started again plans in a fraction of the time.

Planning a step is a trace, a profile (a measured one replays the step several times) and a
search that can take seconds to minutes; a script run again with the same model, input shapes,
budget and options would find the same plan. So each plan is written to a directory (the plan
file `Rockmate.export` writes, readable by `rockplan explain`, and beside it the node times it
was planned on), under a key of everything planning depends on, and read back where the key
matches: the step is still traced (its code is generated from the trace), but not replayed nor
solved.

Nothing is taken on trust. The key holds the captured joint graph (every op, its arguments and
the shapes, strides and dtypes it makes), the budget, the planning options, the device, the
torch version and a hash of rockplan's own source, so a changed model, set-up or planner never
reads an older plan. A plan read back is loaded as a plan file is (`PlanOptions.plan_file`):
checked node by node against the graph built now and replayed by the simulator against the
budget, with the kernels' scratch measured anew. Where that fails, the step is planned as if
nothing were cached, and the entry written again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from rkgraph import RescaledTimes, joint_device
from rkgraph.capture import JointGraph
from rockplan.plan_file import PlanMismatch, plan_document, read_plan, rockplan_version
from rockplan.planner import Plan, PlanOptions, plan
from solvers import InfeasibleBudget

log = logging.getLogger(__name__)

ENVIRONMENT = "ROCKPLAN_PLAN_CACHE"  # a directory, or "off"
OFF = frozenset({"", "0", "off", "false", "no"})
ENTRIES = 64  # plans kept; the least recently used are removed beyond it
_SOURCES = ("rkgraph", "rockplan", "solvers")  # the packages whose code decides a plan


def cache_directory(setting: str | Path | bool | None) -> Path | None:
    """The directory `Rockmate(plan_cache=setting)` keeps plans in, None when off: a path as
    given; False off; None (the default) as ROCKPLAN_PLAN_CACHE says (a directory, or "off"),
    else `$XDG_CACHE_HOME/rockplan/plans` (`~/.cache/rockplan/plans`)."""
    if setting is False:
        return None
    if setting is None or setting is True:
        value = os.environ.get(ENVIRONMENT)
        if value is not None:
            return None if value.strip().lower() in OFF else Path(value).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "rockplan" / "plans"
    return Path(setting).expanduser()


class PlanCache:
    """Plans by key in `directory` (see the module's docstring): `plan` is `rockplan.planner.plan`
    that reads a matching plan instead of profiling and solving, and writes what it plans."""

    def __init__(self, directory: str | Path, entries: int = ENTRIES) -> None:
        self.directory = Path(directory)
        self.entries = entries

    def plan(self, joint: JointGraph, budget: int | float | str, options: PlanOptions,
             real_inputs: list[torch.Tensor] | None = None, held: Plan | None = None) -> Plan:
        if options.plan_file is not None:  # the user's own plan file: nothing to look up
            return plan(joint, budget, options, real_inputs, held)
        key = cache_key(joint, budget, options)
        cached = self._read(key)
        if cached is not None:
            path, times = cached
            # Estimated times are the graph's own (computed again in no time); measured ones
            # are the cached plan's, so that nothing is replayed.
            profile = options.profile if options.profile == "estimate" else times
            try:
                found = plan(joint, budget, dataclasses.replace(options, profile=profile, plan_file=path), real_inputs)
                # What was weighed when it was planned, not what loading its file tried.
                found = dataclasses.replace(found, considered=read_plan(path).considered)
            except (PlanMismatch, InfeasibleBudget, ValueError, OSError) as e:
                log.info("the cached plan %s is not used, planning anew: %s", path, e)
            else:
                log.info("plan of %s read from the cache: %s", options.name or "the model", path)
                return found
        found = plan(joint, budget, options, real_inputs, held)
        self._write(key, found)
        return found

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.plan.json", self.directory / f"{key}.times.json"

    def _read(self, key: str) -> tuple[Path, dict[str, float]] | None:
        path, times_path = self._paths(key)
        try:
            times = json.loads(times_path.read_text())
            os.utime(path)  # recently used: removed last
        except (OSError, ValueError):  # absent, half written by another process, or damaged
            return None
        if not isinstance(times, dict):
            return None
        return path, times

    def _write(self, key: str, found: Plan) -> None:
        """Write `found`'s plan file, then its times (an entry is read only once both are there);
        a directory that cannot be written is logged and skipped: the plan stands."""
        reference = (found.reference.predicted_peak, found.reference.predicted_time)
        document = plan_document(found.graph, found.schedule, reference, found.considered)
        path, times_path = self._paths(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Solver diagnostics may hold numpy numbers or enums: written as text rather than refused.
            _write_atomically(path, json.dumps(document, default=str))
            _write_atomically(times_path, json.dumps(found.times))
            self._evict()
        except OSError as e:
            log.warning("plan not cached in %s: %s", self.directory, e)

    def _evict(self) -> None:
        plans = sorted(self.directory.glob("*.plan.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in plans[self.entries:]:
            for path in self._paths(old.name.removesuffix(".plan.json")):
                path.unlink(missing_ok=True)


def _write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` at once: another process planning the same step reads the old
    file or the new one, never half of one."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def cache_key(joint: JointGraph, budget: int | float | str, options: PlanOptions) -> str:
    """A hash of everything a plan of `joint` within `budget` depends on (the module's docstring)."""
    digest = hashlib.sha256()
    device = joint_device(joint.module)
    for part in (rockplan_version(), _source_hash(), torch.__version__, _device_description(device), repr(budget),
                 options.solver, _described(dict(options.solver_options)), _profile_described(options.profile),
                 options.replay_rng, options.lean_variant, joint.num_fwd_outputs):
        digest.update(repr(part).encode())
        digest.update(b"\0")
    for node in joint.module.graph.nodes:
        digest.update(_node_described(node).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:40]


def _node_described(node: fx.Node) -> str:
    arguments = fx.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
    return f"{node.op} {node.name} {node.target} {_described(arguments)} {_described(node.meta.get('val'))}"


def _described(value: Any) -> str:
    """`value` in words that hold its tensors' metadata, not their data (constants in the
    graph's arguments, fake values in its nodes' meta)."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type, x.requires_grad)
        return x
    return repr(pytree.tree_map(leaf, value))


def _profile_described(profile: Any) -> str:
    if isinstance(profile, RescaledTimes):  # a replan's: the held plan's times, rescaled
        return (f"rescaled, otherwise {profile.otherwise} " + _hashed(sorted(profile.times.items()))
                + _hashed(sorted(profile.estimates.items())))
    if isinstance(profile, Mapping):
        return "given " + _hashed(sorted(profile.items()))
    return str(profile)


def _hashed(items: Any) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _device_description(device: torch.device) -> str:
    """The hardware measured times hold for: the GPU's name, or the CPU and the threads used."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
    return (f"{device.type} {platform.machine()} {platform.processor()} {os.cpu_count()} cores "
            f"{torch.get_num_threads()} threads {torch.backends.cpu.get_cpu_capability()}")


@functools.cache
def _source_hash() -> str:
    """A hash of rockplan's own Python source (its three packages): a plan made by other code
    is never read back, whatever the installed version says."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in _SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
