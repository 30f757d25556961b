"""Typed records of what crosses the run boundary: what the run observed (fault records, the ranks'
iteration lines) and what the analysis made of it (per-fault metrics, the metrics, the verdict).

The run (``testbed.run``) produces ``FaultRecord`` and ``IterationRecord``; the analysis
(``testbed.analysis``) reads them and produces ``FaultMetrics``, ``Metrics`` and ``Verdict``.
The analysis imports nothing of the run (only these records), so data flows one way; only the
pipeline driver, ``run/runner.py``, calls into the analysis.

JSON conversion lives here and only here: ``to_dict`` gives exactly the keys results.json and
timeline.jsonl have always had; ``IterationRecord.from_dict`` reads a line a rank wrote
(tolerant: a garbled line or a hand-written test dict may lack keys). ``jsonable`` turns what is
left (numpy numbers, non-finite floats, sets) into plain JSON.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Union

import numpy as np

from testbed.model.scenario import SHARE_PREFIX

# fault kinds by what they do to a rail: the analysis and the fault schedule share these
RAIL_REMOVING = ("link-down", "blackhole", "flap")   # the rail carries nothing while active
DEGRADING = ("rate", "loss", "delay", "traffic")      # the rail carries less while active
SHAPING = ("rate", "loss", "blackhole", "delay")      # applied as a layer over the link's shape


# ------------------------------------------------------------------------------------ JSON
def jsonable(v: Any) -> Any:
    """Plain JSON values: numpy numbers to Python, NaN/inf to None, sets and tuples to lists,
    anything else unknown to its str()."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, np.floating):
        return jsonable(float(v))
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.ndarray):
        return jsonable(v.tolist())
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [jsonable(x) for x in v]
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    return str(v)


def load_jsonl(path: Union[str, Path]) -> list[dict]:
    """JSON objects, one per line. Blank lines, non-objects and a truncated last line (a rank
    killed mid-write) are skipped; a missing file gives []. Here rather than in the analysis
    because the run (collecting the ranks' files) and the analysis (re-reading a results folder)
    both read these files."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    out.append(obj)
    except FileNotFoundError:
        return []
    return out


def is_num(v: Any) -> bool:
    """A finite int or float (not a bool): what a time or a count must be to be used."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _time(v: Any) -> Optional[float]:
    """A time as a rank or the fault thread wrote it; anything not a finite number is None."""
    return float(v) if is_num(v) else None


# ------------------------------------------------------------------------------------ faults
@dataclass
class Toggle:
    """One state change of a flapping fault."""

    t: Optional[float]
    state: str            # "down" | "up"

    def to_dict(self) -> dict:
        return {"t": self.t, "state": self.state}


@dataclass
class FaultRecord:
    """What the fault schedule did, on the run's monotonic clock.

    ``t_issued``: its first netlink change was issued; ``t_applied``: its last change was
    acknowledged (a rail-wide fault takes one change per link end); ``t_end``: it was undone
    (None: never, or not yet)."""

    index: Optional[int]
    action: str
    target: str = ""
    target_kind: Optional[str] = None     # link | rail | host
    label: Optional[str] = None
    at: Optional[float] = None            # scheduled offset, s after the run's t0
    duration: Optional[float] = None      # "for" in the topology file and in results.json
    t_issued: Optional[float] = None
    t_applied: Optional[float] = None
    t_end: Optional[float] = None
    rails: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    toggles: list[Toggle] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"index": self.index, "action": self.action, "target": self.target,
                "target_kind": self.target_kind, "label": self.label, "at": self.at,
                "for": self.duration, "t_issued": self.t_issued, "t_applied": self.t_applied,
                "t_end": self.t_end, "rails": list(self.rails), "links": list(self.links),
                "toggles": [t.to_dict() for t in self.toggles]}


