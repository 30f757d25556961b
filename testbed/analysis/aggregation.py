"""aggregation_rejoin_ms: how long an aggregation rail's switch, back after a fault, waits
before Nezha gives it its share of the allreduce again.

Per fault that ended on an aggregation rail (a ``kill`` of the rail's switch with ``for``,
or a link-down / blackhole / flap of the rail or one of its links): from the moment the
switch is back and Nezha knows it was gone (the later of the fault's end, ``t_end``: for a
kill, when the restarted switch answered PING, and the first ``agg_down`` after the fault
began: a fault shorter than the detection ends before it) to the first ``agg_back`` event of
any rank after that (every rank takes the switch back at the same operation). The worst
fault counts; a fault after which the switch never came back is a note, not a value.
"""
from __future__ import annotations

from typing import Optional, Sequence

from testbed.model.records import RAIL_REMOVING, FaultRecord, is_num


def _aggregation_rails(topo) -> set[str]:
    return {r.name for r in topo.rails if getattr(r, "protocol", "tcp") == "aggregation"}


def _fault_rail(f: FaultRecord) -> Optional[str]:
    if f.target_kind == "rail":
        return str(f.target)
    if f.target_kind == "link":
        return str(f.target).partition(".")[2]
    return None


def _start(f: FaultRecord) -> float:
    """When the fault began (its first change issued, else applied)."""
    t = f.t_issued if is_num(f.t_issued) else f.t_applied
    return float(t) if is_num(t) else float("-inf")


def rejoin_ms(topo, faults: Sequence[FaultRecord],
              events: Sequence[dict]) -> tuple[Optional[float], str]:
    """(worst rejoin in ms, note). None with a note when nothing could be measured."""
    agg = _aggregation_rails(topo)
    ended = [f for f in faults if _fault_rail(f) in agg and is_num(f.t_end)
             and (f.action == "kill" or f.action in RAIL_REMOVING)]
    if not ended:
        return None, "no fault on an aggregation rail ended"
    def times(name: str) -> list[float]:
        return sorted(e["t"] for e in events if e.get("event") == name and is_num(e.get("t")))
    backs, downs = times("agg_back"), times("agg_down")
    worst: Optional[float] = None
    starts = sorted(_start(f) for f in ended)
    for f in ended:
        start = _start(f)
        until = min((t for t in starts if t > start), default=float("inf"))
        known = [t for t in downs if start <= t < until]   # not the next fault's down
        since = max(f.t_end, known[0]) if known else f.t_end
        after = [t for t in backs if t >= since]
        if not after:
            return None, f"fault {f.index} ({f.label}): the switch never rejoined"
        ms = (after[0] - since) * 1000.0
        worst = ms if worst is None else max(worst, ms)
    return worst, ""
