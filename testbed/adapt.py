"""`adapt`: how Nezha's balancer follows a rail that changes, next to kernel MPTCP.

A balancer tuned on one slowing-rail file can still lag on a shape nobody ran. So this module
runs a matrix: for each hosts x rails x kind of change x system it builds a topology of equal
rails (``--rate``), runs an ``--size`` allreduce for ``--duration`` and changes ``--target`` (rail
r1 unless told: another rail, or one host's link ``hK.rN``) at ``--at`` (kinds: ``rate`` to a
quarter of its rate, ``traffic`` competing TCP flows offered 3/4 of it, ``down`` link-down),
then reads per-iteration times from the run's results folder:

* ``figures(results_dir)``: the pure computation, from ``timeline.jsonl``,
  ``topology.resolved.yaml``, ``results.json`` and the first host's ``ranks/*.results.jsonl``
  to pre_ms, ideal_pre_ms, ideal_during_ms, during_x, recovery_ms, post_x and, for
  ``traffic``, ideal_left_ms and left_x (README: *A rail that changes*); unit tests drive it
  with synthetic files.
* ``sweep(...)``: the run loop; ``main(args)``: the ``python -m testbed adapt`` verb.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

from testbed.errors import SpecError, TestbedError
from testbed.model.records import RAIL_REMOVING, is_num, load_jsonl
from testbed.model.units import (format_duration, format_rate, format_size, parse_duration,
                                 parse_rate, parse_size)

MIB = 1 << 20
KINDS = ("rate", "traffic", "down")
SYSTEMS = ("nezha", "mptcp")
FAULT_TARGET = "r1"       # what changes, unless --target says otherwise
RATE_DIVISOR = 4          # rate: the target falls to a quarter of its rate
TRAFFIC_SHARE = 0.75      # traffic: each TCP flow offered 3/4 of the rate (150 of 200 Mbit/s)
SETTLE_S = 1.0            # during starts 1 s after the change, post 1 s after the return
RECOVERED = 1.1           # recovered: the first iteration within 1.1x pre_ms
TARGET_DURING_X = 1.15    # the issue's targets
TARGET_RECOVERY_MS = 1000.0
MAX_HOSTS = 8             # 2 cores: more ranks measure the CPU, not the balancer
MAX_RAILS = 8
OVERHEAD_S = 5.0          # per run beyond the workload: build, start-up, analysis, plots
FIGURES = ("pre_ms", "ideal_pre_ms", "ideal_during_ms", "during_ms", "during_x",
           "recovery_ms", "post_x", "adaptation_ms", "ideal_left_ms", "left_x")


class Cell(NamedTuple):
    """One point of the matrix."""

    hosts: int
    rails: int
    kind: str
    system: str

    @property
    def shape(self) -> str:
        return f"{self.hosts}x{self.rails}"

    @property
    def name(self) -> str:
        return f"adapt-{self.kind}-{self.shape}-{self.system}"


@dataclass(frozen=True)
class Options:
    """The matrix and how each run is driven (the defaults are the issue's)."""

    hosts: tuple[int, ...] = (2, 3, 4)
    rails: tuple[int, ...] = (2, 3)
    kinds: tuple[str, ...] = KINDS
    systems: tuple[str, ...] = SYSTEMS
    rate_bps: int = 200_000_000
    size: int = 8 * MIB
    duration_s: float = 14.0
    at_s: float = 4.0
    for_s: float = 5.0          # rate and traffic
    down_for_s: float = 3.0     # down
    repeat: int = 1
    target: str = FAULT_TARGET  # a rail rN, or one host's link hK.rN

    def fault_s(self, kind: str) -> float:
        return self.down_for_s if kind == "down" else self.for_s

    def cells(self) -> list[Cell]:
        """Kind, then shape, then system: both systems of a shape run back to back."""
        return [Cell(h, r, k, s) for k in self.kinds for h in self.hosts for r in self.rails
                for s in self.systems]

    def runs(self) -> list[tuple[Cell, int]]:
        return [(c, i) for c in self.cells() for i in range(self.repeat)]


# ------------------------------------------------------------------------------ the topology
def fault_doc(kind: str, opts: Options) -> dict:
    """The change of ``opts.target``, as a fault of the topology file. ``traffic`` loads a
    rail: for a link hK.rN, the rail rN between hK and the next host (one flow each way)."""
    base = {"at": format_duration(opts.at_s), "target": opts.target,
            "for": format_duration(opts.fault_s(kind))}
    if kind == "rate":
        return {**base, "action": "rate", "value": format_rate(opts.rate_bps / RATE_DIVISOR)}
    if kind == "traffic":
        host, rail = _split_target(opts.target)
        pair = {} if host is None else {"target": f"r{rail}",
                                        "between": [f"h{host}", f"h{host + 1}"]}
        return {**base, "action": "traffic",
                "value": format_rate(opts.rate_bps * TRAFFIC_SHARE), **pair}
    return {**base, "action": "link-down"}


def _split_target(target: str) -> tuple[Optional[int], int]:
    """'r2' -> (None, 2); 'h3.r1' -> (3, 1); anything else: SpecError naming --target."""
    m = re.fullmatch(r"(?:h([1-9][0-9]*)\.)?r([0-9]+)", target)
    if not m:
        raise SpecError("--target", repr(target), "a rail such as r1, or one host's link such "
                        "as h2.r1")
    return (int(m.group(1)) if m.group(1) else None), int(m.group(2))


def _check_target(o: Options) -> None:
    """The target must exist in every cell: its rail below the fewest rails, its host (and,
    for traffic, the next one) within the fewest hosts."""
    host, rail = _split_target(o.target)
    if rail >= min(o.rails):
        raise SpecError("--target", repr(o.target), f"a rail r0..r{min(o.rails) - 1} (the "
                        f"smallest --rails is {min(o.rails)})")
    last = min(o.hosts) - (1 if "traffic" in o.kinds else 0)
    if host is not None and host > last:
        raise SpecError("--target", repr(o.target), f"a host h1..h{last} (the smallest "
                        f"--hosts is {min(o.hosts)}"
                        + ("; traffic loads the link to the next host)" if last < min(o.hosts)
                           else ")"))


def topology_doc(cell: Cell, opts: Options) -> dict:
    """The topology a cell runs, as the document the spec loader parses (``spec.parse``):
    equal rails, a short RTO as in topologies/slowing-rail.yaml, one warm-up iteration (the
    first operation pays for slow start), exactness expected."""
    return {
        "name": cell.name,
        "description": (f"adapt benchmark: {cell.hosts} hosts x {cell.rails} rails of "
                        f"{format_rate(opts.rate_bps)}, {cell.system}, {cell.kind} on "
                        f"{opts.target}"),
        "hosts": cell.hosts,
        "rails": [{"name": f"r{i}", "bandwidth": format_rate(opts.rate_bps)}
                  for i in range(cell.rails)],
        "tcp": {"rto_min": "5ms"},
        "workload": {"kind": "allreduce", "size": opts.size,
                     "duration": format_duration(opts.duration_s), "system": cell.system,
                     "warmup": 1},
        "faults": [fault_doc(cell.kind, opts)],
        "expect": {"wrong_results": 0, "iterations_lost": 0},
    }


# ------------------------------------------------------------------------------ the figures
@dataclass
class Figures:
    """One run's figures (times in ms; ``*_x`` are ratios). None: could not be measured."""

    kind: str = ""
    system: str = ""
    hosts: int = 0
    rails: int = 0
    pre_ms: Optional[float] = None
    ideal_pre_ms: Optional[float] = None
    ideal_during_ms: Optional[float] = None
    during_ms: Optional[float] = None
    during_x: Optional[float] = None
    recovery_ms: Optional[float] = None
    post_x: Optional[float] = None
    adaptation_ms: Optional[float] = None
    ideal_left_ms: Optional[float] = None    # traffic: at what the competing flows left
    left_x: Optional[float] = None
    wrong_results: Optional[int] = None
    iterations_lost: Optional[int] = None
    rank_errors: Optional[int] = None
    counts: dict[str, int] = field(default_factory=dict)   # iterations per window
    notes: list[str] = field(default_factory=list)


def kind_of(action: str) -> str:
    """A fault's action as an adapt kind: a rail-removing fault is ``down``."""
    if action in ("rate", "traffic"):
        return action
    if action in RAIL_REMOVING:
        return "down"
    raise TestbedError(f"fault action {action!r} is not a change adapt measures "
                       f"(rate, traffic, link-down, blackhole, flap)")


def _rail_rate(topo: dict, rail: dict) -> float:
    """A rail's ring rate: its slowest link (the ring runs at its slowest hop)."""
    rates = [link.get("rate_bps") for name, link in (topo.get("links") or {}).items()
             if str(name).split(".")[-1] == rail["name"]] or [rail.get("rate_bps")]
    if not all(is_num(r) for r in rates):
        raise TestbedError(f"rail {rail['name']} is unshaped: no capacity, no ideal")
    return float(min(rates))


def _value_bps(value: Any) -> float:
    return float(value) if is_num(value) else float(parse_rate(value, "fault.value"))


def capacities(topo: dict, fault: dict) -> tuple[float, float]:
    """(before, during): the sum of the rails' rates, bit/s, and the same with the fault's rail
    changed: ``rate`` at the lower of its rate and the new one; ``traffic`` keeping
    max(rate - offered, rate / 2) (a TCP flow capped at the offered rate shares the link fairly
    with the workload's one flow there, as adaptation_ms assumes); ``down`` gone."""
    rates = {r["name"]: _rail_rate(topo, r) for r in topo.get("rails") or []}
    rail = str(fault.get("target", "")).split(".")[-1]
    if rail not in rates:
        raise TestbedError(f"the fault's target {fault.get('target')!r} is no rail of "
                           f"{', '.join(rates)}")
    rate, kind = rates[rail], kind_of(str(fault.get("action")))
    if kind == "rate":
        new = min(rate, _value_bps(fault.get("value")))
    elif kind == "traffic":
        new = max(rate - _value_bps(fault.get("value")), rate / 2)
    else:
        new = 0.0
    before = sum(rates.values())
    return before, before - rate + new


def left_capacity(topo: dict, fault: dict, flows: Sequence[dict]) -> Optional[float]:
    """``traffic``: the sum of the rails' rates with the fault's rail at what its competing
    flows left, measured: its rate minus the most any one of them delivered (their receivers'
    count as Ethernet frames, ``received_l2_mbps`` in results.json; the ring runs at its
    busiest hop). capacities() assumes a fair half; a TCP flow that never pauses takes more
    from a workload whose flow waits at every ring step (0.6 of a 100 Mbit/s rail). None
    when no flow of the fault reported."""
    rail = str(fault.get("target", "")).split(".")[-1]
    took = [float(f["received_l2_mbps"]) * 1e6 for f in flows
            if f.get("rail") == rail and f.get("fault", 0) == fault.get("index", 0)
            and is_num(f.get("received_l2_mbps"))]
    if not took:
        return None
    rates = {r["name"]: _rail_rate(topo, r) for r in topo.get("rails") or []}
    return sum(rates.values()) - rates[rail] + max(rates[rail] - max(took), 0.0)


def ideal_ms(hosts: int, size: int, capacity_bps: float) -> Optional[float]:
    """A ring allreduce's wire time: every hop carries 2(N-1)/N x size; at the capacity."""
    if capacity_bps <= 0 or hosts < 2:
        return None
    return 2 * (hosts - 1) / hosts * size * 8 / capacity_bps * 1e3


def _fault_window(timeline: Sequence[dict]) -> tuple[dict, float, float]:
    """The first fault's record and (start, end) on the monotonic clock: its first netlink
    change (``fault_start``) and the moment it was undone (``fault_end``)."""
    starts = [e for e in timeline if e.get("kind") == "fault_start" and is_num(e.get("t"))]
    if not starts:
        raise TestbedError("timeline.jsonl has no fault_start: the fault never applied")
    first = min(starts, key=lambda e: e["t"])
    ends = [e for e in timeline if e.get("kind") == "fault_end" and is_num(e.get("t"))
            and e.get("index") == first.get("index")]
    if not ends:
        raise TestbedError(f"timeline.jsonl has no fault_end for fault {first.get('index')}")
    return first, float(first["t"]), float(min(e["t"] for e in ends))


def window_figures(rows: Sequence[dict], t_fs: float, t_fe: float) -> dict:
    """pre (median, warm-up left out), during (mean from SETTLE_S after the change until its
    end, whole iterations; if none fits, one stalled across the window, the iterations that
    overlap it: leaving the stall out would hide the worst case), recovery (from the end to
    the end of the first iteration within RECOVERED x pre) and post (mean from SETTLE_S after
    the end), in ms."""
    rows = sorted(rows, key=lambda r: r["t_end"])
    pre = [r["seconds"] for r in rows if r["t_end"] < t_fs and not r.get("warmup")]
    during = [r["seconds"] for r in rows if r["t_start"] >= t_fs + SETTLE_S
              and r["t_end"] <= t_fe]
    whole = len(during)
    if not during:
        during = [r["seconds"] for r in rows if r["t_end"] > t_fs + SETTLE_S
                  and r["t_start"] < t_fe]
    post = [r["seconds"] for r in rows if r["t_start"] >= t_fe + SETTLE_S]
    pre_s = statistics.median(pre) if pre else None
    rec = None
    if pre_s is not None:
        rec = next((r["t_end"] - t_fe for r in rows
                    if r["t_end"] > t_fe and r["seconds"] <= RECOVERED * pre_s), None)
    ms = (lambda v: None if v is None else v * 1e3)
    return {"pre_ms": ms(pre_s), "during_ms": ms(statistics.mean(during) if during else None),
            "recovery_ms": ms(rec), "post_ms": ms(statistics.mean(post) if post else None),
            "counts": {"pre": len(pre), "during": len(during), "during_whole": whole,
                       "post": len(post)}}


def _iteration_rows(results_dir: Path, host: str) -> list[dict]:
    """The first host's rank's per-iteration rows (the ring is synchronous: its times are the
    collective's); summary lines and rows without times are left out."""
    files = sorted((results_dir / "ranks").glob(f"*-{host}.results.jsonl"))
    if not files:
        raise TestbedError(f"no ranks/*-{host}.results.jsonl in {results_dir}")
    return [r for r in load_jsonl(files[0]) if not r.get("summary")
            and all(is_num(r.get(k)) for k in ("t_start", "t_end", "seconds"))]


def _results(results_dir: Path) -> dict:
    try:
        doc = json.loads((results_dir / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _metrics(doc: dict) -> dict:
    return doc.get("metrics") or {}


def _flows(doc: dict) -> list[dict]:
    flows = (doc.get("detail") or {}).get("flows") or []
    return [f for f in flows if isinstance(f, dict)]


def figures(results_dir: Path | str) -> Figures:
    """Every figure of one run, from its results folder (see the module docstring)."""
    import yaml
    d = Path(results_dir)
    topo = yaml.safe_load((d / "topology.resolved.yaml").read_text())
    hosts = topo["hosts"] if isinstance(topo["hosts"], list) else \
        [f"h{i + 1}" for i in range(int(topo["hosts"]))]
    record, t_fs, t_fe = _fault_window(load_jsonl(d / "timeline.jsonl"))
    faults = topo.get("faults") or []
    index = record.get("index", 0)
    fault = faults[index] if isinstance(index, int) and 0 <= index < len(faults) else record
    rows = _iteration_rows(d, hosts[0])
    workload = topo.get("workload") or {}
    f = Figures(kind=kind_of(str(fault.get("action"))), hosts=len(hosts),
                rails=len(topo.get("rails") or []),
                system=str(rows[0].get("system") if rows else workload.get("system", "nezha")))
    size = rows[0]["bytes"] if rows and is_num(rows[0].get("bytes")) else \
        parse_size(workload.get("size"), "workload.size")
    before, during = capacities(topo, fault)
    f.ideal_pre_ms, f.ideal_during_ms = (ideal_ms(len(hosts), size, before),
                                         ideal_ms(len(hosts), size, during))
    w = window_figures(rows, t_fs, t_fe)
    f.pre_ms, f.during_ms, f.recovery_ms, f.counts = (w["pre_ms"], w["during_ms"],
                                                      w["recovery_ms"], w["counts"])
    f.during_x = _ratio(f.during_ms, f.ideal_during_ms)
    f.post_x = _ratio(w["post_ms"], f.pre_ms)
    doc = _results(d)
    if f.kind == "traffic":
        left = left_capacity(topo, {**fault, "index": index}, _flows(doc))
        f.ideal_left_ms = None if left is None else ideal_ms(len(hosts), size, left)
        f.left_x = _ratio(f.during_ms, f.ideal_left_ms)
    _add_metrics(f, _metrics(doc))
    _explain(f)
    return f


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def _add_metrics(f: Figures, m: dict) -> None:
    """Exactness from the run's own metrics; adaptation_ms is Nezha's (no other system logs a
    split)."""
    for key in ("wrong_results", "iterations_lost", "rank_errors"):
        if is_num(m.get(key)):
            setattr(f, key, int(m[key]))
    if f.system == "nezha" and is_num(m.get("adaptation_ms")):
        f.adaptation_ms = float(m["adaptation_ms"])


def _explain(f: Figures) -> None:
    """A note for each figure that could not be measured, saying why."""
    c = f.counts
    if not c.get("pre"):
        f.notes.append("no iteration ended before the fault (after warm-up): no pre_ms")
    if not c.get("during"):
        f.notes.append(f"no iteration from {SETTLE_S:g} s after the fault until its end")
    elif not c.get("during_whole"):
        f.notes.append(f"no whole iteration from {SETTLE_S:g} s after the fault until its end: "
                       f"during is the mean of the {c['during']} overlapping that window")
    if f.pre_ms is not None and f.recovery_ms is None:
        f.notes.append(f"no iteration after the fault's end within {RECOVERED}x pre_ms")
    if not c.get("post"):
        f.notes.append(f"no iteration starting {SETTLE_S:g} s after the fault's end")
    if f.wrong_results is None or f.iterations_lost is None:
        f.notes.append("results.json has no wrong_results / iterations_lost")
    elif f.wrong_results or f.iterations_lost:
        f.notes.append(f"{f.wrong_results} wrong results, {f.iterations_lost} iterations lost")
    if f.rank_errors:
        f.notes.append(f"{f.rank_errors} ranks exited non-zero (see the run's ranks/*.log)")


# ------------------------------------------------------------------------------ rows and cells
@dataclass
class Row:
    """One run: its cell, which repeat, its figures, or the error that stopped it."""

    cell: Cell
    repeat: int = 0
    figures: Figures = field(default_factory=Figures)
    results_dir: str = ""
    seconds: float = 0.0
    error: Optional[str] = None

    def to_dict(self) -> dict:
        return {**self.cell._asdict(), "repeat": self.repeat, **asdict(self.figures),
                "results_dir": self.results_dir, "seconds": round(self.seconds, 1),
                "error": self.error}


def _median(values: Sequence[Optional[float]], none_is_inf: bool = False) -> Optional[float]:
    """Median of the measured values; for recovery a run that never recovered counts as
    infinitely slow (so it cannot vanish in the median)."""
    vals = [math.inf if v is None and none_is_inf else v for v in values]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(rows: Sequence[Row]) -> dict[Cell, dict]:
    """Per cell: the median of each figure over its repeats; wrong results and lost iterations
    summed (None if any run did not report them); runs and failed runs counted."""
    out: dict[Cell, dict] = {}
    for cell in dict.fromkeys(r.cell for r in rows):
        mine = [r for r in rows if r.cell == cell]
        ok = [r for r in mine if r.error is None]
        c: dict[str, Any] = {"runs": len(mine), "failed": len(mine) - len(ok)}
        for key in FIGURES:
            c[key] = _median([getattr(r.figures, key) for r in ok],
                             none_is_inf=key == "recovery_ms") if ok else None
        for key in ("wrong_results", "iterations_lost"):
            vals = [getattr(r.figures, key) for r in ok]
            c[key] = None if not ok or None in vals else sum(vals)
        out[cell] = c
    return out


def during_ratio(cells: dict[Cell, dict], cell: Cell) -> Optional[float]:
    """Nezha's mean iteration time during the change over MPTCP's, on the same shape."""
    n = cells.get(cell._replace(system="nezha"), {}).get("during_ms")
    m = cells.get(cell._replace(system="mptcp"), {}).get("during_ms")
    return _ratio(n, m)


# ------------------------------------------------------------------------------------ output
def _num(v: Optional[float], spec: str) -> str:
    if v is None:
        return "-"
    return "never" if math.isinf(v) else format(v, spec)


def _ms(v: Optional[float], none: str = "-") -> str:
    return none if v is None else f"{v:.0f} ms"


def _pair(cells: dict[Cell, dict], cell: Cell, key: str, spec: str, width: int) -> str:
    """'nezha/mptcp' of one figure on one shape ('-' where a system did not run)."""
    vals = [_num(cells.get(cell._replace(system=s), {}).get(key), spec) if
            cell._replace(system=s) in cells else "-" for s in SYSTEMS]
    return f"{'/'.join(vals):>{width}}"


def describe_kind(kind: str, opts: Options) -> str:
    """What the change of a kind is, in words (the table's title)."""
    rate, at, fs = format_rate(opts.rate_bps), f"{opts.at_s:g} s", f"{opts.fault_s(kind):g} s"
    t = opts.target
    host, rail = _split_target(t)
    where = f"r{rail}" if host is None else f"r{rail} between h{host} and h{host + 1}"
    what = {"rate": f"{t} {rate} -> {format_rate(opts.rate_bps / RATE_DIVISOR)}",
            "traffic": (f"competing TCP flows offered {format_rate(opts.rate_bps * TRAFFIC_SHARE)}"
                        f" on {where} ({rate})"),
            "down": f"{t} link-down"}[kind]
    return f"{kind}: {what} at {at} for {fs}"


def format_table(kind: str, cells: dict[Cell, dict], opts: Options) -> str:
    """One row per hosts x rails; each column 'nezha/mptcp'; n/m is Nezha's mean iteration
    time during the change over MPTCP's; for ``traffic`` also left_x (during over the ideal
    at what the competing flows left, measured)."""
    left = kind == "traffic"
    lines = [f"== {describe_kind(kind, opts)}   (columns: nezha/mptcp)",
             f"{'shape':<6}{'ideal pre/dur ms':>17}{'pre ms':>12}{'during_x':>12}"
             + (f"{'left_x':>12}" if left else "")
             + f"{'n/m':>6}{'recovery ms':>14}{'post_x':>12}{'adapt ms':>9}{'wrong/lost':>12}"]
    for h in opts.hosts:
        for r in opts.rails:
            base = Cell(h, r, kind, opts.systems[0])
            if not any(base._replace(system=s) in cells for s in SYSTEMS):
                continue
            first = next(cells[base._replace(system=s)] for s in SYSTEMS
                         if base._replace(system=s) in cells)
            ideal = f"{_num(first['ideal_pre_ms'], '.0f')}/{_num(first['ideal_during_ms'], '.0f')}"
            nez = cells.get(base._replace(system="nezha"), {})
            exact = [cells[base._replace(system=s)] for s in SYSTEMS
                     if base._replace(system=s) in cells]
            wrong = "/".join(_num(sum(c[k] for c in exact) if all(c[k] is not None
                                                                   for c in exact) else None,
                                  "d") for k in ("wrong_results", "iterations_lost"))
            failed = sum(c["failed"] for c in exact)
            lines.append(
                f"{base.shape:<6}{ideal:>17}{_pair(cells, base, 'pre_ms', '.0f', 12)}"
                f"{_pair(cells, base, 'during_x', '.2f', 12)}"
                + (_pair(cells, base, 'left_x', '.2f', 12) if left else "")
                + f"{_num(during_ratio(cells, base), '.2f'):>6}"
                f"{_pair(cells, base, 'recovery_ms', '.0f', 14)}"
                f"{_pair(cells, base, 'post_x', '.2f', 12)}"
                f"{_num(nez.get('adaptation_ms'), '.0f'):>9}{wrong:>12}"
                + (f"  ({failed} run(s) FAILED)" if failed else ""))
    return "\n".join(lines)


def summarize(cells: dict[Cell, dict], opts: Options) -> dict:
    """Nezha against the issue's targets, over every shape and kind that ran."""
    nez = {c: v for c, v in cells.items() if c.system == "nezha"}
    during = {c: v["during_x"] for c, v in nez.items()}
    left = {c: v.get("left_x") for c, v in nez.items() if c.kind == "traffic"}
    rec = {c: v["recovery_ms"] for c, v in nez.items()}
    ratios = {c: during_ratio(cells, c) for c in nez}

    def worst(d: dict) -> Optional[dict]:
        bad = {c: (math.inf if v is None else v) for c, v in d.items()}
        if not bad:
            return None
        c = max(bad, key=bad.get)
        return {"kind": c.kind, "shape": c.shape, "value": None if bad[c] == math.inf
                else bad[c]}
    exact = list(cells.values())
    return {
        "shapes": len(nez),
        "during_x_met": sum(1 for v in during.values() if v is not None and
                            v <= TARGET_DURING_X),
        "during_x_worst": worst(during),
        "left_x_worst": worst(left),
        "compared": sum(1 for v in ratios.values() if v is not None),
        "nezha_le_mptcp": sum(1 for v in ratios.values() if v is not None and v <= 1.0),
        "ratio_worst": worst({c: v for c, v in ratios.items() if v is not None}),
        "recovery_met": sum(1 for v in rec.values() if v is not None and
                            v <= TARGET_RECOVERY_MS),
        "recovery_worst": worst(rec),
        "wrong_results": sum(v["wrong_results"] or 0 for v in exact),
        "iterations_lost": sum(v["iterations_lost"] or 0 for v in exact),
        "unreported": sum(1 for v in exact if v["wrong_results"] is None
                          or v["iterations_lost"] is None),
        "failed_runs": sum(v["failed"] for v in exact),
        "cells": len(exact),
    }


def format_summary(s: dict) -> str:
    """One line per target: met on how many shapes, the worst, and a verdict word."""
    def verdict(met: int, of: int) -> str:
        return "-" if not of else "met" if met == of else "MISSED"

    def at(w: Optional[dict], spec: str, unit: str = "", none: str = "not measured") -> str:
        if not w:
            return ""
        v = none if w["value"] is None else format(w["value"], spec) + unit
        return f" (worst {v}: {w['kind']} {w['shape']})"
    n = s["shapes"]
    lines = [
        f"== targets over {n} nezha shapes x kinds:",
        f"   during_x <= {TARGET_DURING_X}: {s['during_x_met']}/{n}"
        f"{at(s['during_x_worst'], '.2f')} {verdict(s['during_x_met'], n)}",
        *([f"   left_x, traffic against what the competing flows left (measured)"
           f"{at(s['left_x_worst'], '.2f')}: not a target; during_x above it is what they "
           f"took beyond a fair half of the rail"] if s.get("left_x_worst") else []),
        f"   nezha <= mptcp (mean iteration during): {s['nezha_le_mptcp']}/{s['compared']}"
        f"{at(s['ratio_worst'], '.2f', 'x')} {verdict(s['nezha_le_mptcp'], s['compared'])}"
        + ("" if s["compared"] else " (no mptcp runs)"),
        f"   recovery within {RECOVERED}x pre in {TARGET_RECOVERY_MS / 1e3:g} s: "
        f"{s['recovery_met']}/{n}{at(s['recovery_worst'], '.0f', ' ms', 'never')} "
        f"{verdict(s['recovery_met'], n)}",
        f"   exact: {s['wrong_results']} wrong results, {s['iterations_lost']} iterations lost"
        + (f", {s['unreported']} cells unreported" if s["unreported"] else "")
        + (f"; {s['failed_runs']} runs FAILED" if s["failed_runs"] else "")
        + (" -" if not s["cells"] else " met" if not (
            s["wrong_results"] or s["iterations_lost"] or s["unreported"]) else " MISSED")]
    return "\n".join(lines)


def write_json(path: Path, rows: Sequence[Row], opts: Options, interrupted: bool = False
               ) -> None:
    """Every run, the per-cell medians and the summary; rewritten after each run, so an
    interrupted sweep keeps what finished."""
    from testbed.model.records import jsonable
    cells = aggregate(rows)
    doc = {"options": asdict(opts), "interrupted": interrupted,
           "summary": summarize(cells, opts), "rows": [r.to_dict() for r in rows],
           "cells": [{**c._asdict(), **v} for c, v in cells.items()]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jsonable(doc), indent=1))
    tmp.replace(path)


def plot(path: Path, cells: dict[Cell, dict], opts: Options) -> Optional[Path]:
    """Per kind, a column: during_x (top) and recovery_ms (bottom) per shape, nezha and mptcp
    side by side, with the target as a dotted line."""
    kinds = [k for k in opts.kinds if any(c.kind == k for c in cells)]
    if not kinds:
        return None
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(kinds), figsize=(4.2 * len(kinds) + 1, 7), dpi=110,
                             squeeze=False)
    for j, kind in enumerate(kinds):
        shapes = [(h, r) for h in opts.hosts for r in opts.rails]
        for i, (key, target) in enumerate((("during_x", TARGET_DURING_X),
                                           ("recovery_ms", TARGET_RECOVERY_MS))):
            ax = axes[i][j]
            for k, system in enumerate(opts.systems):
                vals = [cells.get(Cell(h, r, kind, system), {}).get(key) for h, r in shapes]
                vals = [math.nan if v is None or math.isinf(v) else v for v in vals]
                ax.bar([x + (k - (len(opts.systems) - 1) / 2) * 0.38 for x in
                        range(len(shapes))], vals, width=0.36, label=system)
            ax.axhline(target, color="grey", lw=0.8, ls=":")
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels([f"{h}x{r}" for h, r in shapes])
            ax.set_ylabel(key if key == "during_x" else "recovery (ms)")
            if i == 0:
                ax.set_title(kind)
            ax.legend(loc="best", fontsize=8)
        axes[1][j].set_xlabel("hosts x rails")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ the loop
def run_cell(cell: Cell, repeat: int, opts: Options, out: Path,
             log: Callable[[str], None]) -> Row:
    """One run through the testbed's own runner (teardown on any exit, Ctrl-C included), then
    its figures. A run that fails is a row with the error, not the end of the sweep."""
    from testbed.model import spec
    from testbed.run.runner import run_topology
    suffix = f"-{repeat + 1}" if opts.repeat > 1 else ""
    d = out / f"{cell.kind}-{cell.shape}-{cell.system}{suffix}"
    row = Row(cell, repeat, results_dir=str(d))
    t0 = time.monotonic()
    try:
        topo = spec.parse(topology_doc(cell, opts), source=f"adapt:{cell.name}")
        run_topology(topo, d, say=log)
        row.figures = figures(d)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one broken run is a row, not the end of a sweep
        row.error = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    row.seconds = time.monotonic() - t0
    return row


def progress_line(n: int, total: int, row: Row) -> str:
    """What a finished run printed: its cell and its headline figures."""
    f, c = row.figures, row.cell
    head = f"   [{n}/{total}] {c.kind} {c.shape} {c.system}" + \
        (f" #{row.repeat + 1}" if row.repeat else "")
    if row.error:
        return f"{head}: FAILED ({row.seconds:.0f} s): {row.error}"
    adapt = f", adaptation {_ms(f.adaptation_ms)}" if c.system == "nezha" else ""
    text = (f"{head}: pre {_ms(f.pre_ms)}, during_x {_num(f.during_x, '.2f')}, "
            f"recovery {_ms(f.recovery_ms, 'never' if f.pre_ms else '-')}, post_x {_num(f.post_x, '.2f')}{adapt}, "
            f"wrong {_num(f.wrong_results, 'd')}, lost {_num(f.iterations_lost, 'd')} "
            f"({row.seconds:.0f} s)")
    return text + "".join(f"\n      ! {note}" for note in f.notes)


def sweep(opts: Options, out: Path, json_path: Path,
          note: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)
          ) -> tuple[list[Row], bool]:
    """Every run in turn, a progress line and the JSON after each. Ctrl-C ends the sweep (the
    runner has torn the fabric down by then) and keeps what finished."""
    out.mkdir(parents=True, exist_ok=True)
    runs = opts.runs()
    rows: list[Row] = []
    interrupted = False
    try:
        for n, (cell, repeat) in enumerate(runs, 1):
            note(f"   [{n}/{len(runs)}] {cell.kind} {cell.shape} {cell.system} ...")
            with open(out / f"{cell.kind}-{cell.shape}-{cell.system}.log", "a") as logf:
                def log(msg: str, _f=logf) -> None:
                    print(msg, file=_f, flush=True)
                row = run_cell(cell, repeat, opts, out, log)
            rows.append(row)
            note(progress_line(n, len(runs), row))
            write_json(json_path, rows, opts)
    except KeyboardInterrupt:
        interrupted = True
        note("   interrupted: the fabric was torn down; tables of what finished")
    write_json(json_path, rows, opts, interrupted)
    return rows, interrupted


