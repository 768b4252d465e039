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


# Go's time.ParseDuration units (Ollama parses keep_alive with it); "us" and "µs" alike.
_DURATION = re.compile(r"([-+]?)((?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+)")
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_SCALE = {
    "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9,
}  # fmt: skip
_SECONDS = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
# A longer duration means no expiry: a model kept 100 years is kept forever, and an expiry
# that far off overflows datetime (year 9999) when /api/ps writes it ("9999999999999h" did).
MAX_DURATION_S = 100 * 365.25 * 86400
FOREVER = -1.0  # what a negative duration means (keep_alive -1)
_MAX_DURATION_CHARS = 64  # "1h30m", "300", "-1": a longer text is no duration anyone writes


def parse_duration_s(value: int | float | str) -> float:
    """Seconds in a duration as Ollama's keep_alive writes it: a number of seconds, or Go's
    "5m", "1h30m", "250ms", "-1m"; ValueError otherwise (NaN, a text that is no duration or
    longer than 64 characters). A negative one means forever, and so does one beyond
    MAX_DURATION_S (infinity included): both come back as FOREVER, so no caller ever adds a
    huge number of seconds to a clock."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int):  # compared as an int: float(10**400) itself overflows
        return FOREVER if value < 0 or value > MAX_DURATION_S else float(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError(f"{value!r} is not a duration")
        return _bounded(value)
    if not isinstance(value, str):
        raise ValueError(f"{_short(value)} is not a duration")
    text = value.strip()
    if len(text) > _MAX_DURATION_CHARS:
        raise ValueError(f"{_short(value)} is not a duration (too long)")
    if _SECONDS.fullmatch(text):  # a plain number of seconds; "inf" and "nan" are not
        return _bounded(float(text))
    parts = _DURATION.fullmatch(text)
    if parts is None:
        raise ValueError(f"{value!r} is not a duration")
    total = sum(float(n) * _DURATION_SCALE[u] for n, u in _DURATION_PART.findall(parts[2]))
    return _bounded(-total if parts[1] == "-" else total)


def _bounded(seconds: float) -> float:
    """FOREVER for a negative or beyond-the-bound number of seconds (infinities included)."""
    return FOREVER if not 0 <= seconds <= MAX_DURATION_S else seconds
