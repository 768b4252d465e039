"""Byte sizes as people write them: 1.5GiB, 800MB, 123456."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "tb": 1000**4,
}


# No memory, file or body this daemon handles comes near 1 PiB; a larger number is a typo or
# an attack (a 400-digit budget made float() give infinity, and int(inf) an OverflowError).
MAX_SIZE = 1 << 50
_MAX_DIGITS = 24  # before the decimal point; more is refused before any arithmetic


def parse_size(value: int | float | str) -> int:
    """Bytes, 0..MAX_SIZE; ValueError (never OverflowError) for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        # Compared as given: math.isfinite(10**400) itself overflows.
        if (isinstance(value, float) and not math.isfinite(value)) or not 0 <= value <= MAX_SIZE:
            raise ValueError(f"size out of range 0..{MAX_SIZE}: {_short(value)}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"not a size: {_short(value)} (e.g. 2GiB, 800MB, 123456)")
    if len(value) > 64:
        raise ValueError(f"size out of range 0..{MAX_SIZE}: {_short(value)}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (e.g. 2GiB, 800MB, 123456)")
    if len(m.group(1).split(".")[0]) > _MAX_DIGITS:
        raise ValueError(f"size out of range 0..{MAX_SIZE}: {_short(value)}")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(n) or n > MAX_SIZE:
        raise ValueError(f"size out of range 0..{MAX_SIZE}: {_short(value)}")
    return int(n)


def _short(value: object) -> str:
    """A value for an error message, cut short (a 400-digit number is not worth echoing)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} chars)"


def format_size(n: int) -> str:
    for unit, div in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


_DURATION = re.compile(r"(-?)((?:\d+(?:\.\d+)?(?:h|m|s|ms))+)")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION_SCALE = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}


def parse_duration_s(value: int | float | str) -> float:
    """Seconds in a duration as Ollama's keep_alive writes it: a number of seconds, or Go's
    "5m", "1h30m", "250ms", "-1m"; ValueError otherwise. A negative one means forever."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a duration")
        return float(value)
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION.fullmatch(text)
        if parts is None:
            raise ValueError(f"{value!r} is not a duration") from None
        total = sum(float(n) * _DURATION_SCALE[u] for n, u in _DURATION_PART.findall(parts[2]))
        return -total if parts[1] else total
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a duration")
    return seconds
