"""Measurement independent of Nezha: kernel counters of every link, sampled on one monotonic clock
(the logs the ranks wrote are merged with them in ``timeline.py``).

* ``Sampler`` reads the counters of every host end of every link: ONE netlink dump (counters
  only, RTM_GETSTATS; link state from notifications, kernel/linkstats.py) per host namespace per
  tick (every 10 ms by default), each stamped with ``time.monotonic()``
  (the midpoint of request and reply). CLOCK_MONOTONIC is shared by all namespaces of one
  machine, so these times line up with the fault records and the ranks' event logs.
* ``Samples`` holds the result as columnar numpy arrays per link; ``Samples.rates`` turns the
  cumulative counters into per-link and per-rail bit rates in fixed bins.
* ``Timeline`` (in ``timeline.py``) merges kernel observations, fault records, Nezha events and
  iteration records, sorted by time, and writes them as ``timeline.jsonl``.

Goodput (used by every metric): the bytes *delivered to hosts*, i.e. for a rail the sum over its
hosts of the ``rx_bytes`` deltas at the host end of each link, in bit/s. These are kernel L2
bytes (IP and TCP headers and ACKs included, no FCS), the same bytes the shapers count.
"""
from __future__ import annotations

import csv
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from testbed.kernel.linkstats import LinkDumper as _LinkDumper
from testbed.kernel.linkstats import PyrouteDumper as _PyrouteDumper

log = logging.getLogger(__name__)

COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets", "rx_dropped", "tx_dropped")
CSV_COLUMNS = ("t", "link", "host", "rail", "tx_bytes", "rx_bytes", "tx_packets", "rx_packets",
               "rx_dropped", "tx_dropped", "up")


# ---------------------------------------------------------------------------------- samples
@dataclass
class LinkSeries:
    """Samples of one link's host end: time (monotonic s) and cumulative kernel counters."""

    link: str
    host: str
    rail: str
    t: np.ndarray
    tx_bytes: np.ndarray
    rx_bytes: np.ndarray
    tx_packets: np.ndarray
    rx_packets: np.ndarray
    rx_dropped: np.ndarray
    tx_dropped: np.ndarray
    up: np.ndarray

    def __len__(self) -> int:
        return len(self.t)


def _monotone(counter: np.ndarray) -> np.ndarray:
    """Cumulative count from a raw counter; a decrease (interface re-created) restarts at 0."""
    c = counter.astype(np.float64)
    if len(c) < 2:
        return c - (c[0] if len(c) else 0)
    d = np.diff(c)
    d = np.where(d < 0, c[1:], d)
    return np.concatenate(([0.0], np.cumsum(d)))


@dataclass
class Rates:
    """Bit rates in bins ``[edges[i], edges[i+1])`` (monotonic seconds).

    ``rail_bps[r]`` is the goodput of rail r: sum over its hosts of rx bytes delivered at the host
    end, times 8, over the bin. ``rail_tx_bps`` is the same for bytes sent by the hosts.
    ``total_bps`` is the sum over rails. Bins a link's samples do not cover are NaN for that link
    and left out of the sums (a sum is NaN only where no link of it is covered)."""

    bin_s: float
    edges: np.ndarray
    link_rx_bps: dict[str, np.ndarray]
    link_tx_bps: dict[str, np.ndarray]
    rail_bps: dict[str, np.ndarray]
    rail_tx_bps: dict[str, np.ndarray]
    total_bps: np.ndarray

    @property
    def t(self) -> np.ndarray:
        """Bin start times."""
        return self.edges[:-1]

    @property
    def centers(self) -> np.ndarray:
        return self.edges[:-1] + self.bin_s / 2

    def __len__(self) -> int:
        return len(self.edges) - 1

    def mask(self, t1: float, t2: float) -> np.ndarray:
        """Bins that lie entirely inside [t1, t2]."""
        return (self.edges[:-1] >= t1 - 1e-9) & (self.edges[1:] <= t2 + 1e-9)


