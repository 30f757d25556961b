"""Per fault: how long Nezha took to notice (detection), to move the traffic (failover) and to use
a healed rail again (recovery), measured from kernel goodput and Nezha's own events.

Honesty rule (as in metrics.py): a value that could not be measured is None with the reason in
the note; nothing here has a default that passes.

Times are measured from a fault's *first* change (``fault_start``), not its last: a rail-wide
fault takes one netlink change per link end, which can take tens of ms on a loaded machine, so
the injection time counts against Nezha rather than for it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from testbed.analysis.sampler import Rates
from testbed.analysis.timeline import rail_name
from testbed.model.records import Detection, Failover, FaultRecord, Recovery, is_num

STALL_FRACTION = 0.3     # a bin is a traffic gap below this fraction of the active level
LEVEL_QUANTILE = 90      # the "active" level of a set of rails: this percentile of its bins
PRE_WINDOW_S = 3.0       # how far before a fault its reference (pattern, share) is taken
SETTLE_S = 0.5           # after a fault's end, excluded from steady-state shares
TOGETHER_S = 0.1        # faults applied this close together are one event (their reference window)
STEADY_S = 1.0           # stalls closer than this to each other belong to the same failover
REROUTE_GRACE_S = 0.1    # after detection, rerouted work is queued within this: a later stall
                         # is not a wait for the failover
RECOVERY_SHARE = 0.5     # a healed rail has recovered at this fraction of its pre-fault share
SUSTAIN_S = 0.25         # ... held over two consecutive windows of this length
EARLY_TOL_S = 0.05       # an event this much before t_applied still belongs to the fault
DETECTION_EVENTS = ("rail_down", "down", "rail_agreed", "agreed")
AGREED_EVENTS = ("rail_agreed", "agreed")
REROUTE_EVENTS = ("rerouted", "reroute")

Span = tuple[float, float]


@dataclass
class FaultContext:
    """What every fault of one run is measured against: the goodput bins, the rails, the faults
    (ordered by t_applied), the workload windows, the end of the samples, the activity floor
    (bit/s below which a set of rails carries background chatter, not work) and the
    iterations' collective spans."""

    rates: Rates
    rails: Sequence[str]
    faults: Sequence[FaultRecord]
    windows: Sequence[Span]
    run_end: float
    floor_bps: float = 0.0
    spans: Optional[Sequence[Span]] = None


# ------------------------------------------------------------------------------- helpers
def fault_rails(f: FaultRecord, rails: Sequence[str]) -> list[str]:
    """The rails a fault acts on (a host fault: every rail, unless it kills the rank)."""
    if f.rails:
        return [r for r in f.rails if r in rails]
    kind, target = f.target_kind, str(f.target)
    if kind == "rail":
        return [target]
    if kind == "link":
        return [target.partition(".")[2]]
    if kind == "host" and f.action != "kill":
        return list(rails)
    return []


def fault_start(f: FaultRecord) -> float:
    """When a fault began to take effect: when its first change was issued (``t_issued``),
    else ``t_applied``. A rail-wide fault takes one netlink change per link end, which can take
    tens of ms on a loaded machine; a rank may see its own link go down before the last one is
    changed, so times are measured from the first change, which counts the injection time
    against Nezha rather than for it."""
    return f.t_issued if is_num(f.t_issued) else f.t_applied


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


def shares(rates: Rates, mask: np.ndarray, rails: Sequence[str], floor_bps: float = 0.0
           ) -> dict[str, Optional[float]]:
    """Each rail's share of the goodput bytes in the bins of ``mask``; None for all when the
    mean total goodput there is below ``floor_bps`` (background chatter, not a workload)."""
    byt = {r: float(np.nansum(rates.rail_bps[r][mask])) * rates.bin_s / 8 for r in rails}
    total = sum(byt.values())
    seconds = float(mask.sum()) * rates.bin_s
    if total <= 0 or seconds <= 0 or total * 8 / seconds < max(floor_bps, 1.0):
        return {r: None for r in rails}
    return {r: byt[r] / total for r in rails}


def _pre_start(T: float, faults: Sequence[FaultRecord], windows: Sequence[Span]) -> float:
    """Start of the reference window before time T: PRE_WINDOW_S back, but not before the
    workload began nor inside an earlier fault (its end + SETTLE_S). Faults applied within
    TOGETHER_S of each other (every link of a host taken down at once) are one event: they
    share the window before the first of them."""
    start = T - PRE_WINDOW_S
    wl = [w for w in windows if w[0] <= T]
    if wl:
        start = max(start, max(w[0] for w in wl))
    for f in faults:
        ta = f.t_applied
        if ta is None or ta >= T - TOGETHER_S:
            continue
        te = f.t_end
        start = max(start, (te if te is not None else ta) + SETTLE_S)
    return start


