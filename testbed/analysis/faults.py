"""Every fault of a run, in time order: its row of per-fault metrics, and detection_ms,
failover_ms and recovery_ms tallied over the faults they apply to (the definitions of the three
are in failover.py; here is only which fault gets which, and against what).

A fault that takes rails out (link-down, blackhole, flap) gets detection and failover; one that
heals rails (its own end, or an explicit link-up after a rail-removing fault) gets recovery.
Without kernel samples a fault's failover and recovery are None with the reason "no kernel
samples": never a pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from testbed.analysis.failover import (REROUTE_GRACE_S, FaultContext, Span, detection, failover,
                                       fault_rails, fault_start, first_end_after,
                                       iteration_stall, recovery)
from testbed.analysis.sampler import Rates
from testbed.model.records import (DEGRADING, RAIL_REMOVING, Detection, FaultMetrics, FaultRecord,
                                   is_num)


@dataclass
class Tally:
    """One metric over the faults of a run: the values, and why a fault has none."""

    values: list[float] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def add(self, value: Optional[float], why_missing: str) -> None:
        if value is None:
            self.missing.append(why_missing)
        else:
            self.values.append(value)


@dataclass
class FaultTallies:
    """The per-fault rows and the detection / failover / recovery tallies over them."""

    rows: list[FaultMetrics] = field(default_factory=list)
    detection_ms: Tally = field(default_factory=Tally)
    failover_ms: Tally = field(default_factory=Tally)
    recovery_ms: Tally = field(default_factory=Tally)


def _onset_limit(f: FaultRecord, det: Detection, table: Sequence[dict]) -> Optional[float]:
    """Until when a stall can still be the failover: the end of the iteration in flight at the
    fault or, once detected, the moment the failed rail's work was moved (the surviving rails
    can only be waiting for the failover until then)."""
    onset = first_end_after(f.t_applied, table)
    if det.detection_ms is not None:
        moved = fault_start(f) + det.detection_ms / 1e3 + REROUTE_GRACE_S
        onset = moved if onset is None else min(onset, moved)
    return onset


@dataclass
class _RunFaults:
    """The faults of one run (ordered by t_applied) and what they are analysed against;
    ``ctx`` is None when there are no kernel samples."""

    ordered: Sequence[FaultRecord]
    events: Sequence[dict]
    rails: Sequence[str]
    table: Sequence[dict]
    ctx: Optional[FaultContext]

    def removing(self, i: int, fr: list[str], row: FaultMetrics, label: str,
                 out: FaultTallies) -> None:
        """Detection and failover of the i-th fault, which takes out the rails ``fr``."""
        f = self.ordered[i]
        nxt = [g.t_applied for g in self.ordered[i + 1:]
               if set(fault_rails(g, self.rails)) & set(fr) and g.action in RAIL_REMOVING]
        row.detection = det = detection(f, self.events, self.rails, fr,
                                        until=min(nxt, default=math.inf))
        out.detection_ms.add(det.detection_ms, f"{label}: Nezha logged no rail_down for "
                             + ", ".join(r for r in fr if det.by_rail[r]["detection_ms"] is None))
        if self.ctx is None:
            out.failover_ms.add(None, f"{label}: no kernel samples")
            return
        row.failover = fo = failover(f, fr, self.ctx, _onset_limit(f, det, self.table))
        row.iteration_stall_ms = iteration_stall(f.t_applied, self.table)
        out.failover_ms.add(fo.failover_ms, f"{label}: {fo.note}")

    def healed(self, i: int, fr: list[str]) -> Optional[tuple[float, float]]:
        """(heal time, reference time) if the i-th fault healed rails: its own end, or an
        explicit link-up after an earlier rail-removing fault on the same rails."""
        f = self.ordered[i]
        if fr and f.t_end is not None and f.action in RAIL_REMOVING + DEGRADING:
            return f.t_end, f.t_applied
        if fr and f.action == "link-up":
            prev = [g for g in self.ordered[:i] if g.action in RAIL_REMOVING
                    and set(fault_rails(g, self.rails)) & set(fr)]
            if prev:
                return f.t_applied, prev[-1].t_applied
        return None

    def recovery(self, i: int, fr: list[str], row: FaultMetrics, label: str,
                 out: FaultTallies) -> None:
        """Recovery of the i-th fault, if it healed rails."""
        healed = self.healed(i, fr)
        if healed is None:
            return
        if self.ctx is None:
            out.recovery_ms.add(None, f"{label}: no kernel samples")
            return
        row.recovery = rc = recovery(*healed, fr, self.ctx)
        out.recovery_ms.add(rc.recovery_ms, f"{label}: {rc.note}")


def analyse_faults(faults: Sequence[FaultRecord], events: Sequence[dict], rails: Sequence[str],
                   table: Sequence[dict], t0: float, rates: Optional[Rates],
                   windows: Sequence[Span], floor_bps: float) -> FaultTallies:
    """Every fault with a t_applied, in time order: its row, and its detection / failover /
    recovery values (or why it has none) tallied per metric."""
    ordered = sorted([f for f in faults if is_num(f.t_applied)], key=lambda f: f.t_applied)
    ctx = None
    if rates is not None and len(rates):
        spans = [(r["t_start"], r["t_end"]) for r in table
                 if r["t_start"] is not None and r["t_end"] is not None]
        ctx = FaultContext(rates, rails, ordered, windows, float(rates.edges[-1]), floor_bps,
                           spans)
    run = _RunFaults(ordered, events, rails, table, ctx)
    out = FaultTallies()
    for i, f in enumerate(ordered):
        fr = fault_rails(f, rails)
        index = f.index if f.index is not None else i
        label = f"fault {index} ({f.label or f.action})"
        row = FaultMetrics(index, f.label, f.action, fr, f.t_applied - t0,
                           None if f.t_end is None else f.t_end - t0)
        if f.action in RAIL_REMOVING and fr:
            run.removing(i, fr, row, label, out)
        run.recovery(i, fr, row, label, out)
        out.rows.append(row)
    return out
