"""Parsing of the explicit units a topology file uses: rates, sizes, durations, percentages,
and the limits every number of a topology file must stay within (README: Topology files, Limits).

Units are required (a bare ``200`` is refused for a rate) because a silent default unit is the
classic way a shaping file means ten times what its author thought.
"""
from __future__ import annotations

import re
from typing import Union

from testbed.errors import SpecError, quote

Number = Union[int, float]

# ---- limits: the one place they are set (the README's Limits table lists them) ---------------
MIN_RATE_BPS = 8_000                   # 8 kbit/s
MAX_RATE_BPS = 1_000_000_000_000       # 1 Tbit/s
MAX_DURATION_S = 86_400.0              # a day: at, for, period, duration, timeout, rto_min
MAX_DELAY_S = 60.0                     # delay, jitter: netem keeps them in 32-bit psched ticks
                                       # (about 274 s at 15.625 ticks/us); a minute is plenty
MAX_SIZE_BYTES = 64 << 30              # 64 GiB: message sizes
MAX_HOSTS = 1023                       # a Linux bridge numbers its ports 1..1023 (BR_MAX_PORTS
                                       # 1024, port 0 reserved): one port per host on each rail
MAX_RAILS = 32                         # interfaces per host
MAX_COUNT = 1_000_000_000              # iterations, warmup
MAX_ROUNDS = 1000                      # compare: rounds
MAX_PHASES = 10_000                    # sweep/compare: sizes x systems x rounds
MAX_CAPTURE_MB = 65_536                # capture.max_mb (64 GiB)
MIN_FLAP_PERIOD_S = 0.010              # a link state change takes 1-4 ms to be acknowledged
MAX_FLAP_STEPS = 100_000               # down/up toggles of all flaps of a schedule together
MAX_FILE_BYTES = 128 << 10              # a topology file (shipped ones are under 2 KiB; PyYAML
                                       # reads about 8 s per MiB on a 2-core machine)
MAX_YAML_NODES = 100_000               # values of the document with every alias expanded
MAX_YAML_DEPTH = 32                    # nesting of mappings and lists

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUM = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"


def _split(value: object, field: str, kind: str, units: dict, example: str) -> tuple[float, str]:
    accepted = f"a number followed by one of {', '.join(units)} (e.g. {example})"
    if isinstance(value, bool) or not isinstance(value, str):
        raise SpecError(field, f"{quote(value)} is not a {kind}", accepted)
    m = re.fullmatch(_NUM + r"\s*([a-zA-Z%]+)", value.strip())
    if not m or m.group(2).lower() not in units:
        raise SpecError(field, f"{quote(value)} is not a {kind}", accepted)
    # 400 digits make float('inf'): every caller compares with its maximum, which refuses inf
    return float(m.group(1)), m.group(2).lower()


def _too_big(value: object, field: str, kind: str, limit: str) -> SpecError:
    return SpecError(field, f"{quote(value)} is over the limit of {limit}",
                     f"a {kind} of at most {limit} (README: Limits)")


def parse_choice(value: object, options: tuple[str, ...], field: str) -> str:
    """One of ``options``, or a SpecError naming the field and listing them."""
    if value not in options:
        raise SpecError(field, f"{quote(value)} is not accepted", f"one of: {', '.join(options)}")
    return value  # type: ignore[return-value]


def parse_int(value: object, field: str, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """A whole number in [minimum, maximum] (not a bool), or a SpecError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise SpecError(field, f"{quote(value)} is not accepted",
                        f"an integer >= {minimum} and <= {maximum}")
    return value


def parse_rate(value: object, field: str) -> int:
    """'200mbit' -> 200_000_000 bit/s. Zero and negative rates are refused."""
    num, unit = _split(value, field, "rate", _RATE_UNITS, "200mbit")
    bps = num * _RATE_UNITS[unit]
    if bps > MAX_RATE_BPS:
        raise _too_big(value, field, "rate", format_rate(MAX_RATE_BPS))
    if bps < MIN_RATE_BPS:
        raise SpecError(field, f"{quote(value)} is too small",
                        f"a rate of at least {format_rate(MIN_RATE_BPS)}")
    return round(bps)


def parse_size(value: object, field: str) -> int:
    """'16MiB' -> 16777216 bytes; a plain non-negative integer counts bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise SpecError(field, f"{quote(value)} is negative", "a size of 0 bytes or more")
        nbytes: float = value
    else:
        num, unit = _split(value, field, "size", _SIZE_UNITS, "16MiB")
        nbytes = num * _SIZE_UNITS[unit]
    if nbytes > MAX_SIZE_BYTES:
        raise _too_big(value, field, "size", format_size(MAX_SIZE_BYTES))
    return round(nbytes)


def parse_duration(value: object, field: str, allow_zero: bool = True,
                   maximum: float = MAX_DURATION_S) -> float:
    """'1ms' -> 0.001 seconds; at most ``maximum`` (a day unless the field says less)."""
    num, unit = _split(value, field, "duration", _TIME_UNITS, "10ms")
    seconds = num * _TIME_UNITS[unit]
    if seconds > maximum:
        raise _too_big(value, field, "duration", format_duration(maximum))
    if seconds == 0 and not allow_zero:
        raise SpecError(field, f"{quote(value)} is zero", "a duration greater than 0 (e.g. 500ms)")
    return seconds


def parse_percent(value: object, field: str) -> float:
    """'0.5%' -> 0.005. Values over 100 % are refused."""
    num, _ = _split(value, field, "percentage", {"%": 1}, "0.5%")
    if num > 100:
        raise SpecError(field, f"{quote(value)} is over 100%", "a percentage from 0% to 100%")
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
