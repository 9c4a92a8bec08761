"""Plans kept on disk between runs: a training script started again plans in a fraction of the time.

Planning a step is a trace, a profile (a measured one replays the step several times) and a
search that can take seconds to minutes; a script run again with the same model, input shapes,
budget and options would find the same plan. So each plan is written to a directory (the plan
file `Rockmate.export` writes, readable by `rockplan explain`), under a key of everything
planning depends on, and read back where the key matches: the step is still traced (its code
is generated from the trace), but not replayed nor solved. The node times it was planned on are
kept under a key without the budget and the planning options, so another budget or solver for
the same step (a sweep) is solved but not replayed.

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
import math
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
from rockplan.plan_file import PlanMismatch, plan_json, rockplan_version
from rockplan.planner import Plan, PlanOptions, plan
from solvers import InfeasibleBudget

log = logging.getLogger(__name__)

ENVIRONMENT = "ROCKPLAN_PLAN_CACHE"  # a directory, or "off"
OFF = frozenset({"", "0", "off", "false", "no"})
ENTRIES = 64  # plans kept, and profiles; the least recently used are removed beyond it
_SOURCES = ("rkgraph", "rockplan", "solvers")  # the packages whose code decides a plan


def cache_directory(setting: str | Path | bool | None) -> Path | None:
    """The directory `Rockmate(plan_cache=setting)` keeps plans in, None when off: a path as
    given; False off; None (the default) as ROCKPLAN_PLAN_CACHE says (a directory, or "off"),
    else `$XDG_CACHE_HOME/rockplan` (`~/.cache/rockplan`), or none where there is no home
    directory to expand `~` to (a container without one)."""
    if setting is False:
        return None
    if setting is None or setting is True:
        value = os.environ.get(ENVIRONMENT)
        if value is not None:
            return None if value.strip().lower() in OFF else Path(value).expanduser()
        base = os.environ.get("XDG_CACHE_HOME")
        if not base:
            home = os.path.expanduser("~")
            if home.startswith("~"):  # unexpanded: a directory named "~" would be made where the script runs
                return None
            base = os.path.join(home, ".cache")
        return Path(base) / "rockplan"
    return Path(setting).expanduser()


class PlanCache:
    """Plans by key in `directory` (see the module's docstring): `plan` is `rockplan.planner.plan`
    that reads a matching plan instead of profiling and solving, and writes what it plans. The
    node times are kept by a key of their own, without the budget and the planning options:
    another budget or solver for the same step replays nothing either (only its solve runs)."""

    def __init__(self, directory: str | Path, entries: int = ENTRIES) -> None:
        self.directory = Path(directory)
        self.entries = entries

    def plan(self, joint: JointGraph, budget: int | float | str, options: PlanOptions,
             real_inputs: list[torch.Tensor] | None = None, held: Plan | None = None) -> Plan:
        if options.plan_file is not None:  # the user's own plan file: nothing to look up
            return plan(joint, budget, options, real_inputs, held)
        profiled = profile_key(joint, options)
        key = plan_key(profiled, budget, options)
        times = self._read_times(profiled)
        # Estimated times are the graph's own (computed again in no time); measured ones are
        # read back, so that nothing is replayed.
        profile = options.profile if times is None or options.profile == "estimate" else times
        path = self._plan_path(key)
        if times is not None and path.exists():
            try:
                found = plan(joint, budget, dataclasses.replace(options, profile=profile, plan_file=path), real_inputs)
            except (PlanMismatch, InfeasibleBudget, ValueError, OSError) as e:
                log.info("the cached plan %s is not used, planning anew: %s", path, e)
            else:
                log.info("plan of %s read from the cache: %s", options.name or "the model", path)
                _touch(path)
                return found
        found = plan(joint, budget, dataclasses.replace(options, profile=profile), real_inputs, held)
        self._write(key, profiled, found)
        return found

    def _plan_path(self, key: str) -> Path:
        return self.directory / "plans" / f"{key}.json"

    def _times_path(self, key: str) -> Path:
        return self.directory / "times" / f"{key}.json"

    def _read_times(self, key: str) -> dict[str, float] | None:
        path = self._times_path(key)
        try:
            times = json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or damaged
            return None
        if not isinstance(times, dict) or not all(isinstance(t, float | int) for t in times.values()):
            return None
        _touch(path)
        return times

    def _write(self, key: str, profiled: str, found: Plan) -> None:
        """Write `found`'s node times and plan file; a directory that cannot be written is
        logged and skipped: the plan stands."""
        reference = (found.reference.predicted_peak, found.reference.predicted_time)
        text = plan_json(found.graph, found.schedule, reference, found.considered)
        try:
            for path, content in ((self._times_path(profiled), json.dumps(found.times)), (self._plan_path(key), text)):
                path.parent.mkdir(parents=True, exist_ok=True)
                _write_atomically(path, content)
                _evict(path.parent, self.entries)
        except OSError as e:
            log.warning("plan not cached in %s: %s", self.directory, e)


def _touch(path: Path) -> None:
    """Mark `path` used now: the least recently used entries are removed first."""
    try:
        os.utime(path)
    except OSError:  # removed meanwhile by another process: it was read all the same
        pass


def _evict(directory: Path, entries: int) -> None:
    """Remove all but the `entries` most recently used files of `directory`."""
    def used(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # removed meanwhile by another process
            return math.inf
    for old in sorted(directory.glob("*.json"), key=used, reverse=True)[entries:]:
        old.unlink(missing_ok=True)


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


def profile_key(joint: JointGraph, options: PlanOptions) -> str:
    """A hash of everything the node times of `joint` depend on: the graph node by node, how it
    is profiled, the device, the versions and our own source (the module's docstring)."""
    digest = hashlib.sha256()
    for part in (rockplan_version(), _source_hash(), torch.__version__, _device_description(joint_device(joint.module)),
                 _profile_described(options.profile), joint.num_fwd_outputs):
        digest.update(repr(part).encode())
        digest.update(b"\0")
    for node in joint.module.graph.nodes:
        digest.update(_node_described(node).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:40]


def plan_key(profiled: str, budget: int | float | str, options: PlanOptions) -> str:
    """A hash of everything a plan depends on beyond its times (`profile_key`): the budget and
    how it is planned."""
    parts = (profiled, repr(budget), options.solver, described(dict(options.solver_options)), options.replay_rng,
             options.lean_variant)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


def _node_described(node: fx.Node) -> str:
    arguments = fx.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
    return f"{node.op} {node.name} {node.target} {described(arguments)} {described(node.meta.get('val'))}"


def described(value: Any) -> str:
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