def in_collective(rates: Rates, spans: Sequence[Span]) -> np.ndarray:
    """Per bin: does its centre lie inside some iteration (first rank's start .. last rank's
    end)? Between iterations the ranks verify, refill and meet at a barrier: the rails are idle
    by design, which is neither a stall nor a natural dip of the collective."""
    c = rates.centers
    mask = np.zeros(len(c), dtype=bool)
    for a, b in spans:
        mask |= (c >= a) & (c <= b)
    return mask


# ------------------------------------------------------------------------------- detection
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


def _first_event(events: Sequence[dict], names: Sequence[str], rail: str, rails: Sequence[str],
                 T: float, until: float) -> Optional[dict]:
    """The first matching event of ``events``, which are in time order (timeline.by_time)."""
    for e in events:
        t = e.get("t")
        if not is_num(t) or t < T - EARLY_TOL_S or t >= until:
            continue
        if e.get("event") in names and rail in _event_rails(e, rails):
            return e
    return None


def detection(f: FaultRecord, events: Sequence[dict], rails: Sequence[str],
              fault_rails: Sequence[str], until: float = math.inf) -> Detection:
    """detection_ms of one rail-removing fault: for each rail the fault takes out, the first
    Nezha event of any rank saying that rail is down (``rail_down``, or ``rail_agreed`` if that
    comes first) at or after the fault's start (``fault_start``: its first change, minus
    EARLY_TOL_S) and before the next fault on that rail, minus that start; the fault's value is
    the slowest of its rails (max), clamped at 0. None if any of its rails has no such event.
    Also reports the first ``rail_agreed`` and ``rerouted``."""
    T = fault_start(f)
    out = Detection(None)
    worst: Optional[float] = 0.0

    def ms(e: Optional[dict]) -> Optional[float]:
        return None if e is None else max(0.0, (e["t"] - T) * 1e3)

    for r in fault_rails:
        d, a, rr = (_first_event(events, names, r, rails, T, until)
                    for names in (DETECTION_EVENTS, AGREED_EVENTS, REROUTE_EVENTS))
        out.by_rail[r] = {"detection_ms": ms(d), "detected_by": None if d is None
                          else d.get("rank"), "event": None if d is None else d.get("event"),
                          "agreed_ms": ms(a), "rerouted_ms": ms(rr)}
        if d is None:
            worst = None
        elif worst is not None:
            worst = max(worst, ms(d))
    out.detection_ms = worst if fault_rails else None
    return out


# ------------------------------------------------------------------------------- failover
def _fault_window_end(f: FaultRecord, run_end: float) -> float:
    """The end of the fault window: the fault's end; for a flap its first link-up; at most the
    end of the run."""
    end = f.t_end
    if f.action == "flap":
        ups = [t.t for t in f.toggles if t.state == "up" and t.t]
        if ups:
            end = min(ups)
    return min(end if end is not None else run_end, run_end)


def _natural_gap(S: np.ndarray, thr: float, k0: int, kT: int, inside: np.ndarray,
                 rates: Rates) -> int:
    """Longest natural dip (bins) of the pre-fault window [k0, kT): on the total goodput, and
    on the surviving rails S if they were active in at least half of its bins."""
    natural = 0
    tot = rates.total_bps[k0:kT]
    Lt = _level(tot)
    if Lt is not None:
        natural = _longest_inner_gap(~(tot >= STALL_FRACTION * Lt) & inside[k0:kT])
    pre_s = S[k0:kT]
    if np.mean(pre_s >= thr) >= 0.5:
        natural = max(natural, _longest_inner_gap(~(pre_s >= thr) & inside[k0:kT]))
    return natural


def _first_chain(stalls: list[tuple[int, int]], bin_s: float) -> list[tuple[int, int]]:
    """The first chain of stalls less than STEADY_S apart."""
    chain = [stalls[0]]
    for a, b in stalls[1:]:
        if (a - chain[-1][1]) * bin_s < STEADY_S:
            chain.append((a, b))
        else:
            break
    return chain


def _resume_time(S: np.ndarray, b: int, L: float, rates: Rates) -> float:
    """When traffic resumed at level L, refined inside bins b-1 and b: their active time is
    assumed contiguous and ending at edges[b+1]."""
    active = (min(S[b - 1] if np.isfinite(S[b - 1]) else 0.0, L) + min(S[b], L)) / L * rates.bin_s
    return float(np.clip(rates.edges[b + 1] - active, rates.edges[b - 1], rates.edges[b + 1]))