# ------------------------------------------------------------------------------------ CLI
def parse_counts(text: str, option: str, low: int, high: int) -> tuple[int, ...]:
    """'2,3,4' -> (2, 3, 4), each within [low, high], in the order given, without repeats."""
    accepted = f"comma-separated whole numbers from {low} to {high}, e.g. {low},{low + 1}"
    out: list[int] = []
    for part in str(text).split(","):
        try:
            v = int(part.strip())
        except ValueError:
            raise SpecError(option, f"{part.strip()!r} is not a whole number", accepted) from None
        if not low <= v <= high:
            raise SpecError(option, f"{v} is out of range", accepted)
        if v not in out:
            out.append(v)
    return tuple(out)


def parse_choices(text: str, option: str, valid: Sequence[str], what: str
                  ) -> tuple[str, ...]:
    """'rate,down' -> ('rate', 'down'); anything else names the valid values."""
    out: list[str] = []
    for part in str(text).split(","):
        p = part.strip().lower()
        if p not in valid:
            raise SpecError(option, f"{part.strip()!r} is not a {what}",
                            f"comma-separated values from: {', '.join(valid)}")
        if p not in out:
            out.append(p)
    return tuple(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `adapt` verb's options (registered by testbed.cli)."""
    p.add_argument("--hosts", default="2,3,4", help="host counts (default 2,3,4)")
    p.add_argument("--rails", default="2,3", help="rail counts (default 2,3)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="changes of the target: rate (to a quarter), traffic (competing TCP "
                   "flows offered 3/4 of the rate), down (link-down); default "
                   "rate,traffic,down")
    p.add_argument("--target", default=FAULT_TARGET,
                   help="what changes: a rail (r0, r1, ...) or one host's link (h2.r1; "
                   "traffic then loads the rail between h2 and h3); default r1")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="nezha, mptcp (default both)")
    p.add_argument("--rate", default="200mbit", help="every rail's rate (default 200mbit)")
    p.add_argument("--size", default="8MiB", help="allreduce size (default 8MiB)")
    p.add_argument("--duration", default="14s", help="workload duration (default 14s)")
    p.add_argument("--at", default="4s", help="when the target changes, from the workload's "
                   "start (default 4s)")
    p.add_argument("--for", dest="for_", default="5s", metavar="FOR",
                   help="how long a rate or traffic change lasts (default 5s)")
    p.add_argument("--down-for", default="3s", help="how long the target stays down "
                   "(default 3s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per cell; the tables show the median (default 1)")
    p.add_argument("--out", help="folder (default results/adapt-TIMESTAMP)")


def _check_timing(o: Options) -> None:
    """The windows must exist: pre iterations before the change (the first operation starts
    about 1.3 s into the workload, and is the warm-up), during iterations from SETTLE_S after
    it, post iterations from SETTLE_S after the end."""
    if o.at_s < 2.0:
        raise SpecError("--at", f"{format_duration(o.at_s)} leaves no iteration before the "
                        "change", "at least 2s (the first operation, a warm-up, starts about "
                        "1.3 s into the workload)")
    for flag, v in (("--for", o.for_s), ("--down-for", o.down_for_s)):
        if v <= SETTLE_S:
            raise SpecError(flag, f"{format_duration(v)} leaves no 'during' window",
                            f"more than {SETTLE_S:g}s (during starts {SETTLE_S:g} s after "
                            "the change)")
    longest = max(o.fault_s(k) for k in o.kinds)
    need = o.at_s + longest + SETTLE_S + 1.0
    if o.duration_s < need:
        raise SpecError("--duration", f"{format_duration(o.duration_s)} ends before the 'post' "
                        f"window (--at {format_duration(o.at_s)} + "
                        f"{format_duration(longest)} + {SETTLE_S:g}s)",
                        f"at least {format_duration(need)}, or a shorter --at / --for")


def options_from(args) -> Options:
    """The verb's arguments, checked: every bad one is a SpecError naming its flag (exit 2)."""
    o = Options(hosts=parse_counts(args.hosts, "--hosts", 2, MAX_HOSTS),
                rails=parse_counts(args.rails, "--rails", 2, MAX_RAILS),
                kinds=parse_choices(args.kinds, "--kinds", KINDS, "kind"),
                systems=parse_choices(args.systems, "--systems", SYSTEMS, "system"),
                rate_bps=parse_rate(args.rate, "--rate"),
                size=parse_size(args.size, "--size"),
                duration_s=parse_duration(args.duration, "--duration", allow_zero=False),
                at_s=parse_duration(args.at, "--at"),
                for_s=parse_duration(args.for_, "--for", allow_zero=False),
                down_for_s=parse_duration(args.down_for, "--down-for", allow_zero=False),
                repeat=args.repeat, target=args.target)
    if o.size < 1:
        raise SpecError("--size", f"{args.size!r} is empty", "a size such as 8MiB")
    if o.rate_bps * TRAFFIC_SHARE < 1e6 or o.rate_bps / RATE_DIVISOR < 1e6:
        raise SpecError("--rate", f"{args.rate!r} is too slow", "at least 4mbit (the rate "
                        "fault takes the target to a quarter of it)")
    if not 1 <= o.repeat <= 100:
        raise SpecError("--repeat", f"{o.repeat}", "a whole number from 1 to 100")
    _check_timing(o)
    _check_target(o)
    return o


def _drop_mptcp(opts: Options) -> Options:
    """Without kernel MPTCP the matrix runs Nezha alone (as `shapes` does), saying why."""
    if "mptcp" not in opts.systems:
        return opts
    from testbed.kernel.capabilities import probe
    caps = probe()
    if caps.mptcp:
        return opts
    left = tuple(s for s in opts.systems if s != "mptcp")
    if not left:
        raise TestbedError(f"--systems mptcp: no kernel MPTCP here ({caps.details.get('mptcp')})")
    print(f"   no kernel MPTCP here ({caps.details.get('mptcp')}): nezha only", file=sys.stderr)
    return replace(opts, systems=left)


def _total(seconds: float) -> str:
    return f"~{seconds / 60:.0f} min" if seconds >= 90 else f"~{seconds:.0f} s"


def main(args) -> int:
    """The `adapt` verb: the sweep, a table per kind, the targets, JSON and plot."""
    import os
    opts = options_from(args)
    if os.geteuid() != 0:
        raise TestbedError("network namespaces need root: run with sudo (or as root)")
    opts = _drop_mptcp(opts)
    out = Path(args.out or Path("results") / f"adapt-{time.strftime('%Y%m%d-%H%M%S')}")
    json_path = out / "adapt.json"
    n, each = len(opts.runs()), opts.duration_s + OVERHEAD_S
    print(f"== adapt: {n} runs ({len(opts.hosts)} host counts x {len(opts.rails)} rail counts "
          f"x {len(opts.kinds)} kinds x {len(opts.systems)} systems"
          + (f" x {opts.repeat} repeats" if opts.repeat > 1 else "")
          + f"), about {each:.0f} s each ({_total(n * each)}); {format_size(opts.size)} "
          f"allreduce on rails of {format_rate(opts.rate_bps)}; results in {out}",
          file=sys.stderr, flush=True)
    rows, interrupted = sweep(opts, out, json_path)
    cells = aggregate(rows)
    for kind in opts.kinds:
        if any(c.kind == kind for c in cells):
            print(format_table(kind, cells, opts))
    print(format_summary(summarize(cells, opts)))
    png = plot(out / "adapt.png", cells, opts)
    print(f"   rows: {json_path}" + (f"; plot: {png}" if png else ""))
    if interrupted:
        return 130
    bad = any(r.error or r.figures.wrong_results or r.figures.iterations_lost
              or r.figures.rank_errors for r in rows)
    return 1 if bad else 0
