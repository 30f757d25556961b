"""The cross-protocol cost model: how much of one allreduce goes through the aggregation
switch(es) and how much through the TCP multi-rail ring, and the agreed state that decides it.

Cost per protocol, for a share of s bytes of the message (both halves run at once)::

    ring:        T_r(s) = a_r + s * b_r   b_r: measured seconds per *message* byte of the
                                          ring half (it moves 2(n-1)/n of them per rank; the
                                          TCP balancer splits it over the TCP rails)
    aggregation: T_g(x) = a_g + x * b_g   b_g: measured seconds per byte of a switch round
                                          trip (each rank sends x and receives x), a_g: the
                                          switch's start-up (half the handshake's time)

Both finish together at x = (S b_r + a_r - a_g) / (b_r + b_g), clamped to [0, S]; a share
under MIN_SHARE is not worth a second path (it goes to the other one).

COLD (no agreed measurements of both halves yet): the rails are assumed equally fast, so
the split follows the bytes each algorithm moves: m switches against k TCP rails and a ring
factor f = 2(n-1)/n give the aggregation m f / (m f + k) of the message (0.6 for one TCP
rail, one switch and 4 ranks). HOT from MIN_SAMPLES agreed samples of each half; every
estimate is the total time over the total bytes of the last WINDOW operations, so a change
is followed within a few operations. Messages under HYBRID_MIN bytes, and ops other than
sum / max / min, stay on the ring (one path, no vote: a small allreduce is mostly wake-ups,
and the switch's round trip adds a thread hand-off and a vote).

Agreement: after every hybrid operation each rank contributes one row (ROW_COLUMNS) to a tiny
allgather; ``HybridState.agree`` turns the gathered rows into the next split, identically on
every rank (the slowest rank's time per half counts: the op ends when the last rank's does).
The split therefore changes only at those points, and all ranks post the ring's receives
for the same byte ranges.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

COLD, HOT = "cold", "hot"
HYBRID_OPS = ("sum", "max", "min")       # what a switch reduces (aggwire): prod rides the ring
HYBRID_MIN = 1 << 20                     # smaller allreduces ride the ring alone
MIN_SHARE = 256 << 10                    # a path gets at least this much, or nothing
WINDOW = 4                               # operations per estimate
MIN_SAMPLES = 2                          # agreed samples of each half before HOT
A_AGG_NOMINAL = 1e-3                     # switch start-up until a handshake was timed
SHARE_HYSTERESIS = 0.01                  # a split event only for a change above this

# one rank's row of the vote (float64): see HybridState.agree
OK, REACHABLE, AGG_BYTES, AGG_S, RING_BYTES, RING_S, AGG_RTT = range(7)
ROW_COLUMNS = 7


def ring_factor(world: int) -> float:
    """Bytes a ring allreduce moves per rank per message byte."""
    return 2.0 * (world - 1) / world


def cold_fraction(world: int, tcp_rails: int, switches: int) -> float:
    """The aggregation's share while nothing is measured: rails of equal rate, so it gets
    what the algorithms' byte counts say (m f / (m f + k))."""
    f = ring_factor(world) * switches
    return f / (f + max(1, tcp_rails))


def hot_bytes(nbytes: int, a_r: float, b_r: float, a_g: float, b_g: float) -> float:
    """The aggregation share that makes both halves finish together (may fall outside
    [0, nbytes]: the caller clamps)."""
    return (nbytes * b_r + a_r - a_g) / (b_r + b_g)


