"""Parse and print sizes (40GiB) and durations (20m) the way people type them."""

from __future__ import annotations

import re

from autotune.errors import UsageError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_size(text: str) -> int:
    """'40GiB' -> 42949672960; '512MB' -> 512000000; '1048576' -> 1048576."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise UsageError(f"cannot read size {text!r}; write it like 40GiB, 512MiB or 2GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str) -> float:
    """'20m' -> 1200.0; '1h30m' -> 5400.0; '90' or '90s' -> 90.0."""
    parts = re.findall(r"([0-9]*\.?[0-9]+)\s*([hms]?)", text.strip().lower())
    if not parts or re.sub(r"[0-9.\shms]", "", text.lower()):
        raise UsageError(f"cannot read duration {text!r}; write it like 90s, 20m or 1h30m")
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


def format_rate(bytes_per_s: float) -> str:
    """A link's bandwidth as the search's probe line and the report say it: GB/s, or MB/s below one."""
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.3g} MB/s"


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
