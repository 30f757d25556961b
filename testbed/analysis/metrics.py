"""From what was measured to numbers an expectation can be held against.

``compute`` returns a flat dict: every name of ``scenario.METRICS``, ``rail_share.<rail>`` for
every rail, ``notes`` (metric -> why it is None, or a caveat) and ``detail`` (per-fault breakdown,
per-rail goodput, per-iteration latency, bus bandwidth by system and size).

Honesty rule: a metric that could not be measured (no events, no such fault, no traffic) is None,
with the reason in ``notes``; the verdict fails an expectation on a None metric as "not measured".
No metric has a default that passes.

All times are CLOCK_MONOTONIC seconds (shared by every namespace of the machine): fault records,
kernel samples, Nezha events and iteration records are compared directly.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from testbed.analysis.sampler import Rates, Samples, rail_name
from testbed.model.scenario import METRICS, SHARE_PREFIX, sized_metric

BIN_S = 0.02             # goodput bin
STALL_FRACTION = 0.3     # a bin is a traffic gap below this fraction of the active level
LEVEL_QUANTILE = 90      # the "active" level of a set of rails: this percentile of its bins
PRE_WINDOW_S = 3.0       # how far before a fault its reference (pattern, share) is taken
SETTLE_S = 0.5           # after a fault's end, excluded from steady-state shares
STEADY_S = 1.0           # stalls closer than this to each other belong to the same failover
REROUTE_GRACE_S = 0.1    # after detection, rerouted work is queued within this: a later stall
                         # is not a wait for the failover
RECOVERY_SHARE = 0.5     # a healed rail has recovered at this fraction of its pre-fault share
SUSTAIN_S = 0.25         # ... held over two consecutive windows of this length
ACTIVITY_FLOOR = 0.01    # traffic below 1 % of the rails' nominal sum is background, not work
ACTIVITY_FLOOR_BPS = 1e6  # ... or below 1 Mbit/s when a rail is unshaped
EARLY_TOL_S = 0.05       # an event this much before t_applied still belongs to the fault
RAIL_REMOVING = ("link-down", "blackhole", "flap")
DEGRADING = ("rate", "loss", "delay")
DETECTION_EVENTS = ("rail_down", "down", "rail_agreed", "agreed")
AGREED_EVENTS = ("rail_agreed", "agreed")
REROUTE_EVENTS = ("rerouted", "reroute")


# ------------------------------------------------------------------------------- iterations
def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def iteration_table(iterations: Iterable[dict], world: Optional[int] = None) -> list[dict]:
    """One row per iteration (key: phase, system, bytes, iter), merged over ranks.

    ``latency_s`` = max over ranks of (t_end - t_start): how long the slowest rank spent in the
    collective; ``span_s`` = last rank's t_end - first rank's t_start. ``complete`` = every rank
    of the phase (``world`` or the ranks seen in that phase, whichever is larger) recorded an
    end. Summary lines and records without ``iter`` are ignored."""
    groups: dict[tuple, list[dict]] = {}
    ranks_in_phase: dict[Any, set] = {}
    for r in iterations:
        if r.get("summary") or "iter" not in r:
            continue
        key = (r.get("phase", 0), r.get("system"), r.get("bytes"), r.get("iter"))
        groups.setdefault(key, []).append(r)
        ranks_in_phase.setdefault(key[0], set()).add(r.get("rank"))
    rows = []
    for key, recs in groups.items():
        n = max(world or 0, len(ranks_in_phase[key[0]]))
        done = [r for r in recs if _num(r.get("t_end")) and _num(r.get("t_start"))]
        ranks_done = {r.get("rank") for r in done}
        row = {"phase": key[0], "system": key[1], "bytes": key[2], "iter": key[3],
               "ranks": n, "ranks_done": len(ranks_done),
               "complete": len(ranks_done) >= n,
               "ok": all(r.get("ok") is not False for r in recs),
               "warmup": any(r.get("warmup") for r in recs),
               "wrong_records": sum(1 for r in recs if r.get("ok") is False),
               "t_start": min((r["t_start"] for r in done), default=None),
               "t_end": max((r["t_end"] for r in done), default=None),
               "latency_s": max((r["t_end"] - r["t_start"] for r in done), default=None)}
        row["span_s"] = (row["t_end"] - row["t_start"]) if done else None
        rows.append(row)
    rows.sort(key=lambda r: (r["t_start"] if r["t_start"] is not None else math.inf,
                             str(r["phase"]), r["iter"] if _num(r["iter"]) else 0))
    return rows


def iteration_counts(table: Sequence[dict], iterations: Iterable[dict] = ()) -> dict:
    """iterations: rows complete on every rank. iterations_lost: rows some rank recorded but not
    every rank; plus, per phase in which a rank wrote no final summary line (killed or crashed)
    while the others finished theirs or died too, the iteration in flight when it died (counted
    once, and only when the ranks do write summary lines, i.e. at least one exists).
    wrong_results: iterations with at least one record ``ok: false`` (records in
    ``wrong_records``)."""
    complete = [r for r in table if r["complete"]]
    partial = [r for r in table if not r["complete"]]
    iterations = list(iterations)
    summaries = [r for r in iterations if r.get("summary")]
    lost = len(partial)
    in_flight = 0
    if summaries:
        by_phase: dict[Any, set] = {}
        for r in iterations:
            if "rank" in r:
                by_phase.setdefault(r.get("phase", 0), set()).add(r["rank"])
        for phase, ranks in by_phase.items():
            summed = {r.get("rank") for r in summaries if r.get("phase", 0) == phase}
            if ranks - summed and not any(p["phase"] == phase for p in partial):
                in_flight += 1
    return {"iterations": len(complete), "iterations_lost": lost + in_flight,
            "wrong_results": sum(1 for r in table if not r["ok"]),
            "wrong_records": sum(r["wrong_records"] for r in table),
            "lost_partial": lost, "lost_in_flight": in_flight}


def busbw_bps(nbytes: float, ranks: int, latency_s: float) -> Optional[float]:
    """Allreduce bus bandwidth in bit/s: bytes * 2(n-1)/n / latency * 8 (the nccl-tests
    convention: what each rank's link must carry, comparable with a link's rate)."""
    if not (_num(nbytes) and ranks and ranks > 1 and latency_s and latency_s > 0):
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


# ------------------------------------------------------------------------------- helpers
def _fault_rails(f: dict, rails: Sequence[str]) -> list[str]:
    if f.get("rails"):
        return [r for r in f["rails"] if r in rails]
    kind, target = f.get("target_kind"), str(f.get("target", ""))
    if kind == "rail":
        return [target]
    if kind == "link":
        return [target.partition(".")[2]]
    if kind == "host" and f.get("action") != "kill":
        return list(rails)
    return []


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index runs where mask is True."""
    out, i, n = [], 0, len(mask)
    while i < n:
        if mask[i]:
            j = i
            while j < n and mask[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def _longest_inner_gap(gap: np.ndarray) -> int:
    """Longest run of gap bins that does not touch the start of the window (a run there is the
    time before the workload began, or the tail of something earlier, not a natural dip)."""
    return max((b - a for a, b in _runs(gap) if a > 0), default=0)


def _level(x: np.ndarray) -> Optional[float]:
    x = x[np.isfinite(x) & (x > 0)]
    if len(x) == 0:
        return None
    return float(np.percentile(x, LEVEL_QUANTILE))


def _bin(rates: Rates, t: float) -> int:
    """Index of the bin containing t (clamped to [0, n])."""
    i = int(math.floor((t - rates.edges[0]) / rates.bin_s + 1e-9))
    return max(0, min(len(rates), i))


def _sum(rates: Rates, rails: Sequence[str]) -> np.ndarray:
    arrs = [rates.rail_bps[r] for r in rails if r in rates.rail_bps]
    if not arrs:
        return np.full(len(rates), np.nan)
    stack = np.vstack(arrs)
    out = np.nansum(stack, axis=0)
    out[np.all(np.isnan(stack), axis=0)] = np.nan
    return out


def _shares(rates: Rates, mask: np.ndarray, rails: Sequence[str], floor_bps: float = 0.0
            ) -> dict[str, Optional[float]]:
    """Each rail's share of the goodput bytes in the bins of ``mask``; None for all when the
    mean total goodput there is below ``floor_bps`` (background chatter, not a workload)."""
    byt = {r: float(np.nansum(rates.rail_bps[r][mask])) * rates.bin_s / 8 for r in rails}
    total = sum(byt.values())
    seconds = float(mask.sum()) * rates.bin_s
    if total <= 0 or seconds <= 0 or total * 8 / seconds < max(floor_bps, 1.0):
        return {r: None for r in rails}
    return {r: byt[r] / total for r in rails}


def _pre_start(T: float, faults: Sequence[dict], windows: Sequence[tuple[float, float]]) -> float:
    """Start of the reference window before time T: PRE_WINDOW_S back, but not before the
    workload began nor inside an earlier fault (its end + SETTLE_S)."""
    start = T - PRE_WINDOW_S
    wl = [w for w in windows if w[0] <= T]
    if wl:
        start = max(start, max(w[0] for w in wl))
    for f in faults:
        ta = f.get("t_applied")
        if ta is None or ta >= T - 1e-9:
            continue
        te = f.get("t_end")
        start = max(start, (te if te is not None else ta) + SETTLE_S)
    return start


# ------------------------------------------------------------------------------- per fault
def detection(f: dict, events: Sequence[dict], rails: Sequence[str], fault_rails: Sequence[str],
              until: float = math.inf) -> dict:
    """detection_ms of one rail-removing fault: for each rail the fault takes out, the first
    Nezha event of any rank saying that rail is down (``rail_down``, or ``rail_agreed`` if that
    comes first) at or after the fault's start (``fault_start``: its first change, minus
    EARLY_TOL_S) and before the next fault on that rail, minus that start; the fault's value is the slowest of its rails (max), clamped at 0. None if any of
    its rails has no such event. Also reports the first ``rail_agreed`` and ``rerouted``."""
    T = fault_start(f)
    out: dict[str, Any] = {"detection_ms": None, "by_rail": {}}
    worst: Optional[float] = 0.0
    for r in fault_rails:
        def first(names):
            for e in events:
                t = e.get("t")
                if not _num(t) or t < T - EARLY_TOL_S or t >= until:
                    continue
                if e.get("event") in names and _event_rails(e, rails) & {r}:
                    return e
            return None
        d, a, rr = first(DETECTION_EVENTS), first(AGREED_EVENTS), first(REROUTE_EVENTS)
        ms = lambda e: None if e is None else max(0.0, (e["t"] - T) * 1e3)  # noqa: E731
        out["by_rail"][r] = {"detection_ms": ms(d), "detected_by": None if d is None
                             else d.get("rank"), "event": None if d is None else d.get("event"),
                             "agreed_ms": ms(a), "rerouted_ms": ms(rr)}
        if d is None:
            worst = None
        elif worst is not None:
            worst = max(worst, ms(d))
    out["detection_ms"] = worst if fault_rails else None
    return out


def _event_rails(e: dict, rails: Sequence[str]) -> set:
    found = set()
    for key in ("rail", "rail_name"):
        name = rail_name(e.get(key), rails)
        if name:
            found.add(name)
    for v in e.get("rails") or () if isinstance(e.get("rails"), (list, tuple)) else ():
        name = rail_name(v, rails)
        if name:
            found.add(name)
    return found


def fault_start(f: dict) -> float:
    """When a fault began to take effect: when its first change was issued (``t_issued``).
    A rail-wide fault takes one netlink change per link end, which can take tens of ms on a
    loaded machine; a rank may see its own link go down before the last one is changed, so
    times are measured from the first change, which counts the injection time against Nezha
    rather than for it."""
    ti = f.get("t_issued")
    return ti if _num(ti) else f["t_applied"]


def in_collective(rates: Rates, spans: Sequence[tuple[float, float]]) -> np.ndarray:
    """Per bin: does its centre lie inside some iteration (first rank's start .. last rank's
    end)? Between iterations the ranks verify, refill and meet at a barrier: the rails are idle
    by design, which is neither a stall nor a natural dip of the collective."""
    c = rates.centers
    mask = np.zeros(len(c), dtype=bool)
    for a, b in spans:
        mask |= (c >= a) & (c <= b)
    return mask


def failover(f: dict, rates: Rates, fault_rails: Sequence[str], rails: Sequence[str],
             faults: Sequence[dict], windows: Sequence[tuple[float, float]],
             run_end: float, floor_bps: float = 0.0, onset_limit: Optional[float] = None,
             spans: Optional[Sequence[tuple[float, float]]] = None) -> dict:
    """failover_ms of one rail-removing fault.

    S(t) = goodput of the surviving rails (every rail the fault does not take out; sum over
    their hosts of bytes delivered), in 20 ms bins. Its active level L = 90th percentile of the
    non-zero bins from t_applied to the end of the fault window (the fault's end; for a flap,
    its first link-up; at most the end of the run). A bin is a gap when S < 0.3 L (no sample
    counts as a gap) and, given the iterations' ``spans``, it lies inside a collective (see
    in_collective: the idle time between iterations is never a gap). The pre-fault pattern is the longest gap in the reference window before
    the fault (PRE_WINDOW_S, not before the workload or an earlier fault; a gap at the very start
    of that window is not counted), taken on the total
    goodput and, if the surviving rails were active in >= half of its bins, on S as well: the
    natural dips between iterations. A gap after the fault is a *stall* when it is longer than
    that. The failover ends at the end of the last stall of the first chain of stalls (stalls
    less than STEADY_S apart) that starts within the fault window and ends after t_applied;
    only stalls that begin before ``onset_limit`` count: the iteration in flight at the fault
    has completed (a dip in a later iteration is the workload's own rhythm), or the failed
    rail's work was moved (detection + REROUTE_GRACE_S: later, the surviving rails are not
    waiting for the failover);
    the end is refined inside its 20 ms bins assuming traffic resumes at level L. So it is the
    time from the fault until the surviving rails carry traffic at their steady rate again,
    including the time they kept carrying their own share before stalling.

    The fault window must carry workload traffic: a mean S below ACTIVITY_FLOOR (1 % of the
    rails' nominal sum, or 1 Mbit/s if a rail is unshaped) is background chatter -> None.
    failover_ms = (end - t_applied) in ms; 0 when the surviving rails never stalled beyond the
    pre-fault pattern (traffic moved on without interruption). None when no rail survives or
    the surviving rails carried nothing after the fault or never resumed before the run ended.
    If traffic resumed only after the fault window, the value is reported with a note (that is
    the link coming back, not a failover)."""
    T = fault_start(f)
    res: dict[str, Any] = {"failover_ms": None, "note": None}
    survivors = [r for r in rails if r not in fault_rails]
    if not survivors:
        res["note"] = "no rail survives this fault"
        return res
    end = f.get("t_end")
    if f.get("action") == "flap":
        ups = [t["t"] for t in f.get("toggles") or () if t.get("state") == "up" and t.get("t")]
        if ups:
            end = min(ups)
    end = min(end if end is not None else run_end, run_end)
    S = _sum(rates, survivors)
    kT, kE = _bin(rates, T), max(_bin(rates, end), _bin(rates, T) + 1)
    L = _level(S[kT:kE])
    mean = float(np.mean(np.nan_to_num(S[kT:kE]))) if kE > kT else 0.0
    if L is None or mean < floor_bps:
        res["note"] = ("the surviving rails carried no workload traffic after the fault"
                       + (f" (mean {mean / 1e6:.3f} Mbit/s, below the "
                          f"{floor_bps / 1e6:.2f} Mbit/s floor)" if L else ""))
        return res
    thr = STALL_FRACTION * L
    # the pre-fault pattern
    k0 = _bin(rates, _pre_start(T, faults, windows))
    inside = in_collective(rates, spans) if spans else np.ones(len(rates), dtype=bool)
    natural = 0
    if kT - k0 >= 5:
        tot = rates.total_bps[k0:kT]
        Lt = _level(tot)
        if Lt is not None:
            natural = _longest_inner_gap(~(tot >= STALL_FRACTION * Lt) & inside[k0:kT])
        pre_s = S[k0:kT]
        if np.mean(pre_s >= thr) >= 0.5:
            natural = max(natural, _longest_inner_gap(~(pre_s >= thr) & inside[k0:kT]))
    else:
        res["note_pattern"] = "no pre-fault reference window; every gap counts as a stall"
    res["natural_gap_ms"] = natural * rates.bin_s * 1e3
    res["level_mbps"] = L / 1e6
    gap = ~(S >= thr) & inside         # NaN (not sampled) counts as a gap
    stalls = [(a, b) for a, b in _runs(gap)
              if b > kT and a < kE and (b - a) > natural]
    if onset_limit is not None:
        # a stall that begins after the iteration in flight at the fault has completed (a dip
        # of a later one), or after the failed rail's work was moved, is not the failover
        late = [x for x in stalls if rates.edges[x[0]] > onset_limit]
        stalls = [x for x in stalls if rates.edges[x[0]] <= onset_limit]
        if late:
            res["later_dips_ms"] = [(rates.edges[a] - T) * 1e3 for a, _ in late[:5]]
    if not stalls:
        res["failover_ms"] = 0.0
        res["note"] = (f"surviving rails never stalled beyond the pre-fault pattern "
                       f"(longest natural gap {res['natural_gap_ms']:.0f} ms)")
        res["stalls"] = []
        return res
    chain = [stalls[0]]
    for a, b in stalls[1:]:
        if (a - chain[-1][1]) * rates.bin_s < STEADY_S:
            chain.append((a, b))
        else:
            break
    a, b = chain[-1]
    res["stalls"] = [{"from_ms": (rates.edges[x] - T) * 1e3, "to_ms": (rates.edges[y] - T) * 1e3}
                     for x, y in chain]
    if b >= len(rates):
        res["note"] = "traffic on the surviving rails never resumed before the end of the run"
        return res
    # refine: active time in bins b-1 and b, assumed contiguous and ending at edges[b+1]
    active = (min(S[b - 1] if np.isfinite(S[b - 1]) else 0.0, L) + min(S[b], L)) / L * rates.bin_s
    t_resume = float(np.clip(rates.edges[b + 1] - active, rates.edges[b - 1], rates.edges[b + 1]))
    res["failover_ms"] = max(0.0, (t_resume - T) * 1e3)
    if t_resume > end + rates.bin_s:
        res["note"] = (f"traffic resumed only {(t_resume - end) * 1e3:.0f} ms after the fault "
                       "window ended: the link came back, no failover")
    return res


def first_end_after(T: float, table: Sequence[dict]) -> Optional[float]:
    """When the iteration in flight at T (the first to end after it, on every rank) ended."""
    ends = [r["t_end"] for r in table if r.get("complete") and _num(r.get("t_end"))
            and r["t_end"] > T]
    return min(ends) if ends else None


def iteration_stall(T: float, table: Sequence[dict]) -> Optional[float]:
    """Cross-check for failover: latency of the iteration in flight at T minus the median
    latency of its (phase, system, size), in ms."""
    for r in table:
        if r["t_start"] is not None and r["complete"] and r["t_start"] <= T <= r["t_end"]:
            same = [x["latency_s"] for x in table if x["complete"] and x["phase"] == r["phase"]
                    and x["system"] == r["system"] and x["bytes"] == r["bytes"]]
            return (r["latency_s"] - statistics.median(same)) * 1e3
    return None


def recovery(heal_t: float, ref_t: float, rates: Rates, fault_rails: Sequence[str],
             rails: Sequence[str], faults: Sequence[dict],
             windows: Sequence[tuple[float, float]], floor_bps: float = 0.0) -> dict:
    """recovery_ms after a fault ends (its t_end, or an explicit link-up's t_applied).

    For each rail the fault took out or degraded: its pre-fault share p = its bytes / all rails'
    bytes in the reference window before the fault (PRE_WINDOW_S, see failover). Recovered at
    the first 20 ms bin k at or after the heal such that the rail's share of the bytes is
    >= RECOVERY_SHARE * p both in [t_k, t_k + SUSTAIN_S) and in the SUSTAIN_S after that, and
    the rail carries traffic in bin k. recovery_ms = t_k - heal; the fault's value is its slowest
    rail. None if the rail carried nothing before the fault, or did not recover before the end
    of the samples."""
    res: dict[str, Any] = {"recovery_ms": None, "note": None, "by_rail": {}}
    k0, kF = _bin(rates, _pre_start(ref_t, faults, windows)), _bin(rates, ref_t)
    if kF - k0 < 3:
        res["note"] = "no pre-fault reference window"
        return res
    mask = np.zeros(len(rates), dtype=bool)
    mask[k0:kF] = True
    pre = _shares(rates, mask, rails, floor_bps)
    m = max(1, int(round(SUSTAIN_S / rates.bin_s)))
    worst: Optional[float] = 0.0
    kh = _bin(rates, heal_t)
    notes = []
    for r in fault_rails:
        p = pre.get(r)
        info: dict[str, Any] = {"pre_share": p, "recovery_ms": None}
        res["by_rail"][r] = info
        if not p or p < 0.01:
            notes.append(f"rail {r} carried no workload traffic before the fault")
            worst = None
            continue
        thr = RECOVERY_SHARE * p
        R = np.nan_to_num(rates.rail_bps[r])
        Tt = np.nan_to_num(rates.total_bps)
        found = None
        for k in range(kh, len(rates) - 2 * m + 1):
            if R[k] <= 0.01 * (p * (np.mean(Tt[k0:kF]) or 1.0)):
                continue
            w1, w2 = slice(k, k + m), slice(k + m, k + 2 * m)
            t1, t2 = Tt[w1].sum(), Tt[w2].sum()
            if t1 > 0 and t2 > 0 and R[w1].sum() / t1 >= thr and R[w2].sum() / t2 >= thr:
                found = k
                break
        if found is None:
            notes.append(f"rail {r} did not carry {RECOVERY_SHARE:.0%} of its pre-fault share "
                         f"({p:.2f}) again before the end of the run")
            worst = None
            continue
        info["recovery_ms"] = max(0.0, (rates.edges[found] - heal_t) * 1e3)
        if worst is not None:
            worst = max(worst, info["recovery_ms"])
    res["recovery_ms"] = worst if fault_rails else None
    res["note"] = "; ".join(notes) or None
    return res


# ------------------------------------------------------------------------------- compute
def _windows(scenario, iterations: Sequence[dict], extra: dict, main: Optional[str],
             span: tuple[float, float]) -> list[tuple[float, float]]:
    """Intervals during which the workload of the main system ran, each starting after its
    warm-up iterations (the last rank's end of the last one)."""
    phases = [p for p in extra.get("phases") or () if _num(p.get("t_start")) and
              _num(p.get("t_end")) and (main is None or p.get("system") in (main, None))]
    recs = [r for r in iterations if _num(r.get("t_start")) and _num(r.get("t_end"))
            and (main is None or r.get("system") in (main, None))]
    if phases:
        out = [(p["t_start"], p["t_end"]) for p in phases]
    elif recs:
        out = [(min(r["t_start"] for r in recs), max(r["t_end"] for r in recs))]
    elif all(math.isfinite(x) for x in span):
        return [span]
    else:
        return []
    warm = [r for r in recs if r.get("warmup")]
    if warm:
        out = [(max([a] + [r["t_end"] for r in warm if a <= r["t_start"] <= b]), b)
               for a, b in out]
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
    return w.system


def nominal_rate_bps(topo, rail: str) -> Optional[float]:
    """A rail's nominal rate: the slowest of its links (a ring runs at its slowest hop)."""
    rates = [l.shape.rate_bps for l in topo.links.values() if l.rail == rail]
    if not rates or any(r is None for r in rates):
        return None
    return float(min(rates))


def compute(topo, scenario, samples: Optional[Samples], iterations: Sequence[dict],
            events: Sequence[dict], faults: Sequence[dict], t0: float,
            extra: Optional[dict] = None) -> dict:
    """Every metric of ``scenario.METRICS`` plus ``rail_share.<rail>``, ``notes`` and ``detail``.

    Definitions (also in each helper's docstring):

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
    * detection_ms / failover_ms: see ``detection`` / ``failover``; worst (max) over the
      rail-removing faults (link-down, blackhole, flap, on a link, rail or host); None if there
      is no such fault or any of them has no value.
    * recovery_ms: see ``recovery``; worst over faults that ended (t_end, or an explicit
      link-up after a link-down) on rails that were taken out or degraded.
    * iterations, iterations_lost, wrong_results: see ``iteration_counts``.
    * busbw_vs_single_rail = busbw of the main system / busbw of system "single" at the largest
      message size both ran (compare workload), or / ``extra['single_rail_busbw_mbps']``;
      busbw_vs_single_rail.<size> (e.g. .16MiB) the same ratio at each size both ran.
    * busbw_vs_rail_sum = busbw_mbps / sum over rails of their nominal rate (slowest link of
      each rail), None if a rail is unshaped.
    * rank_errors = ``extra['rank_errors']`` (a count, or a list whose length is taken).
    """
    extra = dict(extra or {})
    rails = [r.name for r in topo.rails]
    faults = [f for f in faults if f is not None]
    notes: dict[str, str] = {}
    out: dict[str, Any] = {m: None for m in METRICS}
    for r in rails:
        out[SHARE_PREFIX + r] = None

    # iterations
    w = getattr(scenario, "workload", None)
    world = extra.get("world")
    if world is None and w is not None and w.kind != "command":
        world = len(w.hosts) if w.hosts else len(topo.hosts)
    table = iteration_table(iterations, world)
    main = _main_system(scenario, table)
    counts = iteration_counts(table, iterations)
    if table or (w is not None and w.kind not in ("command", "none")):
        out["iterations"] = counts["iterations"]
        if table:
            out["iterations_lost"] = counts["iterations_lost"]
            out["wrong_results"] = counts["wrong_results"]
        else:   # nothing ran: "0 wrong, 0 lost" would pass vacuously
            for k in ("iterations_lost", "wrong_results"):
                notes[k] = "no iteration records were written by any rank"
    else:
        for k in ("iterations", "iterations_lost", "wrong_results"):
            notes[k] = "the workload writes no iteration records"
    bw = busbw_by_system(table)
    if main in bw and bw[main]:
        size = max(bw[main])
        out["busbw_mbps"] = bw[main][size]["median_mbps"]
    else:
        notes["busbw_mbps"] = f"no complete iteration of {main or 'any system'} to time"
    if "single" in bw and main in bw and main != "single":
        common = sorted(set(bw["single"]) & set(bw[main]))
        for s in common:
            out[sized_metric(s)] = bw[main][s]["median_mbps"] / bw["single"][s]["median_mbps"]
        if common:
            out["busbw_vs_single_rail"] = out[sized_metric(common[-1])]
    if out["busbw_vs_single_rail"] is None and _num(extra.get("single_rail_busbw_mbps")) \
            and out["busbw_mbps"] is not None and extra["single_rail_busbw_mbps"] > 0:
        out["busbw_vs_single_rail"] = out["busbw_mbps"] / extra["single_rail_busbw_mbps"]
    if out["busbw_vs_single_rail"] is None:
        notes["busbw_vs_single_rail"] = "no single-rail run to compare with"
    nominal = {r: nominal_rate_bps(topo, r) for r in rails}
    # below this goodput a set of rails carries background chatter (ARP, neighbour discovery,
    # probes), not a workload: shares, failover and recovery are not computed from it
    floor = ACTIVITY_FLOOR * sum(nominal.values()) if all(nominal.values()) \
        else ACTIVITY_FLOOR_BPS
    if out["busbw_mbps"] is not None and all(v for v in nominal.values()):
        out["busbw_vs_rail_sum"] = out["busbw_mbps"] * 1e6 / sum(nominal.values())
    elif out["busbw_mbps"] is not None:
        notes["busbw_vs_rail_sum"] = "a rail has no nominal rate (unshaped)"
    else:
        notes["busbw_vs_rail_sum"] = notes["busbw_mbps"]
    rank_err = extra.get("rank_errors")
    if isinstance(rank_err, (list, tuple, set, dict)):
        rank_err = len(rank_err)
    out["rank_errors"] = rank_err if _num(rank_err) else None
    if out["rank_errors"] is None:
        notes["rank_errors"] = "the runner reported no rank exit status"

    # goodput
    span = samples.span if samples else (math.nan, math.nan)
    windows = _windows(scenario, iterations, extra, main, span)
    detail: dict[str, Any] = {"t0": t0, "bin_s": BIN_S, "main_system": main,
                              "windows": [list(x) for x in windows], "faults": [],
                              "iterations": [], "busbw_by_system": bw, "nominal_mbps":
                              {r: (v / 1e6 if v else None) for r, v in nominal.items()},
                              "counts": counts, "sampler": None}
    rates = None
    if samples:
        start = t0 + math.ceil((span[0] - t0) / BIN_S - 1e-9) * BIN_S
        rates = samples.rates(BIN_S, start=start, end=span[1])
        detail["sampler"] = {"ticks": samples.ticks, "late_ticks": samples.late_ticks,
                             "interval_s": samples.interval, "dump_ms": samples.dump_s * 1e3,
                             "notes": samples.notes}
    if rates is not None and len(rates):
        run_end = float(rates.edges[-1])
        wl = np.zeros(len(rates), dtype=bool)
        for a, b in windows:
            wl |= rates.mask(a, b)
        detail["rail_goodput_mbps"] = {
            r: (float(np.nanmean(rates.rail_bps[r][wl])) / 1e6 if wl.any() else None)
            for r in rails if r in rates.rail_bps}
        steady = wl.copy()
        for f in faults:
            ta = f.get("t_applied")
            if ta is None:
                continue
            te = f.get("t_end")
            stop = (te if te is not None else math.inf) + SETTLE_S
            steady &= ~((rates.edges[1:] > ta) & (rates.edges[:-1] < stop))
        present = [r for r in rails if r in rates.rail_bps]
        sh = _shares(rates, steady, present, floor) if steady.any() else {r: None for r in present}
        for r in rails:
            out[SHARE_PREFIX + r] = sh.get(r)
        if not steady.any():
            notes["rail_share"] = "no steady-state window outside the faults"
        elif all(v is None for v in sh.values()):
            notes["rail_share"] = "no traffic in the steady-state windows"
        detail["steady_s"] = float(steady.sum()) * BIN_S
        detail["goodput"] = {"t_rel": (rates.t - t0).round(4).tolist(),
                             "rails_mbps": {r: np.round(v / 1e6, 3).tolist()
                                            for r, v in rates.rail_bps.items()}}
    else:
        run_end = max([t for f in faults for t in (f.get("t_end"), f.get("t_applied"))
                       if _num(t)], default=t0)
        notes["rail_share"] = "no kernel samples"

    # per iteration
    for r in table:
        detail["iterations"].append({
            "phase": r["phase"], "system": r["system"], "bytes": r["bytes"], "iter": r["iter"],
            "t_rel": None if r["t_start"] is None else r["t_start"] - t0,
            "latency_ms": None if r["latency_s"] is None else r["latency_s"] * 1e3,
            "busbw_mbps": None if r["latency_s"] is None else
            (busbw_bps(r["bytes"], r["ranks"], r["latency_s"]) or 0) / 1e6 or None,
            "complete": r["complete"], "ok": r["ok"]})

    # faults
    det_vals, fo_vals, rec_vals = [], [], []
    det_none, fo_none, rec_none = [], [], []
    ordered = sorted([f for f in faults if _num(f.get("t_applied"))], key=lambda f: f["t_applied"])
    for i, f in enumerate(ordered):
        fr = _fault_rails(f, rails)
        label = f"fault {f.get('index', i)} ({f.get('label') or f.get('action')})"
        row: dict[str, Any] = {"index": f.get("index", i), "label": f.get("label"),
                               "action": f.get("action"), "rails": fr,
                               "t_applied_rel": f["t_applied"] - t0,
                               "t_end_rel": None if f.get("t_end") is None else f["t_end"] - t0}
        removing = f.get("action") in RAIL_REMOVING and fr
        if removing:
            nxt = [g["t_applied"] for g in ordered[i + 1:]
                   if set(_fault_rails(g, rails)) & set(fr) and g.get("action") in RAIL_REMOVING]
            d = detection(f, events, rails, fr, until=min(nxt, default=math.inf))
            row.update(detection_ms=d["detection_ms"], detection_by_rail=d["by_rail"])
            if d["detection_ms"] is None:
                det_none.append(f"{label}: Nezha logged no rail_down for "
                                + ", ".join(r for r in fr if d["by_rail"][r]["detection_ms"]
                                            is None))
            else:
                det_vals.append(d["detection_ms"])
            if rates is not None and len(rates):
                onset = first_end_after(f["t_applied"], table)
                if d["detection_ms"] is not None:
                    # the surviving rails can only be waiting for the failover until the failed
                    # rail's work has been moved to them
                    moved = fault_start(f) + d["detection_ms"] / 1e3 + REROUTE_GRACE_S
                    onset = moved if onset is None else min(onset, moved)
                fo = failover(f, rates, fr, rails, ordered, windows, run_end, floor,
                              onset_limit=onset,
                              spans=[(r["t_start"], r["t_end"]) for r in table
                                     if r["t_start"] is not None and r["t_end"] is not None])
                row.update({k: v for k, v in fo.items() if k != "note"},
                           failover_note=fo["note"])
                row["iteration_stall_ms"] = iteration_stall(f["t_applied"], table)
                if fo["failover_ms"] is None:
                    fo_none.append(f"{label}: {fo['note']}")
                else:
                    fo_vals.append(fo["failover_ms"])
            else:
                fo_none.append(f"{label}: no kernel samples")
        heal, ref = None, None
        if fr and f.get("t_end") is not None and f.get("action") in RAIL_REMOVING + DEGRADING:
            heal, ref = f["t_end"], f["t_applied"]
        elif fr and f.get("action") == "link-up":
            prev = [g for g in ordered[:i] if g.get("action") in RAIL_REMOVING
                    and set(_fault_rails(g, rails)) & set(fr)]
            if prev:
                heal, ref = f["t_applied"], prev[-1]["t_applied"]
        if heal is not None:
            if rates is not None and len(rates):
                rc = recovery(heal, ref, rates, fr, rails, ordered, windows, floor)
                row.update(recovery_ms=rc["recovery_ms"], recovery_by_rail=rc["by_rail"],
                           recovery_note=rc["note"])
                if rc["recovery_ms"] is None:
                    rec_none.append(f"{label}: {rc['note']}")
                else:
                    rec_vals.append(rc["recovery_ms"])
            else:
                rec_none.append(f"{label}: no kernel samples")
        detail["faults"].append(row)

    for metric, vals, nones, what in (
            ("detection_ms", det_vals, det_none, "rail-removing fault"),
            ("failover_ms", fo_vals, fo_none, "rail-removing fault"),
            ("recovery_ms", rec_vals, rec_none, "fault that ended (link-up or 'for')")):
        if nones:
            notes[metric] = "; ".join(nones)
        elif not vals:
            notes[metric] = f"no {what} in this run"
        else:
            out[metric] = max(vals)
    out["notes"] = notes
    out["detail"] = detail
    return out
