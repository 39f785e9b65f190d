"""Byte sizes as people write them: ``6GiB``, ``512MB``, ``1.5g``, ``4096``."""

from __future__ import annotations

import re

from fitgpt.errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}


def parse_bytes(text: str | int, flag: str = "--memory-budget") -> int:
    """Bytes from ``6GiB`` (binary), ``6GB`` (decimal), ``6g`` (binary) or a plain number of bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise UserError(f"{flag} {text!r} is not a size; write it like 6GiB, 512MiB, 8GB or a number of bytes")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"{flag} must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``512 B``: binary units, three significant digits or so."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}" if unit == "GiB" else f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{int(n)} B"


def format_count(n: float) -> str:
    """1.07M, 3.40B: a parameter count."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


_DURATIONS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str = "--time-budget") -> float:
    """Seconds from ``90s``, ``8m``, ``3h``, ``7d``, ``1h30m`` or a plain number of seconds."""
    s = str(text).strip().lower()
    parts = re.findall(r"([0-9]*\.?[0-9]+)\s*([smhd]?)", s)
    rebuilt = "".join(f"{n}{u}" for n, u in parts)
    units = [u for _, u in parts]
    if not parts or rebuilt != re.sub(r"\s+", "", s) or (len(parts) > 1 and "" in units) or len(set(units)) != len(units):
        raise UserError(f"{flag} {text!r} is not a duration; write it like 90s, 8m, 3h, 7d or 1h30m")
    seconds = sum(float(n) * _DURATIONS[u or "s"] for n, u in parts)
    if not seconds > 0:
        raise UserError(f"{flag} must be positive, got {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """``45s``, ``8.0m``, ``3.0h``, ``7.0d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
