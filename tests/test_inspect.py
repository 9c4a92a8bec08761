"""Inspection: plan files round-trip and are checked on reload, explain, pictures, the CLI."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rockplan import Rockmate, cli, zoo
from rockplan.plan_file import FORMAT, VERSION, PlanMismatch, export_plan, fingerprint, load_plan, read_plan
from solvers import simulate
from solvers.bounds import time_lower_bound

# Checkpointing every block recomputes in every block and solves instantly: a plan with all
# three decisions, without the ILP's solve time.
SOLVER = "checkpoint_blocks"


@pytest.fixture(scope="module")
def gpt() -> zoo.ZooEntry:
    return zoo.make("gpt", "tiny")


@pytest.fixture(scope="module")
def planned(gpt: zoo.ZooEntry, tmp_path_factory: pytest.TempPathFactory) -> tuple[Rockmate, Path]:
    model, args, kwargs, _ = gpt
    rk = Rockmate(copy.deepcopy(model), (args, kwargs), 0.7, solver=SOLVER, profile="estimate")
    path = rk.export(tmp_path_factory.mktemp("plan") / "plan.json")
    return rk, path


def _gradients(rk: Rockmate, entry: zoo.ZooEntry) -> list[torch.Tensor]:
    _, args, kwargs, loss_fn = entry
    torch.manual_seed(3)  # the same dropout masks in both runs
    loss_fn(rk(*args, **kwargs), *args).backward()
    return [p.grad for p in rk.model.parameters()]


def test_export_reload_same_schedule_and_gradients(gpt: zoo.ZooEntry, planned: tuple[Rockmate, Path]) -> None:
    rk, path = planned
    model, args, kwargs, _ = gpt
    reloaded = Rockmate(copy.deepcopy(model), (args, kwargs), 0.7, plan_file=path, profile="estimate")
    assert reloaded.schedule == rk.schedule
    solved = Rockmate(copy.deepcopy(model), (args, kwargs), 0.7, solver=SOLVER, profile="estimate")
    for a, b in zip(_gradients(solved, gpt), _gradients(reloaded, gpt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_plan_file_schema(planned: tuple[Rockmate, Path]) -> None:
    rk, path = planned
    obj = json.loads(path.read_text())
    assert (obj["format"], obj["version"]) == (FORMAT, VERSION)
    assert obj["graph"]["fingerprint"] == fingerprint(rk.graph)
    nodes = {n["name"]: n for n in obj["graph"]["nodes"]}
    assert any(n["module"].startswith("transformer.h.0") and n["op"].startswith("aten.") for n in nodes.values())
    counts = simulate(rk.graph, rk.schedule).recompute_counts
    assert counts and all(nodes[name]["recomputed"] == c for name, c in counts.items())
    decisions = {d["decision"] for d in obj["graph"]["data"]}
    assert {"kept", "freed early"} <= decisions
    assert obj["schedule"]["solver"] == SOLVER and obj["schedule"]["predicted_peak"] == rk.schedule.predicted_peak
    assert obj["store_all"]["predicted_peak"] == rk.store_all_peak
    plan = read_plan(path)  # the file alone rebuilds the graph and the schedule
    assert fingerprint(plan.graph) == fingerprint(rk.graph) and plan.schedule == rk.schedule


def _tamper(path: Path, out: Path, edit: str) -> tuple[Path, str]:
    obj = json.loads(path.read_text())
    node = next(n for n in obj["graph"]["nodes"] if n["op"] == "aten.addmm.default")
    if edit == "op":
        node["op"] = "aten.mm.default"
    else:
        data = next(d for d in obj["graph"]["data"] if d["name"] == node["outputs"][0])
        data["size"] += 4
    out.write_text(json.dumps(obj))
    return out, node["name"]


@pytest.mark.parametrize("edit", ["op", "size"])
def test_tampered_plan_names_the_node(planned: tuple[Rockmate, Path], tmp_path: Path, edit: str) -> None:
    rk, path = planned
    tampered, name = _tamper(path, tmp_path / "plan.json", edit)
    with pytest.raises(PlanMismatch, match=rf"\({name}\b.*{'op' if edit == 'op' else 'bytes'}"):
        load_plan(tampered, rk.graph)


def test_reload_on_another_model_is_refused(planned: tuple[Rockmate, Path]) -> None:
    _, path = planned
    model, args, kwargs, _ = zoo.make("mlp", "tiny")
    with pytest.raises(PlanMismatch, match="node 0"):
        Rockmate(model, (args, kwargs), 1.0, plan_file=path, profile="estimate")


def test_bare_schedule_still_exports_and_reloads(planned: tuple[Rockmate, Path], tmp_path: Path) -> None:
    rk, _ = planned
    rk.schedule.export(tmp_path / "schedule.json")
    assert load_plan(tmp_path / "schedule.json", rk.graph) == rk.schedule


def test_export_from_graph_and_schedule(planned: tuple[Rockmate, Path], tmp_path: Path) -> None:
    rk, _ = planned
    path = export_plan((rk.graph, rk.schedule), tmp_path / "pair.json")
    assert load_plan(path, rk.graph) == rk.schedule


def test_explain_lists_every_block_and_totals(planned: tuple[Rockmate, Path]) -> None:
    rk, _ = planned
    text = rk.explain()
    block_rows = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0].isdigit()]
    assert block_rows == [str(i) for i in range(len(rk.graph.blocks))]
    for label in ("store everything", "checkpoint every block", f"this plan ({SOLVER})", "transformer.h.1"):
        assert label in text
    assert "checkpoint" in text.split("totals")[0]  # the blocks' option column
    # The floor explain states is a proven one, and the plan's distance to it is stated against
    # it. Proving it runs MILPs under time limits, so the same floor proved again can come out
    # weaker on a busy machine: checked against the knapsacks' floor, which has no time limit.
    stated = re.search(r"\(proven: ([+-][0-9.]+)% over store-all\); this plan is ([0-9.]+)% above that", text)
    assert stated, text
    floor = rk.store_all_time * (1 + float(stated[1]) / 100)
    knapsacks, _ = time_lower_bound(rk.graph, rk.schedule.budget, closure=False, intervals=False)
    assert knapsacks <= floor * 1.001 and floor <= rk.schedule.predicted_time * 1.001
    assert float(stated[2]) == pytest.approx(100 * (rk.schedule.predicted_time / floor - 1), abs=0.2)
    # At 0.7 the budget costs recomputation: explain names the step that proves it, and where
    # (where one step does: a chain of steps' MILP, when it ends in its time, can prove more).
    tightest = re.search(r"the floor comes from the tightest step: (at node .*)", text)
    assert tightest or "the floor comes from" not in text, text
    assert tightest is None or "(forward" in tightest[1] or "(backward" in tightest[1]


def test_explain_store_all_recomputes_nothing(gpt: zoo.ZooEntry) -> None:
    model, args, kwargs, _ = gpt
    rk = Rockmate(copy.deepcopy(model), (args, kwargs), 1.0, solver="store_all", profile="estimate")
    table = rk.explain().split("totals")[0]
    assert "partial" not in table and "checkpoint " not in table


def test_render_and_plot_write_files(planned: tuple[Rockmate, Path], tmp_path: Path) -> None:
    rk, _ = planned
    pdf = rk.render(tmp_path / "graph.pdf")
    assert pdf.read_bytes().startswith(b"%PDF")
    assert rk.render(tmp_path / "collapsed.svg", collapse=True).stat().st_size > 0
    pytest.importorskip("matplotlib")
    png = rk.plot_memory(tmp_path / "memory.png")
    assert png.read_bytes().startswith(b"\x89PNG")


# --- command line ------------------------------------------------------------------------------


def test_cli_plan_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["plan", "zoo:gpt", "--size", "tiny", "--budget", "0.7", "--solver", SOLVER,
                     "--profile", "estimate", "--out", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "this plan (checkpoint_blocks)" in printed
    assert {"plan.json", "graph.pdf", "memory.png"} <= {p.name for p in tmp_path.iterdir()}
    assert cli.main(["explain", str(tmp_path / "plan.json")]) == 0
    assert capsys.readouterr().out.strip() == printed.strip()  # the file alone says the same


def test_cli_plans_the_loss_inside_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--with-loss` plans the zoo's loss with the model, as the benchmarks do: one scalar
    output, and the graph's name says so."""
    code = cli.main(["plan", "zoo:gpt", "--size", "tiny", "--with-loss", "--budget", "0.7", "--solver", SOLVER,
                     "--profile", "estimate", "--out", str(tmp_path)])
    assert code == 0 and "WithLoss" in capsys.readouterr().out
    graph = read_plan(tmp_path / "plan.json").graph
    (output,) = graph.user_outputs
    assert graph.name == "WithLoss" and graph.data[output].size == 4


