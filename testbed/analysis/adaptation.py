"""adaptation_ms: how long Nezha's split takes to follow a rail that changes.

A *change* is the start or the end of a ``rate`` or ``traffic`` fault, and the end of a
rail-removing one (link-down, blackhole, flap: the rail's return). For each change at time tc
(the fault's first netlink change, ``fault_start``, or its ``t_end``):

* **the new optimum split**: each rail's capacity under the faults active just after tc, fed to
  the bottleneck-aware optimum of ``testbed.shapes.optimum`` (a ring runs at its slowest hop;
  a rail's share of the optimum = its ring's goodput / the sum over rails). A link's capacity:
  its shaped rate; 0 while a rail-removing fault holds it; the lowest active ``rate`` fault;
  minus competing traffic: a UDP flow takes what it delivered (its receiver's count over the
  fault, as L2 bytes; the offered rate when not measured), so the capacity left is
  rate - that; a TCP flow (capped at the offered rate v) shares a link fairly with the
  workload's one flow there, so the capacity left is max(rate - v, rate / 2). Every link of a
  traffic fault's ring carries exactly one flow per direction (testbed/run/traffic.py).
* **Nezha's split over time**, from its event log (what it decided, not what the wire carried):
  a ``weights`` event's ``shares`` (for a 16 MiB message: a 8 MiB one is split the same way
  within a fraction of a percent, the start-up cost being ~0.2 ms); a ``state`` event to
  ``cold`` means equal shares over the live rails; ``rail_agreed`` down/up removes or returns a
  rail (cold: equal over the live ones; hot: the others' shares renormalised). The log of the
  lowest rank that logged a split is used: every rank adopts the same split at the same
  operation boundary.
* **adaptation_ms** = the first moment at or after tc at which Nezha's split is within
  ``TOLERANCE`` (0.10, absolute share, the largest difference over the rails) of the new
  optimum, minus tc; 0 if it already is at tc. It must happen before the next change (or the
  end of the workload); otherwise the change has no value, and the note says how close the
  split came.

The run's ``adaptation_ms`` is the worst change; None (with every change's reason) if any
change has none, or if there is no change, no Nezha event, or a rail without a rate (unshaped:
no optimum to follow). Honesty rule as in metrics.py: not measured is never a pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from testbed.analysis.failover import fault_rails, fault_start
from testbed.analysis.timeline import rail_name
from testbed.model.records import RAIL_REMOVING, FaultRecord, FlowRecord, is_num

TOLERANCE = 0.10
AT_START = ("rate", "traffic")                 # these change a rail when they start...
AT_END = ("rate", "traffic") + RAIL_REMOVING   # ...and these when they end (a rail returns)
EPS = 1e-6

Shares = list[float]


@dataclass
class Step:
    """From ``t`` on (monotonic s), the split is ``shares`` (one per rail, summing to 1)."""

    t: float
    shares: Shares

    def to_dict(self, t0: float) -> dict:
        return {"t_rel": round(self.t - t0, 4), "shares": [round(x, 4) for x in self.shares]}


@dataclass
class Change:
    """One change of a rail's capacity, and how long the split took to follow it."""

    fault: int
    label: str
    edge: str                      # "start" | "end"
    t: float
    target: Optional[Shares] = None
    split_before: Optional[Shares] = None
    adaptation_ms: Optional[float] = None
    closest: Optional[float] = None    # the smallest distance reached (when it never adapted)
    note: Optional[str] = None

    def to_dict(self, t0: float) -> dict:
        r = (lambda v: None if v is None else [round(x, 4) for x in v])
        return {"fault": self.fault, "edge": self.edge, "t_rel": round(self.t - t0, 4),
                "target": r(self.target), "split_before": r(self.split_before),
                "adaptation_ms": self.adaptation_ms,
                "closest": None if self.closest is None else round(self.closest, 4),
                "note": self.note}


# ------------------------------------------------------------------------------ Nezha's split
def _equal(live: set[int], n: int) -> Shares:
    return [1.0 / len(live) if r in live else 0.0 for r in range(n)] if live else [0.0] * n


def _rail_index(value: Any, rails: Sequence[str]) -> Optional[int]:
    name = rail_name(value, rails)
    return None if name is None else list(rails).index(name)


def _shares(value: Any, n: int) -> Optional[Shares]:
    if not isinstance(value, list) or len(value) != n or not all(is_num(x) for x in value):
        return None
    total = float(sum(value))
    return [float(x) / total for x in value] if total > 0 else None


