"""Which stage planning is in, shown on a terminal while it runs.

Planning happens before the first training step and again for each new input signature, and
takes from a second to minutes: without a sign of life a user cannot tell it from a hang. While
a `Progress` is open, the planner names its stages (`stage("profile")`); once planning has run
for `DELAY_SECONDS`, a status line on stderr shows the model, the stage and the seconds spent,
rewritten in place every second and cleared at the end. Only when stderr is a terminal: logs,
notebooks' captured output and CI stay clean. Every stage change is also logged at DEBUG.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

log = logging.getLogger(__name__)

DELAY_SECONDS = 2.0  # planning shorter than this shows nothing
INTERVAL_SECONDS = 1.0

_active: list[Progress] = []  # the innermost open Progress gets the stages (one planning at a time)


def stage(name: str) -> None:
    """Say that planning has entered stage `name` (capture, profile, solve, generate)."""
    if _active:
        _active[-1].enter(name)


class Progress:
    """Context manager: a status line on `stream` (stderr) while planning `model_name`."""

    def __init__(self, model_name: str, stream: TextIO | None = None) -> None:
        self.model_name = model_name
        self.stream = stream if stream is not None else sys.stderr
        self.stages: list[str] = []
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = 0  # characters of the status line on the terminal

    def enter(self, name: str) -> None:
        self.stages.append(name)
        log.debug("planning %s: %s after %.1f s", self.model_name, name, time.perf_counter() - self._start)

    def __enter__(self) -> Progress:
        self._start = time.perf_counter()
        _active.append(self)
        if _is_terminal(self.stream):
            self._thread = threading.Thread(target=self._show, name="rockplan-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        _active.remove(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()

    def _show(self) -> None:
        if self._stop.wait(DELAY_SECONDS):
            return
        while not self._stop.is_set():
            where = self.stages[-1] if self.stages else "starting"
            line = f"rockplan: planning {self.model_name}: {where} ({time.perf_counter() - self._start:.0f} s)"
            self.stream.write("\r" + line.ljust(self._shown))
            self.stream.flush()
            self._shown = max(self._shown, len(line))
            self._stop.wait(INTERVAL_SECONDS)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False
