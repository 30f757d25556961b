"""Parsing of the explicit units a topology file uses: rates, sizes, durations, percentages.

Units are required (a bare ``200`` is refused for a rate) because a silent default unit is the
classic way a shaping file means ten times what its author thought.
"""
from __future__ import annotations

import re
from typing import Union

from testbed.errors import SpecError

Number = Union[int, float]

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUM = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"


def _split(value: object, field: str, kind: str, units: dict, example: str) -> tuple[float, str]:
    accepted = f"a number followed by one of {', '.join(units)} (e.g. {example})"
    if isinstance(value, bool) or not isinstance(value, str):
        raise SpecError(field, f"{value!r} is not a {kind}", accepted)
    m = re.fullmatch(_NUM + r"\s*([a-zA-Z%]+)", value.strip())
    if not m or m.group(2).lower() not in units:
        raise SpecError(field, f"{value!r} is not a {kind}", accepted)
    return float(m.group(1)), m.group(2).lower()


def parse_rate(value: object, field: str) -> int:
    """'200mbit' -> 200_000_000 bit/s. Zero and negative rates are refused."""
    num, unit = _split(value, field, "rate", _RATE_UNITS, "200mbit")
    bps = int(round(num * _RATE_UNITS[unit]))
    if bps < 8000:
        raise SpecError(field, f"{value!r} is too small", "a rate of at least 8kbit")
    return bps


def parse_size(value: object, field: str) -> int:
    """'16MiB' -> 16777216 bytes; a plain non-negative integer counts bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise SpecError(field, f"{value!r} is negative", "a size of 0 bytes or more")
        return value
    num, unit = _split(value, field, "size", _SIZE_UNITS, "16MiB")
    return int(round(num * _SIZE_UNITS[unit]))


def parse_duration(value: object, field: str, allow_zero: bool = True) -> float:
    """'1ms' -> 0.001 seconds."""
    num, unit = _split(value, field, "duration", _TIME_UNITS, "10ms")
    seconds = num * _TIME_UNITS[unit]
    if seconds == 0 and not allow_zero:
        raise SpecError(field, f"{value!r} is zero", "a duration greater than 0 (e.g. 500ms)")
    return seconds


def parse_percent(value: object, field: str) -> float:
    """'0.5%' -> 0.005. Values over 100 % are refused."""
    num, _ = _split(value, field, "percentage", {"%": 1}, "0.5%")
    if num > 100:
        raise SpecError(field, f"{value!r} is over 100%", "a percentage from 0% to 100%")
    return num / 100.0


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "unshaped"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def format_duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:g}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds * 1e6:g}us"


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"