@dataclass
class FlowRecord:
    """One competing flow of a ``traffic`` fault (testbed/run/traffic.py): who sent to whom on
    which rail, and what each end counted. ``sent`` / ``received``: (monotonic t, cumulative
    payload bytes) about every 100 ms, as the flow's own ends wrote them; ``factor``: payload
    bytes per byte of Ethernet frame (to estimate the flow's share of the kernel's L2
    counters); ``t_start`` / ``t_end``: when the sender began and stopped sending."""

    fault: int
    proto: str
    rail: str
    src: str
    dst: str
    offered_bps: float
    factor: float
    t_start: Optional[float] = None
    t_end: Optional[float] = None
    sent: list[tuple[float, int]] = field(default_factory=list)
    received: list[tuple[float, int]] = field(default_factory=list)
    pid_send: Optional[int] = None
    pid_recv: Optional[int] = None

    @property
    def links(self) -> list[str]:
        """The links whose counters carry this flow: the sender's and the receiver's."""
        return [f"{self.src}.{self.rail}", f"{self.dst}.{self.rail}"]

    def rate_bps(self, which: str = "received") -> Optional[float]:
        """Mean payload rate over the time the sender was sending (None: it never did)."""
        pts = getattr(self, which)
        if self.t_start is None or self.t_end is None or self.t_end <= self.t_start or not pts:
            return None
        inside = [b for t, b in pts if t <= self.t_end + 0.2]
        before = [b for t, b in pts if t <= self.t_start]
        n = (inside[-1] if inside else 0) - (before[-1] if before else 0)
        return n * 8 / (self.t_end - self.t_start)

    def to_dict(self) -> dict:
        return {"fault": self.fault, "proto": self.proto, "rail": self.rail, "src": self.src,
                "dst": self.dst, "links": self.links, "offered_bps": self.offered_bps,
                "factor": self.factor, "t_start": self.t_start, "t_end": self.t_end,
                "sent_bps": self.rate_bps("sent"), "received_bps": self.rate_bps("received"),
                "sent_bytes": self.sent[-1][1] if self.sent else 0,
                "received_bytes": self.received[-1][1] if self.received else 0}


# ------------------------------------------------------------------------------------ iterations
@dataclass
class IterationRecord:
    """One line a rank wrote to its results file (``NEZHA_RESULTS``), plus where it ran.

    An iteration line has ``iter``; a rank's last line is a summary (``summary: true``); a
    ``command`` workload may write lines of its own (neither). Times are monotonic seconds;
    a value that is not a finite number (a garbled line) is None. Keys the analysis does not
    read are kept in ``extra``."""

    rank: Optional[int] = None
    iter: Any = None
    phase: Any = 0
    system: Optional[str] = None
    bytes: Any = None
    t_start: Optional[float] = None
    t_end: Optional[float] = None
    ok: Optional[bool] = None             # None: the rank did not check
    warmup: bool = False
    summary: bool = False
    has_iter: bool = False                # the line had an ``iter`` key (an iteration line)
    extra: dict = field(default_factory=dict)

    _KEYS = ("rank", "iter", "phase", "system", "bytes", "t_start", "t_end", "ok", "warmup",
             "summary")

    @property
    def is_iteration(self) -> bool:
        return self.has_iter and not self.summary

    @property
    def done(self) -> bool:
        """Both ends of the collective were recorded."""
        return self.t_start is not None and self.t_end is not None

    @classmethod
    def from_dict(cls, d: Mapping) -> "IterationRecord":
        return cls(rank=d.get("rank"), iter=d.get("iter"), phase=d.get("phase", 0),
                   system=d.get("system"), bytes=d.get("bytes"), t_start=_time(d.get("t_start")),
                   t_end=_time(d.get("t_end")), ok=d.get("ok"), warmup=bool(d.get("warmup")),
                   summary=bool(d.get("summary")), has_iter="iter" in d,
                   extra={k: v for k, v in d.items() if k not in cls._KEYS})


def as_iterations(recs: Iterable[Union[IterationRecord, Mapping]]) -> list[IterationRecord]:
    """Iteration records, from records or the dicts a rank wrote."""
    return [r if isinstance(r, IterationRecord) else IterationRecord.from_dict(r) for r in recs]


# ------------------------------------------------------------------------------------ per fault
@dataclass
class Detection:
    """detection_ms of one rail-removing fault, and per rail what Nezha logged first."""

    detection_ms: Optional[float]
    by_rail: dict[str, dict] = field(default_factory=dict)