def _nansum(arrays: Sequence[np.ndarray], n: int) -> np.ndarray:
    if not arrays:
        return np.full(n, np.nan)
    stack = np.vstack(arrays)
    out = np.nansum(stack, axis=0)
    out[np.all(np.isnan(stack), axis=0)] = np.nan
    return out


class Samples:
    """Everything a Sampler saw: ``links[name] -> LinkSeries`` plus bookkeeping."""

    def __init__(self, links: dict[str, LinkSeries], interval: float = 0.01,
                 notes: Optional[list[str]] = None, ticks: int = 0, late_ticks: int = 0,
                 dump_s: float = 0.0) -> None:
        self.links = links
        self.interval = interval
        self.notes = notes or []
        self.ticks = ticks
        self.late_ticks = late_ticks
        self.dump_s = dump_s          # mean seconds per tick spent in netlink dumps

    # ------------------------------------------------------------- construction
    @classmethod
    def from_rows(cls, rows: Iterable[dict], interval: float = 0.01) -> "Samples":
        """Build from dict rows (keys: t, link, host, rail and the counters; ``up`` optional):
        what tests use for synthetic data, and the inverse of ``to_csv``."""
        acc: dict[str, dict[str, list]] = {}
        meta: dict[str, tuple[str, str]] = {}
        for r in rows:
            name = r["link"]
            host = r.get("host") or name.partition(".")[0]
            rail = r.get("rail") or name.partition(".")[2]
            meta[name] = (host, rail)
            a = acc.setdefault(name, {k: [] for k in ("t",) + COUNTERS + ("up",)})
            a["t"].append(float(r["t"]))
            for k in COUNTERS:
                a[k].append(int(r.get(k, 0) or 0))
            up = r.get("up", True)
            a["up"].append(up if isinstance(up, bool) else str(up) not in ("0", "False", ""))
        links = {}
        for name, a in acc.items():
            order = np.argsort(np.asarray(a["t"]), kind="stable")
            cols = {k: np.asarray(v)[order] for k, v in a.items()}
            links[name] = LinkSeries(name, *meta[name], t=cols["t"].astype(np.float64),
                                     **{k: cols[k].astype(np.int64) for k in COUNTERS},
                                     up=cols["up"].astype(bool))
        return cls(links, interval)

    @classmethod
    def read_csv(cls, path: str | Path) -> "Samples":
        with open(path, newline="") as f:
            return cls.from_rows(csv.DictReader(f))

    # ------------------------------------------------------------- views
    @property
    def rails(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for s in self.links.values():
            out.setdefault(s.rail, []).append(s.link)
        return out

    @property
    def span(self) -> tuple[float, float]:
        ts = [s.t for s in self.links.values() if len(s)]
        if not ts:
            return (math.nan, math.nan)
        return (min(float(t[0]) for t in ts), max(float(t[-1]) for t in ts))

    def __bool__(self) -> bool:
        return any(len(s) for s in self.links.values())

    def to_csv(self, path: str | Path, t0: Optional[float] = None) -> None:
        """One row per link per sample, sorted by time. Columns: t, link, host, rail, tx_bytes,
        rx_bytes, tx_packets, rx_packets, rx_dropped, tx_dropped, up. ``t`` is monotonic
        seconds, or seconds since ``t0`` when it is given. Counters are the kernel's cumulative
        IFLA_STATS64 values at the host end of the link."""
        rows = []
        for s in self.links.values():
            for i in range(len(s)):
                rows.append((float(s.t[i]), s.link, s.host, s.rail) +
                            tuple(int(getattr(s, k)[i]) for k in COUNTERS[:5]) +
                            (int(s.tx_dropped[i]), int(bool(s.up[i]))))
        rows.sort(key=lambda r: (r[0], r[1]))
        off = t0 or 0.0
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(CSV_COLUMNS)
            for r in rows:
                w.writerow((f"{r[0] - off:.6f}",) + r[1:])

    def rates(self, bin_s: float = 0.02, start: Optional[float] = None,
              end: Optional[float] = None) -> Rates:
        """Per-link and per-rail bit rates in bins of ``bin_s`` seconds.

        Each link's cumulative counter is interpolated linearly at the bin edges (so a tick that
        came late spreads its bytes over the time it covers instead of making a spike), then
        differenced. Edges start at ``start`` (default: the first sample) and go to ``end``
        (default: the last sample). Goodput of a rail = sum over its hosts of rx bytes at the
        host end (bytes delivered to that host); ``rail_tx_bps`` = bytes the hosts sent."""
        lo, hi = self.span
        start = lo if start is None else start
        end = hi if end is None else end
        if not (math.isfinite(start) and math.isfinite(end)) or end - start < bin_s:
            edges = np.array([start if math.isfinite(start) else 0.0] * 1, dtype=np.float64)
        else:
            n = int(math.floor((end - start) / bin_s + 1e-9))
            edges = start + bin_s * np.arange(n + 1)
        n = len(edges) - 1
        link_rx, link_tx = {}, {}
        for s in self.links.values():
            for key, dest in (("rx_bytes", link_rx), ("tx_bytes", link_tx)):
                if len(s) < 2 or n < 1:
                    dest[s.link] = np.full(max(n, 0), np.nan)
                    continue
                cum = _monotone(getattr(s, key))
                at = np.interp(edges, s.t, cum, left=np.nan, right=np.nan)
                dest[s.link] = np.diff(at) * 8.0 / bin_s
        rail_rx, rail_tx = {}, {}
        for rail, names in self.rails.items():
            rail_rx[rail] = _nansum([link_rx[l] for l in names], max(n, 0))
            rail_tx[rail] = _nansum([link_tx[l] for l in names], max(n, 0))
        total = _nansum(list(rail_rx.values()), max(n, 0))
        return Rates(bin_s, edges, link_rx, link_tx, rail_rx, rail_tx, total)

    def idle_periods(self, link: str, min_idle: float = 0.04, key: str = "rx_bytes"
                     ) -> list[tuple[float, Optional[float]]]:
        """Periods in which ``key`` of ``link`` did not change for at least ``min_idle`` s.

        Each is (t_stop, t_resume): t_stop is the first sample that showed no further increase
        (traffic last moved in the sample interval before it), t_resume the first sample with
        an increase again, or None if it never resumed. Resolution: one sampling interval."""
        s = self.links[link]
        if len(s) < 2:
            return []
        c = getattr(s, key)
        moved = np.diff(c) != 0          # moved[i]: change between sample i and i+1
        out = []
        i = 0
        n = len(moved)
        while i < n:
            if moved[i]:
                i += 1
                continue
            j = i
            while j < n and not moved[j]:
                j += 1
            # counters flat from sample i to sample j
            t_stop = float(s.t[i])
            t_resume = float(s.t[j]) if j < n else None
            flat_s = (t_resume if t_resume is not None else float(s.t[-1])) - t_stop
            if i > 0 and flat_s >= min_idle:   # i == 0: idle since the start, not a stop
                out.append((t_stop, t_resume))
            i = j
        return out

    def bytes_between(self, t1: float, t2: float, key: str = "rx_bytes") -> dict[str, float]:
        """Per-link bytes counted in [t1, t2] (linear interpolation between samples)."""
        out = {}
        for s in self.links.values():
            if len(s) < 2:
                out[s.link] = math.nan
                continue
            cum = _monotone(getattr(s, key))
            a, b = np.interp([t1, t2], s.t, cum, left=np.nan, right=np.nan)
            out[s.link] = float(b - a)
        return out


# ---------------------------------------------------------------------------------- sampler
class Sampler:
    """Sample every link's host-end counters every ``interval`` seconds in a background thread.

    One netlink dump per host namespace per tick, through a socket of our own in that namespace
    (never the fabric's sockets, which the fault thread uses at the same time). A namespace that
    disappears mid-run (torn down) stops being sampled quietly; its series simply end, and a
    note says when. A link that is down keeps being sampled (its counters just stop moving)."""

    def __init__(self, fabric, interval: float = 0.01) -> None:
        if not 0.001 <= interval <= 1.0:
            raise ValueError("sampling interval must be between 1 ms and 1 s")
        self.interval = interval
        # host namespace -> [(ifname, link name, host, rail)], from the fabric's handles only
        self._plan: dict[str, list[tuple[str, str, str, str]]] = {}
        for link in fabric.links.values():
            host = fabric.hosts[link.host]
            self._plan.setdefault(host.ns, []).append(
                (link.host_end.name, link.name, link.host, link.rail))
        self._rows: dict[str, list[tuple]] = {name: [] for ents in self._plan.values()
                                              for _, name, _, _ in ents}
        self._dumpers: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._notes: list[str] = []
        self._ticks = 0
        self._late = 0
        self._dump_total = 0.0
        self._result: Optional[Samples] = None
        self.error: Optional[BaseException] = None

    def _open(self) -> None:
        for ns in self._plan:
            try:
                self._dumpers[ns] = _LinkDumper(ns)
            except Exception as e:  # pragma: no cover - depends on the platform
                log.warning("raw netlink in %s unavailable (%s); using pyroute2", ns, e)
                self._dumpers[ns] = _PyrouteDumper(ns)

    def start(self) -> "Sampler":
        if self._thread is not None:
            raise RuntimeError("sampler already started")
        self._open()
        self.tick()  # a first sample before returning: rates are defined from start() on
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()
        return self

    def tick(self) -> None:
        """Take one sample of every live namespace (the thread calls this every interval)."""
        t_begin = time.monotonic()
        for ns in list(self._dumpers):
            d = self._dumpers[ns]
            if not d.alive():
                self._drop(ns, "namespace deleted")
                continue
            try:
                a = time.monotonic()
                stats = d.dump()
                b = time.monotonic()
            except OSError as e:
                self._drop(ns, f"netlink dump failed: {e}")
                continue
            t = (a + b) / 2
            for ifname, name, _, _ in self._plan[ns]:
                st = stats.get(ifname)
                if st is not None:
                    self._rows[name].append((t,) + st)
        self._dump_total += time.monotonic() - t_begin
        self._ticks += 1

    def _drop(self, ns: str, why: str) -> None:
        d = self._dumpers.pop(ns)
        d.close()
        self._notes.append(f"{time.monotonic():.6f} {ns}: {why}; sampling of it stopped")
        log.info("sampler: %s: %s", ns, why)

    def _run(self) -> None:
        nxt = time.monotonic()
        try:
            while not self._stop.is_set() and self._dumpers:
                nxt += self.interval
                delay = nxt - time.monotonic()
                if delay > 0:
                    if self._stop.wait(delay):
                        break
                else:
                    self._late += 1
                    if delay < -self.interval:   # fell behind: do not try to catch up
                        nxt = time.monotonic()
                self.tick()
        except BaseException as e:  # never kill the run; the samples so far remain valid
            self.error = e
            self._notes.append(f"sampler stopped by {type(e).__name__}: {e}")
            log.exception("sampler thread failed")

    def stop(self) -> Samples:
        """Stop sampling (idempotent) and return the samples."""
        if self._result is not None:
            return self._result
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._dumpers:
            try:
                self.tick()  # a last sample at the moment of stop
            except Exception:
                pass
        for ns in list(self._dumpers):
            self._dumpers.pop(ns).close()
        links = {}
        for ents in self._plan.values():
            for _, name, host, rail in ents:
                rows = self._rows[name]
                arr = np.array([r[:7] for r in rows], dtype=np.float64).reshape(-1, 7)
                links[name] = LinkSeries(
                    name, host, rail, t=arr[:, 0].copy(),
                    **{k: arr[:, i + 1].astype(np.int64) for i, k in enumerate(COUNTERS)},
                    up=np.array([r[7] for r in rows], dtype=bool))
        self._result = Samples(links, self.interval, list(self._notes), self._ticks, self._late,
                               self._dump_total / max(1, self._ticks))
        return self._result
