"""Human-readable sizes, shared by every stage (the lowest layer owns it)."""

from __future__ import annotations

# Binary units, smallest first: sizes are storages and allocator blocks, counted in powers of two.
BYTE_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30))


def byte_unit(n: float) -> tuple[str, int]:
    """The unit to show `n` bytes in, and its size: the largest unit not above |n| (bytes below
    1 KiB, GiB at most), so that a figure reads between 1 and 1024."""
    return next((unit, size) for unit, size in reversed(BYTE_UNITS) if abs(n) >= size or size == 1)


def format_bytes(n: float, digits: int = 2) -> str:
    """Binary prefixes: 1536 -> '1.50 KiB' (bytes shown whole)."""
    unit, size = byte_unit(n)
    return f"{n:.0f} {unit}" if size == 1 else f"{n / size:.{digits}f} {unit}"