@dataclass
class Failover:
    """failover_ms of one rail-removing fault. The optional fields are reported only when the
    analysis got that far (None: absent from results.json)."""

    failover_ms: Optional[float] = None
    note: Optional[str] = None
    note_pattern: Optional[str] = None
    natural_gap_ms: Optional[float] = None
    level_mbps: Optional[float] = None
    later_dips_ms: Optional[list[float]] = None
    stalls: Optional[list[dict]] = None

    _OPTIONAL = ("note_pattern", "natural_gap_ms", "level_mbps", "later_dips_ms", "stalls")

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"failover_ms": self.failover_ms}
        out.update({k: getattr(self, k) for k in self._OPTIONAL if getattr(self, k) is not None})
        return out


@dataclass
class Recovery:
    """recovery_ms after one fault healed, and per rail its pre-fault share and recovery."""

    recovery_ms: Optional[float] = None
    note: Optional[str] = None
    by_rail: dict[str, dict] = field(default_factory=dict)


@dataclass
class FaultMetrics:
    """What the analysis found for one fault (a row of ``detail.faults`` in results.json).
    ``detection``/``failover`` exist for rail-removing faults, ``recovery`` for healed ones."""

    index: int
    label: Optional[str]
    action: str
    rails: list[str]
    t_applied_rel: float
    t_end_rel: Optional[float]
    detection: Optional[Detection] = None
    failover: Optional[Failover] = None
    iteration_stall_ms: Optional[float] = None
    recovery: Optional[Recovery] = None
    adaptation: Optional[list[dict]] = None    # per change (start/end): adaptation.Change

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"index": self.index, "label": self.label, "action": self.action,
                               "rails": self.rails, "t_applied_rel": self.t_applied_rel,
                               "t_end_rel": self.t_end_rel}
        if self.detection is not None:
            out.update(detection_ms=self.detection.detection_ms,
                       detection_by_rail=self.detection.by_rail)
        if self.failover is not None:
            out.update(self.failover.to_dict(), failover_note=self.failover.note,
                       iteration_stall_ms=self.iteration_stall_ms)
        if self.recovery is not None:
            out.update(recovery_ms=self.recovery.recovery_ms,
                       recovery_by_rail=self.recovery.by_rail, recovery_note=self.recovery.note)
        if self.adaptation is not None:
            out["adaptation"] = self.adaptation
        return out


# ------------------------------------------------------------------------------------ metrics
@dataclass
class Metrics(Mapping):
    """The metrics of one run. As a mapping it holds the values only: every name of
    ``scenario.METRICS``, ``rail_share.<rail>``, ``busbw_vs_single_rail.<size>``; None is
    "not measured" (the reason is in ``notes``), never a pass. ``faults`` is the per-fault
    breakdown; ``detail`` the rest (per-rail goodput, per-iteration latency, bus bandwidth by
    system and size, sampler bookkeeping), JSON-ready."""

    values: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    faults: list[FaultMetrics] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def detail_dict(self) -> dict:
        """``detail`` with the per-fault rows in it, as results.json has it (after
        ``windows``, where they have always been)."""
        faults = [f.to_dict() for f in self.faults]
        out: dict[str, Any] = {}
        for k, v in self.detail.items():
            out[k] = v
            if k == "windows":
                out["faults"] = faults
        out.setdefault("faults", faults)
        return out


# ------------------------------------------------------------------------------------ verdict
UNITS = {"failover_ms": "ms", "detection_ms": "ms", "recovery_ms": "ms", "adaptation_ms": "ms",
         "busbw_mbps": "Mbit/s", "step_time_ms": "ms", "samples_per_s": "samples/s"}


def format_value(metric: str, value: Any) -> str:
    """A measured value for people: units for times and rates, 3 decimals for ratios."""
    if value is None:
        return "not measured"
    if isinstance(value, bool):
        return str(value).lower()     # as an expectation writes it: true / false
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
    """Every expectation held against the metrics; passed only if every row is ok."""

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
