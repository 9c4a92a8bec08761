"""The examples run as a newcomer runs them (small settings), and keep their budget."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rockplan.plan_file import read_plan
from solvers import simulate

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


def test_bench_measures_every_method_that_fits_within_its_budget(tmp_path: Path) -> None:
    """benchmarks/bench.py end to end on the tiny GPT at two budgets: every row that ran has a
    measured peak within its budget and a time ratio to eager, and rockplan is compared with
    every other method timed at its budget."""
    out, plans = tmp_path / "bench.md", tmp_path / "plans"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--models", "gpt", "--size", "tiny",
                           "--ratios", "1.0,0.7", "--repeats", "2", "--solvers", "dtr,rotor", "--out", str(out),
                           "--export-plans", str(plans)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    table, comparisons = out.read_text().split("### Where rockplan is not the fastest")[0].split(
        "### rockplan against each method")
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| gpt")]
    measured = [r for r in rows if r[2] != "eager (store all)" and r[3] != "-"]
    assert len(measured) >= 4, out.read_text()
    for r in measured:
        assert float(r[4]) <= 1.0 and float(r[5].split()[0]) > 0, r  # peak / budget, time vs eager (quartiles)
    paired = [line.split(" | ") for line in comparisons.splitlines() if line.startswith("| gpt")]
    # Every timed method but the first rockplan row (dtr here) and eager is compared with it.
    assert len(paired) == len(measured) - 2, comparisons
    assert all(p[5].rstrip(" |") in ("faster", "slower", "within noise") for p in paired), comparisons
    # torch.compile's knob recomputes at 0.7 (each knob's copy keeps its own compiled graph).
    assert any(r[2] == "torch.compile activation_memory_budget" and r[1].startswith("0.70") and r[3] != "-"
               for r in rows), out.read_text()
    assert out.with_suffix(".png").exists()  # the Pareto plot
    # Each plan written with the costs measured there, to plan again elsewhere: its schedule
    # simulates to the time the page predicted, within its budget.
    written = sorted(p.name for p in plans.iterdir())
    assert written == ["gpt-0.70-dtr.json", "gpt-0.70-rotor.json", "gpt-1.00-dtr.json", "gpt-1.00-rotor.json"]
    read = read_plan(plans / "gpt-0.70-dtr.json")
    simulated = simulate(read.graph, read.schedule)
    assert simulated.peak <= read.schedule.budget
    assert simulated.time == pytest.approx(read.schedule.predicted_time)


def test_bench_times_the_peers_users_switch_on_for_a_hugging_face_model(tmp_path: Path) -> None:
    """benchmarks/bench.py on the tiny HF Llama: Hugging Face's gradient_checkpointing_enable,
    torch.utils.checkpoint per block and selective activation checkpointing each run, peak
    below eager's and within the budget where timed; the "min" budget is planned; the page
    states where rockplan is not the fastest (no time is asserted)."""
    out = tmp_path / "bench.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--models", "hf_llama", "--size",
                           "tiny", "--ratios", "1.0,min", "--repeats", "1", "--solvers", "rockmate", "--knobs", "1.0",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    page = out.read_text()
    table = page.split("### rockplan against each method")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| hf_llama")]
    eager_peak = _bytes(next(r for r in rows if r[2] == "eager (store all)")[3])
    at_full = {r[2]: r for r in rows if r[1].startswith("1.00")}
    for method in ("HF gradient_checkpointing_enable", "torch.utils.checkpoint per block", "SAC per block (op list)"):
        row = at_full[method]
        assert row[3] != "-" and _bytes(row[3]) < eager_peak, row  # it recomputes: its peak is below eager's
        assert float(row[4]) <= 1.0 and float(row[5].split()[0]) > 0, row  # within the budget, and timed
    minimum = [r for r in rows if " min (" in r[1] and r[2] == "rockplan (rockmate)"]
    assert minimum and minimum[0][3] != "-" and float(minimum[0][4]) <= 1.0, table
    assert "### Where rockplan is not the fastest" in page


def test_op_times_compares_every_planned_op_with_its_time_in_a_step() -> None:
    """benchmarks/op_times.py on the tiny GPT: for the store-all step and the plan, the
    predicted total and the ops' total in real steps, and per op kind both columns."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_times.py"), "--size", "tiny",
                           "--budget", "0.5", "--steps", "1", "--rows", "100"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    totals = [line for line in done.stdout.splitlines() if ": predicted " in line]
    assert [t.split(":")[0] for t in totals] == ["store all", "plan"], done.stdout
    for line in totals:
        parts = line.split("predicted ")[1].split(", its ops in the step ")
        predicted, in_step = (float(part.split()[0]) for part in parts)
        assert predicted > 0 and in_step > 0, line
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("  aten.mm.default")]
    assert len(rows) == 2 and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), done.stdout


def test_bench_waits_for_the_device_around_each_timed_step() -> None:
    """A CUDA step returns once its kernels are queued: round_robin waits for the device before
    each step's clock starts and before it stops, or a step is charged with the one before's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    events: list[str] = []
    steps = [lambda name=name: events.append(name) for name in "ab"]
    times = bench.round_robin(steps, 2, sync=lambda: events.append("sync"))
    assert [len(t) for t in times] == [2, 2]
    # One warm-up round, then two timed ones, the order rotated each round.
    order = ["a", "b", "b", "a", "a", "b"]
    assert events == [e for name in order for e in ("sync", name, "sync")]