def failover(f: FaultRecord, fault_rails: Sequence[str], ctx: FaultContext,
             onset_limit: Optional[float] = None) -> Failover:
    """failover_ms of one rail-removing fault.

    S(t) = goodput of the surviving rails (every rail the fault does not take out; sum over
    their hosts of bytes delivered), in 20 ms bins. Its active level L = 90th percentile of the
    non-zero bins from t_applied to the end of the fault window (the fault's end; for a flap,
    its first link-up; at most the end of the run). A bin is a gap when S < 0.3 L (no sample
    counts as a gap) and, given the iterations' ``spans``, it lies inside a collective (see
    in_collective: the idle time between iterations is never a gap). The pre-fault pattern is
    the longest gap in the reference window before the fault (PRE_WINDOW_S, not before the
    workload or an earlier fault; a gap at the very start of that window is not counted), taken
    on the total goodput and, if the surviving rails were active in >= half of its bins, on S
    as well: the natural dips between iterations. A gap after the fault is a *stall* when it is
    longer than that. The failover ends at the end of the last stall of the first chain of
    stalls (stalls less than STEADY_S apart) that starts within the fault window and ends after
    t_applied; only stalls that begin before ``onset_limit`` count: the iteration in flight at
    the fault has completed (a dip in a later iteration is the workload's own rhythm), or the
    failed rail's work was moved (detection + REROUTE_GRACE_S: later, the surviving rails are
    not waiting for the failover); the end is refined inside its 20 ms bins assuming traffic
    resumes at level L. So it is the time from the fault until the surviving rails carry
    traffic at their steady rate again, including the time they kept carrying their own share
    before stalling.

    The fault window must carry workload traffic: a mean S below ACTIVITY_FLOOR (1 % of the
    rails' nominal sum, or 1 Mbit/s if a rail is unshaped) is background chatter -> None.
    failover_ms = (end - t_applied) in ms; 0 when the surviving rails never stalled beyond the
    pre-fault pattern (traffic moved on without interruption). None when no rail survives or
    the surviving rails carried nothing after the fault or never resumed before the run ended.
    If traffic resumed only after the fault window, the value is reported with a note (that is
    the link coming back, not a failover)."""
    # the docstring is the metric's definition, kept whole; the steps are the helpers above
    survivors = [r for r in ctx.rails if r not in fault_rails]
    if not survivors:
        return Failover(note="no rail survives this fault")
    rates, T = ctx.rates, fault_start(f)
    end = _fault_window_end(f, ctx.run_end)
    S = _sum(rates, survivors)
    kT, kE = _bin(rates, T), max(_bin(rates, end), _bin(rates, T) + 1)
    L = _level(S[kT:kE])
    mean = float(np.mean(np.nan_to_num(S[kT:kE]))) if kE > kT else 0.0
    if L is None or mean < ctx.floor_bps:
        return Failover(note="the surviving rails carried no workload traffic after the fault"
                        + (f" (mean {mean / 1e6:.3f} Mbit/s, below the "
                           f"{ctx.floor_bps / 1e6:.2f} Mbit/s floor)" if L else ""))
    return _failover_stalls(f, S, L, kT, kE, end, ctx, onset_limit)


def _failover_stalls(f: FaultRecord, S: np.ndarray, L: float, kT: int, kE: int, end: float,
                     ctx: FaultContext, onset_limit: Optional[float]) -> Failover:
    """failover, once the surviving rails S are known to carry work at level L: the stalls
    beyond the pre-fault pattern, and when traffic resumed after the first chain of them."""
    rates, T = ctx.rates, fault_start(f)
    res = Failover()
    thr = STALL_FRACTION * L
    k0 = _bin(rates, _pre_start(T, ctx.faults, ctx.windows))
    inside = in_collective(rates, ctx.spans) if ctx.spans else np.ones(len(rates), dtype=bool)
    natural = 0
    if kT - k0 >= 5:
        natural = _natural_gap(S, thr, k0, kT, inside, rates)
    else:
        res.note_pattern = "no pre-fault reference window; every gap counts as a stall"
    res.natural_gap_ms = natural * rates.bin_s * 1e3
    res.level_mbps = L / 1e6
    gap = ~(S >= thr) & inside         # NaN (not sampled) counts as a gap
    stalls = [(a, b) for a, b in _runs(gap) if b > kT and a < kE and (b - a) > natural]
    if onset_limit is not None:
        # a stall that begins after the iteration in flight at the fault has completed (a dip
        # of a later one), or after the failed rail's work was moved, is not the failover
        late = [x for x in stalls if rates.edges[x[0]] > onset_limit]
        stalls = [x for x in stalls if rates.edges[x[0]] <= onset_limit]
        if late:
            res.later_dips_ms = [(rates.edges[a] - T) * 1e3 for a, _ in late[:5]]
    if not stalls:
        res.failover_ms, res.stalls = 0.0, []
        res.note = (f"surviving rails never stalled beyond the pre-fault pattern "
                    f"(longest natural gap {res.natural_gap_ms:.0f} ms)")
        return res
    chain = _first_chain(stalls, rates.bin_s)
    res.stalls = [{"from_ms": (rates.edges[x] - T) * 1e3, "to_ms": (rates.edges[y] - T) * 1e3}
                  for x, y in chain]
    b = chain[-1][1]
    if b >= len(rates):
        res.note = "traffic on the surviving rails never resumed before the end of the run"
        return res
    t_resume = _resume_time(S, b, L, rates)
    res.failover_ms = max(0.0, (t_resume - T) * 1e3)
    if t_resume > end + rates.bin_s:
        res.note = (f"traffic resumed only {(t_resume - end) * 1e3:.0f} ms after the fault "
                    "window ended: the link came back, no failover")
    return res


