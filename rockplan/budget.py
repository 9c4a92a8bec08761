"""Budgets: bytes as an int, a string with units ("800MB", "1.5GiB"), or a ratio in (0, 1]."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_budget(budget: int | float | str, reference: int) -> int:
    """Bytes for `budget`; a float is a fraction of `reference` (the store-everything peak)."""
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes (int), a size string like '1.5GiB', or a ratio in (0, 1]")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget} bytes")
        return budget
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"a ratio budget must be in (0, 1], got {budget}")
        return int(budget * reference)
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", budget)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read budget {budget!r}: use a number with one of the units "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '800MB', '1.5GiB')"
            )
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise TypeError(f"budget must be int, float or str, got {type(budget).__name__}")
