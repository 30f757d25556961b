"""The logs the ranks wrote, and every source merged into one timeline on one monotonic clock.

CLOCK_MONOTONIC is shared by all namespaces of one machine, so kernel samples, fault records,
Nezha events and iteration records are compared directly, without any clock correction.

* ``load_iterations`` / ``load_events`` read the ranks' ``--results`` and event-log files
  (JSON lines; a rank killed mid-write leaves a truncated last line, which is skipped).
* ``Timeline`` merges kernel observations, fault records, Nezha events and iteration records,
  sorted by time, and writes them as ``timeline.jsonl``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

from testbed.model.records import (FaultRecord, FlowRecord, IterationRecord, as_iterations,
                                   jsonable, load_jsonl)

if TYPE_CHECKING:
    from testbed.analysis.sampler import Samples

__all__ = ["Timeline", "by_time", "load_events", "load_iterations", "rail_name"]


# ---------------------------------------------------------------------------------- logs
def load_iterations(paths: Iterable[str | Path]
                    ) -> tuple[list[IterationRecord], list[IterationRecord]]:
    """(iteration records, summary lines) from the ranks' ``--results`` files. Lines without
    ``iter`` are ignored; a missing summary (killed rank) is simply absent."""
    recs, summaries = [], []
    for p in paths:
        for rec in map(IterationRecord.from_dict, load_jsonl(p)):
            if rec.summary:
                summaries.append(rec)
            elif rec.has_iter:
                recs.append(rec)
    return recs, summaries


def load_events(paths: Iterable[str | Path]) -> list[dict]:
    """Every rank's Nezha events, sorted by ``t``; lines without a numeric ``t`` are dropped."""
    return by_time(e for p in paths for e in load_jsonl(p))


def by_time(events: Iterable[dict]) -> list[dict]:
    """Events in time order, those without a numeric ``t`` dropped: the ranks' logs are read
    one rank after another, so their order says which rank wrote first, not what came first."""
    return sorted((e for e in events if isinstance(e.get("t"), (int, float))),
                  key=lambda e: e["t"])


def rail_name(value: Any, rails: Sequence[str]) -> Optional[str]:
    """A rail as Nezha logs it (index, "1", or a name) -> the topology's rail name."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return rails[value] if 0 <= value < len(rails) else None
    s = str(value)
    if s in rails:
        return s
    if s.isdigit() and int(s) < len(rails):
        return rails[int(s)]
    return None


# ---------------------------------------------------------------------------------- timeline
def _fault_rows(faults: Sequence[FaultRecord]) -> list[dict]:
    recs = []
    for f in faults:
        base = {"index": f.index, "action": f.action, "target": f.target, "label": f.label,
                "rails": f.rails, "links": f.links}
        if f.t_applied is not None:
            recs.append({"t": f.t_applied, "source": "fault", "kind": "fault_start",
                         "at": f.at, **base})
        for tog in f.toggles:
            if tog.t is not None:
                recs.append({"t": tog.t, "source": "fault", "kind": "fault_toggle",
                             "state": tog.state, **base})
        if f.t_end is not None:
            recs.append({"t": f.t_end, "source": "fault", "kind": "fault_end", **base})
    return recs


def _event_rows(events: Sequence[dict], rail_names: Sequence[str]) -> list[dict]:
    recs = []
    for e in events:
        if not isinstance(e.get("t"), (int, float)):
            continue
        rec = dict(e)
        rec.update(source="nezha", kind=str(e.get("event", "?")))
        if "rail" in e and rail_names:
            rec["rail_name"] = rail_name(e["rail"], rail_names)
        recs.append(rec)
    return recs


def _flow_rows(flows: Sequence[FlowRecord]) -> list[dict]:
    """A competing flow's start and end (traffic faults), with what it delivered."""
    out = []
    for fl in flows:
        base = {"source": "traffic", "fault": fl.fault, "proto": fl.proto, "rail": fl.rail,
                "src": fl.src, "dst": fl.dst}
        if fl.t_start is not None:
            out.append({"t": fl.t_start, "kind": "flow_start", **base,
                        "offered_mbps": fl.offered_bps / 1e6})
        if fl.t_end is not None:
            rate = fl.rate_bps("received")
            out.append({"t": fl.t_end, "kind": "flow_end", **base,
                        "received_mbps": None if rate is None else rate / 1e6})
    return out


def _iteration_rows(iterations: Sequence[IterationRecord]) -> list[dict]:
    return [{"t": it.t_end, "source": "iteration", "kind": "iteration_end", "rank": it.rank,
             "iter": it.iter, "ok": it.ok, "bytes": it.bytes,
             "latency_s": it.t_end - it.t_start if it.t_start is not None else None,
             "system": it.system, "phase": it.phase}
            for it in iterations if it.t_end is not None]


