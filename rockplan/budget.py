"""Budgets: bytes (an integer, or a size string such as "800MB", "1.5GiB") or a ratio in (0, 1]
(a float, or a string such as "0.5", as the command line reads it)."""

from __future__ import annotations

import numbers
import re

from torch import nn

from rkgraph.units import format_bytes
from solvers import InfeasibleBudget

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_FORMS = "bytes (an int, or a string with a unit like '800MB', '1.5GiB') or a ratio in (0, 1] (a float like 0.5)"


def budget_bytes(budget: int | float | str) -> int | None:
    """The bytes of an absolute budget, None for a ratio (known only once the step's peak is).

    Every error a budget can have is raised here, before anything is captured: a wrong type,
    a non-positive size, a ratio outside (0, 1], a string that is not a size. NumPy's and other
    `numbers` integers and reals count as ints and floats. A unit-less string is read as the
    command line reads it: digits only are bytes, a decimal a ratio ("0.5" is half, not 0 bytes).
    """
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Real, str)):
        raise TypeError(f"budget must be {_FORMS}; got {type(budget).__name__} {budget!r}")
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget} bytes")
        return int(budget)
    if isinstance(budget, numbers.Real):
        if not 0 < budget <= 1:
            raise ValueError(f"a ratio budget must be in (0, 1], got {budget}; for bytes pass an int or a size "
                             "string like '800MB'")
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", budget)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read budget {budget!r}: it must be {_FORMS}, with one of the units "
                         "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    number, unit = match.groups()
    if not unit and "." in number:
        return budget_bytes(float(number))
    size = int(float(number) * _UNITS[unit.lower()])
    if size <= 0:
        raise ValueError(f"budget {budget!r} is {size} bytes: it must be positive")
    return size


def parse_budget(budget: int | float | str, reference: int) -> int:
    """Bytes for `budget`; a ratio is a fraction of `reference` (the store-everything peak)."""
    size = budget_bytes(budget)
    return size if size is not None else int(float(budget) * reference)


def check_gradients_fit(budget: int | float | str, model: nn.Module) -> None:
    """InfeasibleBudget, before any capture, for a budget in bytes below what the gradients of
    `model`'s trainable parameters alone take: a step makes them and holds them to its end, so
    no schedule fits (what capture and profiling would take a while to prove).

    A parameter the forward does not use gets no gradient; the message says to freeze those,
    the one case where a budget refused here could fit."""
    size = budget_bytes(budget)
    if size is None:
        return
    trainable = [p for p in model.parameters() if p.requires_grad]
    gradients = sum(p.numel() * p.element_size() for p in trainable)
    if size < gradients:
        raise InfeasibleBudget(
            f"budget {size} bytes ({format_bytes(size)}) is too small: the smallest feasible budget is at least "
            f"{gradients} bytes ({format_bytes(gradients)}), what the gradients of {type(model).__name__}'s "
            f"{len(trainable)} trainable parameters alone take (a step makes them and holds them until it ends). "
            "Give a larger budget, a ratio of the step's memory (e.g. 0.5), or freeze parameters "
            "(requires_grad=False), those the forward does not use first")
