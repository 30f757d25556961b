"""Expectations against metrics: pass or fail, always with the measured value and the bound.

A metric that was not measured (None) fails its expectation with "not measured" and the reason
the metrics module gave; it never passes by default. ``Verdict`` and ``Row`` are records
(testbed.model.records): a verdict crosses the run boundary in ``RunOutcome``.
"""
from __future__ import annotations

from typing import Sequence

from testbed.model.records import Metrics, Row, Verdict
from testbed.model.scenario import SHARE_PREFIX, SIZED_PREFIX, Expectation


def _why_not_measured(metric: str, notes: dict) -> str:
    why = notes.get(metric) or (
        notes.get("rail_share") if metric.startswith(SHARE_PREFIX) else
        notes.get("busbw_vs_single_rail") or "that size was not run by both systems"
        if metric.startswith(SIZED_PREFIX) else None)
    return "not measured" + (f": {why}" if why else "")


def judge(expectations: Sequence[Expectation], metrics: Metrics) -> Verdict:
    """Hold every expectation against ``metrics`` (from ``analysis.metrics.compute``). A metric
    that was not measured fails its expectation, with the reason as the row's note."""
    notes = metrics.notes
    rows = []
    for e in expectations:
        measured = value = metrics.get(e.metric)
        if isinstance(value, bool):     # loss_matches_reference: true holds as 1..1
            value = int(value)
        ok = e.holds(value) if isinstance(value, (int, float)) or value is None else False
        note = ""
        if value is None:
            note = _why_not_measured(e.metric, notes)
        elif e.metric in notes:
            note = notes[e.metric]
        rows.append(Row(e.metric, e.describe(), measured, bool(ok), note))
    return Verdict(rows)
