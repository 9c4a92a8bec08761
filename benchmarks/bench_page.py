"""The generated benchmark pages' shared header: what ran, where, with which versions, when.

Every bench script writes its own page under docs/benchmarks/ through `write_page`, so each
table says on its face which machine and versions produced it and how to produce it again;
docs/benchmarks.md, written by hand, says how to read them.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "benchmarks"
CPUINFO = "/proc/cpuinfo"  # Linux's description of the CPU: the machine's, not the project's data
# Every page times planning or the plans it makes: each script plans afresh, never reading a plan
# an earlier run cached (`rockplan.plan_cache`); the processes it starts inherit this.
os.environ["ROCKPLAN_PLAN_CACHE"] = "off"
# The machine's load when the script started: the machines are shared, and times read with it.
_LOAD_AT_START = os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def revision() -> str:
    """The repository's commit, marked when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} with uncommitted changes" if dirty else head


def cpu_model() -> str:
    """The CPU's model name as the OS reports it (Linux: /proc/cpuinfo), else the platform's."""
    try:
        for line in Path(CPUINFO).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """CPU model and cores, torch's threads, the GPU when there is one, the load (1-minute
    average) when the script started and when the page is written."""
    import torch

    text = f"{cpu_model()}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads)"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    if _LOAD_AT_START is not None:
        text += f", load average {_LOAD_AT_START:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    return text


def command() -> str:
    """The command line that is running, as a person would retype it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def header(title: str, command_line: str | None = None) -> str:
    """A page's title and the paragraph naming its command (by default the running one),
    machine, versions and date."""
    import torch

    return (
        f"# {title}\n\n"
        f"Generated {datetime.date.today().isoformat()} by `{command_line or command()}`; "
        "do not edit by hand, run it again.\n"
        f"Machine: {machine()}; {platform.system()} {platform.machine()}. Versions: Python "
        f"{platform.python_version()}, torch {torch.__version__}, highspy {_version('highspy')}, "
        f"rockplan at commit {revision()}. How to read it: docs/benchmarks.md.\n"
    )


def write_page(path: str | Path, title: str, body: str, command_line: str | None = None) -> Path:
    """Write `body` (markdown) under the shared header to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header(title, command_line) + "\n" + body.rstrip("\n") + "\n")
    return path


def child_row(script: str | Path, *arguments: str, label: str) -> dict | None:
    """The JSON object a fresh interpreter running `script` with `arguments` prints last (None,
    said on stderr with the end of its output, when it failed): one row of a page measured in a
    process of its own, so that imports, caches and peak memory do not carry over."""
    done = subprocess.run([sys.executable, str(script), *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{label}: failed\n{done.stderr[-2000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])
