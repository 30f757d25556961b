"""What kernel MPTCP did in a run, from ``mptcp_events.jsonl`` (testbed/run/mptcp_monitor.py):
subflows per connection, joins that failed, and per fault what the path manager and the
MPTCP-level counters showed between its start and AFTER_S after its end.

``annotate`` adds ``t`` (seconds since the run's t0) to every line of the file; ``summarise``
returns the summary (results.json ``mptcp``); ``describe`` is its text
(``mptcp_summary.txt``).
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional, Sequence

AFTER_S = 3.0            # a fault's window runs until this long after its end
# the MPTcpExt counters that tell what happened to subflows (the rest is in the file)
KEY_COUNTERS = ("SubflowStale", "SubflowRecover", "MPTCPRetrans", "DuplicateData", "RmSubflow",
                "MPJoinSynTx", "MPJoinAckRx", "MPFailTx", "MPRstTx", "Blackhole")
_SUBFLOW_EVENTS = ("SF_ESTABLISHED", "SF_CLOSED", "SF_PRIORITY", "CREATED", "CLOSED",
                   "ANNOUNCED", "REMOVED")


def load(path: Path) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue
    except FileNotFoundError:
        pass
    return out


def annotate(path: Path, t0: float) -> list[dict]:
    """Every event with ``t`` = mono - t0, written back to the file."""
    events = load(path)
    for e in events:
        if "mono" in e:
            e["t"] = round(e["mono"] - t0, 6)
    if events:
        Path(path).write_text("".join(json.dumps(e) + "\n" for e in events))
    return events


def _window_counts(events: Sequence[dict], lo: float, hi: float) -> dict:
    kinds = Counter(e["event"] for e in events if lo <= e.get("t", -1e9) < hi
                    and e["event"] in _SUBFLOW_EVENTS)
    mib: Counter = Counter()
    first_stale = None
    for e in events:
        if e["event"] == "MIB" and lo <= e.get("t", -1e9) < hi:
            for k in KEY_COUNTERS:
                mib[k] += e["delta"].get(k, 0)
            if e["delta"].get("SubflowStale") and first_stale is None:
                first_stale = e["t"]
    closed = [e for e in events if e["event"] == "SF_CLOSED" and lo <= e.get("t", -1e9) < hi]
    return {"events": dict(kinds), "counters": {k: v for k, v in mib.items() if v},
            "first_stale_s": first_stale,
            "subflows_closed": [{"t": e["t"], "host": e["host"], "saddr": e.get("saddr"),
                                 "daddr": e.get("daddr"), "error": e.get("error")}
                                for e in closed][:20]}


def summarise(events: Sequence[dict], faults: Sequence = ()) -> dict:
    """Connections and their subflows; per fault (FaultRecord-like dicts or objects with
    t_applied/t_end relative to t0 in ``t_start_rel``/``t_end_rel``), what happened."""
    conns: dict = defaultdict(lambda: {"subflows": 1, "closed": 0, "failed_joins": 0})
    for e in events:
        key = (e.get("host"), e.get("token"))
        if e["event"] == "CREATED":
            conns[key]
        elif e["event"] == "SF_ESTABLISHED" and key in conns:
            conns[key]["subflows"] += 1
        elif e["event"] == "SF_CLOSED" and key in conns:
            conns[key]["closed"] += 1
    failed = Counter(e.get("error") for e in events if e["event"] == "SF_CLOSED"
                     and e.get("error"))
    paths = Counter(f"{e.get('saddr')}->{e.get('daddr')}" for e in events
                    if e["event"] == "SF_ESTABLISHED")
    per_fault = []
    for f in faults:
        lo, hi = f["t_start_rel"], f["t_end_rel"]
        per_fault.append({"fault": f.get("label"), "start_s": lo, "end_s": hi,
                          **_window_counts(events, lo, (hi if hi is not None else lo)
                                           + AFTER_S)})
    return {
        "connections": len(conns),
        "subflows_per_connection": dict(Counter(c["subflows"] for c in conns.values())),
        "subflows_closed": sum(c["closed"] for c in conns.values()),
        "failed_subflow_errors": {str(k): v for k, v in failed.items()},
        "subflow_paths": len(paths),
        "cross_rail_subflows": sum(n for p, n in paths.items() if _cross(p)),
        "faults": per_fault,
    }


def _cross(path: str) -> bool:
    """A subflow between two different rails' networks (198.18.R.H: the third octet)."""
    try:
        a, b = path.split("->")
        return a.split(".")[2] != b.split(".")[2]
    except (ValueError, IndexError):
        return False


def describe(summary: dict) -> str:
    lines = [f"MPTCP: {summary['connections']} connection ends; subflows per connection "
             f"{summary['subflows_per_connection']}; {summary['subflows_closed']} subflows "
             f"closed; failed joins by errno {summary['failed_subflow_errors'] or '{}'}; "
             f"{summary['cross_rail_subflows']} subflows between two rails' addresses"]
    for f in summary["faults"]:
        end = f"{f['end_s']:.2f}" if f["end_s"] is not None else "-"
        stale = f"{f['first_stale_s'] - f['start_s']:.2f} s after its start" \
            if f["first_stale_s"] is not None else "none"
        lines.append(f"  {f['fault']} ({f['start_s']:.2f}-{end} s, +{AFTER_S:g} s): events "
                     f"{f['events'] or '{}'}; counters {f['counters'] or '{}'}; first "
                     f"SubflowStale {stale}")
    return "\n".join(lines)


def report(out: Path, t0: float, faults: Sequence) -> Optional[dict]:
    """The results folder's MPTCP evidence, when the run recorded any: the file gets ``t``,
    ``mptcp_summary.txt`` is written; returns the summary (None without a file)."""
    path = Path(out) / "mptcp_events.jsonl"
    if not path.exists():
        return None
    events = annotate(path, t0)
    fs = [{"label": f.label, "t_start_rel": (f.t_applied - t0) if f.t_applied is not None
           else None, "t_end_rel": (f.t_end - t0) if f.t_end is not None else None}
          for f in faults if f.t_applied is not None]
    summary = summarise(events, fs)
    (Path(out) / "mptcp_summary.txt").write_text(describe(summary) + "\n")
    return summary
