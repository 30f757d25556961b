"""Expectations against metrics: pass or fail, always with the measured value and the bound.

A metric that was not measured (None) fails its expectation with "not measured" and the reason
the metrics module gave; it never passes by default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from testbed.model.scenario import SHARE_PREFIX, SIZED_PREFIX, Expectation

UNITS = {"failover_ms": "ms", "detection_ms": "ms", "recovery_ms": "ms", "busbw_mbps": "Mbit/s"}


def format_value(metric: str, value: Any) -> str:
    """A measured value for people: units for times and rates, 3 decimals for ratios."""
    if value is None:
        return "not measured"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        unit = UNITS.get(metric)
        if unit == "ms":
            return f"{value:.1f} ms"
        if unit:
            return f"{value:.1f} {unit}"
        if metric.startswith(SHARE_PREFIX) or metric.startswith("busbw_vs"):
            return f"{value:.3f}"
        return f"{value:g}"
    return str(value)


class Row(NamedTuple):
    metric: str
    expected: str        # the bound, as written ("<= 200", "0", "0.4..0.6")
    measured: Any        # the value (None: not measured)
    ok: bool
    note: str            # "" | "not measured: ..." | caveat from the metrics

    @property
    def status(self) -> str:
        return "PASS" if self.ok else "FAIL"


@dataclass
class Verdict:
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[str]:
        """One line per failed expectation naming metric, bound and value."""
        out = []
        for r in self.rows:
            if r.ok:
                continue
            line = f"{r.metric}: measured {format_value(r.metric, r.measured)}, " \
                   f"expected {r.expected}"
            if r.note:
                line += f" ({r.note})"
            out.append(line)
        return out

    def to_dict(self) -> dict:
        return {"passed": self.passed,
                "rows": [{"metric": r.metric, "expected": r.expected, "measured": r.measured,
                          "ok": r.ok, "status": r.status, "note": r.note} for r in self.rows],
                "failures": self.failures}


def judge(expectations: Sequence[Expectation], metrics: dict) -> Verdict:
    """Hold every expectation against ``metrics`` (from ``testbed.metrics.compute``). A metric
    that was not measured fails its expectation, with the reason as the row's note."""
    notes = metrics.get("notes") or {}
    rows = []
    for e in expectations:
        value = metrics.get(e.metric)
        if isinstance(value, bool):
            value = int(value)
        ok = e.holds(value) if isinstance(value, (int, float)) or value is None else False
        note = ""
        if value is None:
            why = notes.get(e.metric) or (
                notes.get("rail_share") if e.metric.startswith(SHARE_PREFIX) else
                notes.get("busbw_vs_single_rail") or "that size was not run by both systems"
                if e.metric.startswith(SIZED_PREFIX) else None)
            note = "not measured" + (f": {why}" if why else "")
        elif e.metric in notes:
            note = notes[e.metric]
        rows.append(Row(e.metric, e.describe(), value, bool(ok), note))
    return Verdict(rows)