def test_cli_plan_from_file_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))\n"
    )
    code = cli.main(["plan", f"{tmp_path / 'mymodel.py'}:make", "--shape", "8x16", "--budget", "1MB",
                     "--solver", "store_all", "--profile", "estimate", "--out", str(tmp_path / "out")])
    assert code == 0
    assert read_plan(tmp_path / "out" / "plan.json").graph.name == "Sequential"


def test_cli_polish_searches_on_from_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             rockmate_calls: list) -> None:
    """`--polish` is the default solver's `polish_time`, passed as given."""
    code = cli.main(["plan", "zoo:gpt", "--size", "tiny", "--budget", "0.7", "--polish", "0.5",
                     "--profile", "estimate", "--out", str(tmp_path)])
    assert code == 0 and rockmate_calls and all(options["polish_time"] == 0.5 for *_, options in rockmate_calls)
    assert "this plan (rockmate)" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "rockplan.zoo:no_such_factory", "--shape", "8x128"], "has no factory 'no_such_factory'"),
    (["plan", "no_such_package.models:make", "--shape", "8x128"], "cannot import no_such_package.models"),
    (["plan", "missing/file.py:make", "--shape", "8x128"], "no file missing/file.py"),
    (["plan", "zoo:gpt", "--shape", "8by128"], "bad shape '8by128'"),
    (["plan", "zoo:gpt", "--budget", "1.5GB/s"], "cannot read budget '1.5GB/s'"),
    (["plan", "zoo:gpt", "--budget", "2.5"], "a ratio budget must be in (0, 1]"),
    (["plan", "torch.nn:Identity", "--with-loss"], "returns no loss: --with-loss needs"),
    (["explain", "no_such_plan.json"], "no plan file no_such_plan.json"),
    (["plan", "zoo:gpt", "--solver", "dtr", "--polish", "5"], "--polish is an option of the default solver"),
])
def test_cli_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_entry_point_and_bench_message(tmp_path: Path) -> None:
    # As installed: `rockplan` is `python -m rockplan.cli`; bench without its script says so.
    result = subprocess.run([sys.executable, "-m", "rockplan.cli", "explain", str(tmp_path / "x.json")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no plan file" in result.stderr
    if not cli.BENCH_SCRIPT.is_file():
        assert cli.main(["bench"]) == 2