def first_end_after(T: float, table: Sequence[dict]) -> Optional[float]:
    """When the iteration in flight at T (the first to end after it, on every rank) ended."""
    ends = [r["t_end"] for r in table if r.get("complete") and is_num(r.get("t_end"))
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


# ------------------------------------------------------------------------------- recovery
def _recovered_at(r: str, p: float, kh: int, k0: int, kF: int, rates: Rates) -> Optional[int]:
    """First bin k >= kh where rail r carries traffic and holds RECOVERY_SHARE of its pre-fault
    share p over two consecutive SUSTAIN_S windows."""
    m = max(1, int(round(SUSTAIN_S / rates.bin_s)))
    thr = RECOVERY_SHARE * p
    R = np.nan_to_num(rates.rail_bps[r])
    Tt = np.nan_to_num(rates.total_bps)
    for k in range(kh, len(rates) - 2 * m + 1):
        if R[k] <= 0.01 * (p * (np.mean(Tt[k0:kF]) or 1.0)):
            continue
        w1, w2 = slice(k, k + m), slice(k + m, k + 2 * m)
        t1, t2 = Tt[w1].sum(), Tt[w2].sum()
        if t1 > 0 and t2 > 0 and R[w1].sum() / t1 >= thr and R[w2].sum() / t2 >= thr:
            return k
    return None


def recovery(heal_t: float, ref_t: float, fault_rails: Sequence[str],
             ctx: FaultContext) -> Recovery:
    """recovery_ms after a fault ends (its t_end, or an explicit link-up's t_applied).

    For each rail the fault took out or degraded: its pre-fault share p = its bytes / all rails'
    bytes in the reference window before the fault (PRE_WINDOW_S, see failover). Recovered at
    the first 20 ms bin k at or after the heal such that the rail's share of the bytes is
    >= RECOVERY_SHARE * p both in [t_k, t_k + SUSTAIN_S) and in the SUSTAIN_S after that, and
    the rail carries traffic in bin k. recovery_ms = t_k - heal; the fault's value is its slowest
    rail. None if the rail carried nothing before the fault, or did not recover before the end
    of the samples."""
    rates = ctx.rates
    res = Recovery()
    k0, kF = _bin(rates, _pre_start(ref_t, ctx.faults, ctx.windows)), _bin(rates, ref_t)
    if kF - k0 < 3:
        res.note = "no pre-fault reference window"
        return res
    mask = np.zeros(len(rates), dtype=bool)
    mask[k0:kF] = True
    pre = shares(rates, mask, ctx.rails, ctx.floor_bps)
    worst: Optional[float] = 0.0
    kh = _bin(rates, heal_t)
    notes = []
    for r in fault_rails:
        p = pre.get(r)
        info: dict[str, Any] = {"pre_share": p, "recovery_ms": None}
        res.by_rail[r] = info
        found = _recovered_at(r, p, kh, k0, kF, rates) if p and p >= 0.01 else None
        if not p or p < 0.01:
            notes.append(f"rail {r} carried no workload traffic before the fault")
        elif found is None:
            notes.append(f"rail {r} did not carry {RECOVERY_SHARE:.0%} of its pre-fault share "
                         f"({p:.2f}) again before the end of the run")
        if found is None:
            worst = None
            continue
        info["recovery_ms"] = max(0.0, (rates.edges[found] - heal_t) * 1e3)
        if worst is not None:
            worst = max(worst, info["recovery_ms"])
    res.recovery_ms = worst if fault_rails else None
    res.note = "; ".join(notes) or None
    return res