def clamp_share(x: float, nbytes: int, quantum: int) -> int:
    """``x`` bytes to a multiple of ``quantum`` in [0, nbytes]; a side under MIN_SHARE
    gets nothing (the whole message goes the other way)."""
    if x < MIN_SHARE or nbytes < 2 * MIN_SHARE and x < nbytes / 2:
        return 0
    if nbytes - x < MIN_SHARE:
        return nbytes
    return int(x // quantum) * quantum


class Window:
    """The last WINDOW (bytes, seconds) samples of one protocol: seconds per byte above a
    start-up term."""

    def __init__(self) -> None:
        self.samples: deque = deque(maxlen=WINDOW)

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes > 0 and math.isfinite(seconds) and seconds > 0:
            self.samples.append((float(nbytes), float(seconds)))

    def per_byte(self, start_up: float) -> float:
        """Total time (less one start-up per op) over total bytes; nan if too few."""
        if len(self.samples) < MIN_SAMPLES:
            return float("nan")
        nb = sum(b for b, _ in self.samples)
        busy = sum(max(s - start_up, 0.1 * s) for _, s in self.samples)
        return busy / nb


@dataclass
class Decision:
    """What the last agreement decided: every rank holds the same one."""
    up: bool = True
    state: str = COLD
    fraction: float = 0.0          # the aggregation's share of a REF_SIZE message (events)
    b_ring: float = float("nan")
    b_agg: float = float("nan")
    a_agg: float = A_AGG_NOMINAL


class HybridState:
    """The agreed cross-protocol state of one Context (same on every rank)."""

    def __init__(self, world: int, tcp_rails: int, switches: int) -> None:
        if world < 1 or tcp_rails < 1 or switches < 1:
            raise ValueError(f"world {world}, tcp_rails {tcp_rails}, switches {switches}: "
                             "each must be >= 1")
        self.world, self.tcp_rails, self.switches = world, tcp_rails, switches
        self.ring, self.agg = Window(), Window()
        self.d = Decision(fraction=cold_fraction(world, tcp_rails, switches))
        self.down_since: Optional[float] = None
        self.agreements = 0

    def agg_bytes(self, nbytes: int, elem: int) -> int:
        """Bytes of a ``nbytes`` allreduce that go through the switches (a multiple of
        ``elem`` x switches): 0 while the aggregation is down."""
        if not self.d.up or nbytes < HYBRID_MIN:
            return 0
        if self.d.state == HOT:
            x = hot_bytes(nbytes, 0.0, self.d.b_ring, self.d.a_agg, self.d.b_agg)
        else:
            x = nbytes * cold_fraction(self.world, self.tcp_rails, self.switches)
        return clamp_share(x, nbytes, elem * self.switches)

    def predict(self, nbytes: int) -> Optional[float]:
        """Seconds the aggregation half of ``nbytes`` should take (None until HOT)."""
        if self.d.state != HOT:
            return None
        return self.d.a_agg + self.agg_bytes(nbytes, 1) * self.d.b_agg

    def agree(self, rows: np.ndarray) -> list[tuple[str, dict]]:
        """The gathered rows (world, ROW_COLUMNS) -> the next decision and its events.
        Deterministic: the same rows give the same decision on every rank."""
        if rows.ndim != 2 or rows.shape[1] != ROW_COLUMNS:
            raise ValueError(f"rows: expected (world, {ROW_COLUMNS}), got {rows.shape}")
        self.agreements += 1
        ok = bool(rows[:, OK].min() > 0)
        reachable = bool(rows[:, REACHABLE].min() > 0)
        if ok and rows[0, AGG_BYTES] > 0:
            self.agg.add(rows[0, AGG_BYTES], float(np.nanmax(rows[:, AGG_S])))
        if rows[0, RING_BYTES] > 0:
            self.ring.add(rows[0, RING_BYTES], float(np.nanmax(rows[:, RING_S])))
        rtts = rows[:, AGG_RTT][np.isfinite(rows[:, AGG_RTT])]
        before = self.d
        a_agg = float(np.median(rtts)) if len(rtts) else before.a_agg
        up = ok and reachable
        b_r, b_g = self.ring.per_byte(0.0), self.agg.per_byte(a_agg)
        hot = math.isfinite(b_r) and math.isfinite(b_g)
        frac = (min(max(hot_bytes(1.0, 0.0, b_r, a_agg / (16 << 20), b_g), 0.0), 1.0) if hot
                else cold_fraction(self.world, self.tcp_rails, self.switches))
        self.d = Decision(up, HOT if hot else COLD, frac, b_r, b_g, a_agg)
        return self._events(before, ok, reachable)

    def _events(self, before: Decision, ok: bool, reachable: bool) -> list[tuple[str, dict]]:
        evs: list[tuple[str, dict]] = []
        if before.up and not self.d.up:
            why = "an aggregation half failed" if not ok else "a rank cannot reach a switch"
            evs.append(("agg_down", {"reason": why}))
        elif not before.up and self.d.up:
            evs.append(("agg_back", {}))
        if (self.d.up != before.up or self.d.state != before.state or
                abs(self.d.fraction - before.fraction) > SHARE_HYSTERESIS or
                self.agreements == 1):
            evs.append(("hybrid_split", self.fields()))
        return evs

    def fields(self) -> dict:
        """The split as events and stats show it: shares per protocol of a 16 MiB message."""
        g = self.d.fraction if self.d.up else 0.0
        return {"shares": {"tcp": round(1.0 - g, 4), "aggregation": round(g, 4)},
                "state": self.d.state, "up": self.d.up, "b_ring": _num(self.d.b_ring),
                "b_agg": _num(self.d.b_agg), "a_agg": _num(self.d.a_agg)}


def _num(x: float) -> Optional[float]:
    """A number for an event (JSON has no nan)."""
    return float(x) if math.isfinite(x) else None
