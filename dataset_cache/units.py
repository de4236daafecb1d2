"""Human-readable units for reports (one formatter, so every report spells sizes the same way)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: int) -> str:
    """``1536`` → ``"1.5 KiB"``; whole bytes below 1 KiB (``"512 B"``); binary units up to TiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