@dataclass
class Timeline:
    """Records from every source on one monotonic clock, sorted by ``t``.

    Every record has ``t`` (monotonic s), ``t_rel`` (s since the run's t0), ``source``
    (kernel | fault | nezha | iteration | traffic) and ``kind``:
    kernel: ``goodput`` (per-rail Mbit/s over the last ``summary_s``), ``link_down`` /
    ``link_up`` (first sample with the changed state), ``traffic_stop`` / ``traffic_resume``
    (a link's rx counter flat for >= ``min_idle``; stop = first flat sample);
    fault: ``fault_start`` / ``fault_toggle`` / ``fault_end``; nezha: the event name;
    iteration: ``iteration_end`` (one per rank and iteration, with latency and ok);
    traffic: ``flow_start`` / ``flow_end`` (a traffic fault's competing flow)."""

    t0: float
    records: list[dict] = field(default_factory=list)

    @classmethod
    def merge(cls, samples: Optional["Samples"] = None,
              faults: Sequence[FaultRecord] = (),
              events: Sequence[dict] = (),
              iterations: Sequence[Union[IterationRecord, Mapping]] = (),
              t0: Optional[float] = None, rails: Optional[Sequence[str]] = None,
              summary_s: float = 0.1, min_idle: float = 0.04,
              flows: Sequence[FlowRecord] = ()) -> "Timeline":
        iterations = as_iterations(iterations)   # records, or the dicts the ranks wrote
        if t0 is None:
            cands = [f.t_applied for f in faults if f.t_applied is not None]
            if samples:
                cands.append(samples.span[0])
            t0 = min(cands) if cands else 0.0
        rail_names = list(rails) if rails else (list(samples.rails) if samples else [])
        recs = cls._kernel(samples, t0, summary_s, min_idle) if samples else []
        recs += _fault_rows(faults) + _event_rows(events, rail_names) + \
            _iteration_rows(iterations) + _flow_rows(flows)
        for r in recs:
            r["t_rel"] = r["t"] - t0
        recs.sort(key=lambda r: r["t"])
        return cls(t0, recs)

    @staticmethod
    def _kernel(samples: "Samples", t0: float, summary_s: float, min_idle: float) -> list[dict]:
        return _goodput_rows(samples, t0, summary_s) + _link_rows(samples, min_idle)

    def of(self, source: Optional[str] = None, kind: Optional[str] = None) -> list[dict]:
        return [r for r in self.records if (source is None or r["source"] == source)
                and (kind is None or r["kind"] == kind)]

    def between(self, t1: float, t2: float) -> list[dict]:
        return [r for r in self.records if t1 <= r["t"] <= t2]

    def write(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps(jsonable(r)) + "\n")

    def __len__(self) -> int:
        return len(self.records)


def _goodput_rows(samples: "Samples", t0: float, summary_s: float) -> list[dict]:
    """Per-rail goodput over each ``summary_s`` window, on a grid aligned with t0."""
    out = []
    lo, hi = samples.span
    if not math.isfinite(lo):
        return out
    start = t0 + math.ceil((lo - t0) / summary_s - 1e-9) * summary_s
    rates = samples.rates(summary_s, start=start, end=hi)
    for i in range(len(rates)):
        rails = {r: (None if math.isnan(v[i]) else round(float(v[i]) / 1e6, 3))
                 for r, v in rates.rail_bps.items()}
        if all(v is None for v in rails.values()):
            continue
        out.append({"t": float(rates.edges[i + 1]), "source": "kernel",
                    "kind": "goodput", "window_s": summary_s, "rails_mbps": rails})
    return out


def _link_rows(samples: "Samples", min_idle: float) -> list[dict]:
    """Link state changes and traffic stops/resumptions, per link."""
    out = []
    for s in samples.links.values():
        if len(s) == 0:
            continue
        where = {"link": s.link, "rail": s.rail, "host": s.host}
        prev = bool(s.up[0])
        for i in range(1, len(s)):
            cur = bool(s.up[i])
            if cur != prev:
                out.append({"t": float(s.t[i]), "source": "kernel",
                            "kind": "link_up" if cur else "link_down", **where})
            prev = cur
        for t_stop, t_resume in samples.idle_periods(s.link, min_idle):
            out.append({"t": t_stop, "source": "kernel", "kind": "traffic_stop", **where})
            if t_resume is not None:
                out.append({"t": t_resume, "source": "kernel", "kind": "traffic_resume",
                            **where, "idle_s": t_resume - t_stop})
    return out
