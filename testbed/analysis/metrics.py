"""From what was measured to numbers an expectation can be held against.

``compute`` returns a ``Metrics`` record (testbed.model.records): as a mapping, every name of
``scenario.METRICS`` and ``rail_share.<rail>`` for every rail; ``notes`` (metric -> why it is
None, or a caveat); ``faults`` (per-fault breakdown, see failover.py) and ``detail`` (per-rail
goodput, per-iteration latency, bus bandwidth by system and size).

Honesty rule: a metric that could not be measured (no events, no such fault, no traffic) is None,
with the reason in ``notes``; the verdict fails an expectation on a None metric as "not measured".
No metric has a default that passes.

All times are CLOCK_MONOTONIC seconds (shared by every namespace of the machine): fault records,
kernel samples, Nezha events and iteration records are compared directly.

This module: the iteration table, counts and bus bandwidth, the steady-state rail shares, and
the driver ``compute``; detection, failover and recovery per fault are defined in
failover.py and applied to every fault of the run in faults.py.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from testbed.analysis.adaptation import adaptation
from testbed.analysis.aggregation import rejoin_ms
from testbed.analysis.competing import competing_bps, flows_detail, workload_bps
from testbed.analysis.failover import SETTLE_S, shares
from testbed.analysis.faults import FaultTallies, analyse_faults
from testbed.analysis.sampler import Rates, Samples
from testbed.analysis.timeline import by_time
from testbed.analysis.training import TRAIN_METRICS, train_metrics
from testbed.model.records import (FaultRecord, FlowRecord, IterationRecord, Metrics,
                                   as_iterations, is_num)
from testbed.model.scenario import METRICS, SHARE_PREFIX, sized_metric

BIN_S = 0.02             # goodput bin
ACTIVITY_FLOOR = 0.01    # traffic below 1 % of the rails' nominal sum is background, not work
ACTIVITY_FLOOR_BPS = 1e6  # ... or below 1 Mbit/s when a rail is unshaped

Span = tuple[float, float]


# ------------------------------------------------------------------------------- iterations
def _table_row(key: tuple, recs: list[IterationRecord], n: int) -> dict:
    done = [r for r in recs if r.done]
    ranks_done = {r.rank for r in done}
    row = {"phase": key[0], "system": key[1], "bytes": key[2], "iter": key[3],
           "ranks": n, "ranks_done": len(ranks_done),
           "complete": len(ranks_done) >= n,
           "ok": all(r.ok is not False for r in recs),
           "warmup": any(r.warmup for r in recs),
           "wrong_records": sum(1 for r in recs if r.ok is False),
           "t_start": min((r.t_start for r in done), default=None),
           "t_end": max((r.t_end for r in done), default=None),
           "latency_s": max((r.t_end - r.t_start for r in done), default=None)}
    row["span_s"] = (row["t_end"] - row["t_start"]) if done else None
    return row


def iteration_table(iterations: Iterable[IterationRecord], world: Optional[int] = None
                    ) -> list[dict]:
    """One row per iteration (key: phase, system, bytes, iter), merged over ranks.

    ``latency_s`` = max over ranks of (t_end - t_start): how long the slowest rank spent in the
    collective; ``span_s`` = last rank's t_end - first rank's t_start. ``complete`` = every rank
    of the phase (``world`` or the ranks seen in that phase, whichever is larger) recorded an
    end. Summary lines and records without ``iter`` are ignored."""
    groups: dict[tuple, list[IterationRecord]] = {}
    ranks_in_phase: dict[Any, set] = {}
    for r in iterations:
        if not r.is_iteration:
            continue
        key = (r.phase, r.system, r.bytes, r.iter)
        groups.setdefault(key, []).append(r)
        ranks_in_phase.setdefault(key[0], set()).add(r.rank)
    rows = [_table_row(key, recs, max(world or 0, len(ranks_in_phase[key[0]])))
            for key, recs in groups.items()]
    rows.sort(key=lambda r: (r["t_start"] if r["t_start"] is not None else math.inf,
                             str(r["phase"]), r["iter"] if is_num(r["iter"]) else 0))
    return rows


def iteration_counts(table: Sequence[dict], iterations: Sequence[IterationRecord] = ()
                     ) -> dict:
    """iterations: rows complete on every rank. iterations_lost: rows some rank recorded but not
    every rank; plus, per phase in which a rank wrote no final summary line (killed or crashed)
    while the others finished theirs or died too, the iteration in flight when it died (counted
    once, and only when the ranks do write summary lines, i.e. at least one exists).
    wrong_results: iterations with at least one record ``ok: false`` (records in
    ``wrong_records``)."""
    complete = [r for r in table if r["complete"]]
    partial = [r for r in table if not r["complete"]]
    summaries = [r for r in iterations if r.summary]
    lost = len(partial)
    in_flight = 0
    if summaries:
        by_phase: dict[Any, set] = {}
        for r in iterations:
            if r.rank is not None:
                by_phase.setdefault(r.phase, set()).add(r.rank)
        for phase, ranks in by_phase.items():
            summed = {r.rank for r in summaries if r.phase == phase}
            if ranks - summed and not any(p["phase"] == phase for p in partial):
                in_flight += 1
    return {"iterations": len(complete), "iterations_lost": lost + in_flight,
            "wrong_results": sum(1 for r in table if not r["ok"]),
            "wrong_records": sum(r["wrong_records"] for r in table),
            "lost_partial": lost, "lost_in_flight": in_flight}


def busbw_bps(nbytes: float, ranks: int, latency_s: float) -> Optional[float]:
    """Allreduce bus bandwidth in bit/s: bytes * 2(n-1)/n / latency * 8 (the nccl-tests
    convention: what each rank's link must carry, comparable with a link's rate)."""
    if not (is_num(nbytes) and ranks and ranks > 1 and latency_s and latency_s > 0):
        return None
    return nbytes * 2 * (ranks - 1) / ranks / latency_s * 8


def busbw_by_system(table: Sequence[dict]) -> dict[str, dict[int, dict]]:
    """{system: {bytes: {median_mbps, n, median_latency_ms}}} over complete iterations, not
    counting warm-up ones."""
    acc: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in table:
        if not r["complete"] or r["latency_s"] is None or r.get("warmup"):
            continue
        bw = busbw_bps(r["bytes"], r["ranks"], r["latency_s"])
        if bw is None:
            continue
        acc.setdefault(str(r["system"]), {}).setdefault(int(r["bytes"]), []).append(
            (bw, r["latency_s"]))
    return {s: {b: {"median_mbps": statistics.median(x[0] for x in v) / 1e6, "n": len(v),
                    "median_latency_ms": statistics.median(x[1] for x in v) * 1e3}
                for b, v in sorted(sizes.items())}
            for s, sizes in acc.items()}


# ------------------------------------------------------------------------------- the run
def _windows(iterations: Sequence[IterationRecord], phases: Sequence[dict], main: Optional[str],
             span: Span) -> list[Span]:
    """Intervals during which the workload of the main system ran, each starting after its
    warm-up iterations (the last rank's end of the last one)."""
    phases = [p for p in phases if is_num(p.get("t_start")) and
              is_num(p.get("t_end")) and (main is None or p.get("system") in (main, None))]
    recs = [r for r in iterations if r.done and (main is None or r.system in (main, None))]
    if phases:
        out = [(p["t_start"], p["t_end"]) for p in phases]
    elif recs:
        out = [(min(r.t_start for r in recs), max(r.t_end for r in recs))]
    elif all(math.isfinite(x) for x in span):
        return [span]
    else:
        return []
    warm = [r for r in recs if r.warmup]
    if warm:
        out = [(max([a] + [r.t_end for r in warm if a <= r.t_start <= b]), b) for a, b in out]
    return out


def _main_system(scenario, table: Sequence[dict]) -> Optional[str]:
    w = getattr(scenario, "workload", None)
    systems = {r["system"] for r in table}
    if w is None:
        return next(iter(systems), None)
    if w.kind == "compare":
        return "nezha" if "nezha" in (w.systems or ()) else (w.systems[0] if w.systems else None)
    if w.kind == "command":
        return "command"
    if w.kind == "train":
        return "nezha" if "nezha" in w.backends else w.backends[0]
    return w.system


def nominal_rate_bps(topo, rail: str) -> Optional[float]:
    """A rail's nominal rate: the slowest of its links (a ring runs at its slowest hop)."""
    rates = [l.shape.rate_bps for l in topo.links.values() if l.rail == rail]
    if not rates or any(r is None for r in rates):
        return None
    return float(min(rates))


@dataclass
class _Run:
    """What every metric of one run is computed from (built once by ``compute``)."""

    topo: Any
    scenario: Any
    iterations: list[IterationRecord]
    table: list[dict]
    main: Optional[str]
    extra: dict
    nominal: dict[str, Optional[float]]
    t0: float

    @property
    def rails(self) -> list[str]:
        return self.topo.rail_order

    @property
    def floor_bps(self) -> float:
        """Below this goodput a set of rails carries background chatter (ARP, neighbour
        discovery, probes), not a workload: shares, failover and recovery are not computed
        from it."""
        if all(self.nominal.values()):
            return ACTIVITY_FLOOR * sum(self.nominal.values())
        return ACTIVITY_FLOOR_BPS


def _world(topo, scenario, extra: dict) -> Optional[int]:
    w = getattr(scenario, "workload", None)
    world = extra.get("world")
    if world is None and w is not None and w.kind != "command":
        world = len(w.hosts) if w.hosts else len(topo.hosts)
    return world


# ------------------------------------------------------------------------------- one metric each
def _iteration_metrics(run: _Run, m: Metrics, counts: dict) -> None:
    """iterations, iterations_lost, wrong_results (see ``iteration_counts``)."""
    w = getattr(run.scenario, "workload", None)
    if not run.table and (w is None or w.kind in ("command", "train", "none")):
        for k in ("iterations", "iterations_lost", "wrong_results"):
            m.notes[k] = "the workload writes no iteration records"
        return
    m.values["iterations"] = counts["iterations"]
    if run.table:
        m.values["iterations_lost"] = counts["iterations_lost"]
        m.values["wrong_results"] = counts["wrong_results"]
    else:   # nothing ran: "0 wrong, 0 lost" would pass vacuously
        for k in ("iterations_lost", "wrong_results"):
            m.notes[k] = "no iteration records were written by any rank"


def _busbw(run: _Run, m: Metrics, bw: dict) -> None:
    """busbw_mbps: median over the main system's complete iterations at its largest size."""
    if run.main in bw and bw[run.main]:
        m.values["busbw_mbps"] = bw[run.main][max(bw[run.main])]["median_mbps"]
    else:
        m.notes["busbw_mbps"] = f"no complete iteration of {run.main or 'any system'} to time"


def _busbw_vs_single_rail(run: _Run, m: Metrics, bw: dict) -> None:
    """busbw_vs_single_rail(.<size>): the main system over system "single" at each size both
    ran (the plain name: the largest), else over ``extra['single_rail_busbw_mbps']``."""
    main, single = run.main, run.extra.get("single_rail_busbw_mbps")
    if "single" in bw and main in bw and main != "single":
        common = sorted(set(bw["single"]) & set(bw[main]))
        for s in common:
            m.values[sized_metric(s)] = (bw[main][s]["median_mbps"]
                                         / bw["single"][s]["median_mbps"])
        if common:
            m.values["busbw_vs_single_rail"] = m.values[sized_metric(common[-1])]
    if m.values["busbw_vs_single_rail"] is None and is_num(single) \
            and m.values["busbw_mbps"] is not None and single > 0:
        m.values["busbw_vs_single_rail"] = m.values["busbw_mbps"] / single
    if m.values["busbw_vs_single_rail"] is None:
        m.notes["busbw_vs_single_rail"] = "no single-rail run to compare with"


def _busbw_vs_rail_sum(run: _Run, m: Metrics) -> None:
    """busbw_vs_rail_sum: busbw over the sum of the rails' nominal rates."""
    busbw = m.values["busbw_mbps"]
    if busbw is not None and all(v for v in run.nominal.values()):
        m.values["busbw_vs_rail_sum"] = busbw * 1e6 / sum(run.nominal.values())
    elif busbw is not None:
        m.notes["busbw_vs_rail_sum"] = "a rail has no nominal rate (unshaped)"
    else:
        m.notes["busbw_vs_rail_sum"] = m.notes["busbw_mbps"]


def _busbw_vs_mptcp(run: _Run, m: Metrics, bw: dict) -> None:
    """busbw_vs_mptcp: the main system over system "mptcp" at the largest size both ran."""
    main = run.main
    common = sorted(set(bw.get("mptcp", {})) & set(bw.get(main, {}))) if main != "mptcp" else []
    if common:
        m.values["busbw_vs_mptcp"] = (bw[main][common[-1]]["median_mbps"]
                                      / bw["mptcp"][common[-1]]["median_mbps"])
    else:
        m.notes["busbw_vs_mptcp"] = "no mptcp run to compare with"


def _rank_errors(run: _Run, m: Metrics) -> None:
    """rank_errors: what the runner reported (a count, or a collection whose size is taken)."""
    rank_err = run.extra.get("rank_errors")
    if isinstance(rank_err, (list, tuple, set, dict)):
        rank_err = len(rank_err)
    m.values["rank_errors"] = rank_err if is_num(rank_err) else None
    if m.values["rank_errors"] is None:
        m.notes["rank_errors"] = "the runner reported no rank exit status"


def _train(run: _Run, m: Metrics) -> None:
    """step_time_ms, samples_per_s, loss_final, loss_matches_reference (training.py);
    ``extra['train_reference']``: the lines of the fault-free reference run, if one ran."""
    w = getattr(run.scenario, "workload", None)
    if w is None or w.kind != "train":
        for k in TRAIN_METRICS:
            m.notes[k] = "only measured for a train workload"
        return
    world = _world(run.topo, run.scenario, run.extra) or 1
    train_metrics(m, w, run.iterations, as_iterations(run.extra.get("train_reference") or ()),
                  world, run.t0)


def _steady_mask(rates: Rates, wl: np.ndarray, faults: Sequence[FaultRecord]) -> np.ndarray:
    """The workload bins outside every fault window (t_applied to t_end + SETTLE_S)."""
    steady = wl.copy()
    for f in faults:
        if f.t_applied is None:
            continue
        stop = (f.t_end if f.t_end is not None else math.inf) + SETTLE_S
        steady &= ~((rates.edges[1:] > f.t_applied) & (rates.edges[:-1] < stop))
    return steady


def _rail_shares(run: _Run, m: Metrics, rates: Rates, windows: Sequence[Span],
                 faults: Sequence[FaultRecord], flows: Sequence[FlowRecord] = ()) -> None:
    """rail_share.<rail> over the steady state; per-rail goodput and the goodput series."""
    wl = np.zeros(len(rates), dtype=bool)
    for a, b in windows:
        wl |= rates.mask(a, b)
    m.detail["rail_goodput_mbps"] = {
        r: (float(np.nanmean(rates.rail_bps[r][wl])) / 1e6 if wl.any() else None)
        for r in run.rails if r in rates.rail_bps}
    steady = _steady_mask(rates, wl, faults)
    present = [r for r in run.rails if r in rates.rail_bps]
    sh = shares(rates, steady, present, run.floor_bps) if steady.any() \
        else {r: None for r in present}
    for r in run.rails:
        m.values[SHARE_PREFIX + r] = sh.get(r)
    if not steady.any():
        m.notes["rail_share"] = "no steady-state window outside the faults"
    elif all(v is None for v in sh.values()):
        m.notes["rail_share"] = "no traffic in the steady-state windows"
    m.detail["steady_s"] = float(steady.sum()) * BIN_S
    m.detail["goodput"] = {"t_rel": (rates.t - run.t0).round(4).tolist(),
                           "rails_mbps": {r: np.round(v / 1e6, 3).tolist()
                                          for r, v in rates.rail_bps.items()}}
    if flows:     # traffic faults: the competing flows' estimate and what is left for the work
        comp = competing_bps(rates, flows)
        m.detail["goodput"]["competing_mbps"] = {r: np.round(v / 1e6, 3).tolist()
                                                 for r, v in comp.items()}
        m.detail["goodput"]["workload_mbps"] = {r: np.round(v / 1e6, 3).tolist()
                                                for r, v in workload_bps(rates, comp).items()}


def _iteration_detail(run: _Run) -> list[dict]:
    """Per iteration: when, how long, what bus bandwidth, complete and correct."""
    return [{"phase": r["phase"], "system": r["system"], "bytes": r["bytes"], "iter": r["iter"],
             "t_rel": None if r["t_start"] is None else r["t_start"] - run.t0,
             "latency_ms": None if r["latency_s"] is None else r["latency_s"] * 1e3,
             "busbw_mbps": None if r["latency_s"] is None else
             (busbw_bps(r["bytes"], r["ranks"], r["latency_s"]) or 0) / 1e6 or None,
             "complete": r["complete"], "ok": r["ok"]} for r in run.table]


def _fault_metrics(m: Metrics, tallies: FaultTallies) -> None:
    """detection_ms, failover_ms, recovery_ms: the worst over the faults they apply to; None
    (with every fault's reason) if any of them has no value, or if there is no such fault."""
    m.faults = tallies.rows
    for metric, what in (("detection_ms", "rail-removing fault"),
                         ("failover_ms", "rail-removing fault"),
                         ("recovery_ms", "fault that ended (link-up or 'for')")):
        tally = getattr(tallies, metric)
        if tally.missing:
            m.notes[metric] = "; ".join(tally.missing)
        elif not tally.values:
            m.notes[metric] = f"no {what} in this run"
        else:
            m.values[metric] = max(tally.values)


def _adaptation(run: _Run, m: Metrics, events: Sequence[dict], faults: Sequence[FaultRecord],
                flows: Sequence[FlowRecord], windows: Sequence[Span]) -> None:
    """adaptation_ms (see adaptation.py): worst change; per change in its fault's row."""
    w = getattr(run.scenario, "workload", None)
    hosts = (w.hosts if w is not None and w.hosts else None) or run.topo.hosts
    ts = [e["t"] for e in events if is_num(e.get("t"))]
    span = (min(a for a, _ in windows), max(b for _, b in windows)) if windows else \
        ((min(ts), max(ts)) if ts else (run.t0, math.inf))
    specs = {f.index: f for f in getattr(run.scenario, "faults", ())}
    ad = adaptation(run.topo, faults, specs, events, flows, hosts, min(span[0], run.t0), span[1])
    m.values["adaptation_ms"] = ad.value_ms
    if ad.value_ms is None:
        m.notes["adaptation_ms"] = ad.why_none() or "not measured"
    m.detail["split"] = ad.detail(run.t0)
    by_fault: dict[int, list[dict]] = {}
    for c in ad.changes:
        by_fault.setdefault(c.fault, []).append(c.to_dict(run.t0))
    for row in m.faults:
        if row.index in by_fault:
            row.adaptation = by_fault[row.index]


def _rates(samples: Optional[Samples], t0: float) -> Optional[Rates]:
    """Goodput in BIN_S bins on a grid aligned with t0, or None without samples."""
    if not samples:
        return None
    span = samples.span
    start = t0 + math.ceil((span[0] - t0) / BIN_S - 1e-9) * BIN_S
    return samples.rates(BIN_S, start=start, end=span[1])


def _sampler_detail(samples: Optional[Samples]) -> Optional[dict]:
    if not samples:
        return None
    return {"ticks": samples.ticks, "late_ticks": samples.late_ticks,
            "interval_s": samples.interval, "dump_ms": samples.dump_s * 1e3,
            "notes": samples.notes}


# ------------------------------------------------------------------------------- compute
def compute(topo, scenario, samples: Optional[Samples],
            iterations: Iterable[Union[IterationRecord, Mapping]], events: Sequence[dict],
            faults: Sequence[FaultRecord], t0: float, extra: Optional[dict] = None,
            flows: Sequence[FlowRecord] = ()) -> Metrics:
    """Every metric of ``scenario.METRICS`` plus ``rail_share.<rail>``, with notes, per-fault
    rows and detail. ``iterations``: the ranks' lines, as records or as the dicts they wrote
    (converted here, once). Definitions (also in each helper's docstring):

    * goodput: per rail, the sum over its hosts of the kernel rx_bytes deltas at the host end
      (bytes delivered to hosts, L2 incl. headers) per 20 ms bin, in bit/s; total = sum of
      rails. ``detail.rail_goodput_mbps`` = mean over the workload windows.
    * iteration latency = max over ranks of (t_end - t_start) of the same iteration;
      busbw = bytes * 2(n-1)/n / latency (allreduce, n ranks); ``busbw_mbps`` = median over the
      complete iterations of the main system (the workload's system; nezha in a compare) at its
      largest message size, in Mbit/s.
    * rail_share.<rail> = that rail's goodput bytes / all rails' goodput bytes over the
      workload windows of the main system minus every fault window (t_applied to t_end +
      SETTLE_S; to the end of the run if the fault never ends).
    * detection_ms / failover_ms: see ``failover.detection`` / ``failover.failover``; worst
      (max) over the rail-removing faults (link-down, blackhole, flap, on a link, rail or
      host); None if there is no such fault or any of them has no value.
    * recovery_ms: see ``failover.recovery``; worst over faults that ended (t_end, or an
      explicit link-up after a link-down) on rails that were taken out or degraded.
    * iterations, iterations_lost, wrong_results: see ``iteration_counts``.
    * busbw_vs_single_rail = busbw of the main system / busbw of system "single" at the largest
      message size both ran (compare workload), or / ``extra['single_rail_busbw_mbps']``;
      busbw_vs_single_rail.<size> (e.g. .16MiB) the same ratio at each size both ran.
    * busbw_vs_rail_sum = busbw_mbps / sum over rails of their nominal rate (slowest link of
      each rail), None if a rail is unshaped.
    * rank_errors = ``extra['rank_errors']`` (a count, or a list whose length is taken).
    * step_time_ms, samples_per_s, loss_final, loss_matches_reference (train): see
      training.py.
    * adaptation_ms: see ``adaptation.adaptation``; worst over the changes (start and end of a
      rate or traffic fault, end of a rail-removing one). ``flows``: the traffic faults'
      competing flows (their goodput is shown apart: ``detail.goodput.competing_mbps``).
    """
    extra = dict(extra or {})
    events = by_time(events)      # as the ranks' logs were read: rank after rank
    iterations = as_iterations(iterations)
    table = iteration_table(iterations, _world(topo, scenario, extra))
    run = _Run(topo, scenario, iterations, table, _main_system(scenario, table), extra,
               {r.name: nominal_rate_bps(topo, r.name) for r in topo.rails}, t0)
    m = Metrics({k: None for k in METRICS} | {SHARE_PREFIX + r: None for r in run.rails})
    counts, bw = iteration_counts(table, iterations), busbw_by_system(table)
    _iteration_metrics(run, m, counts)
    _busbw(run, m, bw)
    _busbw_vs_single_rail(run, m, bw)
    _busbw_vs_rail_sum(run, m)
    _busbw_vs_mptcp(run, m, bw)
    _rank_errors(run, m)
    windows = _windows(iterations, extra.get("phases") or (), run.main,
                       samples.span if samples else (math.nan, math.nan))
    m.detail = {"t0": t0, "bin_s": BIN_S, "main_system": run.main,
                "windows": [list(x) for x in windows], "iterations": _iteration_detail(run),
                "busbw_by_system": bw,
                "nominal_mbps": {r: (v / 1e6 if v else None) for r, v in run.nominal.items()},
                "counts": counts, "sampler": _sampler_detail(samples)}
    _train(run, m)
    _timeline_metrics(run, m, samples, events, faults, flows, windows)
    return m


def _timeline_metrics(run: _Run, m: Metrics, samples: Optional[Samples], events: Sequence[dict],
                      faults: Sequence[FaultRecord], flows: Sequence[FlowRecord],
                      windows: Sequence[Span]) -> None:
    """The metrics read off the run's timeline: rail shares (kernel samples), the per-fault
    times and adaptation_ms, and the competing flows' detail."""
    rates = _rates(samples, run.t0)
    if rates is not None and len(rates):
        _rail_shares(run, m, rates, windows, faults, flows)
    else:
        m.notes["rail_share"] = "no kernel samples"
    _fault_metrics(m, analyse_faults(faults, events, run.rails, run.table, run.t0, rates,
                                     windows, run.floor_bps))
    _adaptation(run, m, events, faults, flows, windows)
    value, note = rejoin_ms(run.topo, faults, events)
    m.values["aggregation_rejoin_ms"] = value
    if note:
        m.notes["aggregation_rejoin_ms"] = note
    if flows:
        m.detail["flows"] = flows_detail(flows, run.t0)