def split_rank(events: Sequence[dict]) -> Optional[int]:
    ranks = {e.get("rank") for e in events if e.get("event") in ("weights", "state")}
    ranks = {r for r in ranks if isinstance(r, int) and not isinstance(r, bool)}
    return min(ranks) if ranks else None


def nezha_split(events: Sequence[dict], rails: Sequence[str]) -> list[Step]:
    """Nezha's split over time, from one rank's event log (see the module docstring)."""
    rank, n = split_rank(events), len(rails)
    if rank is None:
        return []
    live, hot = set(range(n)), False
    current: Optional[Shares] = None
    out: list[Step] = []
    for e in sorted((e for e in events if e.get("rank") == rank and is_num(e.get("t"))),
                    key=lambda e: e["t"]):
        ev, new = e.get("event"), None
        if ev == "state":
            if isinstance(e.get("live"), list):
                live = {int(x) for x in e["live"] if is_num(x) and 0 <= x < n}
            hot = e.get("state") == "hot"
            new = None if hot else _equal(live, n)
        elif ev == "weights":
            new = _shares(e.get("shares"), n)
            hot = e.get("state", "hot") == "hot" if new is not None else hot
        elif ev == "rail_agreed":
            r = _rail_index(e.get("rail"), rails)
            if r is None:
                continue
            (live.discard if e.get("state") == "down" else live.add)(r)
            if not hot or current is None:
                new = _equal(live, n)
            else:
                kept = [x if i in live else 0.0 for i, x in enumerate(current)]
                new = _shares(kept, n) or _equal(live, n)
        if new is not None and new != current:
            current = new
            out.append(Step(float(e["t"]), new))
    return out


def split_at(steps: Sequence[Step], t: float) -> Optional[Shares]:
    cur = None
    for s in steps:
        if s.t > t:
            break
        cur = s.shares
    return cur


def distance(a: Shares, b: Shares) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------ the optimum
def _fault_links(f: FaultRecord, topo) -> list[tuple[str, str]]:
    if f.links:
        return [tuple(l.split(".", 1)) for l in f.links]        # type: ignore[misc]
    rails = fault_rails(f, [r.name for r in topo.rails])
    hosts = [str(f.target).partition(".")[0]] if f.target_kind in ("link", "host") \
        else list(topo.hosts)
    return [(h, r) for h in hosts for r in rails if (h, r) in topo.links]


def _active(faults: Sequence[FaultRecord], t: float) -> list[FaultRecord]:
    return [f for f in faults if is_num(fault_start(f)) and fault_start(f) <= t
            and (f.t_end is None or f.t_end > t)]


def _competitor_bps(f: FaultRecord, spec, flows: Sequence[FlowRecord], link: tuple[str, str],
                    rate: float) -> float:
    """What one traffic fault's flow leaves of a link of rate ``rate`` (module docstring)."""
    v = float(spec.value)
    if getattr(spec, "proto", "tcp") == "tcp":
        return max(rate - v, rate / 2)
    mine = [fl for fl in flows if fl.fault == f.index and fl.dst == link[0]]
    measured = [fl.rate_bps("received") for fl in mine]
    if mine and all(m is not None for m in measured):
        v = sum(m / fl.factor for m, fl in zip(measured, mine))
    return max(0.0, rate - v)


def link_rates(topo, faults: Sequence[FaultRecord], specs: Mapping[int, Any],
               flows: Sequence[FlowRecord], t: float) -> dict[tuple[str, str], Optional[float]]:
    """Every link's capacity (bit/s of frames) at time t; None: unshaped."""
    caps: dict[tuple[str, str], Optional[float]] = {
        k: (None if l.shape.rate_bps is None else float(l.shape.rate_bps))
        for k, l in topo.links.items()}
    active = _active(faults, t)
    for kinds in (("rate",), RAIL_REMOVING, ("traffic",)):   # a rate cut before what flows leave
        for f in (f for f in active if f.action in kinds):
            spec = specs.get(f.index)
            for key in _fault_links(f, topo):
                if key not in caps:
                    continue
                c = caps[key]
                if f.action in RAIL_REMOVING:
                    caps[key] = 0.0
                elif c is None or spec is None:
                    continue
                elif f.action == "rate":
                    caps[key] = min(c, float(spec.value))
                else:
                    caps[key] = _competitor_bps(f, spec, flows, key, c)
    return caps


