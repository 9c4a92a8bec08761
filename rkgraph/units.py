"""Human-readable sizes, shared by every stage (the lowest layer owns it)."""

from __future__ import annotations


def format_bytes(n: float, digits: int = 2) -> str:
    """Binary prefixes: 1536 -> '1.50 KiB' (bytes shown whole)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
