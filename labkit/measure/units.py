"""Human-readable units for the numbers notebooks print. First used in notebook 03 (``03_kv_cache``)."""

from __future__ import annotations


def human_bytes(num_bytes: float) -> str:
    """1536 -> '1.50 KiB' (binary prefixes, as memory is sized)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
