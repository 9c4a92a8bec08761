"""The examples run as a newcomer runs them (small settings), and keep their budget."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _bytes(text: str) -> int:
    value, unit = text.split()
    return int(float(value) * UNITS[unit])


@pytest.mark.parametrize(("script", "args"), [("train_gpt.py", ["--size", "tiny", "--steps", "2"]),
                                              ("train_resnet.py", ["--batch", "2", "--budget", "0.8", "--steps", "2"])])
def test_example_trains_within_its_budget(script: str, args: list[str]) -> None:
    out = _run(script, *args)
    pairs = re.findall(r"peak:? (?:rockplan )?([\d.]+ \w+) \(budget ([\d.]+ \w+)\)", out)
    assert pairs, out
    for peak, budget in pairs:
        assert _bytes(peak) <= _bytes(budget) * 1.001, out  # printed with two decimals
