"""Planning shows its stage on a terminal, and nothing elsewhere."""

from __future__ import annotations

import io
import time

import pytest

from rockplan import Rockmate, progress, zoo


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _plan_tiny_gpt() -> None:
    model, args, kwargs, _loss = zoo.make("gpt", "tiny")
    Rockmate(model, (args, kwargs), 0.6, profile="estimate", solver_options={"time_limit": 5})


def test_a_terminal_sees_each_stage_of_a_long_planning_then_a_cleared_line(monkeypatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.0)
    monkeypatch.setattr(progress, "INTERVAL_SECONDS", 0.001)
    stages: list[list[str]] = []
    enter = progress.Progress.__enter__

    def recorded(self: progress.Progress) -> progress.Progress:
        stages.append(self.stages)
        return enter(self)

    monkeypatch.setattr(progress.Progress, "__enter__", recorded)
    _plan_tiny_gpt()
    # the lean variant's stages come between, when one is planned
    assert stages[0][:3] == ["capture", "profile", "solve"] and stages[0][-1] == "generate"
    shown = terminal.getvalue()
    assert "rockplan: planning GPT: " in shown
    assert shown.endswith("\r")  # the status line is blanked out at the end
    assert shown.rstrip("\r").split("\r")[-1].strip() == ""


def test_planning_writes_nothing_where_stderr_is_not_a_terminal(capfd, monkeypatch) -> None:
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.0)
    _plan_tiny_gpt()
    out, err = capfd.readouterr()
    assert "rockplan: planning" not in out + err


def test_a_short_planning_shows_nothing() -> None:
    terminal = _Terminal()
    with progress.Progress("M", stream=terminal):
        progress.stage("capture")
    assert terminal.getvalue() == ""


def test_stages_go_to_the_innermost_planning_and_outside_one_are_ignored() -> None:
    progress.stage("nowhere")  # no planning open: nothing happens
    with progress.Progress("outer", stream=io.StringIO()) as outer:
        with progress.Progress("inner", stream=io.StringIO()) as inner:
            progress.stage("solve")
        progress.stage("generate")
    assert inner.stages == ["solve"] and outer.stages == ["generate"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_line_is_cleared_when_planning_fails(error: type[BaseException], monkeypatch) -> None:
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.0)
    monkeypatch.setattr(progress, "INTERVAL_SECONDS", 0.001)
    terminal = _Terminal()
    with pytest.raises(error), progress.Progress("M", stream=terminal):
        progress.stage("solve")
        time.sleep(0.05)  # the status line is written at least once
        raise error()
    assert "solve" in terminal.getvalue() and terminal.getvalue().endswith("\r")
    assert not progress._active