def optimum_shares(topo, caps: Mapping[tuple[str, str], Optional[float]],
                   hosts: Sequence[str]) -> Optional[Shares]:
    """The optimum split for these link capacities: ``testbed.shapes.optimum`` on the topology
    with each link's rate replaced; None if a rail is unshaped or nothing can carry anything."""
    from testbed.shapes import optimum
    if any(c is None for c in caps.values()):
        return None
    links = {k: replace(l, shape=replace(l.shape, rate_bps=int(round(caps[k]))))
             for k, l in topo.links.items()}
    bound = optimum(replace(topo, links=links), hosts=list(hosts))
    good = [r.goodput_bps or 0.0 for r in bound.rails]
    total = sum(good)
    return [g / total for g in good] if total > 0 else None


# ------------------------------------------------------------------------------ the metric
@dataclass
class Adaptation:
    """Every change of a run, its adaptation, and the series the split plot draws."""

    changes: list[Change] = field(default_factory=list)
    split: list[Step] = field(default_factory=list)
    capacity: list[Step] = field(default_factory=list)
    rank: Optional[int] = None
    note: Optional[str] = None

    @property
    def value_ms(self) -> Optional[float]:
        if self.note or not self.changes or any(c.adaptation_ms is None for c in self.changes):
            return None
        return max(c.adaptation_ms for c in self.changes)

    def why_none(self) -> Optional[str]:
        if self.note:
            return self.note
        if not self.changes:
            return "no rate or traffic fault, and no rail that returned, in this run"
        missing = [f"fault {c.fault} {c.edge} ({c.label}): {c.note}" for c in self.changes
                   if c.adaptation_ms is None]
        return "; ".join(missing) or None

    def detail(self, t0: float) -> dict:
        return {"tolerance": TOLERANCE, "rank": self.rank,
                "changes": [c.to_dict(t0) for c in self.changes],
                "nezha": [s.to_dict(t0) for s in self.split],
                "capacity": [s.to_dict(t0) for s in self.capacity]}


def _edges(faults: Sequence[FaultRecord]) -> list[tuple[float, str, FaultRecord]]:
    out = []
    for f in faults:
        if f.action in AT_START and is_num(fault_start(f)):
            out.append((fault_start(f), "start", f))
        if f.action in AT_END and is_num(f.t_end):
            out.append((f.t_end, "end", f))
    return sorted(out, key=lambda x: x[0])


def _follow(change: Change, steps: Sequence[Step], until: float) -> None:
    """When the split first came within TOLERANCE of the change's target, before ``until``."""
    cur = split_at(steps, change.t)
    change.split_before = cur
    cands = ([(change.t, cur)] if cur is not None else []) + \
        [(s.t, s.shares) for s in steps if change.t < s.t < until]
    best = math.inf
    for t, sh in cands:
        d = distance(sh, change.target)
        best = min(best, d)
        if d <= TOLERANCE + 1e-9:
            change.adaptation_ms = (t - change.t) * 1e3
            return
    change.closest = None if math.isinf(best) else best
    change.note = (f"Nezha's split never came within {TOLERANCE:.0%} of the new optimum "
                   f"{[round(x, 3) for x in change.target]} in the "
                   f"{until - change.t:.1f} s before the next change or the end"
                   + ("" if math.isinf(best) else f" (closest: {best:.3f} off)"))


def adaptation(topo, faults: Sequence[FaultRecord], specs: Mapping[int, Any],
               events: Sequence[dict], flows: Sequence[FlowRecord], hosts: Sequence[str],
               t_begin: float, t_end: float) -> Adaptation:
    """Every change of the run (module docstring) between ``t_begin`` and ``t_end`` (the
    workload), with its adaptation; ``specs``: the scenario's faults by index (their values)."""
    rails = [r.name for r in topo.rails]
    out = Adaptation(split=nezha_split(events, rails), rank=split_rank(events))
    edges = [e for e in _edges(faults) if t_begin <= e[0] <= t_end]
    for t in [t_begin] + [e[0] for e in edges]:
        sh = optimum_shares(topo, link_rates(topo, faults, specs, flows, t + EPS), hosts)
        if sh is not None and (not out.capacity or out.capacity[-1].shares != sh):
            out.capacity.append(Step(t, sh))
    if not edges:
        return out
    if not out.split:
        out.note = "Nezha logged no split (no state or weights event): not a Nezha workload?"
        return out
    times = [e[0] for e in edges]
    for i, (t, edge, f) in enumerate(edges):
        ch = Change(f.index if f.index is not None else i, f.label or f.action, edge, t)
        out.changes.append(ch)
        ch.target = optimum_shares(topo, link_rates(topo, faults, specs, flows, t + EPS), hosts)
        if ch.target is None:
            ch.note = "no optimum: a rail is unshaped, or no rail has capacity"
            continue
        nxt = [x for x in times if x > t + EPS]
        _follow(ch, out.split, min(nxt) if nxt else t_end)
    return out
